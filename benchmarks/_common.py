"""Helpers shared by the benchmarks: timing loops, release adapters, table formatting, and
the workers and statistics of the P processes x T tasks benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiolock

#: one acquire+release cycle of an implementation under test
Cycle = Callable[[], Awaitable[None]]
#: gives back what an acquire returned
Release = Callable[[Any], Awaitable[Any]]


async def repeat(cycle: Cycle, n: int) -> float:
    """Seconds taken by ``n`` awaited cycles."""
    start = time.perf_counter()
    for _ in range(n):
        await cycle()
    return time.perf_counter() - start


def repeat_sync(cycle: Callable[[], None], n: int) -> float:
    """Seconds taken by ``n`` blocking cycles."""
    start = time.perf_counter()
    for _ in range(n):
        cycle()
    return time.perf_counter() - start


def log(message: str) -> None:
    """A progress line, to stderr."""
    print(f"  .. {message}", file=sys.stderr, flush=True)


def lease_cycle(lock: aiolock.Lock) -> Cycle:
    """One acquire+release of an aiolock lock."""

    async def cycle() -> None:
        lease = await lock.acquire()
        await lease.release()

    return cycle


def peer_cycle(lock: Any) -> Cycle:
    """One acquire+release of a peer's lock object (``acquire()`` / ``release()``)."""

    async def cycle() -> None:
        await lock.acquire()
        await lock.release()

    return cycle


def sync_cycle(lock: Any) -> Callable[[], None]:
    """One acquire+release of a synchronous peer's lock object."""

    def cycle() -> None:
        lock.acquire()
        lock.release()

    return cycle


@dataclass(frozen=True)
class Uncontended:
    """An implementation in an uncontended run: ``session(...)`` yields a cycle (a
    context manager, an async one unless ``sync``)."""

    label: str
    session: Callable[..., Any]
    sync: bool = False


@dataclass
class Rates:
    """An implementation's cycles per second, one a round, or the error that stopped it."""

    label: str
    rates: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.rates) if self.rates else float("nan")


def round_order(n: int, rnd: int) -> list[int]:
    """The order of ``n`` implementations in round ``rnd``: reversed every other round, so
    that none always runs first (a shared machine's load drifts)."""
    return list(range(n))[::-1] if rnd % 2 else list(range(n))


class Exclusion:
    """Holders counted at once, thread-safe (a threaded peer shares it): the most at
    once, how many acquisitions found another holder in, and the contenders' errors."""

    def __init__(self) -> None:
        self.guard = threading.Lock()
        self.holders = 0
        self.max_holders = 0
        self.violations = 0
        self.errors: list[str] = []

    def _count_in(self) -> None:
        """One more holder (call with ``guard`` held)."""
        self.holders += 1
        self.max_holders = max(self.max_holders, self.holders)
        if self.holders > 1:
            self.violations += 1

    def leave(self) -> None:
        with self.guard:
            self.holders -= 1


async def await_contenders(tasks: list[asyncio.Task[None]], timeout: float, grace: float,
                           errors: list[str]) -> None:
    """Wait ``timeout`` s for the contenders; any still waiting then is a hang: cancelled,
    and reported in ``errors`` with where one of them was."""
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    if pending:
        where = io.StringIO()
        next(iter(pending)).print_stack(file=where)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        errors.append(
            f"{len(pending)} contender(s) still waiting {grace:g} s after the deadline (hang); "
            f"one of them was at:\n{where.getvalue()}"
        )


async def release_lease(lease: aiolock.Lease) -> None:
    await lease.release()


def releaser(lock: Any) -> Release:
    """A release callable for a peer lock object whose ``release()`` takes no argument."""

    async def release(_: Any) -> None:
        await lock.release()

    return release


def fmt(value: float | None, spec: str = ",.0f", none: str = "-") -> str:
    return none if value is None or value != value else format(value, spec)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in 0..100)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, round(q / 100 * len(ordered) + 0.5))
    return ordered[min(rank, len(ordered)) - 1]


# -- P processes x T tasks on one lock (bench_procs.py, procs_zk.py) ---------------------------

Record = tuple[float, float, float, int, int]  # call, acquired, release called, pid, task
#: one task's timed loop: cycles until the CLOCK_MONOTONIC time it is given
Loop = Callable[[float], Awaitable[None]]


def timed_loop(records: list[Record], task: int, acquire: Callable[[], Awaitable[Any]],
               release: Release) -> Loop:
    """A task's loop: acquire -> ``await asyncio.sleep(0)`` -> release, a record a cycle."""
    pid = os.getpid()

    async def loop(stop: float) -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            held = await acquire()
            t1 = time.monotonic()
            await asyncio.sleep(0)
            t2 = time.monotonic()
            await release(held)
            records.append((t0, t1, t2, pid, task))

    return loop


def run_threads(records: list[Record], locks: list[Any], stop: float) -> None:
    """One thread a synchronous lock (``acquire()`` / ``release()``), each looping until
    ``stop``, a record a cycle."""
    pid = os.getpid()

    def loop(task: int, lock: Any) -> None:
        while time.monotonic() < stop:
            t0 = time.monotonic()
            lock.acquire()
            t1 = time.monotonic()
            t2 = time.monotonic()
            lock.release()
            records.append((t0, t1, t2, pid, task))

    threads = [threading.Thread(target=loop, args=(i, lk)) for i, lk in enumerate(locks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def peer_acquirer(peer: Any) -> Callable[[], Awaitable[Any]]:
    """An acquire callable for a peer lock object: gives the object back to release."""

    async def acquire() -> Any:
        await peer.acquire()
        return peer

    return acquire


async def release_peer(peer: Any) -> None:
    await peer.release()


def parse_go(line: str) -> tuple[float, str] | None:
    """``GO <stop> <file>`` as (stop, file); None for ``QUIT`` or the end of input."""
    words = line.split()
    if not words or words[0] == "QUIT":
        return None
    return float(words[1]), words[2]


def go_commands() -> Iterator[tuple[float, str]]:
    """The worker's ``GO`` commands read from stdin, until ``QUIT``."""
    for line in sys.stdin:
        go = parse_go(line)
        if go is None:
            return
        yield go


def report(path: str, records: list[Record], cpu: float) -> None:
    """A worker's answer to ``GO``: its records and CPU seconds to ``path``, then ``DONE``."""
    Path(path).write_text(json.dumps({"records": records, "cpu": cpu}))
    print("DONE", flush=True)


class Workers:
    """P worker processes ``script --worker ARGS...``: each prints ``READY``, then answers
    each ``GO <stop> <file>`` with ``report``; ``QUIT`` ends it. ``path`` (an aiolock of
    another revision) goes first on their PYTHONPATH."""

    def __init__(self, script: str, args: list[str], nprocs: int, path: str | None) -> None:
        env = dict(os.environ)
        if path:
            env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
        self.procs = [
            subprocess.Popen([sys.executable, script, "--worker", *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(nprocs)
        ]
        for p in self.procs:
            self._expect(p, "READY")

    def _expect(self, p: subprocess.Popen[str], word: str) -> None:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith(word):
            raise RuntimeError(f"worker said {line!r}, expected {word}")

    def run(self, seconds: float, tmp: Path) -> tuple[list[Record], int, float]:
        """The records of the last ``seconds`` of a run, how many acquisitions the whole
        run made (the server's counters cover the whole run) and the CPU seconds used."""
        stop = time.monotonic() + 0.3 + seconds  # a moment for every process to read GO
        files = [tmp / f"{uuid.uuid4().hex}.json" for _ in self.procs]
        for p, f in zip(self.procs, files, strict=True):
            assert p.stdin is not None
            p.stdin.write(f"GO {stop} {f}\n")
            p.stdin.flush()
        for p in self.procs:
            self._expect(p, "DONE")
        records: list[Record] = []
        cpu = 0.0
        for f in files:
            got = json.loads(f.read_text())
            records += [tuple(r) for r in got["records"]]
            cpu += got["cpu"]
            f.unlink()
        return [r for r in records if r[1] >= stop - seconds], len(records), cpu

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            try:
                p.stdin.write("QUIT\n")
                p.stdin.flush()
            except BrokenPipeError:
                pass
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


@dataclass
class Run:
    """One timed run of P processes x T tasks; ``counters``: the benchmark's own
    per-acquisition counts (server commands, watches, CPU...)."""

    acq_s: float
    xproc_s: float
    p50: float
    p99: float
    wait_p99: float
    lo: int
    hi: int
    handoffs_s: float
    max_handoff: float
    max_local: float
    counters: dict[str, float]


def measure(records: list[Record], seconds: float, nprocs: int,
            counters: dict[str, float]) -> Run:
    """Hand-offs (cross-process and in-process), waits and the spread over processes."""
    records.sort(key=lambda r: r[1])
    cross: list[float] = []
    local: list[float] = []
    for a, b in itertools.pairwise(records):
        if a[3] != b[3]:
            cross.append((b[1] - a[2]) * 1000)
        elif a[4] != b[4]:
            local.append((b[1] - a[2]) * 1000)
    per: dict[int, int] = {}
    for r in records:
        per[r[3]] = per.get(r[3], 0) + 1
    counts = list(per.values()) + [0] * (nprocs - len(per))
    waits = [(r[1] - r[0]) * 1000 for r in records]
    return Run(
        acq_s=len(records) / seconds, xproc_s=len(cross) / seconds,
        p50=percentile(cross, 50), p99=percentile(cross, 99), wait_p99=percentile(waits, 99),
        lo=min(counts), hi=max(counts), handoffs_s=(len(cross) + len(local)) / seconds,
        max_handoff=max(cross + local, default=0.0), max_local=max(local, default=0.0),
        counters=counters,
    )


def timed_runs(workers: Workers, nprocs: int, seconds: float, runs: int, tmp: Path,
               sample: Callable[[], dict[str, float]]) -> list[Run]:
    """A warm-up, then ``runs`` timed runs of ``seconds``; closes the workers. ``sample``:
    the server's counters, taken before and after each run; a Run's ``counters`` are their
    deltas per acquisition, and ``cpu_us`` the workers' CPU microseconds per acquisition."""
    out: list[Run] = []
    try:
        workers.run(min(0.5, seconds), tmp)  # warm-up: connections, sessions, imports
        for _ in range(runs):
            before = sample()
            records, total, cpu = workers.run(seconds, tmp)
            after = sample()
            n = max(total, 1)
            counters = {k: (after[k] - v) / n for k, v in before.items()}
            out.append(measure(records, seconds, nprocs, {**counters, "cpu_us": cpu / n * 1e6}))
    finally:
        workers.close()
    return out


def lead_cells(label: str, runs: list[Run]) -> str:
    """The first cells of a process benchmark's row: implementation, acq/s, xproc/s and
    handoff p50 / p99."""
    return (f"| {label} | {median_range(runs, 'acq_s', ',.0f')} | "
            f"{median_range(runs, 'xproc_s', ',.0f')} | {median_range(runs, 'p50', '.2f')} / "
            f"{median_range(runs, 'p99', '.2f')} |")


def median_range(runs: list[Run], attr: str, spec: str) -> str:
    """``median (min-max)`` of a field or a counter over the runs."""
    values = [r.counters[attr] if attr in r.counters else getattr(r, attr) for r in runs]
    return (f"{fmt(statistics.median(values), spec)} "
            f"({fmt(min(values), spec)}-{fmt(max(values), spec)})")


def spread(runs: list[Run]) -> str:
    """``min / max per process (ratio)`` of the median run, the median ratio."""
    ratio = [r.lo / r.hi if r.hi else 0.0 for r in runs]
    mid = sorted(runs, key=lambda r: r.acq_s)[len(runs) // 2]
    return f"{mid.lo:,} / {mid.hi:,} ({fmt(statistics.median(ratio), '.2f')})"


def procs_args(doc: str, scenarios: str) -> argparse.ArgumentParser:
    """The options both process benchmarks take: --quick, --only, --before, --scenarios."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1.5 s runs instead of 3 s")
    ap.add_argument("--only", help="comma-separated implementations (default: all)")
    ap.add_argument("--before", help="also run aiolock as of this git revision")
    ap.add_argument("--scenarios", default=scenarios)
    return ap


def checkout(root: Path, rev: str, tmp: Path) -> str:
    """``aiolock/`` as of git revision ``rev`` (``git archive``) in ``tmp/before``: the
    directory to put first on a worker's PYTHONPATH."""
    before = tmp / "before"
    before.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, "aiolock"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
    return str(before)
