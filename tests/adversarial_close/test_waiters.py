"""Waiters of every kind on a connection that closes: each ends within a second with a
``LockError`` (README Status: "``aclose()`` ends its connection's waiters at once on
every backend"), gives up its place in the server's queue (README "Connecting"), and the
holder on another connection is untouched. Written from README.md, SPEC.md and docs/
only."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiolock
from aiolock import Capability

from ..scenarios import Scenario
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


async def _observe(election: Any, seen: list[Any]) -> None:
    async for leader in election.observe():
        seen.append(leader)


async def test_waiters_of_every_kind_end_at_once_and_leave_no_place(
    scenario: Scenario, backend_url: str, judge: aiolock.Locks, name: str
) -> None:
    """The judge holds a lock, a fair lock, a write lock, a semaphore's only permit and an
    election; the doomed connection waits on each (two plain waiters, one with a
    timeout, one reentrant; a reader and a writer; a permit; a candidate; an observer)
    and holds one lease whose ``wait_lost()`` a task awaits. It closes at a seeded
    random moment: every waiter ends with a ``LockError`` within a second of the close's
    end, the observer ends (at most a ``LockError``), ``wait_lost()`` returns; the judge
    still holds everything; once it releases, a third connection takes each name at once
    (no place kept for a closed waiter)."""
    rnd = random.Random(f"waiters-{scenario.id}")
    held: list[aiolock.Lease] = [await judge.lock(f"{name}-a", ttl=LONG).acquire(timeout=5)]
    doomed = aiolock.connect(backend_url)
    waits: dict[str, Any] = {
        "lock": lambda: doomed.lock(f"{name}-a", ttl=LONG).acquire(),
        "lock(timeout=20)": lambda: doomed.lock(f"{name}-a", ttl=LONG).acquire(timeout=20),
        "lock(reentrant)": lambda: doomed.lock(f"{name}-a", ttl=LONG, reentrant=True).acquire(),
    }
    if has(judge, Capability.FAIR):
        held.append(await judge.lock(f"{name}-f", ttl=LONG, fair=True).acquire(timeout=5))
        waits["fair lock"] = lambda: doomed.lock(f"{name}-f", ttl=LONG, fair=True).acquire()
    if has(judge, Capability.RWLOCK):
        held.append(await judge.rwlock(f"{name}-rw", ttl=LONG).write().acquire(timeout=5))
        waits["read"] = lambda: doomed.rwlock(f"{name}-rw", ttl=LONG).read().acquire()
        waits["write"] = lambda: doomed.rwlock(f"{name}-rw", ttl=LONG).write().acquire()
    if has(judge, Capability.SEMAPHORE):
        held.append(await judge.semaphore(f"{name}-s", limit=1, ttl=LONG).acquire(timeout=5))
        waits["permit"] = lambda: doomed.semaphore(f"{name}-s", limit=1, ttl=LONG).acquire()
    seen: list[Any] = []
    if has(judge, Capability.ELECTION):
        held.append(await judge.election(f"{name}-e", ttl=LONG).campaign(data="judge").acquire(timeout=5))
        waits["campaign"] = lambda: doomed.election(f"{name}-e", ttl=LONG).campaign(data="doomed").acquire()
    mine = await doomed.lock(f"{name}-m", ttl=LONG).acquire(timeout=5)
    tasks = {what: asyncio.create_task(timed(what, call, cap=30)) for what, call in waits.items()}
    watcher = asyncio.create_task(timed("wait_lost()", mine.wait_lost, cap=30))
    observer = None
    if has(judge, Capability.ELECTION):
        observer = asyncio.create_task(
            timed("observe()", lambda: _observe(doomed.election(f"{name}-e"), seen), cap=30)
        )
    await asyncio.sleep(0.5 + rnd.uniform(0, 0.2))  # every waiter has queued / subscribed / watched
    early = [what for what, t in tasks.items() if t.done()]
    assert not early, f"ended before the close: {[tasks[w].result().describe() for w in early]}"

    closed = await timed("aclose()", doomed.aclose)
    assert closed.error is None and closed.elapsed < CLOSE, closed.describe()
    t0 = time.monotonic()
    done, pending = await asyncio.wait(
        [*tasks.values(), watcher, *([observer] if observer else [])], timeout=PROMPT + 4
    )
    late = time.monotonic() - t0
    failures = []
    for what, task in tasks.items():
        if task not in done:
            failures.append(f"{what}: still waiting {late:.1f} s after the close")
            continue
        try:
            assert_lock_error(task.result(), PROMPT + closed.elapsed)
        except AssertionError as e:
            failures.append(str(e))
    if watcher in done:
        w = watcher.result()
        if w.error is not None or w.elapsed > PROMPT + closed.elapsed + 1:
            failures.append("wait_lost() of a lease held at the close: " + w.describe())
    else:
        failures.append("wait_lost() of a lease held at the close did not return")
    if observer is not None:
        if observer in done:
            try:
                assert_at_most_lock_error(observer.result(), PROMPT + closed.elapsed + 1)
            except AssertionError as e:
                failures.append(str(e))
        else:
            failures.append(f"observe() still iterating after the close (seen {seen})")
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    assert not failures, "\n".join(failures)

    for lease in held:
        assert not lease.lost and not lease.released, f"the judge's lease {lease!r} after the close"
    assert mine.released and not mine.lost
    for lease in held:
        await lease.release()
    async with aiolock.connect(backend_url) as third:
        await take_lock(third, f"{name}-a")
        await take_lock(third, f"{name}-m")
        if has(third, Capability.FAIR):
            await take_lock(third, f"{name}-f", fair=True)
        if has(third, Capability.RWLOCK):
            await take_write(third, f"{name}-rw")
        if has(third, Capability.SEMAPHORE):
            await take_permits(third, f"{name}-s", 1)
        if has(third, Capability.ELECTION):
            await take_leadership(third, f"{name}-e")
