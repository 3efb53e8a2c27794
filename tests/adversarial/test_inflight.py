"""Cancellation while the request is in flight to a frozen server (SIGSTOP): the grant
that the server makes after it resumes must not leave the lock held by nobody (SPEC §2
cancellation safety), and the cancellation itself must not hang."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator

import pytest

import aiolock

from ..servers import RedisServer
from ..zk_server import ZooKeeperServer


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


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
        own_redis.pause()
        try:
            task = asyncio.create_task(prim(a).acquire())
            await asyncio.sleep(0.2)  # the request is out, the server frozen
            task.cancel()
            t0 = time.monotonic()
            async with asyncio.timeout(10):
                results = await asyncio.gather(task, return_exceptions=True)
            took = time.monotonic() - t0
        finally:
            own_redis.resume()
        assert isinstance(results[0], (asyncio.CancelledError, aiolock.LockError)), results
        assert took < 3, f"cancellation took {took:.1f}s"
        await asyncio.sleep(0.5)  # the server ran whatever was queued
        t0 = time.monotonic()
        async with asyncio.timeout(30):
            lease = await prim(b).acquire(timeout=25)
        took = time.monotonic() - t0
        await lease.release()
        assert took < 2, f"lock held by nobody for {took:.1f}s after a cancelled acquire"


@pytest.mark.slow  # own ZooKeeper server, ~5 s
async def test_cancel_acquire_in_flight_to_frozen_zookeeper() -> None:
    zk = ZooKeeperServer().start()
    try:
        url = f"zookeeper://{zk.hosts}/adv"
        async with aiolock.connect(url, session_timeout=6, request_timeout=1) as a, \
                aiolock.connect(url, session_timeout=6, request_timeout=1) as b:
            await (await a.lock("n", ttl=3).acquire()).release()
            zk.pause()
            try:
                task = asyncio.create_task(a.lock("n", ttl=3).acquire())
                await asyncio.sleep(0.2)
                task.cancel()
                t0 = time.monotonic()
                async with asyncio.timeout(15):
                    results = await asyncio.gather(task, return_exceptions=True)
                cancel_took = time.monotonic() - t0
            finally:
                zk.resume()
            assert isinstance(results[0], (asyncio.CancelledError, aiolock.LockError)), results
            assert cancel_took < 3, f"cancellation took {cancel_took:.1f}s"
            await asyncio.sleep(1.0)
            t0 = time.monotonic()
            async with asyncio.timeout(30):
                lease = await b.lock("n", ttl=3).acquire(timeout=25)
            took = time.monotonic() - t0
            await lease.release()
            assert took < 1.5, f"lock held by nobody for {took:.1f}s after a cancelled acquire"
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
        t0 = time.monotonic()
        async with asyncio.timeout(30):
            again = await b.lock(name, ttl=20).acquire(timeout=25)
        took = time.monotonic() - t0
        await again.release()
        assert took < 2, f"lock held by nobody for {took:.1f}s after a cancelled release"
