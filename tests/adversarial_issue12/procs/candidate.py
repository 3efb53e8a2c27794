"""A candidate process: campaign once for ELECTION at URL, report on stdout, lead until
killed. Lines: ``READY pid``, ``LEAD pid token mono``, ``CANCELLED pid mono``,
``LOST pid mono`` (CLOCK_MONOTONIC is shared by the processes of one host)."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import aiolock


def say(*words: object) -> None:
    print(*words, flush=True)


async def main(url: str, name: str, ttl: float) -> None:
    pid = os.getpid()
    async with aiolock.connect(url) as locks:
        election = locks.election(name, ttl=ttl)
        say("READY", pid)
        try:
            async with election.campaign(data=str(pid)) as term:
                say("LEAD", pid, term.token, time.monotonic())
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    say("CANCELLED", pid, time.monotonic())
                    raise
        except aiolock.LockLost:
            say("LOST", pid, time.monotonic())
            await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
