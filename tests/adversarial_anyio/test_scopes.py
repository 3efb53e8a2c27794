"""anyio cancel scopes around ``acquire()``, around the ``async with`` block and inside
its body, against lost leases (README "The watchdog and lease loss", "Cancellation
safety"; SPEC 2). Written from README.md, SPEC.md and docs/ only."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest

import aiolock
from aiolock import Capability

from ..scenarios import Scenario
from .conftest import LEAK_TTL, TTL, assert_free, cancelling, eventually, revoked_after, rows

C = Capability
#: the revoked holder learns it at its next renewal, within ttl/3 (README); plus slack
LEARN = TTL / 3 + 1.0


async def _timeouts_still_work() -> None:
    """After a block that ended, an ``asyncio.timeout`` and an anyio ``fail_after`` in the
    same task still turn their own expiry into ``TimeoutError`` (a cancel request left
    pending on the task turns them into ``CancelledError``)."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await asyncio.sleep(1)
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.02):
            await anyio.sleep(1)


# ------------------------------------------------------------------ loss under a scope


# pin: a revoked lease raises LockLost through an outer scope, which caught nothing
@rows(C.REVOKE, default=("redis",))
async def test_loss_is_not_swallowed_by_an_outer_move_on_after(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """A lease revoked inside ``async with`` under a ``move_on_after(30)`` that does not
    expire: the body is cancelled, the block raises ``LockLost`` through the scope, and
    the scope did not catch a cancel of its own (``cancelled_caught`` False)."""
    reached_end = False
    lease: aiolock.Lease | None = None
    t0 = time.monotonic()
    with pytest.raises(aiolock.LockLost):
        with anyio.move_on_after(30) as scope:
            async with revoked_after(other, name, 0.2), locks.lock(name, ttl=TTL) as lease:
                await anyio.sleep(30)
                reached_end = True
    elapsed = time.monotonic() - t0
    assert not reached_end
    assert not scope.cancelled_caught, "the scope took the lease's loss for its own cancel"
    assert lease is not None and lease.lost
    assert elapsed < 0.2 + LEARN, f"loss learnt after {elapsed:.2f}s"
    assert cancelling() == 0, f"{cancelling()} cancel request(s) left on the task"
    await _timeouts_still_work()
    await assert_free(other, name)


@rows(C.REVOKE)
async def test_loss_is_not_swallowed_by_an_inner_cancel_scope(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """The loss arrives while the body waits inside its own ``CancelScope`` and
    ``move_on_after`` (neither cancelled): they let it through, the block raises
    ``LockLost``, the body runs no further."""
    after_inner = False
    with pytest.raises(aiolock.LockLost):
        async with revoked_after(other, name, 0.2), locks.lock(name, ttl=TTL):
            with anyio.CancelScope() as inner, anyio.move_on_after(30) as timer:
                await anyio.sleep(30)
            after_inner = True
            await anyio.sleep(30)
    assert not after_inner, "the body ran on past the loss"
    assert not inner.cancelled_caught and not timer.cancelled_caught
    assert cancelling() == 0
    await _timeouts_still_work()
    await assert_free(other, name)


@rows(C.REVOKE)
async def test_loss_inside_fail_after_in_body_is_lock_lost_not_timeout(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """A ``fail_after(30)`` in the body: a revocation is a ``LockLost``, never the
    scope's ``TimeoutError``."""
    with pytest.raises(aiolock.LockLost):
        async with revoked_after(other, name, 0.2), locks.lock(name, ttl=TTL):
            with anyio.fail_after(30):
                await anyio.sleep(30)
    assert cancelling() == 0
    await assert_free(other, name)


# ------------------------------------------------------------------ a scope's own cancel


@rows()
async def test_own_scope_cancel_inside_body_is_not_lock_lost(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """A ``move_on_after`` in the body that expires: only that scope is cancelled, the
    body goes on, the block releases normally, nothing is lost."""
    async with locks.lock(name, ttl=TTL) as lease:
        with anyio.move_on_after(0.1) as scope:
            await anyio.sleep(5)
        assert scope.cancelled_caught
        assert not lease.lost
        await anyio.sleep(0.05)
        assert await other.lock(name).locked(), "released while the body still runs"
    assert lease.released and not lease.lost
    assert cancelling() == 0
    await _timeouts_still_work()
    await assert_free(other, name)


@rows()
async def test_own_scope_cancel_around_block_releases_and_is_not_lock_lost(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """A ``move_on_after`` around the block that expires while the body waits: the scope
    catches its own cancel (no ``LockLost``, no ``CancelledError``), the lease is
    released (at once, or by the release that finishes in the background: anyio cancels
    the release again at every await), never lost."""
    lease: aiolock.Lease | None = None
    with anyio.move_on_after(0.3) as scope:
        async with locks.lock(name, ttl=LEAK_TTL) as lease:
            await anyio.sleep(5)
    assert scope.cancelled_caught
    assert lease is not None and not lease.lost
    assert cancelling() == 0
    await assert_free(other, name)
    await eventually("lease.released after its block was cancelled", lambda: lease.released)
    assert not lease.lost
    await _timeouts_still_work()


@rows()
async def test_fail_after_around_block_raises_timeout_not_lock_lost(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """``fail_after`` around the block: its expiry is anyio's ``TimeoutError`` (never a
    ``LockLost``, never ``LockTimeout``: the lock was held), and the lock is free."""
    lease: aiolock.Lease | None = None
    with pytest.raises(TimeoutError) as err:
        with anyio.fail_after(0.3):
            async with locks.lock(name, ttl=LEAK_TTL) as lease:
                await anyio.sleep(5)
    assert not isinstance(err.value, aiolock.LockError), repr(err.value)
    assert lease is not None and not lease.lost
    await assert_free(other, name)
    await eventually("lease.released", lambda: lease.released)


# ------------------------------------------------------------------ acquire under scopes


@rows()
async def test_fail_after_around_waiting_acquire_leaves_no_place(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """A waiting ``acquire()`` under ``fail_after(0.3)``: anyio's ``TimeoutError``; then
    the holder releases and a third party takes the lock at once (no place left in a
    queue for the cancelled waiter; no hand-off to it)."""
    held = await other.lock(name, ttl=LEAK_TTL).acquire(timeout=5)
    with pytest.raises(TimeoutError) as err:
        with anyio.fail_after(0.3):
            await locks.lock(name, ttl=LEAK_TTL).acquire()
    assert not isinstance(err.value, aiolock.LockError), repr(err.value)
    assert cancelling() == 0
    await held.release()
    await assert_free(other, name)
    assert not await locks.lock(name).locked()


@rows()
async def test_acquire_timeout_inside_a_longer_scope_is_lock_timeout(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """``acquire(timeout=0.3)`` under ``move_on_after(10)``: ``LockTimeout`` (also a
    ``TimeoutError``), the scope caught nothing; and ``acquire(timeout=10)`` under
    ``move_on_after(0.3)``: the scope catches its own cancel, no ``LockTimeout``."""
    held = await other.lock(name, ttl=LEAK_TTL).acquire(timeout=5)
    try:
        t0 = time.monotonic()
        with anyio.move_on_after(10) as outer:
            with pytest.raises(aiolock.LockTimeout):
                await locks.lock(name, ttl=LEAK_TTL).acquire(timeout=0.3)
        assert not outer.cancelled_caught
        assert 0.25 < time.monotonic() - t0 < 1.5
        with anyio.move_on_after(0.3) as scope:
            await locks.lock(name, ttl=LEAK_TTL).acquire(timeout=10)
            raise AssertionError("acquired a held lock")
        assert scope.cancelled_caught
        assert cancelling() == 0
    finally:
        await held.release()
    await assert_free(other, name)


# ------------------------------------------------------------------ a scope expiring as the lease does


OFFSETS = [-0.15, -0.02, -0.005, 0.0, 0.005, 0.02, 0.15]
#: the inner-scope test keeps offset 0 on redis in the default run (a pin)
INNER_OFFSETS = [pytest.param(o, marks=() if o == 0.0 else (pytest.mark.slow,)) for o in OFFSETS]


@rows()
@pytest.mark.parametrize("offset", OFFSETS)
async def test_outer_scope_deadline_at_the_lease_expiry(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str,
        offset: float) -> None:
    """``watchdog=False``: the lease is lost at its expiry. A ``CancelScope`` around the
    block gets its deadline at that expiry + ``offset``. Either the loss wins (the block
    raises ``LockLost`` through the scope, which caught nothing) or the scope's deadline
    does (it catches its own cancel, no exception) -- never both, never neither, never a
    bare ``CancelledError``; well before the expiry only the scope, well after only the
    loss; the lease ends lost or released; the lock is free."""
    outcome = "none"
    lease: aiolock.Lease | None = None
    try:
        with anyio.CancelScope() as scope:
            async with locks.lock(name, ttl=1.0, watchdog=False) as lease:
                scope.deadline = anyio.current_time() + lease.expires_in + offset
                await anyio.sleep(5)
                outcome = "body ran on"
    except aiolock.LockLost:
        outcome = "lost"
    assert lease is not None
    if scope.cancelled_caught:
        assert outcome == "none", f"scope caught its cancel and outcome {outcome}"
        outcome = "scope"
    assert outcome in ("lost", "scope"), f"offset {offset}: {outcome}"
    if offset <= -0.1:
        assert outcome == "scope", f"deadline {-offset}s before expiry: {outcome}"
    if offset >= 0.1:
        assert outcome == "lost", f"deadline {offset}s after expiry: {outcome}"
    if outcome == "lost":
        assert lease.lost
    assert cancelling() == 0
    await assert_free(other, name, within=1.5)  # a lease released late still expires by its ttl
    await eventually("lease lost or released", lambda: lease.lost or lease.released)


# pin (offset 0 on redis): a scope in the body expiring with the lease never lets the body run on
@rows(default=("redis",))
@pytest.mark.parametrize("offset", INNER_OFFSETS)
async def test_inner_scope_deadline_at_the_lease_expiry(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str,
        offset: float) -> None:
    """The same with ``move_on_after`` *inside* the body: whichever fires first, the body
    must not run on past the loss, so the block always ends in ``LockLost`` right after
    the expiry (the inner scope may catch its own cancel, never the loss)."""
    ran_on = False
    t0 = time.monotonic()
    expires = 0.0
    with pytest.raises(aiolock.LockLost):
        async with locks.lock(name, ttl=1.0, watchdog=False) as lease:
            expires = lease.expires_in
            with anyio.move_on_after(expires + offset):
                await anyio.sleep(5)
            await anyio.sleep(5)
            ran_on = True
    elapsed = time.monotonic() - t0
    assert not ran_on
    assert lease.lost
    assert elapsed < expires + 0.15 + 0.3, f"LockLost {elapsed:.3f}s after entering, expiry {expires:.3f}"
    assert cancelling() == 0
    await _timeouts_still_work()
    await assert_free(other, name, within=1.5)


# ------------------------------------------------------------------ shield in the body


@rows(C.REVOKE)
async def test_loss_during_a_shielded_section_of_the_body(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """A ``CancelScope(shield=True)`` in the body while the lease is revoked. The docs
    promise only that the body is cancelled "like asyncio.timeout" (a native task cancel,
    which anyio's shield does not stop) and that the block raises ``LockLost``: whether
    the shielded part finishes or not, the block must end in ``LockLost`` (not a bare
    ``CancelledError``, not silently), soon after the shielded part at the latest, and
    nothing stays held."""
    ran_on = False
    t0 = time.monotonic()
    with pytest.raises(aiolock.LockLost):
        async with revoked_after(other, name, 0.1), locks.lock(name, ttl=TTL) as lease:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(TTL)
            await anyio.sleep(30)
            ran_on = True
    assert not ran_on
    assert lease.lost
    assert time.monotonic() - t0 < TTL + LEARN
    assert cancelling() == 0
    await _timeouts_still_work()
    await assert_free(other, name)


@rows(C.REVOKE)
async def test_shielded_scope_around_the_block_still_sees_the_loss(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """The block inside a ``CancelScope(shield=True)`` (a shutdown-proof section): the
    shield is about anyio cancels from outside, the lease's loss still cancels the body
    and raises ``LockLost`` out of the shielded scope."""
    with pytest.raises(aiolock.LockLost):
        with anyio.CancelScope(shield=True) as scope:
            async with revoked_after(other, name, 0.2), locks.lock(name, ttl=TTL):
                await anyio.sleep(30)
    assert not scope.cancelled_caught
    assert cancelling() == 0
    await assert_free(other, name)


# Fixed: grpc calls are awaited in a task of their own (etcd/_wire.own_cancel).
# DEFECT (etcd): the shape of a request handler with a deadline -- ``move_on_after(d)``
# around ``acquire()`` of a free lock, d from 0 to 5.5 ms: on etcd a CancelledError gets
# out of the scope in 5-8 of the 60 tries (7/7 runs fail), so the handler's task is
# cancelled instead of moving on; 0 on every other row. The cancel lands while the etcd
# request is in flight and comes back as grpc.aio's bare ``CancelledError()``, without
# the scope's message (grpc/grpc#43502), which anyio cannot recognise as its own.
@rows(default=("etcd",))
async def test_move_on_after_around_acquire_never_lets_a_cancel_out(
        scenario: Scenario, locks: aiolock.Locks, other: aiolock.Locks, name: str) -> None:
    """``with anyio.move_on_after(d): lease = await lock.acquire()`` on free locks, d in
    0..5.5 ms: each try either wins (released at once) or the scope catches its own
    cancel; no ``CancelledError`` ever gets out of the scope; every lock is free after."""
    escaped: list[tuple[float, tuple[object, ...]]] = []
    names = [f"{name}-{i}" for i in range(60)]
    for i, n in enumerate(names):
        d = 0.0005 * (i % 12)
        try:
            with anyio.move_on_after(d):
                lease = await locks.lock(n, ttl=LEAK_TTL).acquire(timeout=5)
                with anyio.CancelScope(shield=True):
                    await lease.release()
        except asyncio.CancelledError as e:
            escaped.append((d, e.args))
    assert cancelling() == 0
    assert not escaped, (f"{len(escaped)} of {len(names)} tries: a CancelledError got out of "
                         f"move_on_after (deadline s, args): {escaped[:5]}")
    await assert_free(other, *names)
