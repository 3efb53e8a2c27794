"""Child Python processes that a test talks to over their stdout lines (the adversarial
suites' workers), the ``children`` fixture that kills what a test left running, and the
known-defect marking the adversarial suites share."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

import aiolock

ROOT = Path(__file__).resolve().parents[1]


class Child:
    """A child Python process (``python ARGV...``, aiolock importable); reads its stdout."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def run(cls, *argv: str) -> Child:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *argv, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return cls(proc)

    async def line(self, within: float = 20.0) -> str:
        assert self.proc.stdout is not None
        try:
            raw = await asyncio.wait_for(self.proc.stdout.readline(), within)
        except TimeoutError:
            raise AssertionError(f"child said nothing within {within}s") from None
        if not raw:
            err = b""
            if self.proc.stderr is not None:
                err = await self.proc.stderr.read()
            raise AssertionError(f"child ended: {err.decode(errors='replace')[-2000:]}")
        return raw.decode().strip()

    async def expect(self, prefix: str, within: float = 20.0) -> str:
        while True:
            got = await self.line(within)
            if got.startswith(prefix):
                return got

    async def finish(self, within: float = 30.0) -> tuple[str, str]:
        out, err = await asyncio.wait_for(self.proc.communicate(), within)
        return out.decode(), err.decode()

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    async def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.signal(signal.SIGCONT)  # in case it was stopped
            self.proc.kill()
            await self.proc.wait()


@pytest.fixture
async def children() -> AsyncIterator[list[Child]]:
    """Children started by a test; every one still running is killed at its end."""
    started: list[Child] = []
    yield started
    for child in started:
        await child.kill()


def since(start: float) -> float:
    return time.monotonic() - start


def known_defects(items: list[pytest.Item], folder: str,
                  known: Mapping[str, str]) -> Iterator[pytest.Item]:
    """The collected ``items`` under ``folder``, each whose id is in ``known`` (test id ->
    one-line symptom) marked xfail(strict=True): the suite stays green, the defect
    visible, and its fix turns the entry into an error to delete."""
    for item in items:
        if folder in str(item.path):
            reason = known.get(item.name)
            if reason is not None:
                item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
            yield item


def slow_but(item: pytest.Item, file: str, default: set[str]) -> bool:
    """``item`` is a test of ``file`` whose name is not in ``default``: the tests of a file
    that found a defect (since fixed) stay in the default run, the rest go in the slow tier."""
    return item.nodeid.split("::")[0].endswith(file) and item.name.partition("[")[0] not in default


async def exclusion_run(conns: list[Any], name: str, *, tasks: int, ttl: float,
                        seconds: float = 1.0, pause: float = 0.003) -> tuple[int, list[int]]:
    """``tasks`` tasks spread over ``conns`` (``aiolock.Locks``) loop ``async with
    lock(name)`` for ``seconds``, each holding for up to ``pause`` s: the overlaps seen
    (more than one inside at once) and the tokens in grant order."""
    inside = overlaps = 0
    order: list[int] = []
    end = time.monotonic() + seconds

    async def worker(locks: Any) -> None:
        nonlocal inside, overlaps
        lock = locks.lock(name, ttl=ttl)
        while time.monotonic() < end:
            async with lock as lease:
                inside += 1
                overlaps += inside != 1
                order.append(lease.token)
                await asyncio.sleep(random.random() * pause)
                inside -= 1

    await asyncio.gather(*(worker(conns[i % len(conns)]) for i in range(tasks)))
    return overlaps, order


async def held_for(locks: Any, other: Any, name: str, *, ttl: float, seconds: float,
                   step: float) -> Any:
    """Hold ``name`` on ``locks`` for ``seconds`` (several ``ttl``s), checking every ``step``
    that the lease is not lost and that ``other`` cannot take it; the lease, still held."""
    async with locks.lock(name, ttl=ttl) as lease:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            assert not lease.lost
            with pytest.raises(aiolock.LockTimeout):
                await other.lock(name, ttl=1).acquire(timeout=0)
            await asyncio.sleep(step)
        assert lease.expires_in > 0
    return lease
