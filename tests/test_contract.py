"""The backend contract: one suite, run against every backend of the table in
``tests/scenarios.py`` (through the ``locks`` / ``backend_url`` / ``scenario`` fixtures).

A test needing a capability the backend lacks skips itself with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import random
import socket
import time
import traceback
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

import aiolock
from aiolock import Capability

from .conftest import acquire_cancelled_after, need
from .scenarios import SCENARIOS, SECRET, Scenario


async def test_acquire_release_and_tokens_increase(locks: aiolock.Locks, name: str) -> None:
    lock = locks.lock(name)
    assert not await lock.locked()
    tokens = []
    for _ in range(3):
        lease = await lock.acquire(timeout=1)
        assert await lock.locked()
        assert isinstance(lease.token, int) and not lease.lost and lease.name == name
        tokens.append(lease.token)
        await lease.release()
        await lease.release()  # a second release is a no-op
        assert not await lock.locked()
    assert tokens == sorted(set(tokens)) and len(tokens) == 3


async def test_async_with_gives_lease_and_releases(locks: aiolock.Locks, name: str) -> None:
    lock = locks.lock(name)
    async with lock as lease:
        assert await lock.locked()
        info = await locks.status(name)
        assert info.held and info.token == lease.token and 0 < (info.ttl_left or 0) <= 30
    assert not await lock.locked()
    assert lease.released and not lease.lost


async def test_try_once_and_timeout(locks: aiolock.Locks, name: str) -> None:
    lock = locks.lock(name)

    async def other_task() -> None:
        with pytest.raises(aiolock.LockTimeout):
            await locks.lock(name).acquire(timeout=0)
        started = time.monotonic()
        with pytest.raises(aiolock.LockTimeout) as info:
            await locks.lock(name).acquire(timeout=0.2)
        elapsed = time.monotonic() - started
        assert 0.19 <= elapsed < 0.2 + 0.05 + 0.05, elapsed  # honoured within 50 ms (+slack)
        assert isinstance(info.value, TimeoutError)
        with pytest.raises(aiolock.LockTimeout):
            async with locks.lock(name, timeout=0.05):
                pass

    async with lock:
        await asyncio.create_task(other_task())


async def test_mutual_exclusion_many_tasks(locks: aiolock.Locks, name: str) -> None:
    lock = locks.lock(name, ttl=5)
    inside = 0
    peak = 0
    tokens: list[int] = []

    async def worker() -> None:
        nonlocal inside, peak
        for _ in range(5):
            async with lock as lease:
                inside += 1
                peak = max(peak, inside)
                tokens.append(lease.token)
                await asyncio.sleep(random.random() / 1000)
                inside -= 1

    await asyncio.gather(*(worker() for _ in range(40)))
    assert peak == 1
    assert len(tokens) == 200
    assert tokens == sorted(tokens) and len(set(tokens)) == 200  # strictly increasing in hold order


async def test_separate_connections_exclude_each_other(backend_url: str, name: str) -> None:
    async with aiolock.connect(backend_url) as a, aiolock.connect(backend_url) as b:
        async with a.lock(name):
            with pytest.raises(aiolock.LockTimeout):
                await b.lock(name).acquire(timeout=0.1)
        lease = await b.lock(name).acquire(timeout=1)
        await lease.release()


async def test_waiter_wakes_on_release_not_on_ttl(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.EVENTS)
    lock = locks.lock(name, ttl=30)
    lease = await lock.acquire()
    got = asyncio.Event()
    waited: list[float] = []

    async def waiter() -> None:
        async with locks.lock(name, ttl=30):
            got.set()

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.2)
    assert not got.is_set()
    released = time.monotonic()
    await lease.release()
    await asyncio.wait_for(got.wait(), 2)
    waited.append(time.monotonic() - released)
    await task
    assert waited[0] < 0.5, waited  # woken by the release, not by the 30 s ttl


async def release_wakes_waiter(a: aiolock.Locks, b: aiolock.Locks, name: str, within: float) -> None:
    """``a`` holds ``name`` (ttl 30 s) and ``b`` waits for it: the release hands it to ``b``
    within ``within`` seconds (woken by the release, not by the ttl), with a larger token."""
    lease = await a.lock(name, ttl=30).acquire()
    waiter = asyncio.create_task(b.lock(name, ttl=30).acquire(timeout=10))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    released = time.monotonic()
    await lease.release()
    other = await waiter
    assert time.monotonic() - released < within
    assert other.token > lease.token
    await other.release()


async def test_wake_from_other_connection(backend_url: str, name: str) -> None:
    async with aiolock.connect(backend_url) as a, aiolock.connect(backend_url) as b:
        need(a, Capability.EVENTS)
        await release_wakes_waiter(a, b, name, 0.5)


async def test_watchdog_keeps_short_lease_alive(locks: aiolock.Locks, name: str) -> None:
    async with locks.lock(name, ttl=0.8) as lease:
        for _ in range(4):  # 4 x 0.6 s: three TTLs (9 renewals)
            await asyncio.sleep(0.6)
            assert not lease.lost
            assert (await locks.status(name)).held
        with pytest.raises(aiolock.LockTimeout):
            await asyncio.create_task(locks.lock(name).acquire(timeout=0))
    assert not lease.lost


async def test_without_watchdog_the_lease_expires_and_body_is_cancelled(
    locks: aiolock.Locks, name: str
) -> None:
    reached = False
    with pytest.raises(aiolock.LockLost):
        async with locks.lock(name, ttl=0.2, watchdog=False) as lease:
            await asyncio.sleep(1)
            reached = True
    assert not reached and lease.lost
    # the lease counts itself lost from when its request was sent, the server from when
    # it ran it: the server may free the name a request's latency later
    async with asyncio.timeout(2):
        while await locks.lock(name).locked():
            await asyncio.sleep(0.02)


async def test_on_lost_raise_lets_body_finish(locks: aiolock.Locks, name: str) -> None:
    finished = False
    with pytest.raises(aiolock.LockLost):
        async with locks.lock(name, ttl=0.2, watchdog=False, on_lost="raise"):
            await asyncio.sleep(0.5)
            finished = True
    assert finished


async def test_on_lost_callable(locks: aiolock.Locks, name: str) -> None:
    seen: list[aiolock.Lease] = []
    lease = await locks.lock(name, ttl=0.2, watchdog=False, on_lost=seen.append).acquire()
    await asyncio.wait_for(lease.wait_lost(), 2)
    assert lease.lost and seen == [lease]
    await lease.release()


async def test_extend(locks: aiolock.Locks, name: str) -> None:
    # ttl 0.6: room for a loaded machine between acquire() and extend()
    lease = await locks.lock(name, ttl=0.6, watchdog=False).acquire()
    await lease.extend(2)
    await asyncio.sleep(0.8)  # past the first ttl: only the extension keeps it
    assert not lease.lost and lease.expires_in > 0.8
    await lease.release()
    with pytest.raises(aiolock.LockError):
        await lease.extend(1)


async def test_lost_is_exact_after_event_loop_stall(locks: aiolock.Locks, name: str) -> None:
    lease = await locks.lock(name, ttl=0.3).acquire()
    time.sleep(0.5)  # a blocking stall longer than the ttl: the watchdog could not run
    assert lease.lost  # known at once on wake, from the last confirmed expiry
    await lease.release()


async def test_wait_lost_returns_on_release(locks: aiolock.Locks, name: str) -> None:
    lease = await locks.lock(name).acquire()
    waiter = asyncio.create_task(lease.wait_lost())
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await lease.release()
    await asyncio.wait_for(waiter, 1)
    assert not lease.lost


async def test_same_task_reacquire_raises_without_reentrant(locks: aiolock.Locks, name: str) -> None:
    lock = locks.lock(name)
    async with lock:
        started = time.monotonic()
        with pytest.raises(aiolock.LockError) as info:
            await lock.acquire()
        assert time.monotonic() - started < 0.1
        assert not isinstance(info.value, aiolock.LockTimeout)
        with pytest.raises(aiolock.LockError):
            await locks.lock(name).acquire()  # another Lock object, same name


async def test_reentrant_counts_and_other_tasks_wait(locks: aiolock.Locks, name: str) -> None:
    lock = locks.lock(name, reentrant=True)
    outer = await lock.acquire()
    inner = await lock.acquire()
    assert inner.token == outer.token
    other = asyncio.create_task(lock.acquire(timeout=5))  # a task started while held: waits
    await asyncio.sleep(0.1)
    assert not other.done()
    await inner.release()
    await asyncio.sleep(0.1)
    assert not other.done() and await lock.locked()
    await outer.release()
    lease = await other
    assert lease.token > outer.token
    await lease.release()


async def test_lease_taken_in_wait_for_stays_held(locks: aiolock.Locks, name: str) -> None:
    """The owner is the Lease, not the (child) task that acquired it."""
    lease = await asyncio.wait_for(locks.lock(name, ttl=0.3).acquire(), 2)
    await asyncio.gather(asyncio.sleep(0.01))
    await asyncio.sleep(1.0)  # > 3 ttls, the acquiring child task is long gone
    assert not lease.lost and await locks.lock(name).locked()
    await lease.release()
    assert not await locks.lock(name).locked()


async def test_garbage_collected_lease_is_released_with_warning(
    locks: aiolock.Locks, name: str
) -> None:
    lease = await locks.lock(name, ttl=5).acquire()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del lease
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) for w in caught)
    for _ in range(50):
        await asyncio.sleep(0.02)
        if not await locks.lock(name).locked():
            break
    assert not await locks.lock(name).locked()


async def test_random_cancellation_leaves_nothing_held(locks: aiolock.Locks, name: str) -> None:
    lock = locks.lock(name, ttl=10)

    async def user() -> None:
        async with lock:
            await asyncio.sleep(random.random() / 200)

    for _ in range(4):
        tasks = [asyncio.create_task(user()) for _ in range(50)]
        await asyncio.sleep(random.random() / 100)
        for task in random.sample(tasks, 35):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.05)
    assert not await lock.locked()
    lease = await lock.acquire(timeout=1)
    await lease.release()


async def test_cancel_at_every_point_of_acquire(locks: aiolock.Locks, name: str) -> None:
    """Cancel after 0, 1, 2, ... loop steps: whatever step it lands on, nothing leaks."""
    lock = locks.lock(name, ttl=10)
    for steps in range(12):
        await acquire_cancelled_after(lock, steps)
        assert not await lock.locked(), f"leaked after {steps} steps"


async def test_cancelled_release_still_releases(locks: aiolock.Locks, name: str) -> None:
    lock = locks.lock(name, ttl=10)
    for steps in range(6):
        lease = await lock.acquire()
        task = asyncio.create_task(lease.release())
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await lease.release()  # safe to retry; completes the release
        assert not await lock.locked(), f"held after release cancelled at step {steps}"


async def test_close_releases_held_leases(backend_url: str, name: str) -> None:
    locks = aiolock.connect(backend_url)
    lease = await locks.lock(name).acquire()
    await locks.aclose()
    async with aiolock.connect(backend_url) as other:
        assert not await other.lock(name).locked()
    assert lease.released and not lease.lost


async def ended_soon(tasks: list[asyncio.Task[Any]], when: str) -> set[asyncio.Task[Any]]:
    """``tasks`` (calls of a connection just closed) all end within a second."""
    started = time.monotonic()
    done, pending = await asyncio.wait(tasks, timeout=5)
    took = time.monotonic() - started
    for task in pending:
        task.cancel()
    assert not pending, f"{when}: {len(pending)} calls still running 5 s after aclose()"
    assert took < 1.0, f"{when}: the calls ended {took:.2f} s after aclose()"
    return done


async def test_close_ends_this_connections_waiters_soon(
    locks: aiolock.Locks, backend_url: str, name: str
) -> None:
    """aclose() at a random moment of its waiters' first steps (reading, queueing,
    subscribing or watching) ends each of them within a second with a LockError, not
    after a request timeout or their own timeout (15 s); the holder keeps the lock."""
    rnd = random.Random(name)
    holder = await locks.lock(name, ttl=30).acquire(timeout=5)
    try:
        for attempt in range(6):
            doomed = aiolock.connect(backend_url)
            await doomed.status(name)  # connected
            waiters = [asyncio.create_task(doomed.lock(name, ttl=30).acquire(timeout=15))
                       for _ in range(3)]
            await asyncio.sleep(rnd.uniform(0, 0.01))
            await doomed.aclose()
            for task in await ended_soon(waiters, f"attempt {attempt}"):
                error = task.exception()
                assert isinstance(error, aiolock.LockError), "".join(
                    traceback.format_exception(error) if error else [f"{task} returned"])
        assert not holder.lost and not holder.released and await locks.lock(name).locked()
    finally:
        await holder.release()


async def test_close_while_connecting_ends_the_calls_at_once(backend_url: str, name: str) -> None:
    """aclose() after 0, 2, 4... loop steps of a fresh connection's first calls (the
    connect itself in flight): each call ends within a second of the close with a
    result or a LockError -- ZooKeeper's waited for its connect timeout, etcd's raised
    grpc's UsageError -- and nothing stays held."""
    for steps in range(0, 24, 2):
        doomed = aiolock.connect(backend_url)
        calls = [asyncio.create_task(doomed.status(name)),
                 asyncio.create_task(doomed.lock(name, ttl=30).acquire(timeout=5)),
                 asyncio.create_task(doomed.lock(f"{name}-b", ttl=30).locked())]
        for _ in range(steps):
            await asyncio.sleep(0)
        await asyncio.wait_for(doomed.aclose(), 10)
        for task in await ended_soon(calls, f"after {steps} steps"):
            error = task.exception()
            assert error is None or isinstance(error, aiolock.LockError), "".join(
                traceback.format_exception(error))
            if error is None and isinstance(task.result(), aiolock.Lease):
                assert task.result().released, f"after {steps} steps: a lease outlived the close"
    async with aiolock.connect(backend_url) as other:
        assert not await other.lock(name).locked()


async def test_close_leaves_no_place_in_the_queue(
    locks: aiolock.Locks, backend_url: str, name: str
) -> None:
    """aclose() 0-50 ms after a waiter started (its first, busy attempt in flight or just
    answered): once the holder releases, nobody holds the name -- the server did not
    hand it to the closed connection's claim (Cluster and Sentinel did, for 30 s, when
    the close came as the fast path's attempt queued the claim)."""
    for delay in (0.0, 0.0, 0.001, 0.003, 0.01, 0.05):
        busy = await locks.lock(name, ttl=30).acquire(timeout=5)
        doomed = aiolock.connect(backend_url)
        await doomed.status(name)  # connected
        waiter = asyncio.create_task(doomed.lock(name, ttl=30).acquire(timeout=10))
        await asyncio.sleep(delay)
        await asyncio.wait_for(doomed.aclose(), 10)
        (outcome,) = await asyncio.gather(waiter, return_exceptions=True)
        assert isinstance(outcome, aiolock.LockError), repr(outcome)
        await busy.release()
        await asyncio.sleep(0.05)
        info = await locks.status(name)
        assert not info.held, f"closed {delay * 1000:.0f} ms after the waiter started: {info}"


async def test_close_ends_observe_at_once(locks: aiolock.Locks, backend_url: str, name: str) -> None:
    """An ``observe()`` of the closing connection ends within a second of the close
    (with a LockError): on ZooKeeper and Memcached it sat out its ttl / 2 poll."""
    need(locks, Capability.ELECTION)
    term = await locks.election(name, ttl=30).campaign(data="a").acquire(timeout=5)
    doomed = aiolock.connect(backend_url)
    seen: list[object] = []

    async def observe() -> None:
        async for leader in doomed.election(name, ttl=30).observe():
            seen.append(leader)

    task = asyncio.create_task(observe())
    try:
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen, "observe() gave nothing in 2 s"
        await doomed.aclose()
        started = time.monotonic()
        await asyncio.wait([task], timeout=5)
        assert task.done(), "observe() still iterating 5 s after aclose()"
        assert time.monotonic() - started < 1.0, f"observe() ended {time.monotonic() - started:.2f} s after"
        error = task.exception()
        assert error is None or isinstance(error, aiolock.LockError), repr(error)
    finally:
        task.cancel()
        await term.release()


async def test_fair_is_first_come_first_served(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.FAIR)
    lock = locks.lock(name, fair=True, ttl=5)
    first = await lock.acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        async with locks.lock(name, fair=True, ttl=5):
            order.append(i)
            await asyncio.sleep(0.005)

    tasks = []
    counts = True  # does the backend count its waiters? (then wait for each to queue)
    for i in range(10):
        tasks.append(asyncio.create_task(waiter(i)))
        counts = await queued(locks, name, i + 1, counts)  # each queues before the next
    await first.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order == list(range(10))


async def queued(locks: aiolock.Locks, name: str, waiters: int, counts: bool) -> bool:
    """Wait until the server counts ``waiters`` waiting (at most 2 s); a backend that
    does not count them (none seen for the first) gets 100 ms per waiter instead.
    Returns whether it counts."""
    await asyncio.sleep(0.03)
    if not counts:
        await asyncio.sleep(0.07)
        return False
    for _ in range(200):
        seen = (await locks.status(name)).waiters
        if seen >= waiters:
            return True
        if seen == 0 and waiters == 1 and _ >= 50:
            return False  # 0.5 s and still none: this backend does not count waiters
        await asyncio.sleep(0.01)
    return True


async def test_fair_across_connections(backend_url: str, name: str) -> None:
    conns = [aiolock.connect(backend_url) for _ in range(3)]
    try:
        for conn in conns:
            await conn.__aenter__()
        need(conns[0], Capability.FAIR)
        first = await conns[0].lock(name, fair=True).acquire()
        order: list[int] = []

        async def waiter(i: int) -> None:
            async with conns[i % 3].lock(name, fair=True):
                order.append(i)

        tasks = []
        for i in range(9):
            tasks.append(asyncio.create_task(waiter(i)))
            # the next one comes once this one is queued on the server (a loaded machine
            # can take longer than any fixed pause to get a waiter there)
            async with asyncio.timeout(5):
                while (await conns[0].backend.inspect(name)).waiters < i + 1:
                    await asyncio.sleep(0.01)
        await first.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert order == list(range(9))
    finally:
        for conn in conns:
            await conn.aclose()


async def test_rwlock(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.RWLOCK)
    rw = locks.rwlock(name, ttl=5)
    r1 = await rw.read().acquire(timeout=1)
    other = locks.rwlock(name, ttl=5)
    r2 = await asyncio.create_task(other.read().acquire(timeout=1))  # readers share
    writer = asyncio.create_task(other.write().acquire(timeout=5))
    await asyncio.sleep(0.1)
    assert not writer.done()
    late_reader = asyncio.create_task(other.read().acquire(timeout=5))
    await asyncio.sleep(0.1)
    assert not late_reader.done()  # a waiting writer is not starved by new readers
    await r1.release()
    await r2.release()
    w = await asyncio.wait_for(writer, 2)
    assert w.token > max(r1.token, r2.token)
    assert not late_reader.done()
    await w.release()
    r3 = await asyncio.wait_for(late_reader, 2)
    await r3.release()


async def test_semaphore(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.SEMAPHORE)
    sem = locks.semaphore(name, limit=3, ttl=5)
    inside = 0
    peak = 0

    async def user() -> None:
        nonlocal inside, peak
        async with sem as lease:
            assert isinstance(lease.token, int)
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    await asyncio.gather(*(user() for _ in range(20)))
    assert peak == 3


async def test_semaphore_dead_holder_permit_expires(backend_url: str, name: str) -> None:
    async with aiolock.connect(backend_url) as locks:
        need(locks, Capability.SEMAPHORE)
        crashed = aiolock.connect(backend_url)
        await crashed.__aenter__()
        held = await crashed.semaphore(name, limit=1, ttl=0.3).acquire()
        crashed._engine.abandon_for_demo()  # stops renewing without releasing, like a crash
        slack = 2.0 if backend_url.startswith("memcached://") else 0.0
        lease = await locks.semaphore(name, limit=1).acquire(timeout=2 + slack)
        del held
        await lease.release()


async def test_crashed_holder_frees_within_its_documented_bound(
    scenario: Scenario, backend_url: str, name: str
) -> None:
    """A holder that stops renewing (frozen, its connection kept): the lock is free again
    within the backend's documented dead-holder bound (tests/scenarios.py)."""
    ttl = 0.5
    async with aiolock.connect(backend_url) as locks:
        crashed = aiolock.connect(backend_url)
        await crashed.__aenter__()
        old = await crashed.lock(name, ttl=ttl).acquire()
        crashed._engine.abandon_for_demo()
        started = time.monotonic()
        bound = scenario.dead_holder(ttl)
        lease = await locks.lock(name).acquire(timeout=bound + 3)
        assert time.monotonic() - started < bound
        assert lease.token > old.token
        await lease.release()
        await crashed.backend.aclose()  # the "crashed" process's sockets (no release)


async def test_writer_that_gives_up_does_not_block_readers(locks: aiolock.Locks, name: str) -> None:
    need(locks, Capability.RWLOCK)
    reader = await locks.rwlock(name).read().acquire()
    with pytest.raises(aiolock.LockTimeout):
        await asyncio.create_task(locks.rwlock(name).write().acquire(timeout=0.1))
    other = await asyncio.create_task(locks.rwlock(name).read().acquire(timeout=0.5))
    await other.release()
    await reader.release()


async def test_release_after_close_is_a_no_op(backend_url: str, name: str) -> None:
    locks = aiolock.connect(backend_url)
    lease = await locks.lock(name).acquire()
    await locks.aclose()
    await lease.release()
    assert lease.released and not lease.lost
    with pytest.raises(aiolock.LockError, match="closed"):
        await locks.lock(name).acquire()


async def test_try_once_on_a_fair_lock(locks: aiolock.Locks, name: str) -> None:
    """timeout=0 means one try, also for a fair lock never waited on before."""
    need(locks, Capability.FAIR)
    lease = await locks.lock(name, fair=True).acquire(timeout=0)  # free: granted
    with pytest.raises(aiolock.LockTimeout):
        await asyncio.create_task(locks.lock(name, fair=True).acquire(timeout=0))
    await lease.release()
    other = await asyncio.create_task(locks.lock(name, fair=True).acquire(timeout=0))
    assert other.token > lease.token  # the timed-out try left no place in the queue
    await other.release()


async def test_waiters_on_many_names_are_all_woken(locks: aiolock.Locks) -> None:
    """Many tasks cycling many names at once: every release must reach its waiters (a
    missed signal would leave them to their retry timers and stall the run)."""
    names = [f"many-{uuid.uuid4().hex[:10]}-{i}" for i in range(10)]
    done = 0

    async def worker(i: int) -> None:
        nonlocal done
        for _ in range(5):
            async with locks.lock(names[i % len(names)], ttl=30):
                await asyncio.sleep(0.001)
            done += 1

    async with asyncio.timeout(20):  # seconds; a stall waits for ttl=30 retries
        await asyncio.gather(*(worker(i) for i in range(30)))
    assert done == 150


def test_each_backend_declares_what_it_documents(scenario: Scenario) -> None:
    missing = scenario.expects - scenario.capabilities
    assert not missing, f"{scenario.id} no longer declares {sorted(c.value for c in missing)}"


@contextlib.contextmanager
def dead_ports(how: str) -> Iterator[list[int]]:
    """Three loopback ports where nothing answers: ``refused`` (closed) or ``silent`` (a
    listening socket that never accepts nor answers)."""
    socks = [socket.socket() for _ in range(3)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
            if how == "silent":
                sock.listen(8)
        ports = [int(sock.getsockname()[1]) for sock in socks]
        if how == "refused":
            for sock in socks:
                sock.close()
        yield ports
    finally:
        for sock in socks:
            sock.close()


#: every distinct unreachable URL of the table (etcd-cluster shares etcd's)
UNREACHABLE = [s.param() for s in {s.bad_url: s for s in reversed(SCENARIOS) if s.bad_url}.values()]


@pytest.mark.parametrize("how", ["refused", "silent"])
@pytest.mark.parametrize("scenario", UNREACHABLE)
async def test_unreachable_server_is_backend_unavailable_in_bounded_time(
    scenario: Scenario, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SPEC §4: connecting, and a first acquire without ``async with``, raise
    BackendUnavailable within bounded time; the password is in no error and no log."""
    assert scenario.bad_url is not None
    caplog.set_level(logging.DEBUG, logger="aiolock")
    options = {"connect_timeout": 0.3, "request_timeout": 0.3}
    with dead_ports(how) as ports:
        url = scenario.bad_url.format(*ports)
        started = time.monotonic()
        with pytest.raises(aiolock.BackendUnavailable) as connecting:
            async with aiolock.connect(url, **options):
                pass
        assert time.monotonic() - started < 2.0
        locks = aiolock.connect(url, **options)
        started = time.monotonic()
        try:
            with pytest.raises(aiolock.BackendUnavailable) as acquiring:
                await locks.lock("x").acquire(timeout=0)
            # Sentinel: about 8 request timeouts (its sentinels asked in turn, more than once)
            assert time.monotonic() - started < 5.0
        finally:
            await locks.aclose()
    for error in (connecting.value, acquiring.value):
        while error is not None:
            assert SECRET not in str(error), repr(error)
            error = error.__cause__ or error.__context__
    assert SECRET not in caplog.text
