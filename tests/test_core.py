"""Core regressions found in review: the watchdog, the async-with guard, on_lost."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import Sequence

import pytest

import aiolock
from aiolock._lease import _Hold
from aiolock.abc import Claim
from aiolock.backends.memory import MemoryBackend


class StuckRenewals(MemoryBackend):
    """Renewals never answer (a server that stopped responding)."""

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        await asyncio.Event().wait()
        return []


async def test_watchdog_does_not_spin_while_a_renewal_hangs() -> None:
    async with aiolock.connect(StuckRenewals(uuid.uuid4().hex)) as locks:
        a = await locks.lock("a", ttl=1.2).acquire()  # its renewal hangs after 0.4 s
        b = await locks.lock("b", ttl=1.15, watchdog=False).acquire()  # expires meanwhile
        started = time.monotonic()
        await asyncio.sleep(1.5)  # a spinning event loop would never come back here
        assert time.monotonic() - started < 2.5
        assert a.lost and b.lost  # lost at their last confirmed expiry, not renewed


class RefusedRenewals(MemoryBackend):
    """Renewals refused: the user lost a permission (an ACL changed)."""

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        raise aiolock.AccessDenied("NOPERM this user has no permissions to run the 'pexpire' command")


async def test_a_refused_renewal_loses_the_lease_at_once_saying_why() -> None:
    """No retry can mend a refusal: the lease is lost at its first refused renewal (not a
    ttl later), and the loss says what the server said."""
    async with aiolock.connect(RefusedRenewals(uuid.uuid4().hex)) as locks:
        lease = await locks.lock("a", ttl=3).acquire()  # renewed after 1 s: refused
        await asyncio.wait_for(lease.wait_lost(), 2.0)
        with pytest.raises(aiolock.LockLost, match=r"refused its renewal.*NOPERM"):
            await lease.extend(3)


async def test_on_lost_callable_is_not_called_on_normal_release(locks: aiolock.Locks) -> None:
    calls: list[aiolock.Lease] = []
    lease = await locks.lock("cb", on_lost=calls.append).acquire()
    await lease.release()
    async with locks.lock("cb", on_lost=calls.append):
        pass
    await asyncio.sleep(0.05)
    assert calls == []


async def test_loss_seen_inside_the_body_leaves_no_stray_cancel() -> None:
    async with aiolock.connect(f"memory://{uuid.uuid4().hex}") as locks:
        task = asyncio.current_task()
        assert task is not None
        with pytest.raises(aiolock.LockLost):
            async with locks.lock("s", ttl=0.1, watchdog=False) as lease:
                time.sleep(0.15)  # a stall: the loss is found by lease.lost
                assert lease.lost  # no await after this: the block ends here
        assert task.cancelling() == 0
        await asyncio.sleep(0)  # a stray cancel would fire here


async def test_swallowed_guard_cancel_is_undone() -> None:
    async with aiolock.connect(f"memory://{uuid.uuid4().hex}") as locks:
        task = asyncio.current_task()
        assert task is not None
        with pytest.raises(aiolock.LockLost):
            async with locks.lock("w", ttl=0.1, watchdog=False):
                try:  # noqa: SIM105 -- spelled out: the body swallows the cancel
                    await asyncio.sleep(1)
                except asyncio.CancelledError:
                    pass  # the body swallows the cancel and ends normally
        assert task.cancelling() == 0


async def test_outside_cancel_is_not_turned_into_lock_lost() -> None:
    async with aiolock.connect(f"memory://{uuid.uuid4().hex}") as locks:

        async def body() -> None:
            async with locks.lock("c", ttl=0.1, watchdog=False, on_lost="raise"):
                await asyncio.sleep(10)

        task = asyncio.create_task(body())
        await asyncio.sleep(0.3)  # the lease is lost meanwhile; the body runs on
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()


async def test_acquire_after_close_is_refused(backend_url: str) -> None:
    locks = aiolock.connect(backend_url)
    holder = await locks.lock("closing").acquire()
    waiter = asyncio.create_task(locks.lock("closing").acquire())
    await asyncio.sleep(0.05)
    await locks.aclose()
    with pytest.raises(aiolock.LockError):
        await asyncio.wait_for(waiter, 5)
    assert holder.released


async def test_release_whose_reply_is_lost_is_still_a_release(redis_url: str, name: str) -> None:
    """The connection drops after RELEASE was sent: the retry finds nothing to release,
    which must not be reported as a lost lease."""
    async with aiolock.connect(redis_url) as locks:
        resp = locks.backend._resp  # type: ignore[attr-defined]
        async with locks.lock(name):
            pass  # loads the scripts, so the dropped RELEASE below really runs
        async with locks.lock(name) as lease:
            proto = resp._proto
            original = proto.send

            def send_then_drop(
                data: bytes, loop: asyncio.AbstractEventLoop, expected: int = 1
            ) -> object:
                fut = original(data, loop, expected)

                def lose_reply(data: bytes) -> None:
                    proto._transport.abort()  # the release ran, but its reply is lost

                proto.data_received = lose_reply
                return fut

            proto.send = send_then_drop
        assert lease.released and not lease.lost
        assert not await locks.lock(name).locked()


# -- the engine's state: kept while used, dropped after ------------------------------------


async def test_engine_state_is_dropped_after_a_storm_of_acquisitions() -> None:
    """Many tasks on a few names, with re-entries, timeouts and cancellations mid-wait:
    the engine's invariants (asserted as it goes) hold throughout, the mutex is never
    held twice, and once all is done no per-name state, owned hold or acquisition in
    flight is left behind."""
    async with aiolock.connect(f"memory://{uuid.uuid4().hex}") as locks:
        engine = locks._engine
        inside: dict[str, int] = {}

        async def worker(i: int) -> None:
            name = f"n{i % 3}"
            lock = locks.lock(name, ttl=5, reentrant=True, timeout=0.05 if i % 4 == 0 else None)
            for _ in range(20):
                try:
                    async with lock:
                        inside[name] = inside.get(name, 0) + 1
                        try:
                            assert inside[name] == 1, "two holders of one mutex"
                            async with lock:  # a re-entry shares the hold
                                await asyncio.sleep(0)
                        finally:
                            inside[name] -= 1
                except aiolock.LockTimeout:
                    pass

        tasks = [asyncio.create_task(worker(i)) for i in range(24)]
        await asyncio.sleep(0.05)
        for task in tasks[1::5]:
            task.cancel()  # mid-wait or mid-hold
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results), results
        await asyncio.sleep(0.05)  # background abandons of the cancelled claims
        assert not engine._locals and not engine._owned and not engine._acquiring
        assert len(engine.watchdog) == 0


async def test_a_loop_that_never_yields_keeps_no_dead_lease_alive() -> None:
    """Uncontended cycles on memory:// never suspend: nothing may pile up meanwhile (no
    callback scheduled per release, no stale watchdog entry per hold)."""
    async with aiolock.connect(f"memory://{uuid.uuid4().hex}") as locks:
        lock = locks.lock("busy", ttl=30)
        for _ in range(2000):
            async with lock:
                pass
        gc.collect()
        assert sum(isinstance(o, _Hold) for o in gc.get_objects()) < 100  # not one per cycle
        assert len(locks._engine.watchdog._heap) < 200


# -- errors.map_exceptions: the per-backend exception map ------------------------------------


class _ClientError(Exception):
    pass


class _ClientAuthError(_ClientError):
    pass


_EXC_MAP: dict[type[BaseException], type[Exception]] = {
    _ClientAuthError: aiolock.AccessDenied,  # subclasses first: the first match wins
    _ClientError: aiolock.BackendUnavailable,
    OSError: aiolock.BackendUnavailable,
}


@pytest.mark.parametrize(("raised", "expected"), [
    (_ClientAuthError("bad password"), aiolock.AccessDenied),
    (_ClientError("gone"), aiolock.BackendUnavailable),
    (ConnectionResetError("reset"), aiolock.BackendUnavailable),
])
async def test_map_exceptions_maps_around_an_await(raised: Exception, expected: type[Exception]) -> None:
    async def io() -> None:
        await asyncio.sleep(0)
        raise raised

    with pytest.raises(expected) as info, aiolock.errors.map_exceptions(_EXC_MAP):
        await io()
    assert info.value.__cause__ is raised
    assert str(info.value) == f"{type(raised).__name__}: {raised}"
    assert isinstance(info.value, aiolock.LockError)


@pytest.mark.parametrize("raised", [
    ValueError("not in the map"), aiolock.LockTimeout("ours already"), asyncio.CancelledError(),
])
async def test_map_exceptions_lets_the_rest_through(raised: BaseException) -> None:
    with pytest.raises(type(raised)) as info, aiolock.errors.map_exceptions(_EXC_MAP):
        raise raised
    assert info.value is raised


async def test_a_renewal_answered_after_our_own_release_is_no_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A release whose reply is slow (a loaded Redis Cluster took 1.3 s): a renewal that
    reaches the server after the release finds the lease gone -- our own release, not a
    loss. The release's answer decides: the block ends without LockLost
    (tests/adversarial_load_redis found it)."""
    async with aiolock.connect(f"memory://{uuid.uuid4().hex}") as locks:
        backend = locks.backend
        release = backend.release

        async def slow_reply(claim: Claim) -> bool:
            held = await release(claim)
            await asyncio.sleep(0.6)  # a renewal (every 0.4 s) meanwhile finds it gone
            return held

        monkeypatch.setattr(backend, "release", slow_reply)
        async with locks.lock("slow-release", ttl=1.2) as lease:
            await asyncio.sleep(0.05)
        assert not lease.lost


def test_a_record_keeps_how_long_its_claim_queued_and_since_leaves_it_out() -> None:
    from aiolock._holder import decode_holder, encode_holder, with_data, with_queued, with_waiting

    record = with_queued(encode_holder("job 7", "t1", waiting=2), 3.21234)
    assert decode_holder(record, 10.0) == aiolock.Holder(
        decode_holder(record).host, decode_holder(record).pid, "t1", "job 7", pytest.approx(6.788))
    assert decode_holder(record, 10.0).waiting == 2
    assert decode_holder(with_waiting(record, 0), 4.0).since == pytest.approx(0.788)  # kept by a rewrite
    proclaimed = decode_holder(with_data(record, "v2"), 10.0)  # a proclaim keeps the wait
    assert proclaimed.data == "v2" and proclaimed.since == pytest.approx(6.788)
    assert decode_holder(record, 1.0).since == 0.0  # never negative
    assert decode_holder(record).since is None
    assert '"q"' not in encode_holder("job 7", "t1")  # nothing written for no wait
    # a foreign or broken field reads as no wait, never as an error
    assert decode_holder('{"q": "x", "d": "a"}', 5.0).since == 5.0
    assert decode_holder('{"q": -3, "d": "a"}', 5.0).since == 5.0
