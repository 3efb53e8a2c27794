"""``LockInfo.waiters`` and ``Holder.waiting`` (docs/operations.md, "`aiolock ls`: every held
name"; README "Coordination" and "Command line"), written from the documentation alone.

The promise: ``waiters`` counts acquisitions waiting now, from two sources -- the waiters
the server keeps a place for (Redis Lua path / Cluster / Sentinel, ZooKeeper, PostgreSQL:
one per waiting claim that asked the server; a process that does not hold the name asks
with its first waiter only), plus the tasks queued behind a holder in the holder's own
process, carried in the holder's record (``Holder.waiting``, ``holders[].waiting`` in
``aiolock ls --json``), rewritten at most every 0.2 s while it changes, on every backend
with holder records. Holding, and waiting behind a holder of one's own process, cost no
server request ("while the name is held in that process, not even the first does").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

import aiolock
from aiolock import Holder, Kind

from .._children import Child
from ..conftest import backend_fixtures
from ..scenarios import by_id
from ..servers import RedisServer
from .conftest import cli
from .test_logging import Capture, capture

#: how long a count may take to show a change: "rewritten at most every 0.2 s", a round
#: trip, and a loaded 2-core machine
SETTLE = 1.0

#: a holder's data with everything a record encoding could trip on: quotes, backslashes,
#: JSON that looks like a record (and its ``waiting`` field), separators, control
#: characters, NUL, non-BMP unicode and line separators; exactly 1024 characters, the limit
_TRICKY = 'he said "hi" \\ {"w":9,"waiting":9,"d":"x"} | ; : \t\r\n\x00 ünï 漢字 🔒 \u2028 '
DATA = (_TRICKY * 40)[:1024]
#: a task name as tricky (task names are the user's too)
TASK = 'task "B" \\ {"w":7} 🔒\n'


L = TypeVar("L", bound=aiolock.Lease)


def rows(default: tuple[str, ...], slow: tuple[str, ...] = ()) -> list[Any]:
    """``pytest.param`` of the backend rows ``default`` (default run) and ``slow`` (the
    slow tier: the same check on further backends)."""
    out = [by_id(key).param() for key in default]
    for key in slow:
        p = by_id(key).param()
        out.append(pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.slow]))
    return out


sem_row, sem_url, sem_locks = backend_fixtures(
    "sem_row", "sem_url", "sem_locks",
    rows(("redis", "memcached"),
         ("memory", "zookeeper", "postgres", "mysql", "etcd", "redis-cluster", "redis-sentinel")),
    "Backends with semaphores and holder records.")
rw_row, rw_url, rw_locks = backend_fixtures(
    "rw_row", "rw_url", "rw_locks",
    rows(("memory", "redis"),
         ("zookeeper", "postgres", "etcd", "redis-cluster", "redis-sentinel")),
    "Backends with read-write locks and holder records.")
el_row, el_url, el_locks = backend_fixtures(
    "el_row", "el_url", "el_locks",
    rows(("redis", "memcached"),
         ("memory", "zookeeper", "postgres", "redlock", "mysql", "mysql-row", "postgres-row",
          "etcd", "redis-cluster", "redis-sentinel")),
    "Backends with elections.")
any_row, any_url, any_locks = backend_fixtures(
    "any_row", "any_url", "any_locks",
    rows(("memory", "redis"),
         ("memcached", "zookeeper", "postgres", "redlock", "redis-nolua", "mysql", "mysql-row",
          "postgres-row", "etcd", "redis-cluster", "redis-sentinel")),
    "Backends with holder records.")
churn_row, churn_url, churn_locks = backend_fixtures(
    "churn_row", "churn_url", "churn_locks",
    rows(("redis", "memcached"),
         ("memory", "zookeeper", "postgres", "redlock", "etcd", "mysql", "redis-nolua")),
    "Backends with holder records (the churn checks).")
server_row, server_url, server_locks = backend_fixtures(
    "server_row", "server_url", "server_locks",
    rows(("redis",), ("zookeeper", "postgres", "redis-cluster", "redis-sentinel")),
    "Backends whose server keeps a place for each waiter.")
race_row, race_url, race_locks = backend_fixtures(
    "race_row", "race_url", "race_locks",
    rows(("redis",), ("postgres", "zookeeper")),
    "Backends whose server keeps a place for each waiter (waiters starting together).")
rel_row, rel_url, rel_locks = backend_fixtures(
    "rel_row", "rel_url", "rel_locks",
    rows(("memcached",), ("memory", "redis", "zookeeper", "postgres", "redlock", "etcd", "mysql",
                          "redis-nolua")),
    "Backends with holder records (release and expiry beside a rewrite).")


def fresh() -> str:
    return f"adv13w-{uuid.uuid4().hex[:12]}"


async def hold(acquire: Awaitable[L], name: str | None = None) -> L:
    """Acquire in a task of its own (so one test task can hold several leases of a name
    without tripping the same-task deadlock check)."""
    async def run() -> L:
        return await acquire
    return await asyncio.create_task(run(), name=name)


async def staggered(make: Callable[[], Awaitable[aiolock.Lease]], n: int,
                    gap: float = 0.03) -> list[asyncio.Task[aiolock.Lease]]:
    """``n`` waiting acquisitions started one after the other (``gap`` apart)."""
    tasks = []
    for _ in range(n):
        async def run() -> aiolock.Lease:
            return await make()
        tasks.append(asyncio.create_task(run()))
        await asyncio.sleep(gap)
    return tasks


async def drop(tasks: list[asyncio.Task[aiolock.Lease]]) -> None:
    """Cancel ``tasks``; release what they got before the cancel landed."""
    for t in tasks:
        t.cancel()
    for got in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(got, aiolock.Lease):
            await got.release()


async def settle(locks: aiolock.Locks, name: str, want: int, kind: Kind = Kind.LOCK,
                 within: float = SETTLE) -> aiolock.LockInfo:
    """``status(name)`` once its ``waiters`` is ``want`` (or the last seen after
    ``within`` s)."""
    deadline = time.monotonic() + within
    while True:
        info = await locks.status(name, kind)
        if info.waiters == want or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.05)


def warnings(logs: Capture) -> list[str]:
    """The aiolock WARNINGs (and worse) test_logging's handler kept."""
    return [f"{r.name} {r.levelname} {r.getMessage()}" for r in logs.records
            if r.levelno >= logging.WARNING and r.name.startswith("aiolock")]


# ------------------------------------------------------------------ Holder compatibility


def test_holder_still_constructs_positionally_and_waiting_is_not_compared() -> None:
    old = Holder("h", 1, "Task-1", "d", 2.5)
    assert old.waiting == 0
    assert Holder("h", 1, None, "") == Holder("h", 1, None, "", None, 0)
    counted = Holder("h", 1, "Task-1", "d", 2.5, 7)
    assert counted.waiting == 7
    assert counted == old and hash(counted) == hash(old) and len({counted, old}) == 1
    assert Holder("h", 1, "Task-1", "other", 2.5, 7) != old


# ------------------------------------------------------------------ same process


async def test_semaphore_waiters_behind_own_permits_all_counted(sem_locks: aiolock.Locks) -> None:
    """DEFECT (memory, Redis, Cluster, Sentinel, PostgreSQL, Memcached, MySQL): tasks
    queued for a semaphore whose permits are all held by their own process are undercounted
    by one: the first of them is in neither the holder's record nor the server's count.
    ``semaphore(n, limit=1)``: hold the permit, one more task of the same connection waits
    -> ``status(n, Kind.PERMIT).waiters`` stays 0 (limit 2, both held, 3 waiting: 2).
    ZooKeeper and etcd count them all."""
    locks = sem_locks
    name = fresh()
    sem = locks.semaphore(name, 2, ttl=10)
    permits = [await hold(sem.acquire()) for _ in range(2)]
    waiting = await staggered(sem.acquire, 3)
    try:
        info = await settle(locks, name, 3, Kind.PERMIT)
        assert info.waiters == 3, (info.waiters, [h.waiting for h in info.held_by])
        waiting.pop().cancel()
        info = await settle(locks, name, 2, Kind.PERMIT)
        assert info.waiters == 2, info
        await permits.pop().release()  # the first waiter gets it: one left waiting
        info = await settle(locks, name, 1, Kind.PERMIT)
        assert info.waiters == 1, info
    finally:
        await drop(waiting)
        for p in permits:
            await p.release()
    assert (await settle(locks, name, 0, Kind.PERMIT)).waiters == 0


async def test_rwlock_waiters_behind_own_holders_counted_exactly(rw_locks: aiolock.Locks) -> None:
    """DEFECT (memory, Redis, Cluster, Sentinel): the tasks queued behind holders of a
    read-write lock in their own process are miscounted. Redis: a reader waiting behind a
    writer of its process is not counted (``rw.write()`` held, one ``rw.read()`` of the
    same connection waiting -> ``status(n, Kind.READ).waiters`` 0; 3 readers -> 2).
    memory: a waiting writer counts twice (a reader held, a writer waiting -> 2; a writer
    behind a writer -> 2) and readers behind a writer one less (1 -> 0). ZooKeeper,
    PostgreSQL and etcd count each exactly."""
    locks = rw_locks
    cases = [("r", "w"), ("w", "r"), ("w", "w")]
    wrong = []
    for held, waits in cases:
        name = fresh()
        rw = locks.rwlock(name, ttl=10)

        def side(c: str, rw: aiolock.RWLock = rw) -> Callable[[], Awaitable[aiolock.Lease]]:
            return (rw.read() if c == "r" else rw.write()).acquire

        leases = [await hold(side(c)()) for c in held]
        waiting = []
        for c in waits:
            waiting += await staggered(side(c), 1)
        try:
            info = await settle(locks, name, len(waits), Kind.READ)
            if info.waiters != len(waits):
                wrong.append(f"held {held!r}, waiting {waits!r}: waiters {info.waiters} "
                             f"(records {[h.waiting for h in info.held_by]})")
        finally:
            await drop(waiting)
            for lease in leases:
                await lease.release()
    assert not wrong, "\n".join(wrong)


async def test_election_candidates_behind_own_leader_counted(el_locks: aiolock.Locks) -> None:
    """DEFECT (Memcached, Redlock, MySQL, MySQL row mode): candidates campaigning behind a
    leader of their own process are undercounted by one. ``election(n)``: lead with
    ``campaign(data="L")``, one more ``campaign()`` of the same connection waits ->
    ``status(n, Kind.LEADER).waiters`` stays 0 (2 candidates: 1). The count must also
    leave the leader's data alone (``leader()``, ``held_by``, after ``proclaim()``)."""
    locks = el_locks
    name = fresh()
    election = locks.election(name, ttl=10)
    term = await hold(election.campaign(data="L").acquire())
    candidates = await staggered(lambda: election.campaign(data="candidate").acquire(), 2)
    try:
        info = await settle(locks, name, 2, Kind.LEADER)
        leader = await election.leader()
        assert leader is not None and leader.data == "L" and leader.token == term.token
        assert [h.data for h in info.held_by] == ["L"], info
        assert info.waiters == 2, (info.waiters, [h.waiting for h in info.held_by])
        await term.proclaim(DATA)
        candidates.pop().cancel()
        info = await settle(locks, name, 1, Kind.LEADER)
        assert info.waiters == 1, info
        await asyncio.sleep(0.5)  # past any rewrite of the count
        leader = await election.leader()
        assert leader is not None and leader.data == DATA and leader.holder.data == DATA
        assert [h.data for h in (await locks.status(name, Kind.LEADER)).held_by] == [DATA]
    finally:
        await drop(candidates)
        await term.release()


async def test_proclaim_and_observe_untouched_by_count_rewrites(el_locks: aiolock.Locks) -> None:
    """Candidates of the leader's process come and go while the leader proclaims: every
    rewrite of the count keeps the data last proclaimed (``leader()``, ``held_by``), and an
    observer sees only the leader's data changes, never a stale value or a repeat."""
    locks = el_locks
    name = fresh()
    ttl = 2.0  # observe() looks again at least every ttl/2 (backends without events)
    election = locks.election(name, ttl=ttl)
    term = await hold(election.campaign(data="v-first").acquire())
    seen: list[tuple[str, int] | None] = []

    async def observe() -> None:
        async for leader in election.observe():
            seen.append(None if leader is None else (leader.data, leader.token))

    observer = asyncio.create_task(observe())
    candidates: list[asyncio.Task[aiolock.Lease]] = []
    proclaimed = ["v-first"]
    rng = random.Random(13)
    try:
        for i in range(5):
            if candidates and rng.random() < 0.4:
                candidates.pop().cancel()
            else:
                candidates += await staggered(lambda: election.campaign(data="c").acquire(), 1, 0)
            await asyncio.sleep(rng.uniform(0, 0.05))
            proclaimed.append(f'v{i} "{i}" {{"w":{i}}}')
            await term.proclaim(proclaimed[-1])
            await asyncio.sleep(rng.uniform(0.05, 0.25))
        deadline = time.monotonic() + ttl + 0.5  # the observer ends on the current state
        while (not seen or seen[-1] != (proclaimed[-1], term.token)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        leader = await election.leader()
        assert leader is not None and leader.data == proclaimed[-1], leader
        assert leader.holder.data == proclaimed[-1]
        info = await locks.status(name, Kind.LEADER)
        assert [h.data for h in info.held_by] == [proclaimed[-1]], info
        assert not term.lost
    finally:
        observer.cancel()
        await drop(candidates)
        await term.release()
    values = [s for s in seen if s is not None]
    assert values and values[-1] == (proclaimed[-1], term.token), seen
    assert all(a != b for a, b in itertools.pairwise(values)), seen  # no repeats
    assert all(v[0] in proclaimed and v[1] == term.token for v in values), seen


async def test_count_follows_timeouts_grants_and_a_late_change(any_locks: aiolock.Locks) -> None:
    """The holder's record follows its process's queue: a change made right after a
    rewrite still lands (the last change is never dropped), a waiter that times out
    leaves the count, and the waiter granted on release carries its own record (its task,
    its data, exactly -- 1024 tricky characters) with the count of those still behind it,
    nothing of the previous holder's. Released, nothing is left."""
    locks = any_locks
    name = fresh()
    first = await hold(locks.lock(name, ttl=10, data="A").acquire())
    waiting = [asyncio.create_task(hold(locks.lock(name, ttl=10, data=DATA).acquire(), TASK))]
    try:
        assert (await settle(locks, name, 1)).waiters == 1
        await asyncio.sleep(0.21)  # a rewrite just happened (or is due now): change again
        waiting += await staggered(lambda: locks.lock(name, ttl=10).acquire(timeout=0.8), 1, 0.01)
        waiting += await staggered(lambda: locks.lock(name, ttl=10, data="D").acquire(), 1, 0)
        info = await settle(locks, name, 3)
        assert info.waiters == 3 and [h.waiting for h in info.held_by] == [3], info
        since = info.held_by[0].since  # the rewrites keep the record's age
        assert info.held_by[0].data == "A" and since is not None and since > 0.2, info
        with pytest.raises(aiolock.LockTimeout):
            await waiting[1]
        info = await settle(locks, name, 2)
        assert info.waiters == 2 and [h.waiting for h in info.held_by] == [2], info
        await first.release()  # the first waiter (data=DATA) is granted, "D" still waits
        second = await waiting[0]
        info = await settle(locks, name, 1)
        assert info.held and info.token == second.token, info
        (holder,) = info.held_by
        assert (holder.task, holder.data, holder.waiting, info.waiters) == (TASK, DATA, 1, 1), holder
        assert second.holder.data == DATA
        await drop(waiting[2:])
        info = await settle(locks, name, 0)
        assert info.waiters == 0 and [(h.data, h.waiting) for h in info.held_by] == [(DATA, 0)]
        await second.release()
        await asyncio.sleep(0.4)
        info = await locks.status(name)
        assert not info.held and info.held_by == () and info.waiters == 0, info
    finally:
        await drop(waiting)
        await first.release()


async def test_tries_and_reentries_are_not_waiters(any_locks: aiolock.Locks, any_url: str) -> None:
    """``acquire(timeout=0)`` tries (of the holder's process and of another connection) and
    a reentrant holder's re-entries never wait, so never count; another task does."""
    if any_url.startswith(("zookeeper", "etcd")):
        pytest.skip("a try's node or key counts for the moment it exists (docs/operations.md)")
    locks = any_locks
    name = fresh()
    lock = locks.lock(name, ttl=10, reentrant=True)
    async with aiolock.connect(any_url) as other:
        first = await lock.acquire()
        again = await lock.acquire()
        end = time.monotonic() + 0.6

        async def tries(conn: aiolock.Locks) -> int:
            n = 0
            while time.monotonic() < end:
                with contextlib.suppress(aiolock.LockTimeout):
                    await hold(conn.lock(name, ttl=10).acquire(timeout=0))
                    raise AssertionError("a try got a held lock")
                n += 1
                await asyncio.sleep(0.005)
            return n

        spam = [asyncio.create_task(tries(c)) for c in (locks, locks, other)]
        seen = set()
        while time.monotonic() < end:
            seen.add((await locks.status(name)).waiters)
            await asyncio.sleep(0.03)
        assert all(n > 5 for n in await asyncio.gather(*spam))
        assert seen == {0}, seen
        assert (await settle(locks, name, 0)).held_by[0].waiting == 0
        waiter = await staggered(lock.acquire, 1)
        assert (await settle(locks, name, 1)).waiters == 1
        await drop(waiter)
        await again.release()
        assert (await settle(locks, name, 0)).held  # still held once
        await first.release()


async def test_churn_never_negative_converges_no_false_loss(churn_locks: aiolock.Locks) -> None:
    """Many waiters of the holder's process churn (timeouts, cancels) for a while on a
    lease with a short ttl (renewed every 0.3 s while its record is rewritten): the
    count is never negative, the lease is never lost, nothing is logged at WARNING, the
    record keeps the holder's data, and once the churn stops the count is the truth
    (2 left waiting)."""
    locks = churn_locks
    name = fresh()
    rng = random.Random(7)
    with capture(logging.INFO) as logs:
        lease = await hold(locks.lock(name, ttl=0.9, data=DATA, on_lost="raise").acquire())
        end = time.monotonic() + 1.5
        errors: list[str] = []

        async def timed() -> None:
            while time.monotonic() < end:
                try:
                    got = await locks.lock(name, ttl=5).acquire(timeout=rng.uniform(0.01, 0.3))
                except aiolock.LockTimeout:
                    continue
                except Exception as exc:
                    errors.append(repr(exc))
                    return
                await got.release()
                errors.append("a waiter got a held lock")

        async def cancelled() -> None:
            while time.monotonic() < end:
                (task,) = await staggered(lambda: locks.lock(name, ttl=5).acquire(), 1, 0)
                await asyncio.sleep(rng.uniform(0, 0.2))
                await drop([task])

        churn = [asyncio.create_task(timed()) for _ in range(6)]
        churn += [asyncio.create_task(cancelled()) for _ in range(3)]
        samples = []
        while time.monotonic() < end:
            samples.append((await locks.status(name)).waiters)
            await asyncio.sleep(0.05)
        await asyncio.gather(*churn)
        left = await staggered(lambda: locks.lock(name, ttl=5).acquire(), 2)
        try:
            info = await settle(locks, name, 2)
            assert info.waiters == 2 and [h.waiting for h in info.held_by] == [2], info
            assert [h.data for h in info.held_by] == [DATA]
        finally:
            await drop(left)
        info = await settle(locks, name, 0)
        assert info.waiters == 0 and not lease.lost
        await lease.release()
    assert not errors, errors
    assert min(samples) >= 0 and max(samples) > 0, samples
    assert not warnings(logs), warnings(logs)


async def test_release_or_expiry_beside_a_pending_rewrite_leaves_nothing(
        rel_locks: aiolock.Locks, rel_url: str) -> None:
    """A holder released (or whose lease expires) while the count of its waiters has just
    changed: the rewrite due then must not bring its record (or the lock) back: another
    connection finds the name free and takes it at once; no false loss, no WARNING but
    the expiry's own."""
    locks = rel_locks
    name = fresh()
    async with aiolock.connect(rel_url) as other:
        with capture(logging.INFO) as logs:
            for i in range(3):
                lease = await hold(locks.lock(name, ttl=5, data=DATA).acquire())
                waiting = await staggered(lambda: locks.lock(name, ttl=5).acquire(), 2, 0)
                await asyncio.sleep(0.12 + 0.04 * i)
                await drop(waiting[:1])  # the count changes: a rewrite is due
                await drop(waiting[1:])
                await lease.release()
                assert not lease.lost
                await asyncio.sleep(0.35)
                info = await other.status(name)
                assert not info.held and info.held_by == () and info.waiters == 0, (i, info)
                taken = await hold(other.lock(name, ttl=5).acquire(timeout=0))
                await taken.release()
            assert not warnings(logs), warnings(logs)
            # a lease that expires (no watchdog) while its waiters' count changes
            lease = await hold(locks.lock(name, ttl=0.8, watchdog=False, data=DATA).acquire())
            timed = await staggered(lambda: locks.lock(name, ttl=5).acquire(timeout=0.6), 2, 0.1)
            await asyncio.gather(*timed, return_exceptions=True)
            await asyncio.sleep(0.6)  # expired; the count went 2 -> 0 around the expiry
            taken = await hold(other.lock(name, ttl=5, data="other").acquire(timeout=0))
            info = await other.status(name)
            assert [h.data for h in info.held_by] == ["other"], info
            await taken.release()
            assert lease.lost
            await lease.release()


# ------------------------------------------------------------------ other processes

CHILD = """
import asyncio, sys
import aiolock

async def main(url, name, n, gap, holds):
    async with aiolock.connect(url) as locks:
        if holds == "hold":
            lease = await locks.lock(name, ttl=10, data="child").acquire()
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(locks.lock(name, ttl=10).acquire()))
            if gap:
                await asyncio.sleep(gap)
        await asyncio.sleep(0.1)
        print("ready", flush=True)
        await asyncio.sleep(120)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]))
"""


async def child(children: list[Child], url: str, name: str, n: int, gap: float,
                holds: bool) -> Child:
    proc = await Child.run("-c", CHILD, url, name, str(n), str(gap), "hold" if holds else "-")
    children.append(proc)
    await proc.expect("ready")
    return proc


async def test_holders_record_read_from_another_process_plus_server_waiters(
        server_locks: aiolock.Locks, server_url: str, children: list[Child]) -> None:
    """A child process holds the name with 2 of its tasks queued behind it; this process
    waits with 2 tasks (one asks the server, the other queues behind it here): waiters
    = 2 (the child's record, with its pid) + 1 (the server's place) = 3."""
    locks = server_locks
    name = fresh()
    proc = await child(children, server_url, name, 2, 0.1, holds=True)
    mine = await staggered(lambda: locks.lock(name, ttl=10).acquire(), 2, 0.1)
    try:
        info = await settle(locks, name, 3)
        assert [(h.pid, h.data, h.waiting) for h in info.held_by] == [
            (proc.proc.pid, "child", 2)], info
        assert info.waiters == 3, info
    finally:
        await drop(mine)
        await proc.kill()


async def test_waiters_of_another_process_starting_together_count_their_places(
        race_locks: aiolock.Locks, race_url: str, children: list[Child]) -> None:
    """Three tasks of a process that start waiting at the same moment (``gather`` /
    ``create_task`` in a loop) may put two claims in the server's queue (the first try
    of the fast path keeps its place; the head of the local queue asks too): ``waiters``
    counts the places the server keeps -- 1 or 2, never the 3 tasks nor 0, and steady
    while they wait (docs/operations.md)."""
    locks = race_locks
    name = fresh()
    lease = await hold(locks.lock(name, ttl=10).acquire())
    proc = await child(children, race_url, name, 3, 0, holds=False)
    try:
        await asyncio.sleep(0.5)
        counts = []
        for _ in range(3):
            counts.append((await locks.status(name)).waiters)
            await asyncio.sleep(0.3)
        assert len(set(counts)) == 1 and counts[0] in (1, 2), counts
    finally:
        await proc.kill()
        await lease.release()


async def test_ls_json_carries_each_holders_waiting(redis_server: RedisServer) -> None:
    """``aiolock ls --json``: ``waiters`` is the record's count plus the server's places;
    each holder has ``waiting``; the data comes back exactly."""
    url = redis_server.url
    name = fresh()
    async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
        lease = await hold(locks.lock(name, ttl=20, data=DATA).acquire())
        mine = await staggered(lambda: locks.lock(name, ttl=20).acquire(), 2)
        theirs = await staggered(lambda: other.lock(name, ttl=20).acquire(), 1)
        try:
            assert (await settle(locks, name, 3)).waiters == 3
            ran = await cli("ls", "--json", "--url", url, name)
        finally:
            await drop(mine + theirs)
            await lease.release()
    assert ran.code == 0, ran.err
    (row,) = [json.loads(line) for line in ran.out.splitlines() if line.strip()]
    assert row["waiters"] == 3, row
    (holder,) = row["holders"]
    assert holder["waiting"] == 2 and holder["data"] == DATA and holder["pid"] == os.getpid()


# ------------------------------------------------------------------ requests (Redis)


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisServer]:
    """A private redis-server: every request it sees is this file's."""
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed")
    server = RedisServer().start()
    yield server
    server.close()


class Monitor:
    """``redis-cli MONITOR`` over a window: the requests clients sent (a script's own
    commands, shown as ``lua``, are not requests)."""

    def __init__(self, server: RedisServer, path: Path) -> None:
        self.server, self.path = server, path
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Monitor:
        self.path.write_text("")
        self.proc = await asyncio.create_subprocess_exec(
            "redis-cli", "-p", str(self.server.port), "monitor",
            stdout=self.path.open("w"), stderr=asyncio.subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while "OK" not in self.path.read_text() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(0.1)
        assert self.proc is not None
        self.proc.terminate()
        await self.proc.wait()

    def lines(self) -> list[str]:
        return [line for line in self.path.read_text().splitlines() if line[:1].isdigit()]

    def requests(self) -> list[str]:
        """The requests, as ``COMMAND`` (upper case), the scripts' own commands left out."""
        out = []
        for line in self.lines():
            if " lua] " in line:
                continue
            m = re.search(r'\] "([^"]+)"', line)
            if m:
                out.append(m.group(1).upper())
        return out

    def script_calls(self, command: str) -> list[str]:
        return [line for line in self.lines() if " lua] " in line and f'"{command}"' in line.lower()]


async def test_holding_and_waiting_cost_no_request_when_nobody_waits(
        own_redis: RedisServer, tmp_path: Path) -> None:
    """Nobody waiting: holding sends nothing (ttl 30: no renewal in the window); a waiter
    of another connection waits without a request, and the holder does not rewrite its
    record for it. Its own waiters queue without asking the server: only the rewrites of
    the count, at most one per 0.2 s while it changes (12 changes in 0.6 s: at most 5)."""
    url = own_redis.url
    name = fresh()
    async with aiolock.connect(url) as locks, aiolock.connect(url) as other:
        lease = await hold(locks.lock(name, ttl=30).acquire())
        await asyncio.sleep(0.3)
        async with Monitor(own_redis, tmp_path / "idle") as idle:
            await asyncio.sleep(0.6)
        assert idle.requests() == [], idle.requests()
        theirs = await staggered(lambda: other.lock(name, ttl=30).acquire(), 1)
        await asyncio.sleep(0.5)
        async with Monitor(own_redis, tmp_path / "remote") as remote:
            await asyncio.sleep(0.6)
        assert remote.requests() == [], remote.requests()
        async with Monitor(own_redis, tmp_path / "local") as local:
            mine = []
            for _ in range(12):
                mine += await staggered(lambda: locks.lock(name, ttl=30).acquire(), 1, 0.05)
            await asyncio.sleep(0.5)
        try:
            requests = local.requests()
            # (the first wait of a connection may open its pub/sub connection and load a
            # script: once; then only the count's rewrites)
            assert set(requests) <= {"EVALSHA", "HELLO", "SUBSCRIBE", "SCRIPT"}, requests
            assert 1 <= requests.count("EVALSHA") <= 5, requests
            assert local.script_calls("rpush") == [], "a local waiter took a server place"
            info = await locks.status(name)
            assert info.waiters == 13 and info.held_by[0].waiting == 12, info
        finally:
            await drop(mine + theirs)
            await lease.release()


async def test_local_waiter_timing_out_takes_no_place(own_redis: RedisServer, tmp_path: Path) -> None:
    """Found: a task waiting with a timeout behind a holder of its own process asked the
    server at its deadline -- the acquire script, which takes a place in the server's
    queue (RPUSH), cut off at once and abandoned -- and for that moment status() counted
    it twice. Now its wait ends at the deadline without a try. (It still tells the server
    to forget it, as a cancelled one does: a release in its process may have named it.)"""
    url = own_redis.url
    name = fresh()
    async with aiolock.connect(url) as locks:
        lease = await hold(locks.lock(name, ttl=30).acquire())
        await asyncio.sleep(0.3)
        async with Monitor(own_redis, tmp_path / "timed") as mon:
            got = await asyncio.gather(*[hold(locks.lock(name, ttl=30).acquire(timeout=0.2))
                                         for _ in range(3)], return_exceptions=True)
            await asyncio.sleep(0.3)
        await lease.release()
    assert all(isinstance(g, aiolock.LockTimeout) for g in got), got
    assert mon.script_calls("rpush") == [], mon.script_calls("rpush")


async def test_count_rewrite_does_not_wake_no_scripting_waiters(
        own_redis: RedisServer, tmp_path: Path) -> None:
    """DEFECT: every rewrite of ``Holder.waiting`` on the Lua path PUBLISHes on the lock's
    channel -- the release message the no-scripting path's waiters sleep on -- so each
    waiter of ``redis://...?scripting=off`` (which shares the lock) wakes and retries its
    transaction (WATCH, GET, HMGET, PTTL, TIME, UNWATCH) once per rewrite although nothing
    was released: 4 waiters added 0.25 s apart behind a Lua holder, 4 WATCHes from one
    no-scripting waiter (idle, it sends none)."""
    url = own_redis.url
    name = fresh()
    async with aiolock.connect(url) as locks, aiolock.connect(url + "?scripting=off") as txn:
        lease = await hold(locks.lock(name, ttl=30).acquire())
        theirs = await staggered(lambda: txn.lock(name, ttl=30).acquire(), 1)
        await asyncio.sleep(0.5)
        mine: list[asyncio.Task[aiolock.Lease]] = []
        async with Monitor(own_redis, tmp_path / "txn") as mon:
            for _ in range(4):
                mine += await staggered(lambda: locks.lock(name, ttl=30).acquire(), 1, 0.25)
            await asyncio.sleep(0.3)
        try:
            assert (await settle(locks, name, 4)).held_by[0].waiting == 4
        finally:
            await drop(mine + theirs)
            await lease.release()
    watches = [r for r in mon.requests() if r == "WATCH"]
    assert watches == [], f"{len(watches)} retries of the waiting transaction: {mon.requests()}"
