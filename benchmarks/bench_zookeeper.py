"""aiolock on ZooKeeper next to its peers, against one private ZooKeeper, in one run.

    .venv/bin/python benchmarks/bench_zookeeper.py [--quick]

(a) Uncontended acquire+release cycles per second: a raw three-request floor on an
    ``aiozk`` client (create an ephemeral sequential node, list the children, delete the
    node), aiolock (watchdog on), aiozk's ``recipes.Lock`` and kazoo's ``Lock``
    (synchronous, run in a worker thread). Rounds alternate between the implementations;
    the median round is reported.
(b) Handoff: 16 contenders loop acquire -> release on one lock for a fixed time. aiolock
    runs twice (16 ``aiolock.connect`` sessions; 16 tasks on one session), aiozk with 16
    clients, kazoo with 16 threads and 16 clients. Each runs 3 times, the order
    alternating between rounds; reported: the median run's handoffs per second and the
    handoff latency over all runs, from the moment a holder's ``release()`` call
    returned to the moment the next holder's ``acquire()`` returned
    (``time.monotonic()``), plus a mutual-exclusion check.

Requests and watch notifications are counted on the server, from ``mntr`` deltas
(``zk_packets_received``; the ``zk_sum_node_*_watch_count`` summaries, which add up how
many watchers each node event triggered). The server is standalone, so these deltas are
exact for whatever ran in between; pings and session set-up are included.

The server is ``tests/zk_server.py``'s ``ZooKeeperServer``: Debian's ZooKeeper jars, our
own child process on a free loopback port, with a temporary data directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import aiozk

import aiolock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests/zk_server.py

from _common import (  # noqa: E402
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

from tests.zk_server import ZooKeeperServer, four_letter, packets_and_watches  # noqa: E402

try:
    from kazoo.client import KazooClient
except ImportError:  # pip install kazoo
    KazooClient = None

TTL = 30.0  # aiolock lease length, seconds
CONTENDERS = 16  # in (b)
WARMUP = 100  # untimed cycles before each timed run in (a)
GRACE = 15.0  # (b) how long past the deadline a contender may still be waiting before it is a hang


@dataclass(frozen=True)
class Settings:
    rounds: int  # (a) alternating rounds
    cycles: int  # (a) cycles per round
    contend_s: float  # (b) one timed run
    contend_rounds: int  # (b) alternating runs per implementation


FULL = Settings(5, 1000, 3.0, 3)
QUICK = Settings(5, 300, 1.5, 3)


# -- server counters -----------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    packets: int
    watches: int

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.packets - other.packets, self.watches - other.watches)

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.packets + other.packets, self.watches + other.watches)


async def server_counts(server: ZooKeeperServer) -> Counts:
    return Counts(*await asyncio.to_thread(packets_and_watches, server.port))


# -- (a) uncontended: one session per implementation yields a `cycle` ----------------------

@contextlib.asynccontextmanager
async def floor_session(hosts: str, base: str) -> AsyncIterator[Cycle]:
    client = aiozk.ZKClient(hosts)
    await client.start()
    parent = f"{base}/a-floor"
    await client.ensure_path(parent)

    async def cycle() -> None:
        node = await client.create(f"{parent}/lock-", ephemeral=True, sequential=True)
        await client.get_children(parent)
        await client.delete(node)

    try:
        yield cycle
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def aiolock_session(hosts: str, base: str) -> AsyncIterator[Cycle]:
    async with aiolock.connect(f"zookeeper://{hosts}{base}-aiolock") as locks:
        yield lease_cycle(locks.lock("a", ttl=TTL))


@contextlib.asynccontextmanager
async def aiozk_session(hosts: str, base: str) -> AsyncIterator[Cycle]:
    client = aiozk.ZKClient(hosts)
    await client.start()
    try:
        yield peer_cycle(client.recipes.Lock(f"{base}/a-aiozk"))
    finally:
        await client.close()


@contextlib.contextmanager
def kazoo_session(hosts: str, base: str) -> Iterator[Callable[[], None]]:
    zk = KazooClient(hosts=hosts)
    zk.start(timeout=15)
    try:
        yield sync_cycle(zk.Lock(f"{base}/a-kazoo", "bench"))
    finally:
        zk.stop()
        zk.close()


def _timed_sync(impl: Uncontended, hosts: str, base: str, n: int) -> float:
    with impl.session(hosts, base) as cycle:
        repeat_sync(cycle, WARMUP)
        return repeat_sync(cycle, n)


async def timed_cycles(impl: Uncontended, hosts: str, base: str, n: int) -> float:
    """Seconds for ``n`` cycles after a warm-up, on a fresh session (a worker thread if sync)."""
    if impl.sync:
        return await asyncio.to_thread(_timed_sync, impl, hosts, base, n)
    async with impl.session(hosts, base) as cycle:
        await repeat(cycle, WARMUP)
        return await repeat(cycle, n)


@dataclass
class UncontendedResult(Rates):
    counts: Counts = Counts(0, 0)  # over all rounds, warm-up and session set-up included


async def bench_uncontended(
    impls: list[Uncontended], server: ZooKeeperServer, base: str, s: Settings
) -> list[UncontendedResult]:
    results = [UncontendedResult(impl.label) for impl in impls]
    for rnd in range(s.rounds):
        for i in round_order(len(impls), rnd):
            impl, res = impls[i], results[i]
            if res.error:
                continue
            before = await server_counts(server)
            try:
                elapsed = await asyncio.wait_for(
                    timed_cycles(impl, server.hosts, f"{base}/r{rnd}", s.cycles), 60
                )
            except Exception:
                res.error = traceback.format_exc()
                log(f"(a) {impl.label} FAILED:\n{res.error}")
                continue
            res.counts += await server_counts(server) - before
            res.rates.append(s.cycles / elapsed)
        log(f"(a) round {rnd + 1}/{s.rounds}: "
            + ", ".join(f"{r.label.split(' ')[0]} {r.rates[-1]:,.0f}/s" for r in results if r.rates))
    return results


# -- (b) handoff ----------------------------------------------------------------------------


class Tally(Exclusion):
    """What the contenders saw; thread-safe, so the threaded peer can share it."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.start = time.monotonic()
        self.deadline = self.start + seconds
        # one entry per acquisition, in acquisition order (which mutual exclusion makes total)
        self.who: list[int] = []
        self.acquired: list[float] = []
        self.released: list[float | None] = []

    def begin(self) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + self.seconds

    def enter(self, who: int) -> int:
        now = time.monotonic()
        with self.guard:
            self._count_in()
            self.who.append(who)
            self.acquired.append(now)
            self.released.append(None)
            return len(self.who) - 1

    def done(self, index: int) -> None:
        """The ``release()`` call of acquisition ``index`` returned."""
        self.released[index] = time.monotonic()

    @property
    def acquisitions(self) -> int:
        return len(self.who)

    def in_window(self) -> int:
        return sum(t < self.deadline for t in self.acquired)

    def handoffs(self) -> list[float]:
        """Latency of every handoff in the window: acquisition by another contender than the
        previous holder, measured from the previous holder's release returning."""
        out = []
        for i in range(1, len(self.who)):
            prev = self.released[i - 1]
            if self.acquired[i] < self.deadline and self.who[i] != self.who[i - 1] and prev is not None:
                out.append(self.acquired[i] - prev)
        return out


Acquire = Callable[[], Awaitable[Any]]
Release = Callable[[Any], Awaitable[Any]]


async def contend_async(handles: list[tuple[Acquire, Release]], seconds: float) -> Tally:
    """Each handle is one contender's (acquire, release) of the same lock."""
    tally = Tally(seconds)

    async def worker(who: int, acquire: Acquire, release: Release) -> None:
        try:
            while time.monotonic() < tally.deadline:
                held = await acquire()
                index = tally.enter(who)
                tally.leave()
                await release(held)
                tally.done(index)
        except Exception:
            tally.errors.append(traceback.format_exc())

    tally.begin()
    tasks = [asyncio.create_task(worker(i, *h)) for i, h in enumerate(handles)]
    await await_contenders(tasks, seconds + GRACE, GRACE, tally.errors)
    return tally


@contextlib.asynccontextmanager
async def aiolock_sessions(hosts: str, base: str) -> AsyncIterator[list[tuple[Acquire, Release]]]:
    """16 separate aiolock.connect() sessions (16 ZooKeeper sessions) in this process."""
    async with contextlib.AsyncExitStack() as stack:
        url = f"zookeeper://{hosts}{base}-aiolock"
        sessions = await asyncio.gather(
            *(stack.enter_async_context(aiolock.connect(url)) for _ in range(CONTENDERS))
        )
        yield [(locks.lock("b-sessions", ttl=TTL).acquire, release_lease) for locks in sessions]


@contextlib.asynccontextmanager
async def aiolock_tasks(hosts: str, base: str) -> AsyncIterator[list[tuple[Acquire, Release]]]:
    """16 tasks on one aiolock session, each with its own lock object."""
    async with aiolock.connect(f"zookeeper://{hosts}{base}-aiolock") as locks:
        yield [(locks.lock("b-tasks", ttl=TTL).acquire, release_lease) for _ in range(CONTENDERS)]


@contextlib.asynccontextmanager
async def aiozk_clients(hosts: str, base: str) -> AsyncIterator[list[tuple[Acquire, Release]]]:
    """16 aiozk clients (a recipe lock object may not be shared by concurrent tasks)."""
    clients = [aiozk.ZKClient(hosts) for _ in range(CONTENDERS)]
    try:
        await asyncio.gather(*(c.start() for c in clients))
        handles: list[tuple[Acquire, Release]] = []
        for c in clients:
            lock = c.recipes.Lock(f"{base}/b-aiozk")
            handles.append((lock.acquire, releaser(lock)))
        yield handles
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def contend_kazoo(hosts: str, base: str, seconds: float) -> Tally:
    """kazoo: 16 threads, each with its own KazooClient and Lock."""
    clients = [KazooClient(hosts=hosts) for _ in range(CONTENDERS)]
    for zk in clients:
        zk.start(timeout=15)
    tally = Tally(seconds)

    def worker(who: int) -> None:
        lock = clients[who].Lock(f"{base}/b-kazoo", str(who))
        try:
            while time.monotonic() < tally.deadline:
                lock.acquire()
                index = tally.enter(who)
                tally.leave()
                lock.release()
                tally.done(index)
        except Exception:
            tally.errors.append(traceback.format_exc())

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(CONTENDERS)]
    tally.begin()
    for t in threads:
        t.start()
    end = tally.deadline + GRACE
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
        tally.errors.append(f"{stuck} thread(s) still waiting {GRACE:g} s after the deadline (hang)")
    for zk in clients:
        with contextlib.suppress(Exception):
            zk.stop()
            zk.close()
    return tally


@dataclass(frozen=True)
class Contended:
    label: str
    session: Callable[[str, str], Any] | None  # None: the threaded kazoo


@dataclass
class ContendedResult:
    label: str
    tallies: list[Tally] = field(default_factory=list)  # one per round
    counts: Counts = Counts(0, 0)  # over all rounds, session set-up included

    @property
    def errors(self) -> list[str]:
        return [e for t in self.tallies for e in t.errors]

    @property
    def violations(self) -> int:
        return sum(t.violations for t in self.tallies)

    @property
    def max_holders(self) -> int:
        return max((t.max_holders for t in self.tallies), default=0)

    @property
    def acquisitions(self) -> int:
        return sum(t.acquisitions for t in self.tallies)

    def handoffs(self) -> list[float]:
        return [x for t in self.tallies for x in t.handoffs()]

    def median_rate(self, what: str) -> float:
        """Median over the rounds of handoffs (``what="handoffs"``) or acquisitions per second."""
        rates = [(len(t.handoffs()) if what == "handoffs" else t.in_window()) / t.seconds
                 for t in self.tallies]
        return statistics.median(rates) if rates else float("nan")


async def run_contended(impl: Contended, hosts: str, base: str, seconds: float) -> Tally:
    if impl.session is None:
        return await asyncio.to_thread(contend_kazoo, hosts, base, seconds)
    async with impl.session(hosts, base) as handles:
        return await contend_async(handles, seconds)


async def bench_contended(
    impls: list[Contended], server: ZooKeeperServer, base: str, s: Settings
) -> list[ContendedResult]:
    """``s.contend_rounds`` runs of ``s.contend_s`` per implementation, the order
    alternating between rounds (the machine's load drifts: no implementation should
    always run first or last)."""
    results = [ContendedResult(impl.label) for impl in impls]
    for rnd in range(s.contend_rounds):
        order = list(range(len(impls)))
        if rnd % 2:
            order.reverse()
        for i in order:
            impl, res = impls[i], results[i]
            before = await server_counts(server)
            try:
                t = await run_contended(impl, server.hosts, f"{base}/h{rnd}", s.contend_s)
            except Exception:
                t = Tally(s.contend_s)
                t.errors.append(traceback.format_exc())
            res.counts += await server_counts(server) - before
            res.tallies.append(t)
            log(f"(b) round {rnd + 1}/{s.contend_rounds} {impl.label}: "
                f"{len(t.handoffs()) / s.contend_s:,.0f} handoffs/s, "
                f"{t.acquisitions:,} acquisitions, {len(t.errors)} error(s)")
            for err in t.errors[:3]:
                log(f"(b) {impl.label} error:\n{err}")
    return results


# -- report -------------------------------------------------------------------------------


def print_uncontended(s: Settings, rows: list[UncontendedResult]) -> None:
    """``rows[0]`` is the floor."""
    print(f"\n(a) Uncontended acquire+release, one caller; median of {s.rounds} alternating "
          f"rounds x {s.cycles:,} cycles")
    head = (f"{'implementation':<46}{'cycles/s':>10}{'vs floor':>10}{'min..max':>14}"
            f"{'req/cycle':>11}{'watches/cycle':>15}")
    print(head)
    print("-" * len(head))
    floor = rows[0].median
    total = s.rounds * (s.cycles + WARMUP)
    for row in rows:
        if row.error or not row.rates:
            print(f"{row.label:<46}{'ERROR (see log)':>10}")
            continue
        spread = f"{min(row.rates):,.0f}..{max(row.rates):,.0f}"
        done = len(row.rates) * (s.cycles + WARMUP) or total
        print(f"{row.label:<46}{row.median:>10,.0f}{row.median / floor:>9.2f}x{spread:>14}"
              f"{row.counts.packets / done:>11.2f}{row.counts.watches / done:>15.2f}")


def print_contended(s: Settings, rows: list[ContendedResult]) -> None:
    print(f"\n(b) Handoff: {CONTENDERS} contenders, one lock, acquire -> release; median of "
          f"{s.contend_rounds} alternating runs x {s.contend_s:g} s; latency = release() returned "
          f"-> next holder's acquire() returned (all runs)")
    head = (f"{'implementation':<46}{'handoffs/s':>11}{'acq/s':>8}{'lat p50':>10}{'lat p99':>10}"
            f"{'<0':>5}{'req/acq':>9}{'watches/rel':>13}{'max holders':>13}{'violations':>12}"
            f"{'errors':>8}")
    print(head)
    print("-" * len(head))
    for row in rows:
        if not row.tallies:
            continue
        lat = row.handoffs()
        n = row.acquisitions
        req = row.counts.packets / n if n else None
        wch = row.counts.watches / n if n else None
        print(f"{row.label:<46}{row.median_rate('handoffs'):>11,.0f}{row.median_rate('acq'):>8,.0f}"
              f"{fmt(percentile(lat, 50) * 1000, '.2f') + ' ms':>10}"
              f"{fmt(percentile(lat, 99) * 1000, '.2f') + ' ms':>10}"
              f"{sum(x < 0 for x in lat):>5}{fmt(req, '.2f'):>9}{fmt(wch, '.2f'):>13}"
              f"{row.max_holders:>13}{row.violations:>12}{len(row.errors):>8}")


def environment(server: ZooKeeperServer) -> str:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    try:
        zk = four_letter(server.port, "srvr").splitlines()[0].split(":", 1)[1].split(",")[0].strip()
    except (OSError, IndexError):
        zk = "?"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"aiolock {aiolock.__version__} ({commit}), aiozk {version('aiozk')}, "
            f"kazoo {version('kazoo')}, ZooKeeper {zk}, Python {platform.python_version()}, "
            f"{os.cpu_count()} CPUs, load {load}")


# -- main ---------------------------------------------------------------------------------


async def main(s: Settings) -> int:
    log("starting a private ZooKeeper")
    server = await asyncio.to_thread(lambda: ZooKeeperServer().start())
    try:
        print(f"# {environment(server)}", flush=True)
        print(f"# private standalone ZooKeeper at {server.hosts}", flush=True)
        started = time.perf_counter()
        base = f"/bench-{uuid.uuid4().hex[:12]}"

        uncontended = [
            Uncontended("raw floor: create -e -s + getChildren + delete", floor_session),
            Uncontended("aiolock (watchdog on)", aiolock_session),
            Uncontended("aiozk recipes.Lock", aiozk_session),
        ]
        contended = [
            Contended(f"aiolock, {CONTENDERS} sessions (watchdog on)", aiolock_sessions),
            Contended(f"aiolock, {CONTENDERS} tasks on 1 session", aiolock_tasks),
            Contended(f"aiozk recipes.Lock, {CONTENDERS} clients", aiozk_clients),
        ]
        if KazooClient is not None:
            uncontended.append(Uncontended("kazoo Lock, SYNC (worker thread)", kazoo_session, sync=True))
            contended.append(Contended(f"kazoo Lock, SYNC, {CONTENDERS} threads/clients", None))
        else:
            log("kazoo is not installed (.venv/bin/pip install kazoo): its rows are skipped")

        a = await bench_uncontended(uncontended, server, base, s)
        b = await bench_contended(contended, server, base, s)

        print_uncontended(s, a)
        print_contended(s, b)
        print("\nreq = packets the server received (mntr zk_packets_received), watches = watchers "
              "triggered\n(mntr zk_sum_node_*_watch_count), both per cycle / per release over "
              "the whole run,\nwarm-up, session set-up and pings included. <0 = handoffs whose "
              "next acquire() returned\nbefore the previous holder's release() did.")
        print(f"# total {time.perf_counter() - started:.0f} s")

        failures = [r.label for r in a if r.error]
        failures += [r.label for r in b if r.errors or r.violations]
        if failures:
            print(f"# PROBLEMS: {'; '.join(failures)}")
        return 1 if failures else 0
    finally:
        await asyncio.to_thread(server.close)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="shorter runs (300 cycles per round, 1.5 s handoff runs)")
    args = parser.parse_args()
    sys.exit(asyncio.run(main(QUICK if args.quick else FULL)))
