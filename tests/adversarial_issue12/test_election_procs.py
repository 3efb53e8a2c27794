"""Elections across processes (SPEC §8): "At most one leader at a time ...; a leader that
dies is replaced within the same bound as a dead lock holder", terms strictly increasing,
and (SPEC §2) a leader paused past its ttl finds its term lost on waking: "the body of the
``async with`` block is cancelled ... the block then raises ``aiolock.LockLost``"."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from typing import Any

import pytest

import aiolock
from aiolock import Capability

from ..scenarios import params

TTL = 1.0
SLACK = 0.7    # process scheduling on a loaded 2-core machine

row = pytest.mark.parametrize(
    "erow", params(Capability.ELECTION, Capability.DISTRIBUTED, topologies=False))


class Candidates:
    """Candidate processes (procs/candidate.py) and the lines they print."""

    def __init__(self) -> None:
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.lines: list[list[str]] = []
        self.taken: dict[str, int] = {}
        self.changed = asyncio.Event()
        self.readers: list[asyncio.Task[None]] = []

    async def start(self, n: int, url: str, name: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        for _ in range(n):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.adversarial_issue12.procs.candidate", url,
                name, str(TTL), stdout=asyncio.subprocess.PIPE, env=env)
            self.procs[proc.pid] = proc
            self.readers.append(asyncio.create_task(self._read(proc)))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            self.lines.append(raw.decode().split())
            self.changed.set()

    async def next(self, kind: str, within: float) -> list[str]:
        """The next line of ``kind`` not yet returned (lines of other kinds are kept)."""
        async with asyncio.timeout(within):
            while True:
                of_kind = [w for w in self.lines if w[0] == kind]
                i = self.taken.get(kind, 0)
                if i < len(of_kind):
                    self.taken[kind] = i + 1
                    return of_kind[i]
                self.changed.clear()
                await self.changed.wait()

    async def close(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
                except ProcessLookupError:
                    pass
            await proc.wait()
        for task in self.readers:
            task.cancel()
        await asyncio.gather(*self.readers, return_exceptions=True)


@row
async def test_killed_leader_replaced_stopped_leader_cancelled(erow: Any, request: Any,
                                                               name: str) -> None:
    url = erow.url(request)
    bound = erow.kill_bound(TTL) + SLACK
    cands = Candidates()
    try:
        await cands.start(3, url, name)
        for _ in range(3):
            await cands.next("READY", 30)
        first = await cands.next("LEAD", 10)
        os.kill(int(first[1]), signal.SIGKILL)
        killed_at = time.monotonic()
        second = await cands.next("LEAD", bound + 5)
        took = float(second[3]) - killed_at
        assert int(second[2]) > int(first[2]), (first, second)
        assert took < bound, f"killed leader replaced after {took:.2f} s (bound {bound:.2f})"
        async with aiolock.connect(url) as locks:
            leader = await locks.election(name).leader()
            assert leader is not None and leader.token == int(second[2]), leader
            seen: list[aiolock.Leader | None] = []

            async def watch() -> None:
                async for state in locks.election(name, ttl=TTL).observe():
                    seen.append(state)

            watcher = asyncio.create_task(watch())

            # SIGSTOP the leader past its ttl: the third takes over; on wake, the paused
            # leader's body is cancelled and its block raises LockLost at once
            os.kill(int(second[1]), signal.SIGSTOP)
            third = await cands.next("LEAD", bound + 5)
            assert int(third[2]) > int(second[2])
            await asyncio.sleep(max(0.0, TTL * 1.5 - (time.monotonic() - float(third[3]))))
            os.kill(int(second[1]), signal.SIGCONT)
            woke = time.monotonic()
            cancelled = await cands.next("CANCELLED", 5)
            lost = await cands.next("LOST", 5)
            assert cancelled[1] == lost[1] == second[1], " | ".join(" ".join(w) for w in cands.lines)
            assert float(cancelled[2]) - woke < 0.5 + SLACK, "paused leader acted on wake"
            leader = await locks.election(name).leader()
            assert leader is not None and leader.token == int(third[2]), leader
            # SPEC §8: observe() ends on the current leader within one ttl
            await asyncio.sleep(TTL)
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            assert seen and seen[-1] is not None and seen[-1].token == int(third[2]), seen
    finally:
        await cands.close()
