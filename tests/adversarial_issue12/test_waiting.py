"""Waiting (SPEC §2, README "Waiting"): a waiter may wait longer than its own ttl; the
lease it is then granted is a fresh lease of ``ttl`` seconds ("the server-side lease is
``ttl`` seconds and is renewed every ``ttl/3``"), not one already lost at its grant."""

from __future__ import annotations

import asyncio

import aiolock

TTL = 1.0


async def test_lease_granted_after_a_wait_longer_than_ttl_is_live(hlocks: aiolock.Locks,
                                                                  name: str) -> None:
    holder = await hlocks.lock(name, ttl=TTL).acquire()
    waiter = asyncio.create_task(hlocks.lock(name, ttl=TTL).acquire(timeout=10))
    await asyncio.sleep(TTL * 1.6)          # the holder renews; the waiter waits > ttl
    await holder.release()
    lease = await waiter
    try:
        assert not lease.lost, "granted a lease already lost"
        await asyncio.sleep(TTL)             # and the watchdog keeps it
        assert not lease.lost, "the lease granted after a long wait was lost"
    finally:
        await lease.release()


async def test_campaign_granted_after_a_wait_longer_than_ttl_is_live(elocks: aiolock.Locks,
                                                                     name: str) -> None:
    election = elocks.election(name, ttl=TTL)
    first = await election.campaign(data="a").acquire()
    waiter = asyncio.create_task(election.campaign(data="b").acquire(timeout=10))
    await asyncio.sleep(TTL * 1.6)
    await first.release()
    term = await waiter
    try:
        assert not term.lost, "granted a term already lost"
        await asyncio.sleep(TTL)
        assert not term.lost, "the term granted after a long wait was lost"
        leader = await election.leader()
        assert leader is not None and leader.token == term.token
    finally:
        await term.release()


async def test_permit_and_write_granted_after_a_long_wait_are_live(hlocks: aiolock.Locks,
                                                                   name: str) -> None:
    """The same for a semaphore permit and a write lock (SPEC §3: "give out leases with
    fencing tokens and watchdog renewal")."""
    from aiolock import Capability
    makers = []
    if Capability.SEMAPHORE in hlocks.capabilities:
        makers.append(lambda: hlocks.semaphore(name + "s", limit=1, ttl=TTL))
    if Capability.RWLOCK in hlocks.capabilities:
        makers.append(lambda: hlocks.rwlock(name + "w", ttl=TTL).write())
    for make in makers:
        first = await asyncio.create_task(make().acquire())
        waiter = asyncio.create_task(make().acquire(timeout=10))
        await asyncio.sleep(TTL * 1.6)
        await first.release()
        lease = await waiter
        try:
            assert not lease.lost, "granted a lease already lost"
            await asyncio.sleep(TTL)
            assert not lease.lost
        finally:
            await lease.release()
