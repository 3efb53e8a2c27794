"""Revocation (SPEC §7): "``force_release()`` is for operators: the revoked holder learns it
at its next renewal (within ``ttl/3``) and its lease is ``lost`` (body cancelled as usual);
fencing still rejects its writes. Tokens keep increasing across a revocation." Also
§2: "every successful acquisition returns a token strictly greater than that of every
earlier acquisition of the same name"."""

from __future__ import annotations

import asyncio
import random
import time
from itertools import pairwise

import pytest

import aiolock
from aiolock import Capability

TTL = 1.5
SLACK = 1.0    # the renewal after ttl/3, one round trip, a loaded machine


async def test_revoked_body_cancelled_then_token_increases(rlocks: aiolock.Locks, name: str) -> None:
    lock = rlocks.lock(name, ttl=TTL)
    cancelled = False
    t0 = 0.0
    with pytest.raises(aiolock.LockLost):
        async with lock as lease:
            old = lease.token
            assert await rlocks.lock(name).force_release() is True
            t0 = time.monotonic()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled = True
                raise
    took = time.monotonic() - t0
    assert cancelled and lease.lost
    assert took < TTL / 3 + SLACK, f"revocation learnt after {took:.2f} s"
    async with rlocks.lock(name, ttl=TTL, timeout=5) as again:
        assert again.token > old
    assert await rlocks.lock(name).force_release() is False


async def test_revoked_release_does_not_free_next_holder(rlocks: aiolock.Locks, name: str) -> None:
    """A revoked lease's release frees nothing: the next holder keeps the lock."""
    old = await rlocks.lock(name, ttl=TTL, on_lost="raise").acquire()
    assert await rlocks.lock(name).force_release()
    # another task: this one still holds the revoked lease until its next renewal
    new = await asyncio.create_task(rlocks.lock(name, ttl=TTL).acquire(timeout=5))
    try:
        assert new.token > old.token
        await old.release()
        info = await rlocks.status(name)
        assert info.held and info.token == new.token, info
        with pytest.raises(aiolock.LockTimeout):
            await asyncio.create_task(rlocks.lock(name, ttl=TTL).acquire(timeout=0))
        await asyncio.sleep(TTL / 3 + 0.3)
        assert old.lost and not new.lost
    finally:
        await new.release()
    assert not (await rlocks.status(name)).held


async def test_revoke_hands_over_to_waiter_with_higher_token(rlocks: aiolock.Locks, name: str) -> None:
    holder = await rlocks.lock(name, ttl=TTL).acquire()
    waiter = asyncio.create_task(rlocks.lock(name, ttl=TTL).acquire(timeout=TTL * 3))
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    assert await rlocks.lock(name).force_release()
    got = await waiter
    took = time.monotonic() - t0
    try:
        assert got.token > holder.token
        await asyncio.wait_for(holder.wait_lost(), TTL / 3 + SLACK)
        assert holder.lost and not got.lost
        # the waiter is in the same process: it may wait for the revoked lease's renewal,
        # but not for its whole ttl
        assert took < TTL / 3 + SLACK, f"waiter got the revoked lock after {took:.2f} s"
    finally:
        await got.release()
        await holder.release()


@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_revoke_races_acquire_and_release(rlocks: aiolock.Locks, name: str,
                                                fair: bool) -> None:
    """Revocations at random points of acquire/hold/release by 4 tasks: tokens strictly
    increase across every grant, and afterwards the lock is free (nothing left held)."""
    if fair and Capability.FAIR not in rlocks.capabilities:
        pytest.skip("not fair")
    tokens: list[int] = []
    stop = time.monotonic() + 2.0
    rng = random.Random(12)

    async def worker() -> None:
        lock = rlocks.lock(name, ttl=TTL, on_lost="raise", fair=fair)
        while time.monotonic() < stop:
            try:
                lease = await lock.acquire(timeout=TTL * 2)
            except aiolock.LockTimeout:
                continue
            tokens.append(lease.token)
            await asyncio.sleep(rng.random() * 0.01)
            await lease.release()

    async def revoker() -> None:
        while time.monotonic() < stop:
            await asyncio.sleep(rng.random() * 0.03)
            await rlocks.lock(name).force_release()

    await asyncio.gather(*(worker() for _ in range(4)), revoker())
    assert tokens and all(b > a for a, b in pairwise(tokens)), tokens
    async with rlocks.lock(name, ttl=TTL, timeout=TTL + SLACK, fair=fair) as last:
        assert last.token > tokens[-1]
    assert not (await rlocks.status(name)).held


async def test_revoke_every_reader_and_permit(rlocks: aiolock.Locks, name: str) -> None:
    kinds = []
    if Capability.RWLOCK in rlocks.capabilities:
        kinds.append(("rw", lambda: rlocks.rwlock(name, ttl=TTL).read(), rlocks.rwlock(name)))
    if Capability.SEMAPHORE in rlocks.capabilities:
        kinds.append(("sem", lambda: rlocks.semaphore(name + "s", limit=3, ttl=TTL),
                      rlocks.semaphore(name + "s", limit=3)))
    if not kinds:
        pytest.skip("no rwlock or semaphore")
    for label, make, prim in kinds:
        leases = await asyncio.gather(*(asyncio.create_task(make().acquire()) for _ in range(3)))
        assert await prim.force_release(), label
        await asyncio.wait_for(asyncio.gather(*(le.wait_lost() for le in leases)),
                               TTL / 3 + SLACK)
        assert all(le.lost for le in leases), label
        for le in leases:
            await le.release()


async def test_same_task_acquires_again_after_revocation(rlocks: aiolock.Locks, name: str) -> None:
    """Once its lease is lost (revoked), the task no longer holds the lock: acquiring it
    again is a new acquisition (a higher token), not the same-task LockError."""
    lease = await rlocks.lock(name, ttl=TTL, on_lost="raise").acquire()
    assert await rlocks.lock(name).force_release()
    await asyncio.wait_for(lease.wait_lost(), TTL / 3 + SLACK)
    again = await rlocks.lock(name, ttl=TTL).acquire(timeout=2)
    try:
        assert again.token > lease.token
    finally:
        await again.release()
        await lease.release()


@pytest.mark.parametrize("steps", [1, 3, 8])
@pytest.mark.parametrize("fair", [False, True], ids=["plain", "fair"])
async def test_revoke_skips_cancelled_waiter(rlocks: aiolock.Locks, name: str, steps: int,
                                             fair: bool) -> None:
    """README "Cancellation safety": a cancelled wait is abandoned (removed from the queue,
    barred) before CancelledError propagates. A revocation then hands the lock to the live
    waiter behind it at once -- not to the cancelled claim for its ttl."""
    if fair and Capability.FAIR not in rlocks.capabilities:
        pytest.skip("not fair")
    holder = await rlocks.lock(name, ttl=TTL, fair=fair, on_lost="raise").acquire()
    w1 = asyncio.create_task(rlocks.lock(name, ttl=5, fair=fair).acquire())
    await asyncio.sleep(0.1)
    w2 = asyncio.create_task(rlocks.lock(name, ttl=TTL, fair=fair).acquire(timeout=10))
    await asyncio.sleep(0.1)
    for _ in range(steps):
        await asyncio.sleep(0)
    w1.cancel()
    try:
        got1 = await w1
        await got1.release()
    except asyncio.CancelledError:
        pass
    t0 = time.monotonic()
    assert await rlocks.lock(name).force_release()
    lease = await w2
    took = time.monotonic() - t0
    await lease.release()
    await holder.release()
    assert took < TTL / 3 + SLACK, f"the live waiter got the revoked lock after {took:.2f} s"


async def test_revoking_some_leases_of_a_renewal_batch_spares_the_others(
        rlocks: aiolock.Locks) -> None:
    """SPEC §2: "One renewal loop per backend renews all held leases in batches"; §7: the
    *revoked* holder learns it at its next renewal. Revoking 8 of 24 leases held by one
    connection, at random moments across several renewals, loses exactly those 8."""
    base = f"b{random.randrange(1 << 30)}:"
    ttl = 1.2
    leases = [await rlocks.lock(f"{base}{i}", ttl=ttl, on_lost="raise").acquire()
              for i in range(24)]
    try:
        victims = random.Random(7).sample(range(24), 8)
        for i in victims:
            await asyncio.sleep(random.random() * 0.15)
            assert await rlocks.lock(f"{base}{i}").force_release()
        await asyncio.sleep(ttl / 3 + SLACK)
        lost = sorted(i for i, le in enumerate(leases) if le.lost)
        assert lost == sorted(victims), f"lost {lost}, revoked {sorted(victims)}"
        await asyncio.sleep(ttl)
        assert sorted(i for i, le in enumerate(leases) if le.lost) == sorted(victims)
    finally:
        for le in leases:
            await le.release()
