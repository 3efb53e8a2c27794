"""The harness of the load tests: busy-loop hogs, churning worker processes (each writing
its own record file, ``procs/churner.py``), and the checks made on the merged records.

A lease's *belief interval* is ``[enter, last t at which it read lease.lost false]``:
SPEC §2 ("never believe in a lease longer than the server granted it") makes the belief
intervals of an exclusive primitive pairwise disjoint, whatever pauses or kills happen.
Every record is taken on CLOCK_MONOTONIC (system-wide on Linux).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aiolock import Capability

from ..scenarios import by_id

ROOT = Path(__file__).resolve().parents[2]
CHURNER = str(Path(__file__).parent / "procs" / "churner.py")
HOG = "while True: pass"
#: a worker whose connections are closed (no asyncio task left) exits within this many s
EXIT_WITHIN = 10.0


#: the rows under test: every server backend but Redis's
OTHER = ("zookeeper", "postgres", "postgres-row", "mysql", "mysql-row", "memcached", "etcd")


def other_rows(*need: Capability) -> pytest.MarkDecorator:
    """Parametrize the ``scenario`` fixture (tests/conftest.py) over the rows of ``OTHER``
    whose backend declares every one of ``need``."""
    found = [by_id(i).param() for i in OTHER
             if by_id(i).missing or set(need) <= by_id(i).capabilities]
    return pytest.mark.parametrize("scenario", found, indirect=True)


@contextlib.contextmanager
def hogs(n: int = 2) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` busy-loop processes (the machine made busy), killed at the end."""
    procs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]
    try:
        yield procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


def _trace(what: str) -> None:
    if os.environ.get("LOAD_TRACE"):
        print(f"[harness {time.monotonic():.3f}] {what}", file=sys.stderr, flush=True)


@dataclass
class Worker:
    """One churner process."""

    proc: asyncio.subprocess.Process
    out: Path
    cfg: dict[str, Any]
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def expect(self, word: str, within: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + within
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"worker {self.pid}: no {word!r} within {within}s")
            try:
                raw = await asyncio.wait_for(self.proc.stdout.readline(), left)
            except TimeoutError:
                raise AssertionError(f"worker {self.pid}: no {word!r} within {within}s") from None
            if not raw:
                err = await self.stderr()
                raise AssertionError(f"worker {self.pid} ended before {word!r}: {err}")
            line = raw.decode().strip()
            self.lines.append(line)
            if line.startswith(word):
                return line

    async def stderr(self) -> str:
        """Its stderr (it is killed if it has not ended within 5 s)."""
        assert self.proc.stderr is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5)
        await self.kill()
        return (await self.proc.stderr.read()).decode(errors="replace")[-3000:]

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
            await self.proc.wait()


@dataclass
class Lease:
    key: str
    pid: int
    task: int
    role: str
    start: float
    enter: float | None = None
    believed: float | None = None
    exit: float | None = None
    tok: int | None = None
    lost: bool = False  # any record read lease.lost true, or the block raised LockLost


@dataclass
class Run:
    """The merged records of one churn."""

    leases: dict[str, Lease]
    events: list[dict[str, Any]]
    killed: set[int]
    go: float
    end: float

    @property
    def granted(self) -> list[Lease]:
        return [x for x in self.leases.values() if x.enter is not None]

    def of(self, ev: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["ev"] == ev]

    def summary(self) -> str:
        g = self.granted
        per: dict[int, int] = {}
        for x in g:
            per[x.pid] = per.get(x.pid, 0) + 1
        return (f"{len(g)} grants {sorted(per.values())} per process, "
                f"{sum(x.lost for x in g)} lost, {len(self.of('miss'))} misses, "
                f"{len(self.of('cancel'))} cancels")


def load(paths: list[Path], killed: set[int], go: float, end: float) -> Run:
    leases: dict[str, Lease] = {}
    events: list[dict[str, Any]] = []
    for path in paths:
        if not path.exists():
            continue
        for raw in path.read_text().splitlines():
            try:
                e = json.loads(raw)
            except json.JSONDecodeError:  # a line cut by kill -9
                continue
            events.append(e)
            key = e.get("key")
            if e["ev"] == "start":
                leases[key] = Lease(key, e["pid"], e["task"], e["role"], e["t"])
            elif e["ev"] in ("enter", "chk", "exit"):
                x = leases[key]
                if e["ev"] == "enter":
                    x.enter, x.tok = e["t"], e["tok"]
                if e["ev"] == "exit":
                    x.exit = e["t"]
                if e["lost"]:
                    x.lost = True
                elif not x.lost:
                    x.believed = e["t"]
            elif e["ev"] == "lockost":
                leases[key].lost = True
    return Run(leases, events, killed, go, end)


def _fmt(x: Lease) -> str:
    return (f"{x.key} tok={x.tok} role={x.role} enter={x.enter:.4f} "
            f"believed={x.believed} exit={x.exit} lost={x.lost}")


def overlaps(run: Run, exclusive: Callable[[Lease], bool] = lambda _x: True) -> list[str]:
    """Belief intervals that overlap where one of the two is exclusive (a lock, a writer,
    a leader): [enter, believed] of each lease, sorted by enter."""
    found: list[str] = []
    ivs = sorted((x for x in run.granted if x.believed is not None), key=lambda x: x.enter or 0)
    top_all: Lease | None = None  # the interval reaching furthest so far
    top_excl: Lease | None = None  # the exclusive one reaching furthest so far
    for x in ivs:
        assert x.enter is not None and x.believed is not None
        other = top_all if exclusive(x) else top_excl
        if other is not None and other.believed is not None and x.enter < other.believed:
            found.append(f"{_fmt(other)}  OVERLAPS  {_fmt(x)}")
        if top_all is None or (top_all.believed or 0) < x.believed:
            top_all = x
        if exclusive(x) and (top_excl is None or (top_excl.believed or 0) < x.believed):
            top_excl = x
    return found


def most_inside(run: Run) -> tuple[int, float]:
    """The most belief intervals open at once, and when."""
    edges: list[tuple[float, int]] = []
    for x in run.granted:
        if x.believed is not None and x.enter is not None:
            edges += [(x.enter, 1), (x.believed, -1)]
    edges.sort()  # at one instant, an end (-1) sorts before a start
    inside = best = 0
    when = 0.0
    for t, d in edges:
        inside += d
        if inside > best:
            best, when = inside, t
    return best, when


def token_faults(run: Run) -> list[str]:
    """Tokens repeated, or not strictly above every acquisition that ended (acquire
    returned) before this one's acquire was called (SPEC §2)."""
    found: list[str] = []
    seen: dict[int, Lease] = {}
    for x in run.granted:
        assert x.tok is not None
        if x.tok in seen:
            found.append(f"token repeated: {_fmt(seen[x.tok])} and {_fmt(x)}")
        seen[x.tok] = x
    by_enter = sorted(run.granted, key=lambda x: x.enter or 0)
    by_start = sorted(run.granted, key=lambda x: x.start)
    i = 0
    best: Lease | None = None
    for x in by_start:
        while i < len(by_enter) and (by_enter[i].enter or 0) < x.start:
            if best is None or (best.tok or 0) < (by_enter[i].tok or 0):
                best = by_enter[i]
            i += 1
        if best is not None and best is not x and (x.tok or 0) <= (best.tok or 0):
            found.append(f"token not above an earlier grant: {_fmt(best)} then {_fmt(x)}")
    return found


def by_pid_task(run: Run) -> dict[tuple[int, int], list[Lease]]:
    got: dict[tuple[int, int], list[Lease]] = {}
    for x in run.granted:
        got.setdefault((x.pid, x.task), []).append(x)
    return got


async def churn(tmp: Path, url: str, cfgs: list[dict[str, Any]], seconds: float,
                fault: Callable[[list[Worker], float], Awaitable[None]] | None = None,
                ready_within: float = 40.0, hog: int = 2) -> tuple[Run, list[Worker]]:
    """Start one churner per config (``url``, a go file and an own record file added),
    let them churn for ``seconds`` on a machine kept busy by ``hog`` busy loops
    (``fault(workers, go)`` runs meanwhile), wait for each one's final acquire, close
    them; the merged records."""
    go = tmp / f"go-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers: list[Worker] = []
    stack = contextlib.ExitStack()
    try:
        for n, cfg in enumerate(cfgs):
            out = tmp / f"w{n}-{uuid.uuid4().hex[:6]}.jsonl"
            full = {**cfg, "url": url, "go": str(go), "out": str(out)}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, CHURNER, json.dumps(full), env=env,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            workers.append(Worker(proc, out, full))
        for w in workers:
            await w.expect("READY", ready_within)
        _trace("ready")
        stack.enter_context(hogs(hog))
        start = time.monotonic()
        end = start + seconds
        tmpgo = go.with_suffix(".tmp")
        tmpgo.write_text(repr(end))
        tmpgo.rename(go)
        killed: set[int] = set()
        if fault is not None:
            await fault(workers, start)
            _trace("fault done")
            killed = {w.pid for w in workers if w.proc.returncode is not None
                      and w.proc.returncode < 0}
        finals: list[str] = []
        for w in workers:
            if w.pid in killed:
                continue
            finals.append(await w.expect("FINAL", seconds + 40))
            _trace(f"final {w.pid}")
        stack.close()
        (go.parent / (go.name + ".close")).write_text("")
        for w in workers:
            if w.pid in killed:
                continue
            await w.expect("DONE", 40)
            _trace(f"done {w.pid}")
            try:
                rc = await asyncio.wait_for(w.proc.wait(), EXIT_WITHIN)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    w.signal(signal.SIGUSR1)  # faulthandler: its threads' stacks
                await asyncio.sleep(1)
                raise AssertionError(
                    f"worker {w.pid} did not exit within {EXIT_WITHIN} s of closing its connections "
                    f"(its last line: {w.lines[-1]!r}, 'DONE n': n asyncio tasks left): "
                    f"{await w.stderr()}") from None
            if rc != 0:
                raise AssertionError(f"worker {w.pid} exited {rc}: {await w.stderr()}")
        run = load([w.out for w in workers], killed, start, end)
        return run, workers
    finally:
        stack.close()
        for w in workers:  # at once, before any await: no worker outlives the test
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGCONT)
                    os.kill(w.pid, signal.SIGKILL)
        for w in workers:
            await w.kill()
