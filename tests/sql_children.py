"""Child processes for the SQL backend tests (PostgreSQL, MySQL): a lock holder or an
election candidate in a process of its own, so that ``kill -9`` and ``SIGSTOP`` reach a
real client and its connections."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["start_candidate", "start_holder", "stop"]

ROOT = Path(__file__).resolve().parent.parent

#: Holds ``name``: prints ACQUIRED <token>, then sleeps.
HOLDER = """
import asyncio, sys
import aiolock

async def main() -> None:
    url, name, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    async with aiolock.connect(url) as locks:
        async with locks.lock(name, ttl=ttl) as lease:
            print("READY", lease.token, flush=True)
            await asyncio.sleep(3600)

asyncio.run(main())
"""

#: Campaigns: prints READY <term>, holds; LOST on loss.
CANDIDATE = """
import asyncio, sys
import aiolock

async def main() -> None:
    url, name, ttl, data = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    async with aiolock.connect(url) as locks:
        try:
            async with locks.election(name, ttl=ttl).campaign(data=data) as term:
                print("READY", term.token, flush=True)
                await asyncio.sleep(3600)
        except aiolock.LockLost:
            print("LOST", flush=True)

asyncio.run(main())
"""


def _start(script: str, *args: str) -> tuple[subprocess.Popen[str], int]:
    """Run ``script`` with ``args``; once it printed READY <token>, the process and token."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        _out, err = proc.communicate()
        raise AssertionError(f"child process failed: {line!r} {err}")
    return proc, int(line.split()[1])


def start_holder(url: str, name: str, ttl: float) -> tuple[subprocess.Popen[str], int]:
    """A process holding ``name``; its token."""
    return _start(HOLDER, url, name, str(ttl))


def start_candidate(url: str, name: str, ttl: float, data: str) -> tuple[subprocess.Popen[str], int]:
    """A process leading the election ``name``; its term."""
    return _start(CANDIDATE, url, name, str(ttl), data)


def stop(proc: subprocess.Popen[str]) -> None:
    """Kill the child (waking it first if it was paused) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.communicate()
