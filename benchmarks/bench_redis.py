"""aiolock on Redis next to its peers, against one private redis-server, in one run.

    .venv/bin/python benchmarks/bench_redis.py [--quick] [--scale-only]

(a) Uncontended acquire+release cycles per second, watchdog on where the library has
    one: the raw two-command floor (``SET key val NX PX 30000``, then a compare-and-delete
    ``EVALSHA``), aiolock, redis-py's ``redis.asyncio.lock.Lock`` and python-redis-lock
    (``redis_lock``, synchronous, with ``auto_renewal``). Rounds alternate between the
    implementations; the median round is reported, with its ratio to the floor.
(b) 32 tasks (threads for the synchronous python-redis-lock) contend for one lock, each
    looping acquire -> ``await asyncio.sleep(0)`` -> release for a fixed time: handoffs
    per second (an acquisition by another task than the previous holder), acquisitions
    per second, wait-time percentiles (call of ``acquire`` until it returns), requests
    per acquisition, and a mutual-exclusion check (a counter of holders that must never
    exceed 1).
(c) Watchdog scale: 10,000 aiolock leases held at once with ``ttl=3`` while the watchdog
    renews them; how many were lost and how many requests the renewals took.

(d) Burst: 50,000 concurrent acquire+release of distinct names on one connection
    (one ``aiolock.connect``), all started at once: acquisitions per second and errors
    (there must be none: the pipelined connection bounds the requests in flight).

(a) and (b) also run on ``memory://`` for aiolock alone, as a reference.

Requests are counted on the server, two ways (see :mod:`_redis`): ``INFO commandstats``
deltas, which include the commands Lua scripts run inside an ``EVALSHA`` ("server
commands"), and round trips seen by ``MONITOR`` in a separate, shorter pass so that
MONITOR never slows a timed run ("requests").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import hiredis
import redis
import redis.asyncio as aioredis
from _common import (
    Cycle,
    Exclusion,
    Rates,
    Uncontended,
    await_contenders,
    fmt,
    lease_cycle,
    log,
    peer_cycle,
    percentile,
    release_lease,
    releaser,
    repeat,
    repeat_sync,
    round_order,
    sync_cycle,
)
from _redis import RedisServer, RequestCounter, command_stats, stats_delta

import aiolock

try:
    import redis_lock
except ImportError:  # pip install python-redis-lock (the `bench` extra)
    redis_lock = None

TTL = 30.0  # lease length in (a) and (b), seconds
TASKS = 32  # contenders in (b)
WARMUP = 100  # untimed cycles before each timed run in (a)

#: compare-and-delete, the release half of the raw floor
CAD = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


@dataclass(frozen=True)
class Settings:
    rounds: int  # (a) alternating rounds
    cycles: int  # (a) cycles per round
    counted_cycles: int  # (a) cycles in the MONITOR pass
    contend_s: float  # (b) timed run
    counted_contend_s: float  # (b) MONITOR pass
    leases: int  # (c)
    lease_ttl: float  # (c)
    hold_s: float  # (c)
    batch: int  # (c) concurrent acquisitions per batch


FULL = Settings(5, 2000, 300, 5.0, 2.0, 10_000, 3.0, 30.0, 500)
QUICK = Settings(5, 500, 200, 2.0, 1.0, 10_000, 3.0, 10.0, 500)


# -- (a) uncontended: one session per implementation yields a `cycle` ----------------------

def _cad_cycle(request: Callable[..., Awaitable[Any]], sha: str, key: str) -> Cycle:
    """The floor's cycle over ``request(*command)``: SET NX PX of a fresh token, then
    compare-and-delete (the loaded ``CAD`` script)."""
    value = os.urandom(8).hex()
    counter = 0

    async def cycle() -> None:
        nonlocal counter
        counter += 1
        token = f"{value}:{counter}"
        await request("SET", key, token, "NX", "PX", 30_000)
        await request("EVALSHA", sha, 1, key, token)

    return cycle


@contextlib.asynccontextmanager
async def floor_session(url: str) -> AsyncIterator[Cycle]:
    client = aioredis.Redis.from_url(url)
    sha = await client.script_load(CAD)
    try:
        yield _cad_cycle(client.execute_command, sha, "bench:a:floor")
    finally:
        await client.aclose()


class _LeanProtocol(asyncio.Protocol):
    """The least a client can do: write RESP, match hiredis-parsed replies in order."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            fut = self.waiting.popleft()
            if isinstance(reply, hiredis.ReplyError):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        while self.waiting:
            self.waiting.popleft().set_exception(exc or ConnectionError("connection closed"))

    def request(self, *args: Any) -> asyncio.Future[Any]:
        assert self.transport is not None
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self.transport.write(hiredis.pack_command(args))
        return fut


@contextlib.asynccontextmanager
async def lean_floor_session(url: str) -> AsyncIterator[Cycle]:
    """The same two commands without redis-py: what the transport costs at the least."""
    parts = urlsplit(url)
    _, proto = await asyncio.get_running_loop().create_connection(
        _LeanProtocol, parts.hostname, parts.port
    )
    sha = await proto.request("SCRIPT", "LOAD", CAD)
    try:
        yield _cad_cycle(proto.request, sha, "bench:a:lean")
    finally:
        assert proto.transport is not None
        proto.transport.close()


@contextlib.asynccontextmanager
async def aiolock_session(url: str) -> AsyncIterator[Cycle]:
    async with aiolock.connect(url) as locks:
        yield lease_cycle(locks.lock("bench:a:aiolock", ttl=TTL, watchdog=True))


@contextlib.asynccontextmanager
async def redis_py_session(url: str) -> AsyncIterator[Cycle]:
    client = aioredis.Redis.from_url(url)
    try:
        yield peer_cycle(client.lock("bench:a:redis-py", timeout=TTL))
    finally:
        await client.aclose()


@contextlib.contextmanager
def redis_lock_session(url: str) -> Iterator[Callable[[], None]]:
    client = redis.Redis.from_url(url)
    try:
        yield sync_cycle(redis_lock.Lock(client, "bench:a:redis_lock", expire=int(TTL), auto_renewal=True))
    finally:
        client.close()


async def timed_cycles(
    impl: Uncontended, url: str, n: int, counter: RequestCounter | None = None
) -> float:
    """Seconds for ``n`` cycles after a warm-up; ``counter`` (if any) spans only the ``n``."""
    window = counter if counter is not None else contextlib.nullcontext()
    if impl.sync:
        with impl.session(url) as cycle:
            await asyncio.to_thread(repeat_sync, cycle, WARMUP)
            async with window:
                return await asyncio.to_thread(repeat_sync, cycle, n)
    async with impl.session(url) as cycle:
        await repeat(cycle, WARMUP)
        async with window:
            return await repeat(cycle, n)


@dataclass
class UncontendedResult(Rates):
    server_cmds: float | None = None  # per cycle, from commandstats over all rounds
    requests: float | None = None  # per cycle, from the MONITOR pass


async def bench_uncontended(
    impls: list[Uncontended], url: str, s: Settings,
    server: RedisServer | None = None, admin: Any = None,
) -> list[UncontendedResult]:
    results = [UncontendedResult(impl.label) for impl in impls]
    cmds: list[Counter[str]] = [Counter() for _ in impls]
    for rnd in range(s.rounds):
        for i in round_order(len(impls), rnd):
            impl, res = impls[i], results[i]
            if res.error:
                continue
            before = await command_stats(admin) if admin is not None else None
            try:
                elapsed = await timed_cycles(impl, url, s.cycles)
            except Exception:
                res.error = traceback.format_exc()
                log(f"(a) {impl.label} FAILED:\n{res.error}")
                continue
            if before is not None:
                cmds[i] += stats_delta(before, await command_stats(admin))
            res.rates.append(s.cycles / elapsed)
        log(f"(a) round {rnd + 1}/{s.rounds} on {url}: "
            + ", ".join(f"{r.label.split()[0]} {r.rates[-1]:,.0f}/s" for r in results if r.rates))
    if server is not None:
        warm_total = s.rounds * (s.cycles + WARMUP)
        for impl, res, c in zip(impls, results, cmds, strict=True):
            if res.error:
                continue
            res.server_cmds = sum(c.values()) / warm_total  # includes warm-up and setup
            counter = RequestCounter(server, admin)
            await timed_cycles(impl, url, s.counted_cycles, counter)
            res.requests = sum(counter.requests.values()) / s.counted_cycles
    return results


# -- (b) contention ----------------------------------------------------------------------


class Tally(Exclusion):
    """What the contenders saw; thread-safe, so the threaded peer can share it."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline
        self.last: int | None = None
        self.acquisitions = 0  # all, including the ones after the deadline
        self.in_window = 0
        self.handoffs = 0
        self.waits: list[float] = []

    def enter(self, who: int, waited: float) -> None:
        now = time.perf_counter()
        with self.guard:
            self._count_in()
            self.acquisitions += 1
            self.waits.append(waited)
            if now < self.deadline:
                self.in_window += 1
                if self.last is not None and self.last != who:
                    self.handoffs += 1
            self.last = who


Acquire = Callable[[], Awaitable[Any]]
Release = Callable[[Any], Awaitable[Any]]


async def contend_async(handles: list[tuple[Acquire, Release]], seconds: float) -> Tally:
    """Each handle is one task's (acquire, release) of the same lock."""
    tally = Tally(time.perf_counter() + seconds)

    async def worker(who: int, acquire: Acquire, release: Release) -> None:
        try:
            while time.perf_counter() < tally.deadline:
                start = time.perf_counter()
                held = await acquire()
                tally.enter(who, time.perf_counter() - start)
                await asyncio.sleep(0)  # the critical section
                tally.leave()
                await release(held)
        except Exception:
            tally.errors.append(traceback.format_exc())

    tasks = [asyncio.create_task(worker(i, *h)) for i, h in enumerate(handles)]
    await await_contenders(tasks, seconds + 60, 60, tally.errors)
    return tally


def contend_threads(url: str, seconds: float) -> Tally:
    """python-redis-lock: TASKS threads, one sync client, one redis_lock.Lock per thread."""
    client = redis.Redis.from_url(url)
    tally = Tally(time.perf_counter() + seconds)

    def worker(who: int) -> None:
        lock = redis_lock.Lock(client, "bench:b:redis_lock", expire=int(TTL), auto_renewal=True)
        try:
            while time.perf_counter() < tally.deadline:
                start = time.perf_counter()
                lock.acquire()
                tally.enter(who, time.perf_counter() - start)
                time.sleep(0)  # the critical section
                tally.leave()
                lock.release()
        except Exception:
            tally.errors.append(traceback.format_exc())

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(TASKS)]
    for t in threads:
        t.start()
    end = time.monotonic() + seconds + 60
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
        tally.errors.append(f"{stuck} thread(s) still running 60 s after the deadline (hang)")
    client.close()
    return tally


@contextlib.asynccontextmanager
async def aiolock_contenders(url: str) -> AsyncIterator[list[tuple[Acquire, Release]]]:
    async with aiolock.connect(url) as locks:
        handles = []
        for _ in range(TASKS):
            lock = locks.lock("bench:b:aiolock", ttl=TTL, watchdog=True)
            handles.append((lock.acquire, release_lease))
        yield handles


def redis_py_contenders(sleep: float | None) -> Callable[[str], Any]:
    @contextlib.asynccontextmanager
    async def session(url: str) -> AsyncIterator[list[tuple[Acquire, Release]]]:
        client = aioredis.Redis.from_url(url)
        handles = []
        for _ in range(TASKS):
            options = {} if sleep is None else {"sleep": sleep}
            lock = client.lock("bench:b:redis-py", timeout=TTL, **options)
            handles.append((lock.acquire, releaser(lock)))
        try:
            yield handles
        finally:
            await client.aclose()

    return session


@dataclass(frozen=True)
class Contended:
    label: str
    session: Callable[[str], Any] | None  # None: the threaded python-redis-lock


@dataclass
class ContendedResult:
    label: str
    seconds: float
    tally: Tally | None = None
    server_cmds: float | None = None  # per acquisition, commandstats, timed run
    requests: float | None = None  # per acquisition, MONITOR pass
    breakdown: Counter[str] = field(default_factory=Counter)  # MONITOR pass, per command

    @property
    def errors(self) -> list[str]:
        return self.tally.errors if self.tally else []


async def run_contended(impl: Contended, url: str, seconds: float) -> Tally:
    if impl.session is None:
        return await asyncio.to_thread(contend_threads, url, seconds)
    async with impl.session(url) as handles:
        return await contend_async(handles, seconds)


async def bench_contended(
    impls: list[Contended], url: str, s: Settings,
    server: RedisServer | None = None, admin: Any = None,
) -> list[ContendedResult]:
    results = []
    for impl in impls:
        res = ContendedResult(impl.label, s.contend_s)
        results.append(res)
        before = await command_stats(admin) if admin is not None else None
        try:
            res.tally = await run_contended(impl, url, s.contend_s)
        except Exception:
            res.tally = Tally(0.0)
            res.tally.errors.append(traceback.format_exc())
        t = res.tally
        log(f"(b) {impl.label} on {url}: {t.in_window / s.contend_s:,.0f} acq/s, "
            f"{t.handoffs / s.contend_s:,.0f} handoffs/s, {len(t.errors)} error(s)")
        for err in t.errors[:3]:
            log(f"(b) {impl.label} error:\n{err}")
        if before is None or t.errors or not t.acquisitions:
            continue
        res.server_cmds = sum(stats_delta(before, await command_stats(admin)).values()) / (
            t.acquisitions
        )
        assert server is not None
        counter = RequestCounter(server, admin)
        async with counter:
            counted = await run_contended(impl, url, s.counted_contend_s)
        if counted.acquisitions and not counted.errors:
            total = sum(counter.requests.values())
            res.requests = total / counted.acquisitions
            res.breakdown = Counter(
                {cmd: n / counted.acquisitions for cmd, n in counter.requests.items()}
            )
    return results


# -- (c) watchdog scale --------------------------------------------------------------------


@dataclass
class WatchdogResult:
    leases: int
    ttl: float
    hold_s: float
    acquire_s: float = 0.0
    release_s: float = 0.0
    lost: int = 0
    server_cmds: int = 0
    requests: int = 0
    breakdown: Counter[str] = field(default_factory=Counter)
    cpu_s: float = 0.0
    max_lag_s: float = 0.0
    p99_lag_s: float = 0.0
    left_held: int = 0
    error: str | None = None


async def _loop_lags(stop: asyncio.Event) -> list[float]:
    """How late each 50 ms sleep woke up, until ``stop``: the event loop's stalls."""
    lags = []
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(0.05)
        lags.append(time.perf_counter() - start - 0.05)
    return lags


async def bench_watchdog(server: RedisServer, admin: Any, s: Settings) -> WatchdogResult:
    res = WatchdogResult(s.leases, s.lease_ttl, s.hold_s)
    try:
        async with aiolock.connect(server.url) as locks:
            leases: list[aiolock.Lease] = []
            start = time.perf_counter()
            for first in range(0, s.leases, s.batch):
                names = range(first, min(s.leases, first + s.batch))
                leases += await asyncio.gather(
                    *(locks.lock(f"bench:c:{i}", ttl=s.lease_ttl).acquire() for i in names)
                )
            res.acquire_s = time.perf_counter() - start
            log(f"(c) {len(leases):,} leases acquired in {res.acquire_s:.1f} s; "
                f"holding for {s.hold_s:.0f} s")

            counter = RequestCounter(server, admin)
            async with counter:
                before = await command_stats(admin)
                stop = asyncio.Event()
                lag = asyncio.create_task(_loop_lags(stop))
                cpu = time.process_time()
                await asyncio.sleep(s.hold_s)
                res.cpu_s = time.process_time() - cpu
                stop.set()
                lags = await lag
                res.max_lag_s, res.p99_lag_s = max(lags), percentile(lags, 99)
                res.server_cmds = sum(stats_delta(before, await command_stats(admin)).values())
            res.requests = sum(counter.requests.values())
            res.breakdown = counter.requests
            res.lost = sum(lease.lost for lease in leases)

            start = time.perf_counter()
            for first in range(0, len(leases), s.batch):
                await asyncio.gather(*(lease.release() for lease in leases[first:first + s.batch]))
            res.release_s = time.perf_counter() - start
            for first in range(0, s.leases, s.batch):
                names = range(first, min(s.leases, first + s.batch))
                held = await asyncio.gather(
                    *(locks.lock(f"bench:c:{i}", ttl=s.lease_ttl).locked() for i in names)
                )
                res.left_held += sum(held)
    except Exception:
        res.error = traceback.format_exc()
        log(f"(c) FAILED:\n{res.error}")
    return res


# -- report -------------------------------------------------------------------------------


def print_uncontended(s: Settings, redis_rows: list[UncontendedResult],
                      memory_rows: list[UncontendedResult]) -> None:
    """``redis_rows[0]`` is the redis.asyncio floor, ``redis_rows[1]`` the lean-client one."""
    print(f"\n(a) Uncontended acquire+release, one task; median of {s.rounds} alternating "
          f"rounds x {s.cycles:,} cycles")
    head = (f"{'implementation':<48}{'cycles/s':>10}{'vs floor':>10}{'vs lean':>9}"
            f"{'min..max':>16}{'req/cycle':>11}{'srv cmds/cycle':>16}")
    print(head)
    print("-" * len(head))
    floor, lean = (redis_rows[i].median if len(redis_rows) > i else float("nan") for i in (0, 1))
    for row in redis_rows + memory_rows:
        if row.error:
            print(f"{row.label:<48}{'ERROR (see log)':>10}")
            continue
        spread = f"{min(row.rates):,.0f}..{max(row.rates):,.0f}"
        on_redis = any(row is r for r in redis_rows)
        ratios = (f"{row.median / floor:.2f}x", f"{row.median / lean:.2f}x") if on_redis else ("-", "-")
        print(f"{row.label:<48}{row.median:>10,.0f}{ratios[0]:>10}{ratios[1]:>9}{spread:>16}"
              f"{fmt(row.requests, '.2f'):>11}{fmt(row.server_cmds, '.2f'):>16}")


def print_contended(s: Settings, rows: list[ContendedResult]) -> None:
    print(f"\n(b) {TASKS} contenders, one lock, acquire -> sleep(0) -> release for "
          f"{s.contend_s:g} s")
    head = (f"{'implementation':<48}{'handoffs/s':>11}{'acq/s':>9}{'wait p50':>10}"
            f"{'wait p99':>10}{'req/acq':>9}{'srv cmds/acq':>14}{'max holders':>13}"
            f"{'violations':>12}{'errors':>8}")
    print(head)
    print("-" * len(head))
    for row in rows:
        t = row.tally
        if t is None:
            continue
        print(f"{row.label:<48}{t.handoffs / row.seconds:>11,.0f}{t.in_window / row.seconds:>9,.0f}"
              f"{fmt(percentile(t.waits, 50) * 1000, '.2f')+' ms':>10}"
              f"{fmt(percentile(t.waits, 99) * 1000, '.1f')+' ms':>10}"
              f"{fmt(row.requests, '.2f'):>9}{fmt(row.server_cmds, '.2f'):>14}"
              f"{t.max_holders:>13}{t.violations:>12}{len(t.errors):>8}")
    for row in rows:
        if row.breakdown:
            parts = ", ".join(f"{cmd} {n:.2f}" for cmd, n in row.breakdown.most_common())
            print(f"    requests per acquisition, {row.label}: {parts}")


def print_watchdog(r: WatchdogResult) -> None:
    rounds = r.hold_s / (r.ttl / 3)
    print(f"\n(c) Watchdog scale: {r.leases:,} aiolock leases, ttl={r.ttl:g} s (renewed every "
          f"{r.ttl / 3:g} s), held {r.hold_s:g} s = {rounds:.0f} renewal rounds")
    if r.error:
        print(f"    ERROR:\n{r.error}")
        return
    parts = ", ".join(f"{cmd} {n:,}" for cmd, n in r.breakdown.most_common())
    lines = [
        ("acquire all (batches, concurrent)",
         f"{r.acquire_s:.2f} s ({r.leases / r.acquire_s:,.0f}/s)"),
        ("leases lost during the hold", f"{r.lost:,}"),
        ("requests during the hold (MONITOR)",
         f"{r.requests:,} = {r.requests / rounds:,.1f} per renewal round ({parts})"),
        ("server commands during the hold (commandstats)",
         f"{r.server_cmds:,} = {r.server_cmds / rounds:,.0f} per round (incl. inside Lua)"),
        ("client CPU during the hold", f"{r.cpu_s:.2f} s ({r.cpu_s / r.hold_s:.1%} of one core)"),
        ("event-loop lag during the hold, p99 / max",
         f"{r.p99_lag_s * 1000:.1f} ms / {r.max_lag_s * 1000:.1f} ms"),
        ("release all (batches, concurrent)",
         f"{r.release_s:.2f} s ({r.leases / r.release_s:,.0f}/s)"),
        ("still held after release (lock.locked())", f"{r.left_held:,}"),
    ]
    for what, value in lines:
        print(f"    {what:<48}{value}")


@dataclass
class BurstResult:
    acquisitions: int
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


async def bench_burst(server: RedisServer, n: int = 50_000) -> BurstResult:
    res = BurstResult(n)
    async with aiolock.connect(server.url) as locks:

        async def one(i: int) -> None:
            try:
                lease = await locks.lock(f"bench:d:{i}", ttl=60).acquire(timeout=0)
                await lease.release()
            except Exception as exc:
                res.errors.append(f"{type(exc).__name__}: {exc}")

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        res.seconds = time.perf_counter() - start
    return res


def print_burst(r: BurstResult, c: WatchdogResult | None) -> None:
    print(f"\n(d) Burst: {r.acquisitions:,} concurrent acquire+release of distinct names, "
          "one connection")
    beside = (f"   [(c): {c.leases:,} leases acquired at {c.leases / c.acquire_s:,.0f}/s]"
              if c is not None and c.acquire_s else "")
    print(f"    {'acquisitions/s (acquire+release)':<48}{r.acquisitions / r.seconds:,.0f}"
          f" in {r.seconds:.2f} s{beside}")
    print(f"    {'errors':<48}{len(r.errors):,}" + (f" (first: {r.errors[0]})" if r.errors else ""))


def environment(server: RedisServer) -> str:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"aiolock {aiolock.__version__} ({commit}), redis-py {version('redis')}, "
            f"python-redis-lock {version('python-redis-lock')}, redis-server {server.version()}, "
            f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load {load}")


# -- main ---------------------------------------------------------------------------------


async def main(s: Settings, scale_only: bool = False, aiolock_only: bool = False) -> int:
    with RedisServer() as server:
        admin = aioredis.Redis.from_url(server.url)
        try:
            print(f"# {environment(server)}", flush=True)
            print(f"# private redis-server at {server.url}", flush=True)
            started = time.perf_counter()
            if scale_only:  # (c) and (d) only
                c = await bench_watchdog(server, admin, s)
                d = await bench_burst(server)
                print_watchdog(c)
                print_burst(d, c)
                print(f"# total {time.perf_counter() - started:.0f} s")
                return 1 if c.error or c.lost or d.errors else 0

            uncontended = [
                Uncontended("raw floor: SET NX PX + EVALSHA compare-del", floor_session),
                Uncontended("  same, lean client (asyncio Protocol+hiredis)", lean_floor_session),
                Uncontended("aiolock (watchdog on)", aiolock_session),
                Uncontended("redis-py asyncio Lock (has no watchdog)", redis_py_session),
            ]
            contended = [
                Contended("aiolock (watchdog on)", aiolock_contenders),
                Contended("redis-py asyncio Lock, default sleep=0.1", redis_py_contenders(None)),
                Contended("redis-py asyncio Lock, sleep=0.001", redis_py_contenders(0.001)),
            ]
            if aiolock_only:  # an A/B of aiolock versions (PYTHONPATH): floor and aiolock
                uncontended = uncontended[:3]
                contended = contended[:1]
            elif redis_lock is not None:
                uncontended.append(Uncontended(
                    "python-redis-lock, SYNC (auto_renewal thread)", redis_lock_session, sync=True
                ))
                contended.append(Contended(
                    f"python-redis-lock, SYNC, {TASKS} threads (auto_renewal)", None
                ))
            else:
                log("python-redis-lock is not installed: .venv/bin/pip install python-redis-lock")

            a_redis = await bench_uncontended(uncontended, server.url, s, server, admin)
            a_memory = await bench_uncontended(
                [Uncontended("aiolock memory:// (reference)", aiolock_session)], "memory://", s
            )
            b_redis = await bench_contended(contended, server.url, s, server, admin)
            b_memory = await bench_contended(
                [Contended("aiolock memory:// (reference)", aiolock_contenders)], "memory://", s
            )
            print_uncontended(s, a_redis, a_memory)
            print_contended(s, b_redis + b_memory)
            if aiolock_only:
                return 0
            c = await bench_watchdog(server, admin, s)
            d = await bench_burst(server)
            print_watchdog(c)
            print_burst(d, c)
            print("\nreq = requests (round trips) clients sent, counted with MONITOR in a "
                  "separate shorter pass;\nsrv cmds = INFO commandstats calls (an EVALSHA "
                  "counts 1 plus every command its script runs), timed pass,\nsetup included. "
                  "wait = from calling acquire() until it returns.")
            print(f"# total {time.perf_counter() - started:.0f} s")

            failures = [r.label for r in a_redis + a_memory if r.error]
            failures += [r.label for r in b_redis + b_memory if r.errors]
            failures += [r.label for r in b_redis + b_memory if r.tally and r.tally.violations]
            if c.error or c.lost:
                failures.append("watchdog scale")
            if d.errors:
                failures.append("burst")
            if failures:
                print(f"# PROBLEMS: {'; '.join(failures)}")
            return 1 if failures else 0
        finally:
            await admin.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="shorter runs (2 s contention, 10 s watchdog hold)")
    parser.add_argument("--scale-only", action="store_true",
                        help="only (c) watchdog scale and (d) the 50,000-acquire burst")
    parser.add_argument("--aiolock-only", action="store_true",
                        help="only (a) and (b), for aiolock and the raw floor: an A/B of two "
                             "aiolock versions, e.g. PYTHONPATH=<a checkout of main>")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(QUICK if args.quick else FULL, args.scale_only, args.aiolock_only)))
