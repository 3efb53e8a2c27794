"""One waiting process for tests/test_wake_one.py.

    python waiter.py URL NAME HOLD_MS FAIR

Connects, prints ``READY``, then ``WAITING`` just before it acquires NAME (one task,
timeout 20 s), prints ``ACQUIRED <token>``, holds it HOLD_MS ms, releases it, prints
``DONE`` and exits (0; 4 with ``ERROR ...`` on any error).
"""

from __future__ import annotations

import asyncio
import sys

import aiolock


async def main() -> int:
    url, name, hold_ms, fair = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
    try:
        async with aiolock.connect(url) as locks:
            lock = locks.lock(name, ttl=5.0, fair=fair)
            print("READY", flush=True)
            print("WAITING", flush=True)
            lease = await lock.acquire(timeout=20)
            print(f"ACQUIRED {lease.token}", flush=True)
            await asyncio.sleep(hold_ms / 1000)
            await lease.release()
            print("DONE", flush=True)
    except Exception as exc:
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
