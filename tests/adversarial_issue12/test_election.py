"""Leader election (SPEC §8) in one process, on every backend declaring ELECTION."""

from __future__ import annotations

import asyncio
import random
import time
from itertools import pairwise

import pytest

import aiolock

TTL = 1.5
SLACK = 1.0


async def test_one_leader_terms_increase_under_churn(elocks: aiolock.Locks, name: str) -> None:
    """SPEC §8: "At most one leader at a time"; "term.token ... strictly increasing per
    election name". 6 candidates resign and campaign again; a candidate's belief (from its
    grant to its resignation) never overlaps another's, and terms strictly increase."""
    election = elocks.election(name, ttl=TTL)
    leading: list[int] = []
    terms: list[int] = []
    overlaps = 0
    stop = time.monotonic() + 1.5

    async def candidate(i: int) -> None:
        nonlocal overlaps
        while time.monotonic() < stop:
            async with election.campaign(data=f"c{i}") as term:
                if leading:
                    overlaps += 1
                leading.append(i)
                terms.append(term.token)
                await asyncio.sleep(random.random() * 0.005)
                leading.remove(i)

    await asyncio.wait_for(asyncio.gather(*(candidate(i) for i in range(6))), 30)
    assert overlaps == 0
    assert len(terms) > 3 and all(b > a for a, b in pairwise(terms)), terms
    assert await election.leader() is None


@pytest.mark.parametrize("steps", [0, 2, 5])
async def test_cancelled_campaign_leaves_no_phantom_leader(elocks: aiolock.Locks, name: str,
                                                           steps: int) -> None:
    """SPEC §2 cancellation safety, §8 "Resigning is releasing": a campaign cancelled at
    any point leaves nobody leading (leader() None), and the next campaign leads at once;
    also while another candidate leads and then resigns."""
    election = elocks.election(name, ttl=TTL)
    task = asyncio.create_task(election.campaign(data="x").acquire())
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    try:
        term = await task
        await term.release()
    except asyncio.CancelledError:
        pass
    assert await election.leader() is None
    term = await asyncio.create_task(election.campaign(data="y").acquire(timeout=0))
    # a candidate queued behind a leader, cancelled at some point, then the leader resigns
    waiting = asyncio.create_task(election.campaign(data="z").acquire())
    for _ in range(steps + 3):
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)
    waiting.cancel()
    try:
        other = await waiting
        await other.release()
    except asyncio.CancelledError:
        pass
    await term.release()
    leader = await election.leader()
    assert leader is None, f"phantom leader after the cancel: {leader}"
    again = await asyncio.create_task(election.campaign(data="w").acquire(timeout=1.0))
    await again.release()


async def test_proclaim_after_revocation_raises(elocks: aiolock.Locks, name: str) -> None:
    """SPEC §8 / Leadership.proclaim: "Raises LockLost if it was lost meanwhile"; a revoked
    leader's proclaim must not show its data as the leader's."""
    if aiolock.Capability.REVOKE not in elocks.capabilities:
        pytest.skip("no REVOKE")
    election = elocks.election(name, ttl=TTL, on_lost="raise")
    term = await election.campaign(data="old").acquire()
    assert await election.campaign().force_release() is True
    await asyncio.wait_for(term.wait_lost(), TTL / 3 + SLACK)
    with pytest.raises(aiolock.LockLost):
        await term.proclaim("stale")
    leader = await election.leader()
    assert leader is None or leader.data != "stale", leader
    new = await asyncio.create_task(election.campaign(data="new").acquire(timeout=2))
    try:
        assert new.token > term.token
        with pytest.raises(aiolock.LockLost):
            await term.proclaim("stale")
        leader = await election.leader()
        assert leader is not None and (leader.data, leader.token) == ("new", new.token)
    finally:
        await new.release()
        await term.release()


async def test_observe_ends_on_current_leader(elocks: aiolock.Locks, name: str) -> None:
    """SPEC §8: "observe() may skip intermediate states under churn but never ends on a
    stale one: after changes stop, its last value is the current leader (or None) within
    one ttl"."""
    election = elocks.election(name, ttl=TTL)
    seen: list[aiolock.Leader | None] = []

    async def watch() -> None:
        async for leader in election.observe():
            seen.append(leader)

    watcher = asyncio.create_task(watch())
    try:
        for i in range(15):
            async with election.campaign(data=f"d{i}") as term:
                await term.proclaim(f"p{i}")
        final = await election.campaign(data="final").acquire()
        await final.proclaim("final-2")
        await asyncio.sleep(TTL)
        assert seen and seen[-1] is not None, seen[-3:]
        assert (seen[-1].data, seen[-1].token) == ("final-2", final.token), seen[-3:]
        await final.release()
        await asyncio.sleep(TTL)
        assert seen[-1] is None, seen[-3:]
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


async def test_decorated_campaign_and_lock_reentered(elocks: aiolock.Locks, name: str) -> None:
    """README: "locks and campaigns decorate async functions"; SPEC §2: with
    reentrant=False a task acquiring what it already holds gets LockError at once (no
    deadlock). Concurrent calls from other tasks are serialised."""
    lock = elocks.lock(name, ttl=TTL)
    inside = 0
    most = 0

    @lock
    async def job(depth: int) -> None:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        try:
            await asyncio.sleep(0.01)
            if depth:
                await job(depth - 1)
        finally:
            inside -= 1

    with pytest.raises(aiolock.LockError):
        await asyncio.wait_for(job(1), 5)
    await asyncio.wait_for(asyncio.gather(*(job(0) for _ in range(5))), 10)
    assert most == 1
    assert not await lock.locked()

    campaign = elocks.election(name + "e", ttl=TTL).campaign(data="dec")

    @campaign
    async def lead(depth: int) -> int:
        if depth:
            return await lead(depth - 1)
        return 1

    with pytest.raises(aiolock.LockError):
        await asyncio.wait_for(lead(1), 5)
    assert await asyncio.wait_for(lead(0), 5) == 1
    assert await elocks.election(name + "e").leader() is None


async def test_proclaim_data_limits_and_round_trip(elocks: aiolock.Locks, name: str) -> None:
    """Leadership.proclaim(data): the leader's data, "<= 1024 chars" as for campaign():
    any such string round-trips through leader(); a longer one is refused with ValueError
    and changes nothing."""
    election = elocks.election(name, ttl=TTL)
    async with election.campaign(data="start") as term:
        for data in ("\U0001F512" * 1024, "a\nb\x1b[0m" * 100, ""):
            await term.proclaim(data)
            leader = await election.leader()
            assert leader is not None and leader.data == data and leader.token == term.token
        await term.proclaim("kept")
        with pytest.raises(ValueError):
            await term.proclaim("x" * 1025)
        leader = await election.leader()
        assert leader is not None and leader.data == "kept"
        info = await elocks.status(name, aiolock.Kind.LEADER)
        assert info.held and [h.data for h in info.held_by] == ["kept"], info
