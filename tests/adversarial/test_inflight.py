"""Cancellation while the request is in flight to a frozen server (SIGSTOP): the grant
that the server makes after it resumes must not leave the lock held by nobody (SPEC §2
cancellation safety), and the cancellation itself must not hang."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

import aiolock

from ..servers import RedisServer
from ..zk_server import ZooKeeperServer


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


async def cancel_in_flight(server: Any, acquire: Callable[[], Awaitable[Any]], within: float) -> None:
    """Freeze ``server`` (SIGSTOP), start ``acquire()``, cancel it once its request is out
    and resume the server: the acquire ends (cancelled, or a LockError) within 3 s."""
    server.pause()
    try:
        task = asyncio.create_task(acquire())
        await asyncio.sleep(0.2)  # the request is out, the server frozen
        task.cancel()
        t0 = time.monotonic()
        async with asyncio.timeout(within):
            results = await asyncio.gather(task, return_exceptions=True)
        took = time.monotonic() - t0
    finally:
        server.resume()
    assert isinstance(results[0], (asyncio.CancelledError, aiolock.LockError)), results
    assert took < 3, f"cancellation took {took:.1f}s"


async def free_within(lock: aiolock.Lock, bound: float) -> None:
    """``lock`` is acquired within ``bound`` seconds: nobody is left holding it."""
    t0 = time.monotonic()
    async with asyncio.timeout(30):
        lease = await lock.acquire(timeout=25)
    took = time.monotonic() - t0
    await lease.release()
    assert took < bound, f"lock held by nobody for {took:.1f}s after a cancelled acquire or release"


@pytest.mark.parametrize("kind", ["lock", "fair", "write"])
async def test_cancel_acquire_in_flight_to_frozen_redis(own_redis: RedisServer,
                                                        kind: str) -> None:
    opts = {"connect_timeout": 1, "request_timeout": 1}
    name = f"i-{uuid.uuid4().hex}"

    def prim(locks: aiolock.Locks) -> aiolock.Lock:
        if kind == "write":
            return locks.rwlock(name, ttl=20).write()
        return locks.lock(name, ttl=20, fair=kind == "fair")

    async with aiolock.connect(own_redis.url, **opts) as a, \
            aiolock.connect(own_redis.url, **opts) as b:
        await (await prim(a).acquire()).release()  # warm: scripts loaded, connected
        await cancel_in_flight(own_redis, prim(a).acquire, within=10)
        await asyncio.sleep(0.5)  # the server ran whatever was queued
        await free_within(prim(b), 2)


@pytest.mark.slow  # own ZooKeeper server, ~5 s
async def test_cancel_acquire_in_flight_to_frozen_zookeeper() -> None:
    zk = ZooKeeperServer().start()
    try:
        url = f"zookeeper://{zk.hosts}/adv"
        async with aiolock.connect(url, session_timeout=6, request_timeout=1) as a, \
                aiolock.connect(url, session_timeout=6, request_timeout=1) as b:
            await (await a.lock("n", ttl=3).acquire()).release()
            await cancel_in_flight(zk, a.lock("n", ttl=3).acquire, within=15)
            await asyncio.sleep(1.0)
            await free_within(b.lock("n", ttl=3), 1.5)
            info = await b.status("n")
            assert not info.held and info.waiters == 0, info
    finally:
        zk.close()


async def test_cancel_release_in_flight_to_frozen_redis(own_redis: RedisServer) -> None:
    opts = {"connect_timeout": 1, "request_timeout": 1}
    name = f"r-{uuid.uuid4().hex}"
    async with aiolock.connect(own_redis.url, **opts) as a, \
            aiolock.connect(own_redis.url, **opts) as b:
        lease = await a.lock(name, ttl=20).acquire()
        own_redis.pause()
        try:
            task = asyncio.create_task(lease.release())
            await asyncio.sleep(0.2)
            task.cancel()
            async with asyncio.timeout(10):
                await asyncio.gather(task, return_exceptions=True)
        finally:
            own_redis.resume()
        async with asyncio.timeout(10):
            await lease.release()  # safe to call again; finishes the release
        await free_within(b.lock(name, ttl=20), 2)
