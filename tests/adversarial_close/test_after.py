"""Every use of a closed connection: a ``LockError`` at once (the contract suite:
``match="closed"``), never a hang, never a bare ``CancelledError`` or another exception;
``release()`` of a lease it held is a no-op (contract suite); nothing gets held on the
server by a call made after the close. Written from README.md, SPEC.md and docs/ only."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiolock
from aiolock import Capability

from .conftest import (
    LONG,
    PROMPT,
    Outcome,
    assert_at_most_lock_error,
    assert_lock_error,
    has,
    take_lock,
    take_permits,
    take_write,
    timed,
)


async def _async_with(lock: Any) -> None:
    async with lock:
        pass


async def _first(iterator: Any) -> Any:
    async for item in iterator:
        return item
    return "ended"


async def test_every_call_after_close_raises_lock_error_at_once(
    backend_url: str, judge: aiolock.Locks, name: str
) -> None:
    doomed = aiolock.connect(backend_url)
    held = await doomed.lock(name, ttl=LONG).acquire(timeout=5)
    await doomed.status(name)
    await doomed.aclose()
    assert doomed.closed

    calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("lock().acquire(timeout=None)", lambda: doomed.lock(name).acquire(timeout=None)),
        ("lock().acquire(timeout=0)", lambda: doomed.lock(name).acquire(timeout=0)),
        ("lock(other).acquire(timeout=5)", lambda: doomed.lock(f"{name}-o", ttl=LONG).acquire(timeout=5)),
        ("lock(reentrant).acquire()", lambda: doomed.lock(f"{name}-r", reentrant=True).acquire()),
        ("async with lock(other)", lambda: _async_with(doomed.lock(f"{name}-w", ttl=LONG))),
        ("lock().locked()", lambda: doomed.lock(name).locked()),
        ("status()", lambda: doomed.status(name)),
        ("status(other)", lambda: doomed.status(f"{name}-o")),
    ]
    if has(doomed, Capability.FAIR):
        calls.append(("lock(fair).acquire()", lambda: doomed.lock(f"{name}-f", fair=True).acquire()))
    if has(doomed, Capability.REVOKE):
        calls.append(("force_release()", lambda: doomed.lock(name).force_release()))
    if has(doomed, Capability.SCAN):
        calls.append(("scan()", lambda: _first(doomed.scan(prefix=name))))
    if has(doomed, Capability.RWLOCK):
        calls.append(("rwlock().read().acquire()", lambda: doomed.rwlock(f"{name}-rw").read().acquire()))
        calls.append(("rwlock().write().acquire()", lambda: doomed.rwlock(f"{name}-rw").write().acquire()))
    if has(doomed, Capability.SEMAPHORE):
        calls.append(("semaphore().acquire()", lambda: doomed.semaphore(f"{name}-s", limit=2).acquire()))
    if has(doomed, Capability.ELECTION):
        election = f"{name}-e"
        calls.append(("campaign().acquire()", lambda: doomed.election(election).campaign().acquire()))
        calls.append(("async with campaign()", lambda: _async_with(doomed.election(election).campaign())))
        calls.append(("leader()", lambda: doomed.election(election).leader()))
        calls.append(("observe() first item", lambda: _first(doomed.election(election).observe())))

    failures: list[str] = []
    for what, call in calls:
        outcome = await timed(what, call)
        try:
            assert_lock_error(outcome)
        except AssertionError as e:
            failures.append(str(e))
        if isinstance(outcome.result, aiolock.Lease):
            await outcome.result.release()

    # a lease held at the close: release() is a no-op (contract), extend() at most a LockError
    released: Outcome = await timed("release() after the close", held.release)
    if released.error is not None or released.elapsed >= PROMPT:
        failures.append("release() of a lease held at the close is not a no-op: " + released.describe())
    extended = await timed("extend() after the close", lambda: held.extend(LONG))
    try:
        assert_at_most_lock_error(extended)
    except AssertionError as e:
        failures.append(str(e))
    assert held.released and not held.lost, repr(held)

    assert not failures, (
        f"{len(failures)} of {len(calls) + 2} calls after the close misbehaved:\n" + "\n".join(failures)
    )

    # nothing a call after the close made is held on the server
    for n in (name, f"{name}-o", f"{name}-r", f"{name}-w", f"{name}-f"):
        await take_lock(judge, n, fair=n.endswith("-f") and has(judge, Capability.FAIR))
    if has(judge, Capability.RWLOCK):
        await take_write(judge, f"{name}-rw")
    if has(judge, Capability.SEMAPHORE):
        await take_permits(judge, f"{name}-s", 2)
    if has(judge, Capability.ELECTION):
        assert await judge.election(f"{name}-e").leader() is None


async def test_lock_object_made_before_close_fails_after_it(
    backend_url: str, judge: aiolock.Locks, name: str
) -> None:
    """``Lock``, ``RWLock`` side, ``Semaphore`` and campaign objects made while the
    connection was open (a ``Lock`` may be shared by many tasks and kept): used after the
    close, each raises a ``LockError`` at once, twice in a row, and never takes anything."""
    doomed = aiolock.connect(backend_url)
    objects: list[tuple[str, Any]] = [("lock", doomed.lock(name, ttl=LONG))]
    if has(doomed, Capability.RWLOCK):
        objects.append(("read", doomed.rwlock(f"{name}-rw", ttl=LONG).read()))
        objects.append(("write", doomed.rwlock(f"{name}-rw", ttl=LONG).write()))
    if has(doomed, Capability.SEMAPHORE):
        objects.append(("semaphore", doomed.semaphore(f"{name}-s", limit=1, ttl=LONG)))
    if has(doomed, Capability.ELECTION):
        objects.append(("campaign", doomed.election(f"{name}-e", ttl=LONG).campaign()))
    for _what, obj in objects:  # each used once while open
        lease = await asyncio.create_task(obj.acquire(timeout=5))
        await lease.release()
    await doomed.aclose()
    failures = []
    for what, obj in objects:
        for attempt in range(2):
            for label, call in (
                (f"{what}.acquire(timeout=None) #{attempt}", lambda o=obj: o.acquire()),
                (f"async with {what} #{attempt}", lambda o=obj: _async_with(o)),
            ):
                outcome = await timed(label, call)
                try:
                    assert_lock_error(outcome)
                except AssertionError as e:
                    failures.append(str(e))
                if isinstance(outcome.result, aiolock.Lease):
                    await outcome.result.release()
    assert not failures, "\n".join(failures)
    await take_lock(judge, name)
