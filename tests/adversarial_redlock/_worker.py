"""A mutual-exclusion worker process for test_procs.py (not a test module).

    python _worker.py URL NAME TASKS TTL OUTFILE

Connects, takes one lease (so every node is connected), prints ``READY``, reads
``GO <stop>`` (a time.monotonic() value: one clock for every process of the host), then
TASKS tasks loop ``async with lock`` until ``stop``, recording ``[token, start, end, pid]``
with time.monotonic() inside the critical section; a few holds last longer than
``TTL / 3`` so that renewals happen while held. Writes the records as JSON lines to
OUTFILE and prints ``DONE <count>``.
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
    url, name, outfile = sys.argv[1], sys.argv[2], sys.argv[5]
    ntasks, ttl = int(sys.argv[3]), float(sys.argv[4])
    records: list[tuple[int, float, float, int]] = []
    pid = os.getpid()
    async with aiolock.connect(url) as locks:
        lock = locks.lock(name, ttl=ttl)
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
                    if roll < 0.04:
                        await asyncio.sleep(ttl / 2)  # across a renewal
                    elif roll < 0.5:
                        await asyncio.sleep(random.random() * 0.003)
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
