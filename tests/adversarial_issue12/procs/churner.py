"""TASKS tasks that campaign for ELECTION at URL again and again for SECONDS, each term
held ~HOLD s. Lines: ``TERM pid token start end`` (CLOCK_MONOTONIC: from the grant to
the last moment the holder still believed in it, checked with ``lost``), ``DONE``."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import time

import aiolock


async def main(url: str, name: str, tasks: int, seconds: float, hold: float) -> None:
    pid = os.getpid()
    async with aiolock.connect(url) as locks:
        election = locks.election(name, ttl=2.0)
        print("READY", flush=True)
        stop = time.monotonic() + seconds

        async def candidate() -> None:
            while time.monotonic() < stop:
                try:
                    async with election.campaign(data=str(pid)) as term:
                        start = time.monotonic()
                        await asyncio.sleep(random.random() * hold)
                        end = time.monotonic()
                        if not term.lost:
                            print("TERM", pid, term.token, start, end, flush=True)
                except aiolock.LockLost:
                    pass

        await asyncio.gather(*(candidate() for _ in range(tasks)))
        print("DONE", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]),
                     float(sys.argv[5])))
