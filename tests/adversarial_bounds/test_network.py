"""The other two ways a server becomes unreachable: a proxy that black-holes traffic
(tests/faults/proxy.py: nothing moves either way, new connections hang too) and a killed
server (connections refused). Each must give ``BackendUnavailable`` within the timeouts
(README "Errors"), and a held lease behind a black hole is lost by its ttl.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

import aiolock

from ..faults.proxy import Proxy
from ..redis_topology import RedisClusterServers
from ..servers import RedisServer
from .conftest import CT, RT, SINGLE, SLACK, Target, assert_unavailable, backends, timed, warm


@pytest.fixture
async def proxy(target: Target) -> AsyncIterator[Proxy]:
    made = await Proxy(target.port).start()
    yield made
    await made.aclose()


@backends(SINGLE, default=("postgres",))
async def test_status_behind_black_hole(target: Target, proxy: Proxy, name: str) -> None:
    async with target.connect(target.url_via(proxy.port)) as locks:
        await warm(locks, name)
        proxy.set_faults(up=True, down=True)
        out = await timed(lambda: locks.status(name))
        proxy.heal()
    assert_unavailable(out, RT + SLACK, f"{target.id} status behind a black hole")


@backends(SINGLE)
async def test_try_acquire_beside_lease_behind_black_hole(target: Target, proxy: Proxy, name: str) -> None:
    async with target.connect(target.url_via(proxy.port)) as locks:
        held = await locks.lock(name + "-held", ttl=10).acquire(timeout=5)
        proxy.set_faults(up=True, down=True)
        out = await timed(lambda: locks.lock(name, ttl=5).acquire(timeout=0))
        proxy.heal()
        await timed(held.release, 10)
    assert_unavailable(out, CT + RT + SLACK, f"{target.id} acquire(timeout=0) behind a black hole")


@backends(SINGLE)
async def test_lease_lost_by_ttl_behind_black_hole(target: Target, proxy: Proxy, name: str) -> None:
    ttl = 2.0
    async with target.connect(target.url_via(proxy.port)) as locks:
        lease = await locks.lock(name, ttl=ttl).acquire(timeout=5)
        await asyncio.sleep(0.4 * ttl)
        proxy.set_faults(up=True, down=True)
        cut_at = time.monotonic()
        out = await timed(lease.wait_lost, ttl + SLACK + 2)
        lost_after = time.monotonic() - cut_at
        proxy.heal()
    assert out.error is None and lease.lost, f"{target.id}: {out.describe()}"
    assert lost_after < ttl + SLACK, f"{target.id}: lost {lost_after:.2f} s after the cut (ttl {ttl})"


@backends(SINGLE)
async def test_connect_behind_black_hole(target: Target, proxy: Proxy) -> None:
    async def enter() -> None:
        async with target.connect(target.url_via(proxy.port)):
            pass

    proxy.set_faults(up=True, down=True)
    out = await timed(enter)
    proxy.heal()
    assert_unavailable(out, CT + RT + SLACK, f"{target.id} connect() behind a black hole")


@backends(SINGLE)
async def test_killed_server_behind_proxy(target: Target, proxy: Proxy, name: str) -> None:
    """The server is gone (the proxy resets every connection and refuses new ones)."""
    async with target.connect(target.url_via(proxy.port)) as locks:
        await warm(locks, name)
        await proxy.aclose()  # every connection reset, nothing listens any more
        out = await timed(lambda: locks.status(name))
    assert_unavailable(out, CT + RT + SLACK, f"{target.id} status after the server went away")


@pytest.mark.slow
async def test_killed_redis_server(name: str) -> None:
    server = RedisServer().start()
    try:
        async with aiolock.connect(server.url, connect_timeout=CT, request_timeout=RT) as locks:
            await warm(locks, name)
            server.kill()
            out = await timed(lambda: locks.status(name))
            assert_unavailable(out, CT + RT + SLACK, "redis status after kill -9")
            out = await timed(lambda: locks.lock(name).acquire(timeout=0))
            assert_unavailable(out, CT + RT + SLACK, "redis acquire after kill -9")
    finally:
        server.close()


@pytest.mark.slow
async def test_cluster_master_killed(name: str) -> None:
    """One master of three killed: a lock on its slot is unavailable within the documented
    Cluster bound (``4 x request_timeout`` + 0.25 s, docs/backends/redis-cluster.md)."""
    cluster = RedisClusterServers(masters=3).start()
    try:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in cluster.ports)
        async with aiolock.connect(url, connect_timeout=CT, request_timeout=RT) as locks:
            await warm(locks, name)
            info_before = await locks.status(name)
            assert not info_before.held
            for node in cluster.nodes:
                node.kill()
            start = time.monotonic()
            out = await timed(lambda: locks.status(name))
            assert_unavailable(out, 4 * RT + 0.25 + CT + SLACK, "cluster status, masters killed")
            assert time.monotonic() - start < 4 * RT + 0.25 + CT + SLACK
    finally:
        cluster.close()
