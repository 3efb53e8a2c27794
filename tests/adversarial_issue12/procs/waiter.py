"""A process that takes lock NAME at URL ROUNDS times, one task, and reports each wait:
``WAIT mono`` before each acquire, ``GOT mono`` after it (CLOCK_MONOTONIC is shared by
the processes of one host); holds each grant HOLD seconds."""

from __future__ import annotations

import asyncio
import sys
import time

import aiolock


async def main(url: str, name: str, rounds: int, hold: float) -> None:
    async with aiolock.connect(url) as locks:
        lock = locks.lock(name, ttl=5)
        async with lock:            # warm up: connections, scripts, subscriptions
            pass
        print("READY", flush=True)
        for _ in range(rounds):
            print("WAIT", time.monotonic(), flush=True)
            async with lock:
                print("GOT", time.monotonic(), flush=True)
                await asyncio.sleep(hold)
            await asyncio.sleep(0.01)
        print("DONE", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
