"""Helper processes of the tests (scripts in ``tests/procs/``, or ``-c CODE``) run with
this interpreter, their stdout read line by line; and the P processes x T tasks runs of
``tests/procs/worker.py`` that the fault and fairness tests of every backend share."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

PROCS = Path(__file__).parent / "procs"

#: a worker.py record: token, critical section start, end, pid
Record = tuple[int, float, float, int]


class Proc:
    """One helper process; ``lines``: what it printed so far."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.stderr_path = stderr
        self.lines: list[str] = []

    async def expect(self, prefix: str, timeout: float) -> str:
        """The next stdout line starting with ``prefix`` (earlier lines are kept)."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    raise AssertionError(f"process exited before {prefix!r}:\n{self.output()}")
                line = raw.decode().rstrip("\n")
                self.lines.append(line)
                if line.startswith(prefix):
                    return line

    async def say(self, line: str) -> None:
        """One line to its stdin (spawned with ``stdin=True``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{line}\n".encode())
        await self.proc.stdin.drain()

    async def finish(self, timeout: float) -> int:
        """Wait for exit, collecting the rest of stdout."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            rest = await self.proc.stdout.read()
            self.lines += rest.decode().splitlines()
            return await self.proc.wait()

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def output(self) -> str:
        err = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return "stdout:\n" + "\n".join(self.lines) + "\nstderr:\n" + err[-4000:]


class Procs:
    """The helper processes of one test; ``cleanup`` kills those still running."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.running: list[Proc] = []

    async def spawn(self, script: str, *args: str, stdin: bool = False) -> Proc:
        """``tests/procs/<script> ARGS...``; ``script`` ``-c``: the first arg is code."""
        target = script if script == "-c" else str(PROCS / script)
        stderr = self.tmp / f"proc-{len(self.running)}.stderr"
        with stderr.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, target, *args,
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=err,
            )
        p = Proc(proc, stderr)
        self.running.append(p)
        return p

    async def cleanup(self) -> None:
        for p in self.running:
            if p.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    os.kill(p.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(p.proc.wait(), 5)


@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        await p.cleanup()


async def run_workers(procs: Procs, url: str, name: str, nprocs: int, ntasks: int,
                      duration: float, ttl: float | None = None,
                      ready: Callable[[], object] | None = None) -> tuple[float, list[list[Record]]]:
    """P ``worker.py`` processes x T tasks loop on lock ``name`` for ``duration`` s from
    a common start: that start (CLOCK_MONOTONIC) and each process's records. ``ttl``:
    worker.py's TTL argument; ``ready()`` is called once every worker is connected."""
    files = [procs.tmp / f"worker-{i}.jsonl" for i in range(nprocs)]
    extra = () if ttl is None else (str(ttl),)
    workers = [await procs.spawn("worker.py", url, name, str(ntasks), str(f), *extra, stdin=True)
               for f in files]
    for w in workers:
        await w.expect("READY", 30)
    if ready is not None:
        ready()
    start = time.monotonic()
    for w in workers:
        await w.say(f"GO {start + duration}")
    for w in workers:
        assert await w.finish(duration + 30) == 0, w.output()
    return start, [[tuple(r) for r in map(json.loads, f.read_text().splitlines())]
                   for f in files]


def longest_waits(per_worker: list[list[Record]], after: float,
                  nprocs: int) -> tuple[dict[int, int], dict[int, int]]:
    """Per process (pid): its acquisitions that started after ``after`` (CLOCK_MONOTONIC),
    and the most acquisitions of others it went without one of its own, in token order;
    every process must have got in."""
    records = sorted((token, t0, pid) for mine in per_worker for token, t0, _t1, pid in mine)
    steady = [pid for _token, t0, pid in records if t0 > after]
    per_proc = {pid: steady.count(pid) for pid in set(steady)}
    assert len(per_proc) == nprocs, f"a process never got in after the warm-up: {per_proc}"
    gaps = {pid: 0 for pid in per_proc}
    worst = dict(gaps)
    for pid in steady:
        for other in gaps:
            gaps[other] = 0 if other == pid else gaps[other] + 1
            worst[other] = max(worst[other], gaps[other])
    print(f"acquisitions per process {sorted(per_proc.values())}, longest waits {sorted(worst.values())}")
    return per_proc, worst
