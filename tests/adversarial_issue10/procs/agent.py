"""A child process of the issue-10 adversarial tests: one OS process using one lock.

``agent.py MODE URL NAME OPTIONS_JSON``; OPTIONS_JSON: ``ttl`` (s), ``fair``, ``hold``
(s), ``connect`` (keywords of ``aiolock.connect``), and what each mode reads below. Every
time is ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the box).

``once``: connect, print ``READY <pid>``, wait for ``GO`` on stdin, print ``WAITING <t>``,
acquire once (no timeout; with ``retry_unavailable``, again after each
``BackendUnavailable``, printing ``UNAVAILABLE <t>``), print ``GOT <token> <t> <lost>
<expires_in>``, then every 20 ms
``HB <t> <lost>`` while holding ``hold`` s, print ``RELEASING <t>``, release, print
``RELEASED <t>``; then stay
connected (idle) until killed.

``loop``: connect, print ``READY <pid>``, wait for ``GO <end>`` on stdin; ``tasks`` tasks
acquire, hold up to ``hold`` s (uniform; ``hold_min`` at least), release, until ``end``;
then one ``REC <token> <t_got> <t_release> <pid>`` line per grant and ``DONE``.

``cancel``: as ``loop``, but each acquisition is interrupted at a random point (cancelled
after some loop steps or some time, or a short ``timeout``); a grant that still arrives
is held briefly and released, that release itself cancelled at random now and then
(then released again, which must be safe). ``REC`` lines and ``DONE`` as ``loop``.

``many``: connect, ``READY``, wait for ``GO``, start ``tasks`` tasks one after another
(10 ms apart), each acquiring once; print ``WAITING <t>`` once all are started; each
grant is held ``hold`` s; at the end ``ORDER i,j,...`` (task numbers in grant order),
``TOKENS t,...`` (same order) and ``DONE``.

``multi``: connect, ``READY``, wait for ``GO``, then one task per lock of ``names`` (NAME
ignored), each acquiring it once: ``WAITING <t>`` once all are started, ``GOT<i> <token>
<t>`` per grant, held ``hold`` s, then ``RELEASED<i> <t>``; then stay connected.

``timeout``: connect, ``READY``, wait for ``GO``, print ``WAITING``, ``acquire(timeout=
wait)``: ``TIMEOUT <t>`` or ``GOT ...``; then wait (forever) for the lock ``other`` so that
the process keeps listening for hand-offs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
import time
from typing import Any

import aiolock

now = time.monotonic


def say(*parts: object) -> None:
    print(*parts, flush=True)


async def stdin_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def once(locks: aiolock.Locks, name: str, o: dict[str, Any]) -> None:
    lock = locks.lock(name, ttl=o["ttl"], fair=o.get("fair", False))
    await stdin_line()
    say("WAITING", now())
    while True:
        try:
            lease = await lock.acquire()
            break
        except aiolock.BackendUnavailable:  # documented; a user would try again
            if not o.get("retry_unavailable"):
                raise
            say("UNAVAILABLE", now())
            await asyncio.sleep(0.05)
    say("GOT", lease.token, now(), int(lease.lost), lease.expires_in)
    end = now() + o.get("hold", 0.1)
    while now() < end:
        say("HB", now(), int(lease.lost))
        await asyncio.sleep(0.02)
    say("HB", now(), int(lease.lost))
    say("RELEASING", now())
    await lease.release()
    say("RELEASED", now())
    await asyncio.sleep(3600)


async def timeout(locks: aiolock.Locks, name: str, o: dict[str, Any]) -> None:
    lock = locks.lock(name, ttl=o["ttl"])
    await stdin_line()
    say("WAITING", now())
    try:
        lease = await lock.acquire(timeout=o["wait"])
    except aiolock.LockTimeout:
        say("TIMEOUT", now())
    else:
        say("GOT", lease.token, now(), int(lease.lost), lease.expires_in)
    await locks.lock(o["other"], ttl=o["ttl"]).acquire()
    say("OTHER", now())
    await asyncio.sleep(3600)


async def many(locks: aiolock.Locks, name: str, o: dict[str, Any]) -> None:
    lock = locks.lock(name, ttl=o["ttl"], fair=o.get("fair", False))
    await stdin_line()
    order: list[int] = []
    tokens: list[int] = []

    async def one(i: int) -> None:
        async with lock as lease:
            order.append(i)
            tokens.append(lease.token)
            await asyncio.sleep(o.get("hold", 0.0))

    tasks = []
    for i in range(o["tasks"]):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0.01)
    say("WAITING", now())
    await asyncio.gather(*tasks)
    say("ORDER", ",".join(map(str, order)))
    say("TOKENS", ",".join(map(str, tokens)))
    say("DONE")
    await asyncio.sleep(3600)


async def multi(locks: aiolock.Locks, o: dict[str, Any]) -> None:
    await stdin_line()

    async def one(i: int, name: str) -> None:
        async with locks.lock(name, ttl=o["ttl"], fair=o.get("fair", False)) as lease:
            say(f"GOT{i}", lease.token, now())
            await asyncio.sleep(o.get("hold", 0.0))
        say(f"RELEASED{i}", now())

    tasks = [asyncio.create_task(one(i, n)) for i, n in enumerate(o["names"])]
    await asyncio.sleep(0.05)
    say("WAITING", now())
    await asyncio.gather(*tasks)
    await asyncio.sleep(3600)


Rec = tuple[int, float, float]


async def interrupted(lock: aiolock.Lock, rng: random.Random) -> aiolock.Lease | None:
    """One acquisition interrupted at a random point: the lease if it was granted anyway."""
    how = rng.random()
    if how < 0.25:
        try:
            return await lock.acquire(timeout=rng.random() * 0.02)
        except aiolock.LockTimeout:
            return None
    task = asyncio.create_task(lock.acquire())
    if how < 0.6:
        for _ in range(rng.randrange(80)):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(rng.random() * 0.02)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return None


async def release_maybe_cancelled(lease: aiolock.Lease, rng: random.Random) -> None:
    """Release; now and then cancel that release at a random step first (it finishes in
    the background) and release again, which must be safe. (Not again at once without
    that: until the background release is confirmed the task still holds the lease, and
    its next acquire would be refused as a same-task deadlock.)"""
    if rng.random() < 0.25:
        task = asyncio.create_task(lease.release())
        for _ in range(rng.randrange(30)):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await lease.release()


async def churn(locks: aiolock.Locks, name: str, o: dict[str, Any], cancelling: bool) -> None:
    lock = locks.lock(name, ttl=o["ttl"], fair=o.get("fair", False))
    line = await stdin_line()
    end = float(line.split()[1])
    recs: list[Rec] = []
    hold, hold_min = o.get("hold", 0.002), o.get("hold_min", 0.0)

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        while now() < end:
            if cancelling:
                lease = await interrupted(lock, rng)
                if lease is None:
                    await asyncio.sleep(rng.random() * 0.005)
                    continue
            else:
                lease = await lock.acquire(timeout=60)
            got = now()
            await asyncio.sleep(hold_min + rng.random() * (hold - hold_min))
            t_rel = now()
            recs.append((lease.token, got, t_rel))
            if cancelling:
                await release_maybe_cancelled(lease, rng)
            else:
                await lease.release()

    await asyncio.gather(*(worker(os.getpid() * 100 + i) for i in range(o.get("tasks", 1))))
    for token, got, t_rel in recs:
        say("REC", token, got, t_rel, os.getpid())
    say("DONE")
    await asyncio.sleep(o.get("linger", 0))


async def main() -> None:
    mode, url, name, raw = sys.argv[1:5]
    o: dict[str, Any] = json.loads(raw)
    async with aiolock.connect(url, **o.get("connect", {})) as locks:
        say("READY", os.getpid())
        if mode == "once":
            await once(locks, name, o)
        elif mode == "multi":
            await multi(locks, o)
        elif mode == "many":
            await many(locks, name, o)
        elif mode == "timeout":
            await timeout(locks, name, o)
        elif mode in ("loop", "cancel"):
            await churn(locks, name, o, cancelling=mode == "cancel")
        else:
            raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    asyncio.run(main())
