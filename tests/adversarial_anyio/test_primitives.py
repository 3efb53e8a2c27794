"""Fair locks, semaphores and read-write locks under anyio cancellation (README
"Waiting" -- a cancelled waiter is "removed from the fair queue" --, "Read-write locks
and semaphores", "Cancellation safety"). Written from README.md, SPEC.md and docs/ only."""

from __future__ import annotations

import time

import anyio

import aiolock
from aiolock import Capability

from ..scenarios import Scenario
from .conftest import LEAK_TTL, TAKE, assert_free, cancelling, checkpoints, rows

C = Capability


async def _acquire_into(lock: aiolock.Lock, got: list[aiolock.Lease]) -> None:
    got.append(await lock.acquire())


async def _hold_forever(lock: aiolock.Lock, got: list[aiolock.Lease]) -> None:
    async with lock as lease:
        got.append(lease)
        await anyio.sleep(30)


# Fixed: a PostgreSQL connect runs in a task of its own (postgres/_backend.py).
# DEFECT (postgres, advisory mode): cancelling fair waiters leaves asyncpg's
# "Future exception was never retrieved: ConnectionError('unexpected connection_lost()
# call')" on the event loop (a connection dropped under a cancelled request, its waiter
# future never awaited): an error report in the application's log for a clean cancel.
# The lock itself is free afterwards. Every run (3/3: 1 alone, 2 in full runs); plain asyncio
# task.cancel() does it too. postgres-row and every other row pass.
@rows(C.FAIR, default=("postgres",))
async def test_fair_waiters_cancelled_by_their_group_leave_the_queue(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """``fair=True``: three children queue (first come, first served) for a lock the
    other connection holds; their group is cancelled after k steps. When the holder
    releases, a third party (also fair) gets the lock at once: the cancelled waiters'
    places are gone, the release is not handed to any of them."""
    for k in (0, 1, 2, 3, 5, 8, 13, 30):
        n = f"{name}-{k}"
        blocker = await other.lock(n, ttl=LEAK_TTL, fair=True).acquire(timeout=5)
        got: list[aiolock.Lease] = []
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(_acquire_into, locks.lock(n, ttl=LEAK_TTL, fair=True), got)
            await checkpoints(k)
            if k == 30:
                await anyio.sleep(0.2)  # all queued
            tg.cancel_scope.cancel()
        assert not got
        assert cancelling() == 0
        await blocker.release()
        t0 = time.monotonic()
        try:
            lease = await other.lock(n, ttl=LEAK_TTL, fair=True).acquire(timeout=TAKE)
        except aiolock.LockTimeout:
            raise AssertionError(f"cancelled after {k} steps: a fair lock not taken within {TAKE}s "
                                 f"after its holder released ({await other.status(n)})") from None
        assert time.monotonic() - t0 < TAKE + 0.5
        await lease.release()


# Fixed: a PostgreSQL connect runs in a task of its own (postgres/_backend.py).
# DEFECT (postgres, advisory mode): cancelling semaphore holders and waiters leaves asyncpg's
# "Future exception was never retrieved: ConnectionError('unexpected connection_lost()
# call')" on the event loop (a connection dropped under a cancelled request, its waiter
# future never awaited): an error report in the application's log for a clean cancel.
# The lock itself is free afterwards. Every run (3/3: 1 alone, 2 in full runs); plain asyncio
# task.cancel() does it too. postgres-row and every other row pass.
@rows(C.SEMAPHORE, default=("postgres",))
async def test_semaphore_permits_come_back_after_a_cancelled_group(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """A semaphore of 2 permits; a group of four children (two get permits and hold them,
    two wait) is cancelled after k steps: both permits are free at once afterwards."""
    for k in (0, 1, 2, 3, 5, 8, 13, 40):
        n = f"{name}-{k}"
        got: list[aiolock.Lease] = []
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(_hold_forever, locks.semaphore(n, limit=2, ttl=LEAK_TTL), got)
            await checkpoints(k)
            if k == 40:
                await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
        assert cancelling() == 0
        assert len(got) <= 2
        permits = []
        try:
            for _ in range(2):
                permits.append(await other.semaphore(n, limit=2, ttl=LEAK_TTL).acquire(timeout=TAKE))
        except aiolock.LockTimeout:
            raise AssertionError(f"cancelled after {k} steps: only {len(permits)} of 2 permits "
                                 f"free ({await other.status(n, aiolock.Kind.PERMIT)})") from None
        finally:
            for p in permits:
                await p.release()


@rows(C.RWLOCK)
async def test_cancelled_waiting_writer_does_not_block_later_readers(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """A reader (other connection) holds; a writer waits in a child task (new readers now
    queue behind it: "waiting writers are not starved"); the writer's group is cancelled.
    Its place must go with it: a new reader gets in at once, and once the readers leave,
    a writer does too."""
    for k in (0, 1, 3, 8, 30):
        n = f"{name}-{k}"
        reader = await other.rwlock(n, ttl=LEAK_TTL).read().acquire(timeout=5)
        got: list[aiolock.Lease] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_acquire_into, locks.rwlock(n, ttl=LEAK_TTL).write(), got)
            await checkpoints(k)
            if k == 30:
                await anyio.sleep(0.2)  # the writer waits
            tg.cancel_scope.cancel()
        assert not got
        seconds: list[aiolock.Lease] = []
        with anyio.move_on_after(TAKE):  # another task: this one holds a read lease already
            async with anyio.create_task_group() as tg:
                tg.start_soon(_acquire_into, other.rwlock(n, ttl=LEAK_TTL).read(), seconds)
        if not seconds:
            raise AssertionError(f"writer cancelled after {k} steps: a new reader still waits "
                                 f"behind it after {TAKE}s")
        await seconds[0].release()
        await reader.release()
        try:
            w = await other.rwlock(n, ttl=LEAK_TTL).write().acquire(timeout=TAKE)
        except aiolock.LockTimeout:
            raise AssertionError(f"writer cancelled after {k} steps: no writer gets in after "
                                 f"the readers left") from None
        await w.release()
    await assert_free(other, f"{name}-unused")
