"""Coordinating plain asyncio tasks: a run-once migration, reentrant steps, a leader.

What it shows
-------------
1. **Run once among many.** Eight "instances" boot at the same time and each wants to make
   sure the schema migration ran. Each takes ``locks.lock("schema-migration")``, checks a
   marker, and only runs the migration if the marker is missing; the marker is a fenced
   write carrying the lease's token. The migration runs exactly once; the others wait
   their turn, see the marker and carry on.
2. **reentrant=True.** The migration's steps take the same lock themselves, so they are
   safe to call on their own (say from an admin command) *and* from inside the migration,
   which already holds it: the inner ``async with`` re-enters (same token) instead of
   deadlocking, and the lock is freed only at the outermost exit. Without
   ``reentrant=True`` the inner acquire raises ``aiolock.LockError`` at once.
3. **Leader election, stopping work when the lease is lost.** Three candidates (each with
   its own connection, as if in separate processes) loop on ``lock.acquire()``. The
   leader runs its work in a task and watches ``lease.wait_lost()`` next to it: if the
   lease is lost, the work is cancelled at once -- a leader must never keep acting after
   someone else may have been elected. The leader lease uses ``watchdog=False`` and is
   extended by the leader after every unit of work, so leadership lasts only while the
   work makes progress (with the default watchdog a hung leader would keep its lease
   as long as its process lives). The first leader hangs on purpose; its lease expires, its
   work is cancelled, and another candidate takes over with a higher fencing token.

Run it
------
    python examples/task_coordination.py                               # memory://
    AIOLOCK_URL=redis://127.0.0.1:6379/0 python examples/task_coordination.py

It takes about three seconds, checks what it claims, and exits 1 if a check fails.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
import uuid
from typing import Any

import aiolock

AIOLOCK_URL = os.environ.get("AIOLOCK_URL", "memory://")
RUN = uuid.uuid4().hex[:8]  # keeps names of separate runs apart on a shared Redis
T0 = time.monotonic()


def say(who: str, text: str) -> None:
    print(f"[{time.monotonic() - T0:5.2f}s] {who:<12} {text}", flush=True)


def is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "unix://"))


class Store:
    """Fenced records: Redis hashes when the locks are on Redis, else in-process."""

    def __init__(self, url: str) -> None:
        self._client: Any = None
        self._memory: dict[str, aiolock.MemoryFencedResource] = {}
        self._keys: list[str] = []
        if is_redis(url):
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(url)

    def record(self, key: str) -> aiolock.FencedResource:
        key = f"example:{RUN}:{key}"
        if self._client is not None:
            self._keys.append(key)
            return aiolock.RedisFencedResource(self._client, key)
        return self._memory.setdefault(key, aiolock.MemoryFencedResource())

    async def aclose(self) -> None:
        if self._client is not None:
            if self._keys:
                await self._client.delete(*set(self._keys))
            await self._client.aclose()


# -- 1 + 2: a migration that runs once, with reentrant steps --------------------------------


async def migration_demo(url: str, store: Store) -> bool:
    print("== 1+2. run-once migration among 8 booting instances, with reentrant steps ==")
    marker = store.record("schema-version")
    ran: list[str] = []
    steps_done: list[tuple[str, int, int]] = []  # (step, inner token, outer token)

    async def boot(instance: str) -> None:
        async with aiolock.connect(url) as locks:
            migration = locks.lock(f"schema-migration:{RUN}", reentrant=True, timeout=10)

            async def add_column(outer_token: int) -> None:
                # A step is safe to run on its own: it takes the migration lock itself.
                async with migration as lease:  # re-entered: same task, same lease token
                    await asyncio.sleep(0.05)
                    steps_done.append(("add_column", lease.token, outer_token))

            async def backfill(outer_token: int) -> None:
                async with migration as lease:
                    await asyncio.sleep(0.05)
                    steps_done.append(("backfill", lease.token, outer_token))

            async with migration as lease:
                _, version = await marker.read()
                if version == b"2":
                    say(instance, f"schema already at v2 (token {lease.token}); booting")
                    return
                say(instance, f"got the migration lock (token {lease.token}); migrating")
                await add_column(lease.token)
                await backfill(lease.token)
                say(instance, f"still held after the reentrant steps: {await migration.locked()}")
                if await marker.write(lease.token, "2"):
                    ran.append(instance)
                    say(instance, "migration done, schema at v2")
            if ran == [instance]:  # only the outermost exit released it: the others go on
                say(instance, "released the migration lock at the outermost exit")

    await asyncio.gather(*(boot(f"instance-{i}") for i in range(8)))

    # reentrant=False: re-entering in the same task fails fast instead of deadlocking.
    async with aiolock.connect(url) as locks:
        plain = locks.lock(f"plain:{RUN}", timeout=1)
        async with plain:
            try:
                await plain.acquire()
                deadlock_guard = False
            except aiolock.LockError as exc:
                deadlock_guard = not isinstance(exc, aiolock.LockTimeout)
                say("main", f"reentrant=False, acquiring again: LockError: {exc}")

    reentered = all(inner == outer for _, inner, outer in steps_done) and len(steps_done) == 2
    ok = len(ran) == 1 and reentered and deadlock_guard
    if ok:
        print(f"migration ran exactly once (by {ran[0]}); its steps re-entered the lock "
              "with the same token")
    else:
        print(f"FAIL: migration ran {len(ran)} times; steps {steps_done}; "
              f"deadlock guard {deadlock_guard}")
    return ok


# -- 3: leader election ----------------------------------------------------------------------

LEADER_TTL = 0.5  # a leader that makes no progress for this long loses its lease
TICK = 0.1
TICKS_PER_TERM = 4  # a healthy leader steps down after this many ticks, to rotate
TERMS = 4  # stop after this many terms
HANG_AT_TICK = 1  # the first leader hangs on this tick of its term


async def leader_demo(url: str, store: Store) -> bool:
    print("== 3. leader election: the work stops when the lease is lost ==")
    name = f"leader:{RUN}"
    journal = store.record("leader-journal")  # what leaders write, fenced by their token
    terms: list[dict[str, Any]] = []
    stop = asyncio.Event()

    async def lead(who: str, lease: aiolock.Lease, term: dict[str, Any], hang: bool) -> None:
        """The leader's work: ticks that each end by extending the lease."""
        for tick in range(TICKS_PER_TERM):
            if hang and tick == HANG_AT_TICK:
                say(who, "work hangs (a stuck call): stops extending its lease")
                await asyncio.sleep(30)  # cancelled when the lease is lost
            await asyncio.sleep(TICK)
            if not await journal.write(lease.token, f"{who} tick {tick}"):
                say(who, f"journal write REJECTED: token {lease.token} is stale")
                return
            term["last_act"] = time.monotonic()
            await lease.extend()  # proof of progress: keep leading for another ttl

    async def candidate(who: str) -> None:
        async with aiolock.connect(url) as locks:
            lock = locks.lock(name, ttl=LEADER_TTL, watchdog=False)
            while not stop.is_set():
                try:
                    lease = await lock.acquire(timeout=0.2)
                except aiolock.LockTimeout:
                    continue  # someone else leads; check `stop`, then run again
                if stop.is_set():
                    await lease.release()
                    break
                now = time.monotonic()
                term = {"who": who, "token": lease.token, "start": now, "last_act": now}
                terms.append(term)
                say(who, f"elected leader (token {lease.token})")
                work = asyncio.create_task(lead(who, lease, term, hang=len(terms) == 1))
                lost = asyncio.create_task(lease.wait_lost())
                await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
                if lease.lost:
                    work.cancel()  # never act as leader without a lease
                    await asyncio.gather(work, return_exceptions=True)
                    term["outcome"] = "lost"
                    say(who, "lease LOST: leader work cancelled, back to candidate")
                else:
                    await work  # finished its term (or raised: let it propagate)
                    term["last_act"] = time.monotonic()
                    await lease.release()
                    await lost
                    term["outcome"] = "stepped down"
                    say(who, "stepped down (released)")
                if len(terms) >= TERMS:
                    stop.set()
                await asyncio.sleep(0.05)  # let another candidate win the next election

    await asyncio.gather(*(candidate(f"candidate-{i}") for i in range(3)))

    tokens = [t["token"] for t in terms]
    rising = all(a < b for a, b in itertools.pairwise(tokens))
    # A term runs from its election to its leader's last act as leader.
    spans = sorted((t["start"], t["last_act"]) for t in terms)
    disjoint = all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    lost_terms = [t for t in terms if t["outcome"] == "lost"]
    ok = rising and disjoint and lost_terms == terms[:1]
    summary = ", ".join(f"{t['who']}#{t['token']} {t['outcome']}" for t in terms)
    print(f"terms: {summary}")
    if ok:
        print("leader election OK: tokens rose every term, terms never overlapped, "
              "the hung leader was stopped when its lease was lost")
    else:
        print(f"FAIL: rising={rising} disjoint={disjoint} lost={len(lost_terms)}")
    return ok


async def main(url: str) -> int:
    print(f"lock backend: {url}")
    store = Store(url)
    try:
        migrated = await migration_demo(url, store)
        elected = await leader_demo(url, store)
    finally:
        await store.aclose()
    return 0 if migrated and elected else 1


if __name__ == "__main__":
    logging.basicConfig(format="%(name)s %(levelname)s: %(message)s")  # aiolock logs losses
    sys.exit(asyncio.run(main(AIOLOCK_URL)))
