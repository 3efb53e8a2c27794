"""A held lease whose server freezes is lost by its last confirmed expiry (README "The
watchdog and lease loss": "Never believe in a lease longer than the server granted it";
each renewal's expiry counts from when it was *sent*): since every confirmed renewal was
sent before the freeze, the lease is lost at most ``ttl`` after the freeze. After the
server resumes, the lock works again.
"""

from __future__ import annotations

import asyncio
import time

import aiolock

from .conftest import ALL, SLACK, Target, backends, timed

TTL = 2.0


def ttl_for(target: Target) -> float:
    # Sentinel fails over after 3 s of silence (tests/redis_topology.py): keep the freeze short
    return 1.5 if target.max_freeze < 3.0 else TTL


async def _lost_after_freeze(target: Target, name: str, delay: float) -> None:
    ttl = ttl_for(target)
    async with target.connect() as locks:
        lease = await locks.lock(name, ttl=ttl).acquire(timeout=5)
        await asyncio.sleep(delay * ttl)
        assert not lease.lost, f"{target.id}: lease lost before any fault"
        target.freeze()
        frozen_at = time.monotonic()
        try:
            out = await timed(lease.wait_lost, ttl + SLACK + 2)
            lost_after = time.monotonic() - frozen_at
            lost = lease.lost
        finally:
            target.thaw()
        assert out.error is None, f"{target.id}: wait_lost(): {out.describe()}"
        assert lost, f"{target.id}: wait_lost() returned but the lease is not lost"
        assert lost_after < ttl + SLACK, (
            f"{target.id}: lease (ttl {ttl}) frozen {delay:.2f} x ttl after the grant was "
            f"reported lost {lost_after:.2f} s after the freeze, bound {ttl + SLACK:.2f} s")
        # after the resume the lock works again (the old claim expires on the server)
        again = await timed(lambda: locks.lock(name, ttl=ttl).acquire(timeout=15), 20)
        assert isinstance(again.result, aiolock.Lease), f"{target.id} after resume: {again.describe()}"
        await again.result.release()


@backends(ALL, default=("redis",))
async def test_lease_lost_by_ttl_when_frozen_right_after_grant(target: Target, name: str) -> None:
    await _lost_after_freeze(target, name, 0.05)


@backends(ALL)
async def test_lease_lost_by_ttl_when_frozen_as_a_renewal_is_due(target: Target, name: str) -> None:
    """Frozen just before the first renewal (ttl/3): that renewal never answers."""
    await _lost_after_freeze(target, name, 0.30)


@backends(ALL)
async def test_lease_lost_by_ttl_when_frozen_after_renewals(target: Target, name: str) -> None:
    await _lost_after_freeze(target, name, 0.55)


@backends(ALL)
async def test_async_with_body_cancelled_when_frozen(target: Target, name: str) -> None:
    ttl = ttl_for(target)
    async with target.connect() as locks:
        frozen_at = 0.0

        async def body() -> None:
            nonlocal frozen_at
            async with locks.lock(name, ttl=ttl):
                await asyncio.sleep(0.1)
                target.freeze()
                frozen_at = time.monotonic()
                await asyncio.sleep(30)

        try:
            out = await timed(body, ttl + SLACK + 2)
            lost_after = time.monotonic() - frozen_at
        finally:
            target.thaw()
        assert isinstance(out.error, aiolock.LockLost), f"{target.id} async with, frozen: {out.describe()}"
        assert lost_after < ttl + SLACK, (
            f"{target.id}: async with body (ttl {ttl}) ended {lost_after:.2f} s after the freeze")
