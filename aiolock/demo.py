"""``aiolock demo``: the project's main job, live in the terminal.

Four workers -- each with its own connection, as if they were separate processes --
contend for one lock guarding an account balance. Every write to the balance goes
through a fenced resource that rejects tokens older than the newest it has seen.
Midway, the worker holding the lock freezes (its process stops, like a long GC pause or
SIGSTOP): its lease stops being renewed and expires on the server; another worker takes
the lock with a higher token and writes; when the frozen worker wakes up and writes
with its old token, the fencing check rejects it. At the end the demo checks that the
tokens rose strictly in hold order, no two holders overlapped, and the balance has no
lost update; it exits 0 only if all of that holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any, TextIO

from ._connect import connect
from ._lease import Lease
from ._locks import Locks
from .abc import Capability
from .errors import LockLost, LockTimeout
from .fencing import FencedResource, MemoryFencedResource

__all__ = ["run_demo"]

WORKERS = 4
ROUNDS = 3  # acquisitions per worker
TTL = 1.0  # seconds: short, so the frozen worker's lease expires quickly
FREEZE = 2.5 * TTL
FROZEN_WORKER = 2  # the worker that freezes while holding the lock, on its 2nd round


class _Screen:
    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.start = time.monotonic()
        self.color = out.isatty()

    def say(self, who: str, text: str, style: str = "") -> None:
        codes = {"ok": "32", "bad": "31;1", "warn": "33", "dim": "2", "head": "1"}
        stamp = f"{time.monotonic() - self.start:6.2f}s"
        line = f"[{stamp}] {who:<9} {text}"
        if self.color and style:
            line = f"\x1b[{codes[style]}m{line}\x1b[0m"
        print(line, file=self.out, flush=True)


async def run_demo(url: str | None = None, out: TextIO = sys.stdout) -> int:
    """Run the demo on ``url`` (default: the embedded ``memory://``); 0 if all checks hold."""
    url = url or f"memory://demo-{uuid.uuid4().hex[:8]}"
    screen = _Screen(out)
    name = f"demo:account:{uuid.uuid4().hex[:6]}"
    screen.say("demo", f"backend {url}, lock {name!r}, ttl {TTL}s, {WORKERS} workers", "head")
    conns: list[Locks] = [connect(url) for _ in range(WORKERS)]
    for conn in conns:
        await conn.__aenter__()
    resource, close_resource = await _resource(url, name)
    balance = {"value": 0, "expected": 0}
    holds: list[tuple[int, float, float, int]] = []  # (token, start, end, worker)
    inside = {"n": 0, "max": 0}
    stale: list[int] = []

    async def worker(i: int) -> None:
        who = f"worker-{i}"
        fair = Capability.FAIR in conns[i].capabilities  # FIFO where the backend offers it
        lock = conns[i].lock(name, ttl=TTL, timeout=30, fair=fair)
        for round_ in range(ROUNDS):
            await asyncio.sleep(0.05 * i)
            screen.say(who, "waiting for the lock", "dim")
            try:
                lease = await lock.acquire()
            except LockTimeout:
                screen.say(who, "gave up waiting", "warn")
                return
            start = time.monotonic()
            inside["n"] += 1
            inside["max"] = max(inside["max"], inside["n"])
            screen.say(who, f"acquired  token {lease.token}", "ok")
            value = balance["value"]  # read
            await asyncio.sleep(0.15)  # work
            if i == FROZEN_WORKER and round_ == 1:
                inside["n"] -= 1
                holds.append((lease.token, start, time.monotonic(), i))
                if await _freeze(screen, who, conns[i], lease, resource, value + 10):
                    stale.append(lease.token)
                return
            if await resource.write(lease.token, str(value + 10)):
                balance["value"] = value + 10
                balance["expected"] += 10
                screen.say(who, f"wrote balance {value} -> {value + 10} with token {lease.token}")
            inside["n"] -= 1
            holds.append((lease.token, start, time.monotonic(), i))
            with contextlib.suppress(LockLost):
                await lease.release()
            screen.say(who, "released", "dim")

    try:
        await asyncio.gather(*(worker(i) for i in range(WORKERS)))
    finally:
        for conn in conns:
            await conn.aclose()
        await close_resource()
    return _verdict(screen, holds, inside["max"], balance, stale)


async def _freeze(
    screen: _Screen, who: str, conn: Locks, lease: Lease, resource: FencedResource, value: int,
) -> bool:
    """The worker holding ``lease`` freezes (stops renewing, releases nothing) past its
    ttl, then writes ``value`` with its stale token; True if fencing rejected the write."""
    screen.say(who, f"FREEZES while holding token {lease.token} "
               f"(process paused {FREEZE:.1f}s; its watchdog cannot renew)", "bad")
    conn._engine.abandon_for_demo()
    await asyncio.sleep(FREEZE)
    screen.say(who, f"wakes up, still thinks it holds token {lease.token}; writes the balance", "warn")
    if await resource.write(lease.token, str(value)):
        screen.say(who, "stale write ACCEPTED -- fencing failed", "bad")
        return False
    newest, _ = await resource.read()
    screen.say(who, f"stale write REJECTED by fencing: token {lease.token} < {newest} already seen", "ok")
    return True


def _verdict(
    screen: _Screen, holds: list[tuple[int, float, float, int]], peak: int,
    balance: dict[str, int], stale: list[int],
) -> int:
    by_time = sorted(holds, key=lambda h: h[1])
    tokens = [h[0] for h in by_time]
    increasing = all(a < b for a, b in itertools.pairwise(tokens))
    checks = [
        (increasing, f"tokens strictly increasing in hold order: {tokens}"),
        (peak == 1, f"never more than one live holder at a time (peak {peak})"),
        (len(stale) == 1, f"the frozen worker's stale write was rejected ({len(stale)} rejected)"),
        (balance["value"] == balance["expected"], f"no lost update: balance {balance['value']}"),
    ]
    for ok, text in checks:
        screen.say("check", ("PASS  " if ok else "FAIL  ") + text, "ok" if ok else "bad")
    return 0 if all(ok for ok, _ in checks) else 1


async def _resource(url: str, name: str) -> tuple[FencedResource, Callable[[], Any]]:
    if url.startswith(("redis://", "rediss://", "unix://")):
        import redis.asyncio as aioredis

        from .fencing import RedisFencedResource

        client = aioredis.Redis.from_url(url)
        return RedisFencedResource(client, f"{name}:balance"), client.aclose

    async def nothing() -> None:
        return None

    return MemoryFencedResource(), nothing
