"""A lock holder run as a separate OS process by tests/test_faults_redis.py.

    python holder.py URL NAME TTL [FENCE_KEY]

Acquires NAME (``async with``, watchdog on, on_lost="cancel"), prints
``ACQUIRED <token>`` and flushes, then holds until killed. With FENCE_KEY it loops doing
a fenced write of ``stale-<token>-<i>`` to that Redis hash every 20 ms, but only while
``not lease.lost``; each attempt prints ``WRITE <monotonic time of the lost-check> <i>
<accepted 0/1>``.

Exit codes: 3 the block raised LockLost (prints ``LOST <seconds after last write>``),
4 any other error (prints ``ERROR ...``), 5 the block ended without an error (a bug: the
body never ends on its own).
"""

from __future__ import annotations

import asyncio
import sys
import time

import redis.asyncio as aioredis

import aiolock


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main() -> int:
    url, name, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
    fence_key = sys.argv[4] if len(sys.argv) > 4 else None
    client = aioredis.Redis.from_url(url) if fence_key else None
    try:
        async with aiolock.connect(url) as locks:
            lock = locks.lock(name, ttl=ttl)
            try:
                async with lock as lease:
                    out(f"ACQUIRED {lease.token}")
                    if fence_key is None:
                        while True:
                            await asyncio.sleep(3600)
                    resource = aiolock.RedisFencedResource(client, fence_key)
                    i = 0
                    while True:
                        checked = time.monotonic()
                        if not lease.lost:
                            i += 1
                            ok = await resource.write(lease.token, f"stale-{lease.token}-{i}")
                            out(f"WRITE {checked:.6f} {i} {int(ok)}")
                        await asyncio.sleep(0.02)
            except aiolock.LockLost as exc:
                out(f"LOST {time.monotonic():.6f} {exc}")
                return 3
            out("ENDED")
            return 5
    except Exception as exc:
        out(f"ERROR {type(exc).__name__}: {exc}")
        return 4
    finally:
        if client is not None:
            await client.aclose()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
