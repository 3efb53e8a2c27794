"""A mutual-exclusion worker run as a separate OS process by tests/test_faults_redis.py.

    python worker.py URL NAME TASKS OUTFILE [TTL]

Connects (with TTL: takes one lease of TTL s first, so that every server is connected),
prints ``READY``, then reads ``GO <stop>`` from stdin (``stop`` a
time.monotonic() value: CLOCK_MONOTONIC is shared by all processes of one host). Then TASKS
tasks loop ``async with lock`` -> record ``(token, start, end)`` with time.monotonic()
around a short critical section -> release, until STOP (with TTL: leases of TTL s, a
few of them held TTL/2, across a renewal, and never lost). The records go to OUTFILE as JSON
lines ``[token, start, end, pid]``; the process prints ``DONE <count>``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import aiolock


async def main() -> int:
    url, name = sys.argv[1], sys.argv[2]
    ntasks, outfile = int(sys.argv[3]), sys.argv[4]
    ttl = float(sys.argv[5]) if len(sys.argv) > 5 else None
    records: list[tuple[int, float, float, int]] = []
    pid = os.getpid()
    async with aiolock.connect(url) as locks:
        lock = locks.lock(name, ttl=ttl or 5.0)
        if ttl is not None:
            async with lock:
                pass
        print("READY", flush=True)
        line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        stop = float(line.split()[1])

        async def task() -> None:
            while time.monotonic() < stop:
                async with lock as lease:
                    t0 = time.monotonic()
                    roll = random.random()
                    if ttl is not None and roll < 0.04:
                        await asyncio.sleep(ttl / 2)  # across a renewal
                    elif roll < 0.5:
                        await asyncio.sleep(random.random() * 0.002)
                    else:
                        await asyncio.sleep(0)
                    t1 = time.monotonic()
                    assert not lease.lost
                    records.append((lease.token, t0, t1, pid))

        await asyncio.gather(*(task() for _ in range(ntasks)))
    text = "".join(json.dumps(rec) + "\n" for rec in records)
    await asyncio.to_thread(Path(outfile).write_text, text)
    print(f"DONE {len(records)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
