"""Bad arguments -> ValueError saying what is accepted (SPEC §4); names, ttls, timeouts,
URLs and odd objects given to connect() (issue 9 #8-#11)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import fakeredis
import pytest
import redis
import redis.asyncio
import redis.asyncio.sentinel

import aiolock

from ..servers import RedisServer

BAD_NUMBERS = [0, -1, float("nan"), float("inf"), float("-inf"), 1e16, 10**30, -0.0]


@pytest.fixture(params=["memory", "redis", "zookeeper"])
async def locks(request: pytest.FixtureRequest) -> Any:
    if request.param == "memory":
        url = f"memory://adv-{uuid.uuid4().hex[:8]}"
    elif request.param == "redis":
        url = request.getfixturevalue("redis_server").url
    else:
        url = f"zookeeper://{request.getfixturevalue('zk_server').hosts}/adv-{uuid.uuid4().hex[:8]}"
    async with aiolock.connect(url) as conn:
        yield conn


@pytest.mark.parametrize("ttl", [*BAD_NUMBERS, "30", None, True])
async def test_bad_ttl(locks: aiolock.Locks, ttl: Any) -> None:
    async with asyncio.timeout(5):
        with pytest.raises(ValueError, match="ttl"):
            lock = locks.lock(f"n-{uuid.uuid4().hex}", ttl=ttl)
            lease = await lock.acquire(timeout=0)
            await lease.release()


@pytest.mark.parametrize("kind", ["rwlock", "semaphore"])
@pytest.mark.parametrize("ttl", [float("nan"), 1e16, -3])
async def test_bad_ttl_other_primitives(locks: aiolock.Locks, kind: str, ttl: float) -> None:
    async with asyncio.timeout(5):
        with pytest.raises(ValueError, match="ttl"):
            if kind == "rwlock":
                async with locks.rwlock(f"n-{uuid.uuid4().hex}", ttl=ttl).write():
                    pass
            else:
                async with locks.semaphore(f"n-{uuid.uuid4().hex}", limit=2, ttl=ttl):
                    pass


async def test_documented_ttl_range(locks: aiolock.Locks) -> None:
    """README: ttl from 0.001 to 2,000,000 seconds, the one maximum of every backend."""
    for bad in (0.0009, 2_000_000.5, 2_000_001):
        with pytest.raises(ValueError, match="ttl"):
            locks.lock("x", ttl=bad)
    lease = await locks.lock(f"n-{uuid.uuid4().hex}", ttl=2_000_000).acquire(timeout=0)
    await lease.release()
    lease = await locks.lock(f"n-{uuid.uuid4().hex}", ttl=0.001, watchdog=False).acquire(
        timeout=0)
    await lease.release()


@pytest.mark.parametrize("timeout", [-1, float("nan"), float("-inf"), "1"])
async def test_bad_timeout(locks: aiolock.Locks, timeout: Any) -> None:
    name = f"n-{uuid.uuid4().hex}"
    async with asyncio.timeout(5):
        with pytest.raises(ValueError, match="timeout"):
            lease = await locks.lock(name).acquire(timeout=timeout)
            await lease.release()
        with pytest.raises(ValueError, match="timeout"):
            locks.lock(name, timeout=timeout)


async def test_huge_timeout_is_just_long(locks: aiolock.Locks) -> None:
    """timeout=inf / 1e300 means 'wait a long time', not an OverflowError."""
    for timeout in (float("inf"), 1e300):
        try:
            lease = await asyncio.wait_for(
                locks.lock(f"n-{uuid.uuid4().hex}").acquire(timeout=timeout), 5)
        except ValueError:
            continue  # refusing is fine too
        await lease.release()


@pytest.mark.parametrize("bad", [-1, float("nan"), 1e16])
async def test_bad_extend(locks: aiolock.Locks, bad: float) -> None:
    lease = await locks.lock(f"n-{uuid.uuid4().hex}", ttl=5).acquire()
    try:
        with pytest.raises(ValueError):
            await lease.extend(bad)
        assert not lease.lost
    finally:
        await lease.release()


@pytest.mark.parametrize("name", ["", "\ud800", "a\udfffb", "x" * 513, "é" * 513])
async def test_bad_names(locks: aiolock.Locks, name: str) -> None:
    async with asyncio.timeout(5):
        with pytest.raises(ValueError) as info:
            lease = await locks.lock(name).acquire(timeout=0)
            await lease.release()
    if "\ud800" in name or "\udfff" in name:
        assert "utf" in str(info.value).lower(), str(info.value)
    with pytest.raises(ValueError):
        await locks.status(name)


@pytest.mark.parametrize("name", ["x" * 512, "é" * 512, "🔒" * 512, "{a}%b}{", "a\x00b",
                                  " ", "\n", "/../..", "*", "aiolock:{x}"])
async def test_odd_but_valid_names(locks: aiolock.Locks, name: str) -> None:
    lease = await locks.lock(name, ttl=5).acquire(timeout=1)
    info = await locks.status(name)
    assert info.held
    await lease.release()
    assert not (await locks.status(name)).held


async def test_names_are_not_confused(locks: aiolock.Locks) -> None:
    """Escaping must be injective: names differing only by escaped characters are
    distinct locks."""
    base = uuid.uuid4().hex
    names = [f"{base}{{x}}", f"{base}%7Bx%7D", f"{base}%x%", f"{base}{{x", f"{base}x}}",
             f"{base}%25", f"{base}%"]
    leases = [await locks.lock(n, ttl=5).acquire(timeout=0) for n in names]
    for lease in leases:
        await lease.release()


# --- connect() ---------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["http://x", "redis+foo://127.0.0.1", "rediss+cluster://h:1",
                                 "", "localhost:6379", "redis:/x", "REDIS-CLUSTER://x",
                                 "zookeeper://", "redis://127.0.0.1:notaport/0",
                                 "redis://127.0.0.1:99999/0", "redis://127.0.0.1:6379/abc"])
async def test_bad_url(url: str) -> None:
    async with asyncio.timeout(10):
        with pytest.raises(ValueError) as info:
            async with aiolock.connect(url, connect_timeout=1):
                pass
    if "://" in url and url.split("://")[0].lower() not in aiolock.SCHEMES:
        assert "redis://" in str(info.value) and "zookeeper" in str(info.value), str(info.value)


@pytest.mark.parametrize("target", [None, b"redis://127.0.0.1:1/0", 42, object()])
async def test_connect_odd_objects(target: Any) -> None:
    async with asyncio.timeout(5):
        with pytest.raises(ValueError):
            async with aiolock.connect(target):
                pass


async def test_connect_sync_client_refused(redis_server: RedisServer) -> None:
    client = redis.Redis(port=redis_server.port)
    try:
        with pytest.raises(ValueError) as info:
            async with asyncio.timeout(5), aiolock.connect(client):
                pass
        assert "redis.asyncio" in str(info.value), str(info.value)
    finally:
        client.close()


async def test_connect_sentinel_object_refused() -> None:
    sentinel = redis.asyncio.sentinel.Sentinel([("127.0.0.1", 1)])  # type: ignore[no-untyped-call]
    with pytest.raises(ValueError):
        async with asyncio.timeout(5), aiolock.connect(sentinel):
            pass


class MyRedis(redis.asyncio.Redis):
    pass


async def test_connect_subclass_of_async_redis(redis_server: RedisServer) -> None:
    client = MyRedis(port=redis_server.port)
    try:
        async with asyncio.timeout(10), aiolock.connect(client) as locks:
            name = f"n-{uuid.uuid4().hex}"
            lease = await locks.lock(name, ttl=5).acquire()
            waiter = asyncio.create_task(locks.lock(name, ttl=5).acquire())
            await asyncio.sleep(0.2)
            await lease.release()
            await (await waiter).release()
        assert await client.ping()  # not closed for us
    finally:
        await client.aclose()


async def test_connect_fakeredis() -> None:
    client = fakeredis.FakeAsyncRedis()
    async with asyncio.timeout(10), aiolock.connect(client) as locks:
        name = f"n-{uuid.uuid4().hex}"
        lease = await locks.lock(name, ttl=5).acquire()
        with pytest.raises(aiolock.LockTimeout):  # another task: one try fails
            await asyncio.create_task(locks.lock(name, ttl=5).acquire(timeout=0))
        waiter = asyncio.create_task(locks.lock(name, ttl=5).acquire())
        await asyncio.sleep(0.1)
        await lease.release()
        second = await waiter
        assert second.token > lease.token
        await second.release()
        async def read() -> None:
            async with locks.rwlock(name + "rw").read():
                await asyncio.sleep(0.05)
        await asyncio.gather(read(), read())
        async with locks.semaphore(name + "s", limit=2):
            pass
    assert await client.ping()
    await client.aclose()


async def test_connect_client_with_decode_responses(redis_server: RedisServer) -> None:
    """A user's client often has decode_responses=True: tokens must still be ints."""
    client = redis.asyncio.Redis(port=redis_server.port, decode_responses=True)
    try:
        async with asyncio.timeout(10), aiolock.connect(client) as locks:
            name = f"n-{uuid.uuid4().hex}"
            lease = await locks.lock(name, ttl=5).acquire()
            assert isinstance(lease.token, int)
            info = await locks.status(name)
            assert info.held
            await lease.release()
    finally:
        await client.aclose()
