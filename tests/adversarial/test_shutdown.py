"""aclose() under waiters leaves nothing behind (issue 9 #5); a dead or silent server
fails every waiter within connect_timeout + request_timeout (issue 9 #6, SPEC §4);
replies that mean "not now" (READONLY, MASTERDOWN) are BackendUnavailable (#12)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import redis as sync_redis

import aiolock

from ..servers import RedisServer
from ..zk_server import ZooKeeperServer
from .servers import PasswordRedis


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


def _url(request: pytest.FixtureRequest, backend: str) -> str:
    if backend == "redis":
        return str(request.getfixturevalue("redis_server").url)
    zk: ZooKeeperServer = request.getfixturevalue("zk_server")
    return f"zookeeper://{zk.hosts}/adv-{uuid.uuid4().hex[:8]}"


async def _settle(tasks: list[asyncio.Task[Any]], within: float) -> list[BaseException | None]:
    """Wait for every task; return each one's exception (None if it returned)."""
    async with asyncio.timeout(within):
        out = await asyncio.gather(*tasks, return_exceptions=True)
    return [r if isinstance(r, BaseException) else None for r in out]


async def _unavailable_within(waiters: list[asyncio.Task[Any]], died: float, settle: float,
                              bound: float) -> None:
    """Every waiter ends in BackendUnavailable, the last ``bound`` seconds after ``died``."""
    ended: list[float] = []
    for t in waiters:
        t.add_done_callback(lambda _t: ended.append(time.monotonic() - died))
    for r in await _settle(waiters, settle):
        assert isinstance(r, aiolock.BackendUnavailable), repr(r)
    assert max(ended) < bound, f"waiters failed at {sorted(round(e, 1) for e in ended)} s"


@pytest.mark.parametrize("backend", ["redis", "zookeeper"])
async def test_aclose_with_fair_waiters_and_writers(request: pytest.FixtureRequest,
                                                    backend: str) -> None:
    url = _url(request, backend)
    name, rw = f"f-{uuid.uuid4().hex}", f"rw-{uuid.uuid4().hex}"
    async with aiolock.connect(url) as a, aiolock.connect(url) as c:
        holder = await a.lock(name, ttl=20, fair=True).acquire()
        reader = await a.rwlock(rw, ttl=20).read().acquire()
        b = aiolock.connect(url)
        waiters = [asyncio.create_task(b.lock(name, ttl=20, fair=True).acquire())
                   for _ in range(5)]
        writers = [asyncio.create_task(b.rwlock(rw, ttl=20).write().acquire())
                   for _ in range(3)]
        await asyncio.sleep(0.5)
        assert not any(t.done() for t in waiters + writers)
        async with asyncio.timeout(10):
            await b.aclose()
        results = await _settle(waiters + writers, 5)
        for r in results:  # every waiter of the closed connection ended, with an aiolock error
            assert isinstance(r, (aiolock.LockError, asyncio.CancelledError)), repr(r)
        await holder.release()
        await reader.release()
        t0 = time.monotonic()
        async with asyncio.timeout(10):
            lease = await c.lock(name, ttl=20, fair=True).acquire()
            took_lock = time.monotonic() - t0
            t0 = time.monotonic()
            wlease = await c.rwlock(rw, ttl=20).write().acquire()
            took_write = time.monotonic() - t0
        assert took_lock < 1.0, f"fair newcomer waited {took_lock:.1f}s after aclose()"
        assert took_write < 1.0, f"writer waited {took_write:.1f}s after aclose()"
        await lease.release()
        await wlease.release()


async def test_aclose_releases_what_it_holds(request: pytest.FixtureRequest) -> None:
    url = _url(request, "redis")
    name = f"h-{uuid.uuid4().hex}"
    b = aiolock.connect(url)
    lease = await b.lock(name, ttl=20).acquire()
    await b.semaphore(name + "s", limit=1, ttl=20).acquire()
    await b.aclose()
    async with aiolock.connect(url) as c:
        async with asyncio.timeout(2):
            again = await c.lock(name, ttl=20).acquire(timeout=0)
            assert again.token > lease.token
            await again.release()
            permit = await c.semaphore(name + "s", limit=1, ttl=20).acquire(timeout=0)
            await permit.release()
    # after aclose(), using the connection is an error, not a hang
    with pytest.raises((aiolock.LockError, RuntimeError)):
        async with asyncio.timeout(3):
            await b.lock(name).acquire(timeout=0)


async def test_aclose_twice_and_concurrently(request: pytest.FixtureRequest) -> None:
    b = aiolock.connect(_url(request, "redis"))
    lease = await b.lock(f"x-{uuid.uuid4().hex}").acquire()
    async with asyncio.timeout(10):
        await asyncio.gather(b.aclose(), b.aclose())
        await b.aclose()
    assert lease.released or lease.lost


# --- a dead or silent server -----------------------------------------------------------

KINDS: dict[str, Callable[[aiolock.Locks, str], Coroutine[Any, Any, Any]]] = {
    "lock": lambda c, n: c.lock(n, ttl=10).acquire(),
    "fair": lambda c, n: c.lock(n, ttl=10, fair=True).acquire(),
    "write": lambda c, n: c.rwlock(n, ttl=10).write().acquire(),
    "semaphore": lambda c, n: c.semaphore(n, limit=1, ttl=10).acquire(),
}


@pytest.mark.parametrize("kind", list(KINDS))
async def test_waiters_fail_together_when_server_dies(own_redis: RedisServer, kind: str) -> None:
    """(A SIGSTOPped server is not in this bound: waiters send nothing while they wait,
    and see it at their ttl-bounded retry; measured 4.8-10.5 s with ttl=10.)"""
    fault = "kill"
    name = f"d-{uuid.uuid4().hex}"
    start = KINDS[kind]
    async with aiolock.connect(own_redis.url, connect_timeout=1, request_timeout=1) as holder:
        held = await start(holder, name)  # keep it: a collected Lease is released
        locks = aiolock.connect(own_redis.url, connect_timeout=1, request_timeout=1)
        try:
            waiters: list[asyncio.Task[Any]] = [
                asyncio.create_task(start(locks, name)) for _ in range(10)]
            await asyncio.sleep(0.5)
            assert not any(t.done() for t in waiters)
            died = time.monotonic()
            if fault == "kill":
                own_redis.kill()
            else:
                own_redis.pause()
            await _unavailable_within(waiters, died, 15, 2.5)
            assert held is not None
        finally:
            if fault == "pause":
                own_redis.resume()
            async with asyncio.timeout(10):
                await locks.aclose()


async def test_new_acquire_on_silent_server_bounded(own_redis: RedisServer) -> None:
    async with aiolock.connect(own_redis.url, connect_timeout=1, request_timeout=1) as locks:
        await (await locks.lock("warm").acquire()).release()
        own_redis.pause()
        try:
            t0 = time.monotonic()
            with pytest.raises(aiolock.BackendUnavailable):
                async with asyncio.timeout(10):
                    await locks.lock(f"s-{uuid.uuid4().hex}").acquire()
            assert time.monotonic() - t0 < 2.5
            t0 = time.monotonic()
            with pytest.raises(aiolock.BackendUnavailable):
                async with asyncio.timeout(10):
                    await locks.status("warm")
            assert time.monotonic() - t0 < 2.5
        finally:
            own_redis.resume()
        # and it comes back
        async with asyncio.timeout(10):
            while True:
                try:
                    lease = await locks.lock(f"s-{uuid.uuid4().hex}").acquire(timeout=1)
                    break
                except aiolock.BackendUnavailable:
                    await asyncio.sleep(0.2)
            await lease.release()


async def test_unreachable_connect_bounded() -> None:
    # 192.0.2.1 (TEST-NET-1): packets go nowhere, a connect hangs until its timeout
    for url in ("redis://192.0.2.1:6379/0", "zookeeper://192.0.2.1:2181/x",
                "memcached://192.0.2.1:11211"):
        t0 = time.monotonic()
        with pytest.raises(aiolock.BackendUnavailable):
            async with asyncio.timeout(15), aiolock.connect(url, connect_timeout=1) as locks:
                await locks.lock("x").acquire(timeout=0)
        assert time.monotonic() - t0 < 3, url


@pytest.mark.parametrize("extra", [
    ["--replicaof", "127.0.0.1", "1"],  # a replica: writes get READONLY
    ["--replicaof", "127.0.0.1", "1", "--replica-serve-stale-data", "no"],  # MASTERDOWN
])
async def test_not_now_replies_are_backend_unavailable(extra: list[str]) -> None:
    server = PasswordRedis(extra=extra).start()
    try:
        async with asyncio.timeout(20):
            with pytest.raises(aiolock.BackendUnavailable):
                async with aiolock.connect(server.url, connect_timeout=1,
                                           request_timeout=1) as locks:
                    await locks.lock(f"r-{uuid.uuid4().hex}").acquire(timeout=1)
    finally:
        server.close()


async def test_aclose_bounded_on_dead_redis(own_redis: RedisServer) -> None:
    name = f"k-{uuid.uuid4().hex}"
    locks = aiolock.connect(own_redis.url, connect_timeout=1, request_timeout=1)
    leases = [await locks.lock(f"{name}{i}", ttl=10).acquire() for i in range(5)]
    fair = await locks.lock(name + "f", ttl=10, fair=True).acquire()
    waiter = asyncio.create_task(locks.lock(name + "f", ttl=10, fair=True).acquire())
    await asyncio.sleep(0.3)
    own_redis.kill()
    t0 = time.monotonic()
    async with asyncio.timeout(15):
        await locks.aclose()
    assert time.monotonic() - t0 < 2.5, f"aclose() took {time.monotonic() - t0:.1f}s"
    (r,) = await _settle([waiter], 5)
    assert isinstance(r, aiolock.LockError), repr(r)
    assert leases and fair is not None


async def test_aclose_bounded_on_dead_zookeeper() -> None:
    zk = ZooKeeperServer().start()
    try:
        locks = aiolock.connect(f"zookeeper://{zk.hosts}/adv", connect_timeout=1,
                                request_timeout=1)
        lease = await locks.lock("k", ttl=10).acquire()
        zk.kill()
        t0 = time.monotonic()
        async with asyncio.timeout(20):
            await locks.aclose()
        assert time.monotonic() - t0 < 3, f"aclose() took {time.monotonic() - t0:.1f}s"
        assert lease is not None
    finally:
        zk.close()


async def test_busy_script_is_backend_unavailable() -> None:
    """Another client runs a long script: Redis answers BUSY to everyone else. That is
    'cannot serve now' (BackendUnavailable, retryable), not a LockError."""
    server = PasswordRedis(extra=["--lua-time-limit", "50"]).start()
    stop = threading.Event()

    def spin() -> None:
        client = sync_redis.Redis(port=server.port)
        try:
            client.eval("local i = 0 while true do i = i + 1 end", 0)
        except Exception:
            pass
        finally:
            client.close()
            stop.set()

    try:
        async with aiolock.connect(server.url, connect_timeout=1, request_timeout=1) as locks:
            await (await locks.lock("warm").acquire()).release()
            thread = threading.Thread(target=spin, daemon=True)
            thread.start()
            await asyncio.sleep(0.3)
            with pytest.raises(aiolock.BackendUnavailable):
                async with asyncio.timeout(10):
                    await locks.lock(f"b-{uuid.uuid4().hex}").acquire(timeout=1)
    finally:
        killer = sync_redis.Redis(port=server.port)
        with contextlib.suppress(Exception):
            killer.script_kill()
        killer.close()
        stop.wait(5)
        server.close()


@pytest.mark.slow  # own ZooKeeper server, ~5 s
async def test_zookeeper_waiters_fail_when_server_dies() -> None:
    """A dead ZooKeeper: waiters end with BackendUnavailable in bounded time (at the
    latest when the session can no longer be kept), they never hang."""
    zk = ZooKeeperServer().start()
    try:
        url = f"zookeeper://{zk.hosts}/adv"
        opts = {"connect_timeout": 1, "request_timeout": 1, "session_timeout": 2}
        async with aiolock.connect(url, **opts) as a:
            held = await a.lock("z", ttl=5).acquire()
            b = aiolock.connect(url, **opts)
            waiters: list[asyncio.Task[Any]] = [
                asyncio.create_task(b.lock("z", ttl=5).acquire()) for _ in range(5)]
            await asyncio.sleep(0.5)
            assert not any(t.done() for t in waiters)
            died = time.monotonic()
            zk.kill()
            await _unavailable_within(waiters, died, 20, 2 + 1 + 1.5)
            async with asyncio.timeout(10):
                await held.wait_lost()
            async with asyncio.timeout(10):
                await b.aclose()
    finally:
        zk.close()



@pytest.mark.parametrize("release_after", [0.0, 0.3])
async def test_waiter_survives_pubsub_kill(redis_server: RedisServer,
                                           release_after: float) -> None:
    """CLIENT KILL TYPE pubsub while a waiter waits, then the holder releases (during or
    after the reconnect): the waiter gets the lock promptly, not at the ttl retry."""
    name = f"p-{uuid.uuid4().hex}"
    async with aiolock.connect(redis_server.url) as a, aiolock.connect(redis_server.url) as b:
        held = await a.lock(name, ttl=20).acquire()
        waiter = asyncio.create_task(b.lock(name, ttl=20).acquire())
        await asyncio.sleep(0.3)
        admin = sync_redis.Redis(port=redis_server.port)
        try:
            killed = admin.client_kill_filter(_type="pubsub")
        finally:
            admin.close()
        assert killed >= 1
        await asyncio.sleep(release_after)
        t0 = time.monotonic()
        await held.release()
        async with asyncio.timeout(25):
            lease = await waiter
        took = time.monotonic() - t0
        await lease.release()
        assert took < 1.5, f"waiter woke {took:.1f}s after the release"


async def test_lease_survives_connection_kill(redis_server: RedisServer) -> None:
    """Every connection of ours killed by the server (CLIENT KILL): the watchdog
    reconnects and renews; the lease is not lost and the lock stays ours."""
    name = f"k-{uuid.uuid4().hex}"
    async with aiolock.connect(f"{redis_server.url}?client_name=adv-victim") as a, \
            aiolock.connect(redis_server.url) as b:
        lease = await a.lock(name, ttl=1.5).acquire()
        admin = sync_redis.Redis(port=redis_server.port, decode_responses=True)
        try:
            for _ in range(2):
                for c in admin.client_list():
                    if c["name"] == "adv-victim" or c["cmd"] in ("evalsha", "eval"):
                        admin.client_kill_filter(_id=c["id"])
                await asyncio.sleep(0.4)
        finally:
            admin.close()
        await asyncio.sleep(0.8)
        assert not lease.lost
        with pytest.raises(aiolock.LockTimeout):
            await b.lock(name, ttl=1.5).acquire(timeout=0)
        await lease.release()
