"""A churning process of tests/adversarial_status (run as a script).

    python _churn_child.py URL NAME KIND TASKS SECONDS OUTFILE TAG

KIND ``lock`` or ``election``. Prints READY once connected, waits for a line on stdin,
then TASKS tasks acquire/release NAME (campaign/resign, with one proclaim per term) for
SECONDS, each with its own data string; every grant is appended to OUTFILE as a JSON
line ``[token, data, ...]`` (flushed) before it is released.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import TextIO

import aiolock


async def main(out: TextIO) -> int:
    url, name, kind, ntasks, seconds, _outfile, tag = sys.argv[1:8]

    def record(*row: object) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()

    async with aiolock.connect(url) as locks:
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        end = time.monotonic() + float(seconds)

        async def churn(t: int) -> None:
            i = 0
            while time.monotonic() < end:
                i += 1
                data = f"{tag}-t{t}-{i}"
                if kind == "lock":
                    lease = await locks.lock(name, ttl=5, data=data).acquire(timeout=30)
                    record(lease.token, data)
                    await asyncio.sleep(0.002)
                    await lease.release()
                else:
                    term = await locks.election(name, ttl=5).campaign(data=data).acquire(timeout=30)
                    record(term.token, data, data + "/p")
                    await asyncio.sleep(0.001)
                    await term.proclaim(data + "/p")
                    await asyncio.sleep(0.001)
                    await term.release()

        await asyncio.gather(*(churn(t) for t in range(int(ntasks))))
    print("DONE", flush=True)
    return 0


if __name__ == "__main__":
    with open(sys.argv[6], "a") as outfile:
        sys.exit(asyncio.run(main(outfile)))
