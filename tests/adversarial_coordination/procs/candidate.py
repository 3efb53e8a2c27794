"""A candidate process for the adversarial election tests.

    python candidate.py URL NAME TTL DATA TASKS HOLD DURATION [FENCE_REDIS_URL]

Runs TASKS candidate tasks on one connection. Each campaigns for NAME (ttl TTL) with data
DATA-<task>, and while leading prints ``LEAD <monotonic> <token> <data>``; then holds for
HOLD seconds (HOLD < 0: until killed, printing ``TICK <monotonic> <token> <lost 0/1>`` every
50 ms), prints ``END <monotonic> <token>`` and resigns (releases). Loops until DURATION
seconds passed (DURATION <= 0: one term only). A lost term prints ``LOST <monotonic>
<token>``; a cancelled body ``CANCELLED <monotonic> <token>``. Exit 0 at the end.

With FENCE_REDIS_URL, each TICK that finds the term not lost also sends a fenced write of
its token to the Redis hash NAME there (aiolock.RedisFencedResource), in a task of its
own (cancelling the body cannot recall a write on its way), and prints ``WRITE
<monotonic> <token> <accepted 0/1>`` when it is answered. SIGUSR1 makes the process
SIGSTOP itself at its next tick, between that check and the write (a pause at the worst
moment: the write arrives after the term was lost).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time

import aiolock


def out(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Fence:
    """Fenced writes to a Redis hash; ``armed`` (SIGUSR1): stop before the next one."""

    def __init__(self, url: str, key: str) -> None:
        import redis.asyncio

        self.resource = aiolock.RedisFencedResource(redis.asyncio.Redis.from_url(url), key)
        self.armed = False
        self.inflight: set[asyncio.Task[None]] = set()

    def send(self, token: int, data: str) -> None:
        if self.armed:
            self.armed = False
            os.kill(os.getpid(), signal.SIGSTOP)  # the test sends SIGCONT
        task = asyncio.create_task(self.write(token, data))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)

    async def write(self, token: int, data: str) -> None:
        ok = await self.resource.write(token, data)
        out(f"WRITE {time.monotonic():.6f} {token} {int(ok)}")


async def candidate(locks: aiolock.Locks, name: str, ttl: float, data: str, hold: float,
                    until: float, fence: Fence | None) -> None:
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
                            if fence is not None and not term.lost:
                                fence.send(token, data)
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
    fence = Fence(sys.argv[8], name) if len(sys.argv) > 8 else None
    if fence is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, setattr, fence, "armed", True)
    async with aiolock.connect(url) as locks:
        out("READY")
        await asyncio.gather(*(candidate(locks, name, ttl, f"{data}-{i}", hold, until, fence)
                               for i in range(tasks)))
    if fence is not None:  # writes on their way still arrive (and are printed)
        await asyncio.gather(*fence.inflight, return_exceptions=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
