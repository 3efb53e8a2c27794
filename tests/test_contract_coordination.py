"""The coordination contract (SPEC §7 holders, listing, revocation; §8 elections), run on
every backend through the ``locks`` fixture; a backend that does not declare a capability
skips the tests that need it (``need``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

import pytest

import aiolock
from aiolock import Capability, Kind

from .conftest import need


async def test_holder_record_is_kept_beside_the_claim(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.HOLDERS)
    lock = locks.lock(name, ttl=5, data="request 7f3a")

    async def holder_task() -> tuple[aiolock.Holder, aiolock.LockInfo]:
        async with lock as lease:
            return lease.holder, await locks.status(name)

    mine, info = await asyncio.create_task(holder_task(), name="charger-1")
    assert (mine.host, mine.pid, mine.task, mine.data) == (
        socket.gethostname(), os.getpid(), "charger-1", "request 7f3a")
    assert info.held and info.held_by and len(info.held_by) == 1
    seen = info.held_by[0]
    assert (seen.host, seen.pid, seen.task, seen.data) == (mine.host, mine.pid, "charger-1",
                                                           "request 7f3a")
    assert seen.since is not None and 0 <= seen.since < 5
    assert (await locks.status(name)).held_by == ()


async def test_every_reader_and_permit_is_listed(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.HOLDERS)
    if Capability.RWLOCK in locks.capabilities:
        readers = [await asyncio.create_task(locks.rwlock(name, ttl=5, data=d).read().acquire())
                   for d in ("r1", "r2")]  # two tasks: one task may not read twice
        info = await locks.status(name, Kind.READ)
        assert sorted(h.data for h in info.held_by) == ["r1", "r2"]
        for r in readers:
            await r.release()
    if Capability.SEMAPHORE in locks.capabilities:
        permits = [await locks.semaphore(name, 3, ttl=5, data=f"p{i}").acquire() for i in range(3)]
        info = await locks.status(name, Kind.PERMIT)
        assert sorted(h.data for h in info.held_by) == ["p0", "p1", "p2"]
        for p in permits:
            await p.release()


async def test_since_is_the_current_holders_after_a_hand_over(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """A lock handed from a holder that was renewed to a waiter: the new holder's
    ``since`` counts from its own grant, not the previous holder's."""
    need(locks, Capability.HOLDERS)
    async with aiolock.connect(backend_url) as other:
        first = await locks.lock(name, ttl=0.6).acquire()
        waiting = asyncio.create_task(other.lock(name, ttl=5, data="next").acquire())
        await asyncio.sleep(0.45)  # past the first renewal (ttl/3)
        await first.release()
        second = await asyncio.wait_for(waiting, 5)
        info = await locks.status(name)
        (holder,) = info.held_by
        await second.release()
        assert holder.data == "next" and holder.since is not None, info
        assert holder.since < 0.35, info


async def test_since_counts_from_the_grant_after_a_long_wait_for_every_kind(
    locks: aiolock.Locks, backend_url: str, name: str,
) -> None:
    """A lock, a write lock, a permit and a leadership each granted after its claim
    waited 0.8 s behind another connection's: ``since`` (read at once, from the first
    connection) counts from the grant, not from when it queued (ZooKeeper and etcd keep
    only the time the waiting claim's node or key was made)."""
    need(locks, Capability.HOLDERS)
    takes: dict[str, tuple[Kind, object]] = {
        "lock": (Kind.LOCK, lambda c: c.lock(name, ttl=5)),
    }
    if Capability.RWLOCK in locks.capabilities:
        takes["write"] = (Kind.WRITE, lambda c: c.rwlock(name, ttl=5).write())
    if Capability.SEMAPHORE in locks.capabilities:
        takes["permit"] = (Kind.PERMIT, lambda c: c.semaphore(name, 1, ttl=5))
    if Capability.ELECTION in locks.capabilities:
        takes["leader"] = (Kind.LEADER, lambda c: c.election(name, ttl=5).campaign())
    async with aiolock.connect(backend_url) as other:
        for what, (kind, make) in takes.items():
            first = await make(locks).acquire(timeout=5)  # type: ignore[operator]
            waiting = asyncio.create_task(make(other).acquire(timeout=10))  # type: ignore[operator]
            await asyncio.sleep(0.8)
            assert not waiting.done(), what
            await first.release()
            second = await asyncio.wait_for(waiting, 5)
            try:
                info = await locks.status(name, kind)
                sinces = [h.since for h in info.held_by]
                assert sinces and all(s is not None and s < 0.5 for s in sinces), (what, info)
            finally:
                await second.release()


async def _waiters_become(locks: aiolock.Locks, name: str, count: int) -> aiolock.LockInfo:
    deadline = time.monotonic() + 3.0
    while True:
        info = await locks.status(name)
        if info.waiters == count or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.05)


async def test_tasks_queued_behind_a_holder_of_their_process_are_counted(
    locks: aiolock.Locks, name: str,
) -> None:
    """Tasks waiting behind a holder of their own process never reach the server (a
    release here wakes them): status() counts them through the holder's record."""
    need(locks, Capability.HOLDERS)
    async with locks.lock(name, ttl=10, data="d") as lease:
        waiting = [asyncio.create_task(locks.lock(name, ttl=10).acquire()) for _ in range(3)]
        info = await _waiters_become(locks, name, 3)
        # the head may have asked the server by now (woken by the record's write), and
        # counts there if the server keeps waiters' places
        assert info.waiters == 3 and info.held_by[0].waiting >= 2, info
        assert info.held_by[0].data == "d" and lease.holder.data == "d"
        if Capability.SCAN in locks.capabilities:
            (listed,) = [i async for i in locks.scan(name)]
            assert listed.waiters == 3, listed
        waiting.pop().cancel()
        assert (await _waiters_become(locks, name, 2)).waiters == 2
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        info = await _waiters_become(locks, name, 0)
        assert info.waiters == 0 and info.held and info.held_by[0].waiting == 0, info


@pytest.mark.parametrize("data", ["x" * 1025, 7, b"bytes", "\ud800"])
async def test_bad_holder_data_is_a_value_error(locks: aiolock.Locks, data: object) -> None:
    with pytest.raises(ValueError, match="data must be"):
        locks.lock("d", data=data)  # type: ignore[arg-type]


async def test_scan_lists_held_names_of_every_kind(locks: aiolock.Locks, name: str) -> None:
    if Capability.SCAN not in locks.capabilities:
        with pytest.raises(ValueError, match="scan"):
            [i async for i in locks.scan(name)]
        pytest.skip(f"{locks.url} does not offer scan")
    held = [await locks.lock(f"{name}:a", ttl=5, data="A").acquire()]
    if Capability.RWLOCK in locks.capabilities:
        held.append(await locks.rwlock(f"{name}:b", ttl=5).read().acquire())
    if Capability.SEMAPHORE in locks.capabilities:
        held.append(await locks.semaphore(f"{name}:c", 2, ttl=5).acquire())
    free = await locks.lock(f"{name}:free", ttl=5).acquire()
    await free.release()
    found = {info.name: info async for info in locks.scan(f"{name}:")}
    assert set(found) == {lease.name for lease in held}
    assert found[f"{name}:a"].family == "lock" and found[f"{name}:a"].held_by[0].data == "A"
    assert all(info.held for info in found.values())
    assert [i async for i in locks.scan(f"{name}:zzz")] == []
    for lease in held:
        await lease.release()
    assert [i async for i in locks.scan(f"{name}:")] == []


async def test_force_release_revokes_and_cancels_the_body(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.REVOKE)
    lock = locks.lock(name, ttl=1.5)
    entered = asyncio.Event()
    cancelled_at: list[float] = []

    async def body() -> None:
        async with lock:
            entered.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled_at.append(time.monotonic())
                raise

    task = asyncio.create_task(body())
    await entered.wait()
    token = (await locks.status(name)).token
    revoked_at = time.monotonic()
    assert await locks.lock(name).force_release() is True
    with pytest.raises(aiolock.LockLost, match="revoked"):
        await asyncio.wait_for(task, 5)
    assert cancelled_at and cancelled_at[0] - revoked_at < 1.5 / 3 + 0.5
    async with locks.lock(name, ttl=2) as lease:  # tokens keep increasing
        assert token is not None and lease.token > token
    assert await locks.lock(name).force_release() is False


async def test_lock_and_campaign_as_decorators(locks: aiolock.Locks, name: str) -> None:
    inside = 0
    peak = 0

    @locks.lock(name, ttl=5)
    async def job(x: int) -> int:
        nonlocal inside, peak
        inside += 1
        peak = max(peak, inside)
        await asyncio.sleep(0.01)
        inside -= 1
        return x * 2

    assert await asyncio.gather(*(job(i) for i in range(5))) == [0, 2, 4, 6, 8]
    assert peak == 1
    with pytest.raises(ValueError, match="async"):
        locks.lock(name)(lambda: None)  # type: ignore[arg-type,return-value]
    if Capability.ELECTION in locks.capabilities:
        election = locks.election(name, ttl=5)

        @election.campaign(data="deco")
        async def lead() -> str | None:
            leader = await election.leader()
            return None if leader is None else leader.data

        assert await lead() == "deco"


async def test_election_campaign_leader_proclaim_resign(locks: aiolock.Locks, name: str) -> None:
    if Capability.ELECTION not in locks.capabilities:
        with pytest.raises(ValueError, match="election"):
            locks.election(name)
        pytest.skip(f"{locks.url} does not offer elections")
    election = locks.election(name, ttl=3)
    assert await election.leader() is None
    async with election.campaign(data="host-a:8080") as term:
        leader = await election.leader()
        assert leader is not None and (leader.data, leader.token) == ("host-a:8080", term.token)
        assert leader.holder.pid == os.getpid()
        other = asyncio.create_task(election.campaign(data="host-b").acquire())
        await asyncio.sleep(0.2)
        assert not other.done()  # at most one leader
        await term.proclaim("host-a:9090")
        leader = await election.leader()
        assert leader is not None and leader.data == "host-a:9090" and leader.token == term.token
    second = await asyncio.wait_for(other, 5)  # resigning hands over
    assert isinstance(second, aiolock.Leadership) and second.token > term.token
    leader = await election.leader()
    assert leader is not None and leader.data == "host-b"
    await second.release()
    assert await election.leader() is None
    with pytest.raises(aiolock.LockError):
        await second.proclaim("late")


async def test_observe_sees_every_settled_state(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.ELECTION)
    election = locks.election(name, ttl=3)
    seen: list[str | None] = []
    changed = asyncio.Event()

    async def watch() -> None:
        async for leader in election.observe():
            seen.append(None if leader is None else leader.data)
            changed.set()

    async def settled(value: str | None) -> None:
        deadline = time.monotonic() + 3  # within one ttl
        while not (seen and seen[-1] == value):
            changed.clear()
            left = deadline - time.monotonic()
            assert left > 0, f"observe() ended on {seen[-1:]} instead of {value!r}: {seen}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    watcher = asyncio.create_task(watch())
    try:
        await settled(None)
        term = await election.campaign(data="one").acquire()
        await settled("one")
        await term.proclaim("one-b")
        await settled("one-b")
        await term.release()
        await settled(None)
        async with election.campaign(data="two"):
            await settled("two")
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def test_revoked_leader_loses_its_term(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.ELECTION)
    need(locks, Capability.REVOKE)
    election = locks.election(name, ttl=1.5)
    with pytest.raises(aiolock.LockLost):
        async with election.campaign(data="doomed") as term:
            assert await election.campaign().force_release()
            await asyncio.sleep(5)
    async with election.campaign(data="next") as nxt:
        assert nxt.token > term.token
