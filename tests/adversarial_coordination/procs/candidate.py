"""A candidate process for the adversarial election tests.

    python candidate.py URL NAME TTL DATA TASKS HOLD DURATION

Runs TASKS candidate tasks on one connection. Each campaigns for NAME (ttl TTL) with data
DATA-<task>, and while leading prints ``LEAD <monotonic> <token> <data>``; then holds for
HOLD seconds (HOLD < 0: until killed, printing ``TICK <monotonic> <token> <lost 0/1>`` every
50 ms), prints ``END <monotonic> <token>`` and resigns (releases). Loops until DURATION
seconds passed (DURATION <= 0: one term only). A lost term prints ``LOST <monotonic>
<token>``; a cancelled body ``CANCELLED <monotonic> <token>``. Exit 0 at the end.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import aiolock


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def candidate(locks: aiolock.Locks, name: str, ttl: float, data: str, hold: float,
                    until: float) -> None:
    el = locks.election(name, ttl=ttl)
    rng = random.Random()
    while True:
        token = -1
        try:
            async with el.campaign(data=data) as term:
                token = term.token
                out(f"LEAD {time.monotonic():.6f} {token} {data}")
                try:
                    if hold < 0:
                        while True:
                            out(f"TICK {time.monotonic():.6f} {token} {int(term.lost)}")
                            await asyncio.sleep(0.05)
                    await asyncio.sleep(rng.random() * hold)
                except asyncio.CancelledError:
                    out(f"CANCELLED {time.monotonic():.6f} {token}")
                    raise
                out(f"END {time.monotonic():.6f} {token}")
        except aiolock.LockLost:
            out(f"LOST {time.monotonic():.6f} {token}")
        if time.monotonic() >= until:
            return


async def main() -> int:
    url, name, ttl, data = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    tasks, hold, duration = int(sys.argv[5]), float(sys.argv[6]), float(sys.argv[7])
    until = time.monotonic() + duration
    async with aiolock.connect(url) as locks:
        out("READY")
        await asyncio.gather(*(candidate(locks, name, ttl, f"{data}-{i}", hold, until)
                               for i in range(tasks)))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
