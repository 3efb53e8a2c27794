"""What a close does to the leases its connection holds: every kind is released on the
server (another connection takes it at once), each lease ends ``released`` and not
``lost``, the watchdog stops, and ``aclose()`` is idempotent and safe from several tasks
at once. Written from README.md, SPEC.md and docs/ only."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiolock
from aiolock import Capability

from .conftest import (
    CLOSE,
    LONG,
    PROMPT,
    assert_at_most_lock_error,
    assert_lock_error,
    has,
    take_leadership,
    take_lock,
    take_permits,
    take_write,
    timed,
)


async def _in_task(coro: Any) -> Any:
    """Await ``coro`` in a task of its own (a permit or a read lease per task: one task
    may not take the same primitive twice)."""
    return await asyncio.create_task(coro)


async def _hold_everything(conn: aiolock.Locks, name: str) -> tuple[dict[str, aiolock.Lease], list[Any]]:
    """Take one lease of every kind the backend declares on ``conn``; return the leases
    by label and the checks (awaitables on the judge) that each is free again."""
    leases: dict[str, aiolock.Lease] = {}
    checks: list[Any] = []
    leases["lock"] = await conn.lock(f"{name}-a", ttl=LONG).acquire(timeout=5)
    leases["lock2"] = await conn.lock(f"{name}-b", ttl=LONG, data="x" * 100).acquire(timeout=5)
    leases["no-watchdog"] = await conn.lock(f"{name}-c", ttl=LONG, watchdog=False).acquire(timeout=5)
    reentrant = conn.lock(f"{name}-r", ttl=LONG, reentrant=True)
    leases["reentrant"] = await reentrant.acquire(timeout=5)
    leases["reentrant-again"] = await reentrant.acquire(timeout=5)  # counted: two releases needed
    checks += [("lock", f"{name}-a"), ("lock", f"{name}-b"), ("lock", f"{name}-c"), ("lock", f"{name}-r")]
    if has(conn, Capability.FAIR):
        leases["fair"] = await conn.lock(f"{name}-f", ttl=LONG, fair=True).acquire(timeout=5)
        checks.append(("fair", f"{name}-f"))
    if has(conn, Capability.RWLOCK):
        rw = conn.rwlock(f"{name}-rw", ttl=LONG)
        leases["read1"] = await _in_task(rw.read().acquire(timeout=5))
        leases["read2"] = await _in_task(rw.read().acquire(timeout=5))
        leases["write"] = await conn.rwlock(f"{name}-w", ttl=LONG).write().acquire(timeout=5)
        checks += [("rw", f"{name}-rw"), ("rw", f"{name}-w")]
    if has(conn, Capability.SEMAPHORE):
        sem = conn.semaphore(f"{name}-s", limit=2, ttl=LONG)
        leases["permit1"] = await _in_task(sem.acquire(timeout=5))
        leases["permit2"] = await _in_task(sem.acquire(timeout=5))
        checks.append(("sem", f"{name}-s"))
    if has(conn, Capability.ELECTION):
        leases["leader"] = (
            await conn.election(f"{name}-e", ttl=LONG).campaign(data="doomed").acquire(timeout=5)
        )
        checks.append(("election", f"{name}-e"))
    return leases, checks


async def _check_free(judge: aiolock.Locks, checks: list[Any]) -> None:
    for kind, n in checks:
        if kind in ("lock", "fair"):
            await take_lock(judge, n, fair=(kind == "fair"))
        elif kind == "rw":
            await take_write(judge, n)
        elif kind == "sem":
            await take_permits(judge, n, 2)
        else:
            await take_leadership(judge, n)


async def test_close_releases_every_kind_it_holds(backend_url: str, judge: aiolock.Locks, name: str) -> None:
    """A connection holding plain, no-watchdog, reentrant (twice), fair, read (two), write,
    permit (two) and leader leases (what the backend declares), all with ttl 30 s: after
    ``aclose()`` every lease is ``released`` and not ``lost``, its ``wait_lost()``
    returns at once, ``status()`` from another connection shows each name free, and that
    connection takes each of them at once."""
    doomed = aiolock.connect(backend_url)
    leases, checks = await _hold_everything(doomed, name)
    for label, lease in leases.items():
        assert not lease.lost and not lease.released, f"{label}: {lease!r} before the close"
    closed = await timed("aclose()", doomed.aclose)
    assert closed.error is None and closed.elapsed < CLOSE, closed.describe()
    assert doomed.closed
    for label, lease in leases.items():
        assert lease.released and not lease.lost, (
            f"{label} lease after the close: released={lease.released} lost={lease.lost} "
            "(expected released, not lost)"
        )
        waited = await timed(f"{label}: wait_lost() after the close", lease.wait_lost)
        assert waited.error is None and waited.elapsed < PROMPT, waited.describe()
    for _kind, n in checks:
        info = await judge.status(n)
        assert not info.held, f"{n!r} still held on the server after the close: {info}"
    await _check_free(judge, checks)


async def test_watchdog_stops_at_the_close(backend_url: str, judge: aiolock.Locks, name: str) -> None:
    """Leases of ttl 1 s (renewed every ~0.33 s) at the close: after it, another connection
    holds the names for 1.5 s -- longer than the leases' ttl, several renewal periods. A
    watchdog still running would find them gone or expired: the closed connection's
    leases must stay ``released`` and not ``lost``, and the new holder keeps them
    (nothing renewed or released them from under it)."""
    doomed = aiolock.connect(backend_url)
    short = [await doomed.lock(f"{name}-{i}", ttl=1.0).acquire(timeout=5) for i in range(3)]
    await asyncio.sleep(0.4)  # a renewal went out
    lost_before = [lease.lost for lease in short]
    closed = await timed("aclose()", doomed.aclose)
    assert closed.error is None and closed.elapsed < CLOSE, closed.describe()
    mine = [await judge.lock(f"{name}-{i}", ttl=LONG).acquire(timeout=2) for i in range(3)]
    await asyncio.sleep(1.5)
    for i, lease in enumerate(short):
        if lost_before[i]:
            continue  # lost before the close (a loaded machine): nothing to judge
        assert lease.released and not lease.lost, (
            f"lease {i} 1.5 s after the close: released={lease.released} lost={lease.lost}"
        )
    for i, lease in enumerate(mine):
        assert not lease.lost, f"the new holder of {name}-{i} lost it: {lease!r}"
        info = await judge.status(f"{name}-{i}")
        assert info.held and info.token == lease.token, f"{name}-{i}: {info} (new holder {lease.token})"
        await lease.release()


async def test_aclose_is_idempotent_and_safe_from_many_tasks(
    backend_url: str, judge: aiolock.Locks, name: str
) -> None:
    """Five tasks call ``aclose()`` at once while the connection holds three leases, has a
    waiter queued behind the judge and a ``status()`` in flight; then once more, and the
    ``async with`` block exits after an explicit ``aclose()`` inside it. Every call
    returns (no error) promptly, the leases end released, the waiter a ``LockError``, the
    names are free; a connection never used closes twice without error too."""
    blocker = await judge.lock(f"{name}-busy", ttl=LONG).acquire(timeout=5)
    try:
        doomed = aiolock.connect(backend_url)
        leases = [await doomed.lock(f"{name}-{i}", ttl=LONG).acquire(timeout=5) for i in range(3)]
        waiter = asyncio.create_task(
            timed("waiter", lambda: doomed.lock(f"{name}-busy", ttl=LONG).acquire(timeout=20))
        )
        peek = asyncio.create_task(timed("status", lambda: doomed.status(f"{name}-0")))
        await asyncio.sleep(0.3)
        closes = await asyncio.gather(*(timed(f"aclose #{i}", doomed.aclose) for i in range(5)))
        for c in closes:
            assert c.error is None and c.elapsed < CLOSE, c.describe()
        again = await timed("aclose() again", doomed.aclose)
        assert again.error is None and again.elapsed < PROMPT, again.describe()
        assert_lock_error(await waiter, PROMPT + CLOSE)
        assert_at_most_lock_error(await peek, PROMPT + CLOSE)
        for lease in leases:
            assert lease.released and not lease.lost, repr(lease)
        for i in range(3):
            await take_lock(judge, f"{name}-{i}")
    finally:
        await blocker.release()
    await take_lock(judge, f"{name}-busy")  # the closed waiter kept no place in the queue

    async with aiolock.connect(backend_url) as conn:
        lease = await conn.lock(f"{name}-x", ttl=LONG).acquire(timeout=5)
        inner = await timed("aclose() inside the block", conn.aclose)
        assert inner.error is None and inner.elapsed < CLOSE, inner.describe()
    assert lease.released and not lease.lost
    await take_lock(judge, f"{name}-x")

    never = aiolock.connect(backend_url)  # connects lazily: never connected
    for i in range(2):
        c = await timed(f"aclose #{i} of a connection never used", never.aclose)
        assert c.error is None and c.elapsed < PROMPT, c.describe()


async def test_leaving_connect_while_other_tasks_hold_and_wait(
    backend_url: str, judge: aiolock.Locks, name: str
) -> None:
    """Leaving ``async with aiolock.connect()`` while another task sits in an ``async with
    lock`` body and a third waits behind it: the lock is free on the server at once after
    the block, the waiting task ends with a ``LockError`` within a second, and the
    holding task's block ends without anything but (at most) a ``LockError`` once its
    body returns -- never a ``CancelledError`` it did not ask for."""
    inside = asyncio.Event()
    leave = asyncio.Event()
    outcome: dict[str, Any] = {}

    async def holder(conn: aiolock.Locks) -> None:
        try:
            async with conn.lock(name, ttl=LONG) as lease:
                outcome["lease"] = lease
                inside.set()
                await leave.wait()
                outcome["body"] = "ran to its end"
        except BaseException as e:
            outcome["error"] = e
            raise

    async with aiolock.connect(backend_url) as conn:
        hold = asyncio.create_task(holder(conn))
        await asyncio.wait_for(inside.wait(), 10)
        wait = asyncio.create_task(timed("waiter", lambda: conn.lock(name, ttl=LONG).acquire(timeout=20)))
        await asyncio.sleep(0.3)
    t0 = time.monotonic()
    await take_lock(judge, name)
    assert_lock_error(await wait, PROMPT + CLOSE)
    assert time.monotonic() - t0 < PROMPT + 1
    leave.set()
    await asyncio.wait([hold], timeout=5)
    assert hold.done(), "the holding task's block did not end 5 s after its body returned"
    assert not hold.cancelled(), f"the holding task was cancelled: {outcome}"
    hold.exception()  # retrieved (judged below)
    error = outcome.get("error")
    assert error is None or isinstance(error, aiolock.LockError), f"holder's block raised {error!r}"
    lease = outcome["lease"]
    assert lease.released and not lease.lost, repr(lease)
