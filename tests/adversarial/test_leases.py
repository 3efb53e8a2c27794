"""Lease promises (SPEC §2-§3) on Redis and ZooKeeper: misuse raises aiolock errors, the
lease reads the clock itself after a stall, a collected lease is released with a
ResourceWarning, semaphores never over-admit, waiting writers are not starved."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import Iterator

import pytest

import aiolock

from ..conftest import rows_fixture, url_fixture
from ..scenarios import params_of
from ..servers import RedisServer

_OWN: dict[str, RedisServer] = {}


@pytest.fixture
def own_redis_url() -> Iterator[str]:
    server = RedisServer().start()
    _OWN[server.url] = server
    yield server.url
    del _OWN[server.url]
    server.close()


row = rows_fixture("row", params_of("redis", "zookeeper"), "The backends under test.")
url = url_fixture("url", "row")


async def _lapsed(locks: aiolock.Locks, ttl: float) -> tuple[str, aiolock.Lease]:
    """A fresh name and a lease on it taken without watchdog, left to lapse (lost)."""
    name = f"m-{uuid.uuid4().hex}"
    lease = await locks.lock(name, ttl=ttl, watchdog=False).acquire()
    await asyncio.sleep(ttl + 0.2)
    assert lease.lost
    return name, lease


async def test_lease_misuse_raises_aiolock_errors(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    name = f"m-{uuid.uuid4().hex}"
    lease = await a.lock(name, ttl=5).acquire()
    await lease.release()
    await lease.release()  # a no-op
    async with asyncio.timeout(3):
        await lease.wait_lost()  # returns once released
    with pytest.raises(aiolock.LockError):
        await lease.extend(5)
    # someone else holds it now: the old lease cannot extend it back
    other = await b.lock(name, ttl=5).acquire(timeout=1)
    with pytest.raises(aiolock.LockError):
        await lease.extend(5)
    assert not other.lost
    await other.release()


async def test_extend_after_loss_is_lock_lost(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    name, lease = await _lapsed(a, 0.4)
    other = await b.lock(name, ttl=5).acquire(timeout=2)
    with pytest.raises(aiolock.LockLost):
        await lease.extend(5)
    await lease.release()  # releasing a lost lease must not free someone else's lock
    assert (await b.status(name)).held and not other.lost
    await other.release()


async def test_lost_reads_the_clock_after_a_stall(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, _ = pair
    lease = await a.lock(f"m-{uuid.uuid4().hex}", ttl=0.6).acquire()
    time.sleep(0.9)  # the event loop is stalled past the ttl: no renewal could run
    assert lease.lost, "lease.lost must read the clock itself"
    await lease.release()


async def test_closed_connection_refuses_use(url: str) -> None:
    locks = aiolock.connect(url)
    await locks.aclose()
    with pytest.raises(aiolock.LockError):
        async with asyncio.timeout(3):
            await locks.lock("x").acquire(timeout=0)
    with pytest.raises(aiolock.LockError):
        async with asyncio.timeout(3):
            await locks.status("x")


async def test_collected_lease_is_released_with_warning(
        pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    name = f"g-{uuid.uuid4().hex}"
    with pytest.warns(ResourceWarning):
        lease = await a.lock(name, ttl=10).acquire()
        del lease
        gc.collect()
        await asyncio.sleep(0)
    async with asyncio.timeout(5):
        again = await b.lock(name, ttl=10).acquire(timeout=3)
    await again.release()


async def test_semaphore_never_over_admits(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    name = f"s-{uuid.uuid4().hex}"
    inside = peak = admitted = 0

    async def worker(locks: aiolock.Locks, i: int) -> None:
        nonlocal inside, peak, admitted
        for _ in range(4):
            try:
                async with asyncio.timeout(0.02 if i % 3 == 0 else 10):
                    async with locks.semaphore(name, limit=3, ttl=5):
                        inside += 1
                        try:
                            peak = max(peak, inside)
                            admitted += 1
                            await asyncio.sleep(0.005)
                        finally:
                            inside -= 1
            except TimeoutError:
                pass

    async with asyncio.timeout(60):
        await asyncio.gather(*(worker((a, b)[i % 2], i) for i in range(12)))
    assert peak <= 3, f"{peak} holders of a 3-permit semaphore"
    assert admitted >= 30
    permits = [await b.semaphore(name, limit=3, ttl=5).acquire(timeout=1) for _ in range(3)]
    for p in permits:
        await p.release()


async def test_writer_not_starved(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    name = f"w-{uuid.uuid4().hex}"
    stop = asyncio.Event()

    async def reader(locks: aiolock.Locks) -> None:
        while not stop.is_set():
            async with locks.rwlock(name, ttl=5).read():
                await asyncio.sleep(0.05)

    readers = [asyncio.create_task(reader((a, b)[i % 2])) for i in range(4)]
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(5):
            async with b.rwlock(name, ttl=5).write():
                took = time.monotonic() - t0
    finally:
        stop.set()
        await asyncio.gather(*readers)
    assert took < 1.0, f"writer waited {took:.2f}s behind a stream of readers"


async def test_shared_lock_object_local_fifo(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    """One Lock object shared by many tasks: mutual exclusion, and local waiters are
    served in arrival order (README: waiters for one lock queue locally, FIFO)."""
    a, _ = pair
    lock = a.lock(f"q-{uuid.uuid4().hex}", ttl=5)
    order: list[int] = []
    inside = 0

    async def task(i: int) -> None:
        nonlocal inside
        async with lock:
            inside += 1
            try:
                assert inside == 1
                order.append(i)
                await asyncio.sleep(0.01)
            finally:
                inside -= 1

    first = await lock.acquire()
    tasks = []
    for i in range(15):
        tasks.append(asyncio.create_task(task(i)))
        await asyncio.sleep(0.01)  # arrival order is well defined
    await first.release()
    async with asyncio.timeout(20):
        await asyncio.gather(*tasks)
    assert order == list(range(15)), order


async def test_lease_lost_after_server_restart(own_redis_url: str) -> None:
    """The server restarts without persistence: the held lease vanished and is reported
    lost at the next renewal (within ttl/3); a waiter either gets the lock soon or fails
    with BackendUnavailable (then a retry gets it at once)."""
    server = _OWN[own_redis_url]
    async with aiolock.connect(own_redis_url, connect_timeout=1, request_timeout=1) as a, \
            aiolock.connect(own_redis_url, connect_timeout=1, request_timeout=1) as b:
        held = await a.lock("x", ttl=3).acquire()
        waiter = asyncio.create_task(b.lock("x", ttl=3).acquire())
        await asyncio.sleep(0.3)
        await asyncio.to_thread(server.restart, down_for=0.3)
        t0 = time.monotonic()
        async with asyncio.timeout(10):
            await held.wait_lost()
        assert held.lost
        assert time.monotonic() - t0 < 3 / 3 + 1 + 0.5, "lost later than the next renewal"
        try:
            async with asyncio.timeout(5):
                lease = await waiter
        except aiolock.BackendUnavailable:
            lease = await b.lock("x", ttl=3).acquire(timeout=1)
        await lease.release()


async def test_on_lost_callback_that_raises(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    """A user's on_lost callback that raises must not stop the watchdog of the others."""
    a, b = pair
    if not a.url.startswith("redis"):
        pytest.skip("the watchdog is shared code: one backend is enough")
    name = f"cb-{uuid.uuid4().hex}"
    calls = 0

    def boom(lease: aiolock.Lease) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("user bug")

    keeper = await a.lock(name + "k", ttl=0.9).acquire()
    with pytest.raises(aiolock.LockLost):
        async with a.lock(name, ttl=0.5, watchdog=False, on_lost=boom):
            await asyncio.sleep(0.8)
    assert calls == 1
    await asyncio.sleep(1.5)  # more than the keeper's ttl: only renewals keep it
    assert not keeper.lost
    with pytest.raises(aiolock.LockTimeout):
        await b.lock(name + "k", ttl=0.9).acquire(timeout=0)
    await keeper.release()


async def test_many_leases_renewed(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    n = 1500 if a.url.startswith("redis") else 300
    base = uuid.uuid4().hex
    async with asyncio.timeout(60):
        leases = await asyncio.gather(*(a.lock(f"{base}:{i}", ttl=1.0).acquire()
                                        for i in range(n)))
        await asyncio.sleep(2.0)  # two ttls
        lost = sum(lease.lost for lease in leases)
        assert lost == 0, f"{lost} of {n} leases lost while held"
        with pytest.raises(aiolock.LockTimeout):
            await b.lock(f"{base}:{n - 1}", ttl=1.0).acquire(timeout=0)
        await asyncio.gather(*(lease.release() for lease in leases))


async def test_tokens_increase_across_expiry(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    """The token counter outlives every lease (it never expires with the lock)."""
    a, b = pair
    name, first = await _lapsed(a, 0.3)
    second = await b.lock(name, ttl=0.3, watchdog=False).acquire(timeout=1)
    await second.release()
    await asyncio.sleep(0.6)
    third = await a.lock(name, ttl=5).acquire(timeout=1)
    assert first.token < second.token < third.token
    await third.release()


async def test_extend_without_watchdog(pair: tuple[aiolock.Locks, aiolock.Locks]) -> None:
    a, b = pair
    name = f"x-{uuid.uuid4().hex}"
    lease = await a.lock(name, ttl=0.6, watchdog=False).acquire()
    await lease.extend(2.0)
    await asyncio.sleep(1.0)  # past the first ttl
    assert not lease.lost and lease.expires_in > 0.5
    with pytest.raises(aiolock.LockTimeout):
        await b.lock(name, ttl=1).acquire(timeout=0)
    await lease.release()


async def test_fair_is_fifo_across_connections(url: str) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b, \
            aiolock.connect(url) as c:
        conns = (a, b, c)
        name = f"f-{uuid.uuid4().hex}"
        order: list[int] = []

        async def waiter(i: int) -> None:
            async with conns[i % 3].lock(name, ttl=5, fair=True):
                order.append(i)
                await asyncio.sleep(0.005)

        first = await a.lock(name, ttl=5, fair=True).acquire()
        tasks = []
        for i in range(12):
            tasks.append(asyncio.create_task(waiter(i)))
            await asyncio.sleep(0.03)
        await first.release()
        async with asyncio.timeout(20):
            await asyncio.gather(*tasks)
        assert order == list(range(12)), order


async def test_fair_queue_skips_cancelled_and_timed_out(url: str) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        name = f"f-{uuid.uuid4().hex}"
        order: list[int] = []

        async def waiter(i: int, timeout: float | None = None) -> None:
            async with (a, b)[i % 2].lock(name, ttl=5, fair=True, timeout=timeout):
                order.append(i)

        first = await a.lock(name, ttl=5, fair=True).acquire()
        tasks = []
        for i in range(8):
            tasks.append(asyncio.create_task(waiter(i, 0.3 if i == 5 else None)))
            await asyncio.sleep(0.03)
        tasks[2].cancel()
        tasks[3].cancel()
        await asyncio.sleep(0.4)  # waiter 5 timed out
        t0 = time.monotonic()
        await first.release()
        async with asyncio.timeout(20):
            await asyncio.gather(*tasks, return_exceptions=True)
        took = time.monotonic() - t0
        assert order == [0, 1, 4, 6, 7], order
        assert took < 1.0, f"queue drained in {took:.1f}s: a gone waiter's place blocked it"
