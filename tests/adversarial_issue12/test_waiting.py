"""Waiting (SPEC §2, README "Waiting"): a waiter may wait longer than its own ttl; the
lease it is then granted is a fresh lease of ``ttl`` seconds ("the server-side lease is
``ttl`` seconds and is renewed every ``ttl/3``"), not one already lost at its grant."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiolock

TTL = 1.0


async def granted_after_a_long_wait(make: Callable[[], Any], check: Callable[[Any], Any] | None = None,
                                    ) -> None:
    """A holder of ``make()`` renews while a second ``make()`` waits longer than its ttl;
    the lease the waiter then gets is live, and the watchdog keeps it (``check(lease)``:
    more to assert while it is held)."""
    first = await asyncio.create_task(make().acquire())
    waiter = asyncio.create_task(make().acquire(timeout=10))
    await asyncio.sleep(TTL * 1.6)          # the holder renews; the waiter waits > ttl
    await first.release()
    lease = await waiter
    try:
        assert not lease.lost, "granted a lease already lost"
        await asyncio.sleep(TTL)             # and the watchdog keeps it
        assert not lease.lost, "the lease granted after a long wait was lost"
        if check is not None:
            await check(lease)
    finally:
        await lease.release()


async def test_lease_granted_after_a_wait_longer_than_ttl_is_live(hlocks: aiolock.Locks,
                                                                  name: str) -> None:
    await granted_after_a_long_wait(lambda: hlocks.lock(name, ttl=TTL))


async def test_campaign_granted_after_a_wait_longer_than_ttl_is_live(elocks: aiolock.Locks,
                                                                     name: str) -> None:
    election = elocks.election(name, ttl=TTL)

    async def leads(term: Any) -> None:
        leader = await election.leader()
        assert leader is not None and leader.token == term.token

    await granted_after_a_long_wait(lambda: election.campaign(data="x"), leads)


async def test_permit_and_write_granted_after_a_long_wait_are_live(hlocks: aiolock.Locks,
                                                                   name: str) -> None:
    """The same for a semaphore permit and a write lock (SPEC §3: "give out leases with
    fencing tokens and watchdog renewal")."""
    from aiolock import Capability
    if Capability.SEMAPHORE in hlocks.capabilities:
        await granted_after_a_long_wait(lambda: hlocks.semaphore(name + "s", limit=1, ttl=TTL))
    if Capability.RWLOCK in hlocks.capabilities:
        await granted_after_a_long_wait(lambda: hlocks.rwlock(name + "w", ttl=TTL).write())
