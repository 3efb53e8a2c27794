"""Fault injection against real Redis servers: dead, stopped and racing holders, a
restarted, flushed, paused or unreachable server, and cancellation storms.

Each test asserts what a bug would break (SPEC §2: watchdog, lease loss, cancellation
safety; §4: bounded connects) and is bounded in time (short TTLs). Holders in other OS
processes are the scripts in ``tests/procs/``. Tests that kill, pause or flush a server
use their own :class:`RedisServer`, so the session server stays untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import signal
import socket
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import aiolock

from ._workers import Procs, procs, run_workers  # noqa: F401 -- fixture
from .servers import RedisServer

PROCS = Path(__file__).parent / "procs"

pytestmark = pytest.mark.timeout(60)


# -- helpers -------------------------------------------------------------------------------


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A private redis-server for tests that kill, pause or flush it."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            if server.proc is not None:
                server.resume()
        server.close()


class Held:
    """Hold ``lock`` in a task's ``async with`` body that sleeps until cancelled; record
    when (and whether) the body was cancelled and what the block raised."""

    def __init__(self, lock: aiolock.Lock) -> None:
        self.lock = lock
        self.acquired: asyncio.Future[aiolock.Lease] = asyncio.get_running_loop().create_future()
        self.cancelled_at: float | None = None
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with self.lock as lease:
            self.acquired.set_result(lease)
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled_at = time.monotonic()
                raise

    async def lease(self) -> aiolock.Lease:
        return await asyncio.wait_for(asyncio.shield(self.acquired), 5)

    async def expect_lost(self, within: float) -> aiolock.LockLost:
        """The block must end with LockLost within ``within`` s; returns the error."""
        try:
            async with asyncio.timeout(within):
                await asyncio.shield(self.task)
        except TimeoutError:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
            raise AssertionError(f"the lease was not reported lost within {within} s") from None
        except aiolock.LockLost as exc:
            return exc
        raise AssertionError("the async with block ended without raising LockLost")


# -- 1. a holder process killed with SIGKILL ------------------------------------------------


async def test_killed_holder_lease_expires_within_ttl(redis_url: str, name: str, procs: Procs) -> None:  # noqa: F811
    ttl = 1.5
    holder = await procs.spawn("holder.py", redis_url, name, str(ttl))
    old_token = int((await holder.expect("ACQUIRED", 15)).split()[1])
    async with aiolock.connect(redis_url) as locks:
        lock = locks.lock(name, ttl=ttl)
        # Past one ttl: the holder's watchdog (another process) must have kept it alive.
        await asyncio.sleep(ttl + 0.2)
        with pytest.raises(aiolock.LockTimeout):
            await lock.acquire(timeout=0)
        assert (await locks.status(name)).token == old_token

        holder.signal(signal.SIGKILL)
        killed = time.monotonic()
        lease = await lock.acquire(timeout=3 * ttl)
        elapsed = time.monotonic() - killed
        try:
            assert await holder.finish(5) == -signal.SIGKILL
            # The server had confirmed a renewal at most ttl/3 before the kill ...
            assert elapsed >= ttl * 2 / 3 - 0.15, f"taken over {elapsed:.3f}s after the kill"
            # ... and lets it expire by ttl; the waiter retries within the holder's ttl.
            assert elapsed <= ttl + ttl / 3 + 0.5, f"acquirable only {elapsed:.3f}s after the kill"
            assert lease.token > old_token
        finally:
            await lease.release()
        assert not await lock.locked()


async def test_waiter_retries_promptly_when_holder_lease_runs_out(redis_url: str, name: str) -> None:
    """SPEC §2: a waiter's retry is bounded by the *holder's* remaining ttl, so a holder
    that dies (no release message) delays it by at most that. Race covered here: the
    waiter retries in the very millisecond the holder's key expires (PTTL says 0).

    A dead holder is simulated by a lease that is never renewed (watchdog=False) whose
    key is then set to expire in ~150 ms; the waiter (ttl=30) must get the lock within
    that + 0.5 s, not after its own ttl/3 or its timeout. The race is hit in roughly one
    try in six, so the test tries up to 25 times and stops at the first late one."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with aiolock.connect(redis_url) as locks, aiolock.connect(redis_url) as ghost:
            keep = []
            for i in range(25):
                n = f"{name}-{i}"
                keep.append(await ghost.lock(n, ttl=30, watchdog=False).acquire(timeout=1))
                keys = [k async for k in client.scan_iter(match=f"*{n}*", count=1000)]
                keys = [k for k in keys if await client.pttl(k) > 0]
                assert len(keys) == 1, f"expected one expiring key for the held lock: {keys}"
                expires_in = (150 + i) / 1000
                await client.pexpire(keys[0], round(expires_in * 1000))
                started = time.monotonic()
                lease = await locks.lock(n, ttl=30).acquire(timeout=5)
                took = time.monotonic() - started
                await lease.release()
                assert took <= expires_in + 0.5, (
                    f"try {i}: the holder's lease ran out after {expires_in:.3f}s, "
                    f"but the waiter got the lock only after {took:.3f}s"
                )
    finally:
        await client.aclose()


# -- 2. a holder process stopped (SIGSTOP) past its ttl --------------------------------------


async def test_stopped_holder_loses_lease_and_never_writes_stale(
    redis_url: str, name: str, procs: Procs  # noqa: F811
) -> None:
    ttl = 1.0
    key = f"fence:{name}"
    holder = await procs.spawn("holder.py", redis_url, name, str(ttl), key)
    old_token = int((await holder.expect("ACQUIRED", 15)).split()[1])
    await holder.expect("WRITE", 5)
    await asyncio.sleep(0.4)  # a few renewals and writes

    client = aioredis.Redis.from_url(redis_url)
    try:
        async with aiolock.connect(redis_url) as locks:
            lock = locks.lock(name, ttl=10)
            holder.signal(signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(aiolock.LockTimeout):
                await lock.acquire(timeout=0)  # still held: its lease has not run out yet
            lease = await lock.acquire(timeout=3)
            took = time.monotonic() - stopped
            assert took <= ttl + 0.5, f"the stopped holder's lease ran {took:.3f}s (ttl {ttl})"
            assert lease.token > old_token

            resource = aiolock.RedisFencedResource(client, key)
            assert await resource.write(lease.token, "fresh")
            _, rejected_before = await resource.counts()

            await asyncio.sleep(max(0.0, stopped + 2.5 - time.monotonic()))
            holder.signal(signal.SIGCONT)
            resumed = time.monotonic()
            rc = await holder.finish(5)
            out = holder.output()
            assert rc == 3, f"holder exit code {rc}, expected 3 (LockLost)\n{out}"
            lost_line = next(line for line in holder.lines if line.startswith("LOST"))
            lost_at = float(lost_line.split()[1])
            assert lost_at - resumed < 1.0, f"holder noticed the loss {lost_at - resumed:.3f}s after SIGCONT"

            # No fenced write was even attempted after the holder resumed.
            writes = [line.split() for line in holder.lines if line.startswith("WRITE")]
            late = [w for w in writes if float(w[1]) >= resumed]
            assert not late, f"stale holder wrote after resuming: {late}\n{out}"
            # The resource still has the new holder's write; at most one write that was
            # already past its check when SIGSTOP hit may have reached it (and was refused).
            token, value = await resource.read()
            assert (token, value) == (lease.token, b"fresh")
            _, rejected = await resource.counts()
            assert rejected - rejected_before <= 1, f"{rejected - rejected_before} stale writes refused"

            # The stale holder's clean-up must not have freed the new holder's lock.
            info = await locks.status(name)
            assert info.held and info.token == lease.token
            assert not lease.lost
            await lease.release()
            assert not await lock.locked()
    finally:
        await client.aclose()


# -- 3. mutual exclusion across OS processes -----------------------------------------------


async def test_mutual_exclusion_across_processes(
    redis_url: str, name: str, procs: Procs  # noqa: F811
) -> None:
    nprocs, ntasks, duration = 4, 8, 3.0
    _, per_worker = await run_workers(procs, redis_url, name, nprocs, ntasks, duration)
    per_proc = [len(mine) for mine in per_worker]
    records = [r for mine in per_worker for r in mine]
    print(f"critical sections per process: {per_proc}")
    records.sort(key=lambda r: r[1])
    overlaps = [(a, b) for a, b in pairwise(records) if b[1] < a[2]]
    assert not overlaps, f"{len(overlaps)} overlapping critical sections, e.g. {overlaps[:3]}"
    tokens = [r[0] for r in records]
    bad = [(a, b) for a, b in pairwise(tokens) if b <= a]
    assert not bad, f"tokens not strictly increasing in hold order: {bad[:5]}"
    assert len(records) >= 300, f"only {len(records)} critical sections in {duration}s: {per_proc}"
    assert sum(1 for n in per_proc if n > 0) >= nprocs - 1, f"per process: {per_proc}"


# -- 4. the Redis server restarted (no persistence) under a held lease ---------------------


@pytest.mark.parametrize("down_for", [0.0, 2.5], ids=["restart", "down-2.5s"])
async def test_server_restart_loses_lease_and_recovers(
    own_server: RedisServer, name: str, down_for: float
) -> None:
    ttl = 2.0
    url = own_server.url
    other = f"{name}-other"
    async with aiolock.connect(url) as locks, aiolock.connect(url) as peer:
        # Give the peer a live pub/sub connection before the crash (it must come back).
        first = await locks.lock(other, ttl=10).acquire(timeout=1)
        waiting = asyncio.create_task(peer.lock(other, ttl=10).acquire(timeout=5))
        await asyncio.sleep(0.2)
        await first.release()
        await (await waiting).release()

        held = Held(locks.lock(name, ttl=ttl))
        lease = await held.lease()
        await asyncio.sleep(ttl / 2)
        killed = time.monotonic()
        own_server.kill()
        if down_for:
            await asyncio.sleep(down_for)
        else:
            await asyncio.to_thread(own_server.start)
        exc = await held.expect_lost(ttl + 1.5)
        lost_after = time.monotonic() - killed
        assert held.cancelled_at is not None, "the body was not cancelled"
        took = held.cancelled_at - killed
        assert took <= ttl + 0.3, f"lost {took:.3f}s after the crash"
        assert lease.lost
        assert str(lease.token) in str(exc)

        if down_for:
            # While the server is down, an acquire fails fast and clearly.
            started = time.monotonic()
            with pytest.raises(aiolock.BackendUnavailable):
                await locks.lock(name, ttl=ttl).acquire(timeout=1)
            assert time.monotonic() - started < 2.0
            await asyncio.to_thread(own_server.start)

        # The library recovers: a new acquire works (tokens may restart: no persistence).
        again = await locks.lock(name, ttl=ttl).acquire(timeout=2)
        assert not again.lost
        assert (await locks.status(name)).held
        await again.release()
        assert not await locks.lock(name).locked()

        # Cross-process wake-ups work again: the peer is woken by the release message,
        # not by its retry timer (the holder's ttl is 10 s).
        first = await locks.lock(other, ttl=10).acquire(timeout=2)
        waiting = asyncio.create_task(peer.lock(other, ttl=10).acquire(timeout=8))
        await asyncio.sleep(0.3)
        released = time.monotonic()
        await first.release()
        second = await waiting
        woke = time.monotonic() - released
        await second.release()
        assert woke < 1.5, f"peer got the lock {woke:.3f}s after the release (pub/sub not back?)"
        assert lost_after < ttl + 1.5


# -- 5. FLUSHALL under a held lease ---------------------------------------------------------


async def test_flushall_loses_lease_at_next_renewal(own_server: RedisServer, name: str) -> None:
    ttl = 1.5
    client = aioredis.Redis.from_url(own_server.url)
    try:
        async with aiolock.connect(own_server.url) as locks:
            held = Held(locks.lock(name, ttl=ttl))
            lease = await held.lease()
            await asyncio.sleep(0.2)
            flushed = time.monotonic()
            await client.flushall()
            await held.expect_lost(ttl + 1.0)
            assert held.cancelled_at is not None, "the body was not cancelled"
            took = held.cancelled_at - flushed
            assert took <= ttl / 3 + 0.3, f"lost {took:.3f}s after FLUSHALL (renewal every {ttl / 3:.2f}s)"
            assert lease.lost
            assert not (await locks.status(name)).held
            again = await locks.lock(name, ttl=ttl).acquire(timeout=1)
            await again.release()
    finally:
        await client.aclose()


# -- 6. a storm of random cancellations ----------------------------------------------------


async def test_random_cancellation_leaves_nothing_held(redis_url: str, name: str) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    stats = dict(granted=0, acquire_cancelled=0, release_cancelled=0, timeouts=0)
    inside = 0
    violations: list[str] = []

    def enter() -> None:
        nonlocal inside
        inside += 1
        stats["granted"] += 1
        if inside != 1:
            violations.append(f"{inside} holders at once")

    def leave() -> None:
        nonlocal inside
        inside -= 1

    kept: list[aiolock.Lease] = []  # every lease the test saw stays referenced until the end

    async def use(lease: aiolock.Lease) -> None:
        kept.append(lease)
        enter()
        try:
            await asyncio.sleep(rng.random() * 0.003)
        finally:
            leave()
        if rng.random() < 0.5:  # cancel the release itself
            task = asyncio.create_task(lease.release())
            # at least one step, so the task is inside release() (not cancelled unstarted)
            for _ in range(rng.randrange(1, 4)):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                stats["release_cancelled"] += 1
                if rng.random() < 0.5:
                    await lease.release()  # may be called again
        else:
            await lease.release()

    async with aiolock.connect(redis_url) as locks, aiolock.connect(redis_url) as other:
        sessions = [locks, other]

        async def one(i: int) -> None:
            lock = sessions[i % 2].lock(name, ttl=10)
            await asyncio.sleep(rng.random() * 0.5)  # spread the storm over half a second
            delay = rng.random() * 0.02
            mode = rng.randrange(4)
            if mode == 0:
                try:
                    lease = await asyncio.wait_for(lock.acquire(), delay)
                except TimeoutError:
                    stats["acquire_cancelled"] += 1
                    return
                await use(lease)
            elif mode == 1:
                task = asyncio.create_task(lock.acquire())
                await asyncio.sleep(delay)
                task.cancel()
                try:
                    lease = await task
                except asyncio.CancelledError:
                    stats["acquire_cancelled"] += 1
                    return
                await use(lease)
            elif mode == 2:

                async def body() -> None:
                    async with lock:
                        enter()
                        try:
                            await asyncio.sleep(rng.random() * 0.003)
                        finally:
                            leave()

                body_task = asyncio.create_task(body())
                await asyncio.sleep(delay)
                body_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await body_task
            else:
                try:
                    lease = await lock.acquire(timeout=delay)
                except aiolock.LockTimeout:
                    stats["timeouts"] += 1
                    return
                await use(lease)

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            async with asyncio.timeout(20):
                await asyncio.gather(*(one(i) for i in range(200)))
            gc.collect()
            # A cancelled release finishes in the background: give it a round trip or two.
            deadline = time.monotonic() + 1.0
            while await locks.lock(name).locked() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        info = await locks.status(name)
        context = f"seed={seed} stats={stats} status={info}"
        assert not violations, f"{violations[:3]} {context}"
        assert not await locks.lock(name).locked(), f"still held after the storm: {context}"
        assert not info.held, context
        # A lease the library made but never handed to the test (they are all in `kept`).
        leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert not leaked, f"leases dropped inside the library: {leaked[:3]} {context}"
        assert stats["granted"] >= 10 and stats["acquire_cancelled"] >= 10, context
        for session in sessions:
            lease = await session.lock(name, ttl=10).acquire(timeout=1)
            await lease.release()
    async with aiolock.connect(redis_url) as fresh:
        lease = await fresh.lock(name).acquire(timeout=1)
        await lease.release()
    assert all(lease.released or not lease.lost for lease in kept)


async def test_cancelled_release_then_dropped_lease_is_not_reported_leaked(
    own_server: RedisServer, name: str
) -> None:
    """SPEC §2: a cancelled release finishes in the background. The user did release, so
    dropping the lease while that background release is still in flight must not warn
    "garbage collected while held" (nor release it a second time). The server is paused
    so that the background release is reliably still in flight."""
    async with aiolock.connect(own_server.url) as locks:
        lock = locks.lock(name, ttl=10)
        lease = await lock.acquire(timeout=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            own_server.pause()
            try:
                task = asyncio.create_task(lease.release())
                await asyncio.sleep(0.05)  # inside release(), waiting for the server
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                ref = weakref.ref(lease)
                del lease, task
                deadline = time.monotonic() + 2.0
                while ref() is not None and time.monotonic() < deadline:
                    gc.collect()
                    await asyncio.sleep(0.01)
                assert ref() is None, "test setup: the lease was not collected"
            finally:
                own_server.resume()
            deadline = time.monotonic() + 2.0
            while await lock.locked() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        assert not await lock.locked(), "the cancelled release did not finish in the background"
        messages = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert not messages, messages


# -- 7. an unreachable server ---------------------------------------------------------------


@pytest.fixture
def blackhole() -> Iterator[int]:
    """A port whose accept queue is full: the kernel drops new SYNs (connect hangs)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        fillers.append(s)
    time.sleep(0.1)
    try:
        yield port
    finally:
        for s in fillers:
            s.close()
        srv.close()


async def test_connect_to_blackhole_is_bounded(blackhole: int) -> None:
    url = f"redis://127.0.0.1:{blackhole}/0"
    started = time.monotonic()
    with pytest.raises(aiolock.BackendUnavailable):
        async with aiolock.connect(url, connect_timeout=1):
            pass
    took = time.monotonic() - started
    assert 0.9 <= took < 2.0, f"gave up after {took:.3f}s (connect_timeout=1)"


async def test_connect_to_paused_server_is_bounded(own_server: RedisServer) -> None:
    own_server.pause()  # the kernel still completes the handshake; nothing answers
    try:
        started = time.monotonic()
        with pytest.raises(aiolock.BackendUnavailable):
            async with aiolock.connect(own_server.url, connect_timeout=1):
                pass
        took = time.monotonic() - started
        assert took < 2.0, f"gave up after {took:.3f}s (connect_timeout=1)"
    finally:
        own_server.resume()


# -- 8. a paused Redis under a held lease ------------------------------------------------------


async def test_paused_server_lease_lost_by_last_confirmed_expiry(
    own_server: RedisServer, name: str
) -> None:
    ttl = 1.5
    async with aiolock.connect(own_server.url) as locks:
        backend: Any = locks.backend
        renewals: list[tuple[float, list[int | None]]] = []
        renew = backend.renew

        async def recording_renew(claims: Any) -> list[int | None]:
            sent = time.monotonic()
            granted: list[int | None] = await renew(claims)
            renewals.append((sent, granted))
            return granted

        backend.renew = recording_renew  # the watchdog calls backend.renew
        held = Held(locks.lock(name, ttl=ttl))
        lease = await held.lease()
        await asyncio.sleep(1.1)
        assert renewals, "the watchdog did not renew within 1.1 s (ttl/3 = 0.5 s)"
        own_server.pause()
        paused = time.monotonic()
        try:
            await held.expect_lost(ttl + 1.5)
            assert held.cancelled_at is not None, "the body was not cancelled"
            confirmed = [sent for sent, granted in renewals if granted and granted[0]]
            last_sent = max(confirmed)
            expiry = last_sent + ttl
            lost_at = held.cancelled_at
            assert lost_at <= expiry + 0.1, (
                f"lost {lost_at - expiry:.3f}s after the last confirmed expiry "
                f"(renewal sent {paused - last_sent:.3f}s before the pause)"
            )
            assert lost_at <= paused + ttl + 0.1
            assert lost_at >= paused + ttl / 3 - 0.1, "declared lost before it could have expired"
            assert lease.lost
        finally:
            own_server.resume()
        again = await locks.lock(name, ttl=ttl).acquire(timeout=3)
        await again.release()


async def test_acquire_timeout_honoured_while_server_paused(own_server: RedisServer, name: str) -> None:
    """``acquire(timeout=0.5)`` must not hang for the request timeout on a silent server."""
    async with aiolock.connect(own_server.url) as locks:
        await (await locks.lock(name).acquire(timeout=1)).release()  # connected
        own_server.pause()
        try:
            started = time.monotonic()
            with pytest.raises((aiolock.LockTimeout, aiolock.BackendUnavailable)):
                await locks.lock(f"{name}-{uuid.uuid4().hex[:6]}").acquire(timeout=0.5)
            took = time.monotonic() - started
            assert took < 1.5, f"acquire(timeout=0.5) returned after {took:.3f}s"
        finally:
            own_server.resume()
