"""A child process for the issue-15 adversarial tests.

``hold URL NAME TTL``: acquire NAME, print ``GOT <token>``, then every 50 ms print
``WRITE <token>`` (a write it would make) while ``lease.lost`` is false, ``LOST`` when it
is; ``LOCKLOST`` when the block raises LockLost.

``churn URL NAME SECONDS TASKS COUNTER_URL [TTL HOLD]``: TASKS tasks acquire and release NAME for
SECONDS; inside, each INCRs a Redis counter (``COUNTER_URL``) that must read 1 (else
``OVERLAP``) and DECRs it; at the end ``TOKENS t,t,...`` (grant order of this process).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import aiolock


async def hold(url: str, name: str, ttl: float) -> None:
    async with aiolock.connect(url) as locks:
        try:
            async with locks.lock(name, ttl=ttl, on_lost="raise") as lease:
                print("GOT", lease.token, flush=True)
                while True:
                    if lease.lost:
                        print("LOST", flush=True)
                        break
                    print("WRITE", lease.token, time.monotonic(), flush=True)
                    await asyncio.sleep(0.05)
        except aiolock.LockLost:
            print("LOCKLOST", flush=True)


async def churn(url: str, name: str, seconds: float, tasks: int, counter_url: str,
                ttl: float = 5.0, hold: float = 0.002) -> None:
    import redis.asyncio as aioredis

    counter = aioredis.from_url(counter_url)
    key = f"adv15:inside:{name}"
    tokens: list[int] = []
    overlaps = 0
    end = time.monotonic() + seconds

    async def one(locks: aiolock.Locks) -> None:
        nonlocal overlaps
        lock = locks.lock(name, ttl=ttl)
        while time.monotonic() < end:
            try:
                async with lock as lease:
                    if await counter.incr(key) != 1:
                        overlaps += 1
                    tokens.append(lease.token)
                    try:
                        await asyncio.sleep(random.random() * hold)
                    finally:
                        await counter.decr(key)
            except aiolock.LockLost:
                print("LEASELOST", flush=True)

    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        await asyncio.gather(*(one(a if i % 2 else b) for i in range(tasks)))
    await counter.aclose()
    print("OVERLAPS", overlaps, flush=True)
    print("TOKENS", ",".join(map(str, tokens)), flush=True)


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "hold":
        asyncio.run(hold(args[0], args[1], float(args[2])))
    elif mode == "churn":
        extra = [float(a) for a in args[5:]]
        asyncio.run(churn(args[0], args[1], float(args[2]), int(args[3]), args[4], *extra))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
