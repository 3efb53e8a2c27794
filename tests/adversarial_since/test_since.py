"""Adversarial checks of ``Holder.since`` (SPEC section 7: "seconds it has been held, from
the server's view where the backend has one"; docs/operations.md "A holder's since": on
ZooKeeper and etcd "a claim granted there after a wait of 0.25 s or more writes how long it
waited into its record before ``acquire()`` returns ... and ``since`` leaves it out (a
shorter wait is counted in)").

Written from README, SPEC and docs only. Every bound is taken from the client's clock:
a grant cannot come before the previous holder's ``release()`` was called, nor after the
waiter's ``acquire()`` returned, so a ``since`` read at once (from another connection)
must lie between those two instants' ages, give or take ``SLACK`` (plus the documented
0.25 s for a wait shorter than that).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import aiolock
from aiolock import Capability, Kind

from ..conftest import need
from ..scenarios import params_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(30)]

ROWS = pytest.mark.parametrize(
    "scenario", params_of("zookeeper", "etcd", "postgres", "redis"), indirect=True)
QUEUE_ROWS = pytest.mark.parametrize(
    "scenario", params_of("zookeeper", "etcd"), indirect=True)

#: clock reading / rounding slack (ZooKeeper keeps milliseconds; one machine, one clock)
SLACK = 0.15
#: the documented threshold: a shorter wait may be counted in
SHORT = 0.25
Reader = Callable[[], Awaitable[list[float | None]]]
WORKTREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(sinces: list[float | None], released_at: float, returned_at: float,
           read_start: float, read_end: float, *, waited: float, what: object) -> None:
    """Each since read between ``read_start`` and ``read_end`` of a holder granted between
    ``released_at`` and ``returned_at`` (all monotonic) after a wait of ``waited`` s."""
    assert sinces, what
    extra = SHORT if waited < SHORT + 0.05 else 0.0
    high = read_end - released_at + SLACK + extra
    low = read_start - returned_at - SLACK
    for s in sinces:
        assert s is not None, what
        assert low <= s <= high, (
            f"{what}: since={s:.3f} outside [{low:.3f}, {high:.3f}] "
            f"(waited {waited:.2f} s; all: {sinces})")


async def _timed(read: Reader) -> tuple[list[float | None], float, float]:
    start = time.monotonic()
    got = await read()
    return got, start, time.monotonic()


def _status_reader(judge: aiolock.Locks, name: str, kind: Kind) -> Reader:
    async def read() -> list[float | None]:
        info = await judge.status(name, kind)
        return [h.since for h in info.held_by]
    return read


def _scan_reader(judge: aiolock.Locks, name: str) -> Reader:
    async def read() -> list[float | None]:
        found = [i async for i in judge.scan(name)]
        return [h.since for i in found if i.name == name for h in i.held_by]
    return read


def _cli_reader(url: str, name: str) -> Reader:
    async def read() -> list[float | None]:
        env = dict(os.environ, PYTHONPATH=WORKTREE)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aiolock", "ls", "--url", url, "--json", name,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
        out, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0, err.decode()
        rows = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
        return [h["since"] for r in rows if r["name"] == name for h in r["holders"]]
    return read


async def _queue_then_grant(
    block: Callable[[], Awaitable[list[aiolock.Lease]]],
    waiters: Callable[[], list[Awaitable[aiolock.Lease]]],
    wait: float,
) -> tuple[list[aiolock.Lease], float, float]:
    """Hold with ``block``, start ``waiters`` (each in its own task), let them queue
    ``wait`` s, release the blockers: (granted leases, released_at, returned_at)."""
    blockers = await block()
    tasks = [asyncio.ensure_future(w) for w in waiters()]
    await asyncio.sleep(wait)
    assert not any(t.done() for t in tasks), "a waiter was granted while blocked"
    released_at = time.monotonic()
    for b in blockers:
        await b.release()
    granted = []
    returned = []
    for t in asyncio.as_completed(tasks, timeout=5):
        granted.append(await t)
        returned.append(time.monotonic())
    return granted, released_at, max(returned)


async def _release_all(leases: list[aiolock.Lease]) -> None:
    for lease in leases:
        await lease.release()


# ---------------------------------------------------------------- readers and permits


@ROWS
async def test_queued_readers_since_from_the_grant_status_scan_and_cli(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """Three readers queued 1 s behind a writer of another connection: once granted, each
    reader's since (status, scan, ``aiolock ls --json``) counts from the grant."""
    need(locks, Capability.RWLOCK)
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        async def block() -> list[aiolock.Lease]:
            return [await other.rwlock(name, ttl=3).write().acquire(timeout=5)]

        def waiters() -> list[Awaitable[aiolock.Lease]]:
            return [asyncio.create_task(locks.rwlock(name, ttl=3, data=f"r{i}").read().acquire(timeout=10))
                    for i in range(3)]

        granted, released_at, returned_at = await _queue_then_grant(block, waiters, 1.0)
        try:
            got, a, b = await _timed(_status_reader(judge, name, Kind.READ))
            assert len(got) == 3, got
            _check(got, released_at, returned_at, a, b, waited=1.0, what="status readers")
            own = [lease.holder.since for lease in granted]
            _check(own, released_at, returned_at, a, b, waited=1.0, what="lease.holder")
            if Capability.SCAN in judge.capabilities:
                got, a, b = await _timed(_scan_reader(judge, name))
                _check(got, released_at, returned_at, a, b, waited=1.0, what="scan readers")
                got, a, b = await _timed(_cli_reader(backend_url, name))
                _check(got, released_at, returned_at, a, b, waited=1.0, what="ls --json readers")
        finally:
            await _release_all(granted)


@ROWS
async def test_queued_permits_since_from_the_grant(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """A semaphore of 2 held by another connection; 2 permits queue 1.2 s; once granted,
    both permits' since (status, scan) count from the grant; the held-on permit... none
    left from the first holders."""
    need(locks, Capability.SEMAPHORE)
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        async def block() -> list[aiolock.Lease]:
            return [await other.semaphore(name, 2, ttl=3).acquire(timeout=5) for _ in range(2)]

        def waiters() -> list[Awaitable[aiolock.Lease]]:
            return [asyncio.create_task(locks.semaphore(name, 2, ttl=3, data=f"p{i}").acquire(timeout=10))
                    for i in range(2)]

        granted, released_at, returned_at = await _queue_then_grant(block, waiters, 1.2)
        try:
            got, a, b = await _timed(_status_reader(judge, name, Kind.PERMIT))
            assert len(got) == 2, got
            _check(got, released_at, returned_at, a, b, waited=1.2, what="status permits")
            if Capability.SCAN in judge.capabilities:
                got, a, b = await _timed(_scan_reader(judge, name))
                _check(got, released_at, returned_at, a, b, waited=1.2, what="scan permits")
                got, a, b = await _timed(_cli_reader(backend_url, name))
                _check(got, released_at, returned_at, a, b, waited=1.2, what="ls --json permits")
        finally:
            await _release_all(granted)


@ROWS
async def test_permit_granted_by_one_of_several_releases_staggered(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """Semaphore of 3 held by 3 permits of another connection; 3 waiters queue, then the
    holders release one by one 0.5 s apart: each waiter's since counts from its own grant
    (the later ones queued longer)."""
    need(locks, Capability.SEMAPHORE)
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        held = [await other.semaphore(name, 3, ttl=2).acquire(timeout=5) for _ in range(3)]
        tasks = [asyncio.create_task(locks.semaphore(name, 3, ttl=2, data=f"w{i}").acquire(timeout=10))
                 for i in range(3)]
        await asyncio.sleep(0.6)
        granted: list[aiolock.Lease] = []
        try:
            for step, h in enumerate(held):
                released_at = time.monotonic()
                await h.release()
                done, _ = await asyncio.wait([t for t in tasks if not t.done()], timeout=5,
                                             return_when=asyncio.FIRST_COMPLETED)
                returned_at = time.monotonic()
                assert len(done) == 1, (step, done)
                lease = done.pop().result()
                granted.append(lease)
                a = time.monotonic()
                info = await judge.status(name, Kind.PERMIT)
                b = time.monotonic()
                mine = [x.since for x in info.held_by if x.data == lease.holder.data]
                _check(mine, released_at, returned_at, a, b, waited=0.6 + 0.5 * step,
                       what=f"permit {lease.holder.data} at step {step}: {info.held_by}")
                await asyncio.sleep(0.5)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _release_all(granted)


# ---------------------------------------------------------------- waits around 0.25 s


@ROWS
@pytest.mark.parametrize("wait", [0.15, 0.22, 0.24, 0.26, 0.28, 0.32, 0.4])
async def test_waiter_granted_near_the_quarter_second(
    locks: aiolock.Locks, backend_url: str, name: str, wait: float,
) -> None:
    """A lock waiter granted after ``wait`` s: its since, read at once from another
    connection, is at most the time since the grant plus, for a wait under 0.25 s, that
    wait; from 0.25 s on, the wait is left out."""
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        for _ in range(3):
            async def block() -> list[aiolock.Lease]:
                return [await other.lock(name, ttl=3).acquire(timeout=5)]

            def waiters() -> list[Awaitable[aiolock.Lease]]:
                return [asyncio.create_task(locks.lock(name, ttl=3, data="w").acquire(timeout=10))]

            granted, released_at, returned_at = await _queue_then_grant(block, waiters, wait)
            try:
                got, a, b = await _timed(_status_reader(judge, name, Kind.LOCK))
                _check(got, released_at, returned_at, a, b, waited=wait, what=f"lock after {wait}")
                _check([granted[0].holder.since], released_at, returned_at, a, b, waited=wait,
                       what=f"lease.holder after {wait}")
            finally:
                await _release_all(granted)


# ---------------------------------------------------------------- renewals, re-entry


@ROWS
@pytest.mark.parametrize("queued", [0.0, 1.0])
async def test_since_after_many_renewals(
    locks: aiolock.Locks, backend_url: str, name: str, queued: float,
) -> None:
    """ttl 1 s held 3 s (about nine renewals), after queueing ``queued`` s: since is about
    3 s (renewals rewrite the record: they must keep the wait left out, and not restart
    the count)."""
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        if queued:
            async def block() -> list[aiolock.Lease]:
                return [await other.lock(name, ttl=1).acquire(timeout=5)]

            def waiters() -> list[Awaitable[aiolock.Lease]]:
                return [asyncio.create_task(locks.lock(name, ttl=1, data="w").acquire(timeout=10))]

            granted, released_at, returned_at = await _queue_then_grant(block, waiters, queued)
        else:
            released_at = time.monotonic()
            granted = [await locks.lock(name, ttl=1, data="w").acquire(timeout=5)]
            returned_at = time.monotonic()
        try:
            samples = []
            for _ in range(6):
                await asyncio.sleep(0.5)
                got, a, b = await _timed(_status_reader(judge, name, Kind.LOCK))
                samples.append(got)
                _check(got, released_at, returned_at, a, b, waited=max(queued, 1.0),
                       what=f"after {a - returned_at:.2f} s held (queued {queued}): {samples}")
                _check([granted[0].holder.since], released_at, returned_at, a, b,
                       waited=max(queued, 1.0), what="lease.holder after renewals")
            if Capability.SCAN in judge.capabilities:
                got, a, b = await _timed(_cli_reader(backend_url, name))
                _check(got, released_at, returned_at, a, b, waited=max(queued, 1.0),
                       what="ls --json after renewals")
        finally:
            await _release_all(granted)


@ROWS
async def test_reentered_lease_keeps_its_grant_time(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """A reentrant lock granted after a 1 s wait, re-entered twice over 1.5 s (ttl 1, so
    renewed): since keeps counting from the first grant, for the lease and the judge."""
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        blocker = await other.lock(name, ttl=1).acquire(timeout=5)
        lock = locks.lock(name, ttl=1, reentrant=True, data="re")

        async def holder() -> list[tuple[float, float, float, list[float | None], float | None]]:
            seen = []
            outer = await lock.acquire(timeout=10)
            returned_at = time.monotonic()
            try:
                for _ in range(2):
                    await asyncio.sleep(0.7)
                    inner = await lock.acquire(timeout=5)
                    try:
                        got, a, b = await _timed(_status_reader(judge, name, Kind.LOCK))
                        seen.append((returned_at, a, b, got, inner.holder.since))
                    finally:
                        await inner.release()
                got, a, b = await _timed(_status_reader(judge, name, Kind.LOCK))
                seen.append((returned_at, a, b, got, outer.holder.since))
            finally:
                await outer.release()
            return seen

        task = asyncio.create_task(holder())
        await asyncio.sleep(1.0)
        released_at = time.monotonic()
        await blocker.release()
        for returned_at, a, b, got, own in await asyncio.wait_for(task, 10):
            _check(got, released_at, returned_at, a, b, waited=1.0, what="judge, re-entered")
            _check([own], released_at, returned_at, a, b, waited=1.0, what="lease.holder, re-entered")


# ---------------------------------------------------------------- elections


@ROWS
async def test_leadership_won_after_a_long_campaign(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """A candidate campaigns 3 s behind a renewed leader (ttl 1): once it leads, since in
    leader(), observe(), status(LEADER), scan and ``ls --json`` count from the win."""
    need(locks, Capability.ELECTION)
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        async def block() -> list[aiolock.Lease]:
            return [await other.election(name, ttl=1).campaign(data="old").acquire(timeout=5)]

        def waiters() -> list[Awaitable[aiolock.Lease]]:
            return [asyncio.create_task(locks.election(name, ttl=1).campaign(data="new").acquire(timeout=10))]

        granted, released_at, returned_at = await _queue_then_grant(block, waiters, 3.0)
        try:
            async def via_leader() -> list[float | None]:
                leader = await judge.election(name, ttl=1).leader()
                assert leader is not None and leader.data == "new", leader
                return [leader.holder.since]

            async def via_observe() -> list[float | None]:
                async for leader in judge.election(name, ttl=1).observe():
                    assert leader is not None and leader.data == "new", leader
                    return [leader.holder.since]
                raise AssertionError("observe() ended")

            for what, read in (("leader()", via_leader), ("observe()", via_observe),
                               ("status", _status_reader(judge, name, Kind.LEADER))):
                got, a, b = await _timed(read)
                _check(got, released_at, returned_at, a, b, waited=3.0, what=what)
            if Capability.SCAN in judge.capabilities:
                got, a, b = await _timed(_scan_reader(judge, name))
                _check(got, released_at, returned_at, a, b, waited=3.0, what="scan leader")
                got, a, b = await _timed(_cli_reader(backend_url, name))
                _check(got, released_at, returned_at, a, b, waited=3.0, what="ls --json leader")
        finally:
            await _release_all(granted)


@ROWS
async def test_proclaim_after_a_wait_keeps_since_from_the_win(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """A leader that campaigned 1.5 s proclaims new data at once, then again after 1.2 s
    of renewals (ttl 1): each rewrite of its record must keep since from the win."""
    need(locks, Capability.ELECTION)
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        async def block() -> list[aiolock.Lease]:
            return [await other.election(name, ttl=1).campaign(data="old").acquire(timeout=5)]

        def waiters() -> list[Awaitable[aiolock.Lease]]:
            return [asyncio.create_task(locks.election(name, ttl=1).campaign(data="new").acquire(timeout=10))]

        granted, released_at, returned_at = await _queue_then_grant(block, waiters, 1.5)
        term: Any = granted[0]
        election = judge.election(name, ttl=1)
        try:
            for i, pause in enumerate((0.0, 1.2, 0.3)):
                await asyncio.sleep(pause)
                await term.proclaim(f"v{i}")
                a = time.monotonic()
                leader = await election.leader()
                info = await judge.status(name, Kind.LEADER)
                b = time.monotonic()
                assert leader is not None and leader.data == f"v{i}", leader
                _check([leader.holder.since], released_at, returned_at, a, b, waited=1.5,
                       what=f"leader() after proclaim v{i}")
                _check([h.since for h in info.held_by], released_at, returned_at, a, b,
                       waited=1.5, what=f"status after proclaim v{i}")
                _check([term.holder.since], released_at, returned_at, a, b, waited=1.5,
                       what=f"term.holder after proclaim v{i}")
        finally:
            await _release_all(granted)


@ROWS
async def test_observer_sees_since_from_the_win_as_leadership_changes(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """An observer running throughout: the value it yields for a leader that waited 1 s
    carries a since counted from that leader's win."""
    need(locks, Capability.ELECTION)
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        seen: list[tuple[float, Any]] = []

        async def watch() -> None:
            async for leader in judge.election(name, ttl=1).observe():
                seen.append((time.monotonic(), leader))

        watcher = asyncio.create_task(watch())
        try:
            first = await other.election(name, ttl=1).campaign(data="a").acquire(timeout=5)
            waiting = asyncio.create_task(locks.election(name, ttl=1).campaign(data="b").acquire(timeout=10))
            await asyncio.sleep(1.0)
            released_at = time.monotonic()
            await first.release()
            second = await asyncio.wait_for(waiting, 5)
            returned_at = time.monotonic()
            try:
                deadline = time.monotonic() + 2
                while not any(v is not None and v.data == "b" for _, v in seen):
                    assert time.monotonic() < deadline, seen
                    await asyncio.sleep(0.02)
                at, value = next((t, v) for t, v in seen if v is not None and v.data == "b")
                # the value was read before it was yielded (at): it is no older than that
                _check([value.holder.since], released_at, returned_at, released_at, at,
                       waited=1.0, what=f"observe() value for b: {seen}")
            finally:
                await second.release()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


# ---------------------------------------------------------------- cancellation at the grant


@ROWS
@pytest.mark.parametrize("kind", ["lock", "read", "permit", "leader"])
async def test_acquire_cancelled_around_the_grant_leaves_nothing_held(
    locks: aiolock.Locks, backend_url: str, name: str, kind: str,
) -> None:
    """A claim queued 0.3-0.5 s (so a granted one rewrites its record) is cancelled at a
    random moment 0-40 ms around the release that grants it: whatever step the cancel
    lands on, nothing stays held (a judge connection takes the name at once), and a claim
    the acquire did return has a since from its grant."""
    need(locks, Capability.HOLDERS)
    if kind == "read":
        need(locks, Capability.RWLOCK)
    if kind == "permit":
        need(locks, Capability.SEMAPHORE)
    if kind == "leader":
        need(locks, Capability.ELECTION)
    rng = random.Random()

    def make(c: aiolock.Locks, data: str) -> Any:
        if kind == "lock":
            return c.lock(name, ttl=3, data=data)
        if kind == "read":
            return c.rwlock(name, ttl=3, data=data).read()
        if kind == "permit":
            return c.semaphore(name, 1, ttl=3, data=data)
        return c.election(name, ttl=3).campaign(data=data)

    def block(c: aiolock.Locks) -> Any:
        if kind == "read":
            return c.rwlock(name, ttl=3).write()
        return make(c, "blocker")

    def judge_of(c: aiolock.Locks) -> Any:
        if kind == "read":
            return c.rwlock(name, ttl=3).write()  # a writer: no reader may be left
        return make(c, "judge")

    started = time.monotonic()
    cancelled_then_got = 0
    rounds = 0
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        while time.monotonic() - started < 9 and rounds < 12:
            rounds += 1
            blocker = await block(other).acquire(timeout=5)
            task = asyncio.create_task(make(locks, "w").acquire(timeout=10))
            await asyncio.sleep(rng.uniform(0.3, 0.5))
            offset = rng.uniform(-0.005, 0.04)
            if offset < 0:
                task.cancel()
                await asyncio.sleep(-offset)
                released_at = time.monotonic()
                await blocker.release()
            else:
                released_at = time.monotonic()
                rel = asyncio.create_task(blocker.release())
                await asyncio.sleep(offset)
                task.cancel()
                await rel
            try:
                lease = await task
            except asyncio.CancelledError:
                lease = None
            if lease is not None:
                cancelled_then_got += 1
                a = time.monotonic()
                info = await judge.status(name, {"lock": Kind.LOCK, "read": Kind.READ,
                                                  "permit": Kind.PERMIT, "leader": Kind.LEADER}[kind])
                b = time.monotonic()
                _check([h.since for h in info.held_by], released_at, a, a, b, waited=0.3,
                       what=f"round {rounds}: acquire returned despite cancel")
                await lease.release()
            t0 = time.monotonic()
            try:
                taken = await judge_of(judge).acquire(timeout=2)
            except aiolock.LockTimeout as exc:
                info = await judge.status(name)
                raise AssertionError(
                    f"round {rounds} (offset {offset * 1000:.1f} ms): name still held "
                    f"after the cancelled acquire: {info}") from exc
            took = time.monotonic() - t0
            await taken.release()
            assert took < 1.0, f"round {rounds}: judge waited {took:.2f} s (offset {offset:.3f})"
    assert rounds >= 5


@ROWS
async def test_proclaim_after_a_wait_then_renewals(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """A leader that campaigned 1.5 s proclaims once, then is renewed 1.2 s (ttl 1): the
    since read then (leader(), status, the term's own record) counts from the win."""
    need(locks, Capability.ELECTION)
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other, aiolock.connect(backend_url) as judge:
        async def block() -> list[aiolock.Lease]:
            return [await other.election(name, ttl=1).campaign(data="old").acquire(timeout=5)]

        def waiters() -> list[Awaitable[aiolock.Lease]]:
            return [asyncio.create_task(locks.election(name, ttl=1).campaign(data="new").acquire(timeout=10))]

        granted, released_at, returned_at = await _queue_then_grant(block, waiters, 1.5)
        term: Any = granted[0]
        try:
            await term.proclaim("v")
            await asyncio.sleep(1.2)
            a = time.monotonic()
            leader = await judge.election(name, ttl=1).leader()
            info = await judge.status(name, Kind.LEADER)
            b = time.monotonic()
            assert leader is not None and leader.data == "v", leader
            every = (f"leader()={leader.holder.since}, status={[h.since for h in info.held_by]}, "
                     f"term.holder={term.holder.since}, held {a - returned_at:.2f} s")
            _check([leader.holder.since], released_at, returned_at, a, b, waited=1.5,
                   what=f"leader() 1.2 s after proclaim ({every})")
            _check([h.since for h in info.held_by], released_at, returned_at, a, b,
                   waited=1.5, what="status 1.2 s after proclaim")
            _check([term.holder.since], released_at, returned_at, a, b, waited=1.5,
                   what="term.holder 1.2 s after proclaim")
        finally:
            await _release_all(granted)
