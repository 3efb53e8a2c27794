"""Fixtures: real servers (started here), and ``locks`` parametrized over every backend.

The contract suite (``test_contract.py``) takes the ``locks`` fixture and so runs once
per backend; a test needing a capability the backend lacks skips itself with a reason
(``need(locks, Capability.X)``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import aiolock
from aiolock import Capability

from .mc_server import MemcachedServer
from .mysql_server import MariaDBServer
from .pg_server import PostgresServer
from .servers import RedisServer
from .zk_server import ZooKeeperServer

BACKENDS = ["memory", "redis", "zookeeper", "postgres", "postgres-row", "memcached", "mysql",
            "mysql-row"]
# backends still being built join the suite as soon as their module exists
BACKENDS += [
    param for param, module in (
        ("redis-cluster", "aiolock.backends.redis_cluster"),
        ("redis-sentinel", "aiolock.backends.redis_sentinel"),
        ("redlock", "aiolock.backends.redlock"),
    ) if importlib.util.find_spec(module) is not None
]
if importlib.util.find_spec("etcd3aio") is not None and shutil.which("etcd") is not None:
    BACKENDS += ["etcd", "etcd-cluster"]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def zk_server() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def mysql_server() -> Iterator[MariaDBServer]:
    server = MariaDBServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def memcached_server() -> Iterator[MemcachedServer]:
    server = MemcachedServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """A real 3-master Redis Cluster on loopback (``redis-cli --cluster create``)."""
    from .redis_topology import RedisClusterServers

    servers = RedisClusterServers(masters=3).start()
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[Any]:
    """A real master, replica and sentinel on loopback."""
    from .redis_topology import RedisSentinelServers

    servers = RedisSentinelServers().start()
    yield servers
    servers.close()


@pytest.fixture(scope="session")
def redlock_servers() -> Iterator[list[RedisServer]]:
    """Three independent redis-servers for ``redlock://``."""
    servers = [RedisServer().start() for _ in range(3)]
    yield servers
    for server in servers:
        server.close()


def redlock_url(servers: list[RedisServer]) -> str:
    return "redlock://" + ",".join(f"127.0.0.1:{s.port}" for s in servers)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[Any]:
    from .etcd_server import EtcdServer

    server = EtcdServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[Any]:
    from .etcd_server import EtcdCluster

    cluster = EtcdCluster(3).start()
    yield cluster
    cluster.close()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return f"memory://test-{uuid.uuid4().hex[:8]}"
    if request.param == "zookeeper":
        zk: ZooKeeperServer = request.getfixturevalue("zk_server")
        return f"zookeeper://{zk.hosts}/aiolock-{uuid.uuid4().hex[:8]}"  # fresh chroot
    if request.param == "memcached":
        mc: MemcachedServer = request.getfixturevalue("memcached_server")
        return mc.url
    if request.param.startswith("postgres"):
        pg: PostgresServer = request.getfixturevalue("postgres_server")
        return pg.url + ("?mode=row" if request.param == "postgres-row" else "")
    if request.param.startswith("mysql"):
        my: MariaDBServer = request.getfixturevalue("mysql_server")
        return my.url + ("?mode=row" if request.param == "mysql-row" else "")
    if request.param == "redis-cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    if request.param == "redis-sentinel":
        return str(request.getfixturevalue("redis_sentinel").url)
    if request.param == "redlock":
        return redlock_url(request.getfixturevalue("redlock_servers"))
    if request.param.startswith("etcd"):  # a fresh key prefix per test
        etcd = request.getfixturevalue("etcd_cluster" if request.param == "etcd-cluster" else "etcd_server")
        return f"{etcd.url}?prefix=aiolock-{uuid.uuid4().hex[:8]}"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


@pytest.fixture
async def locks(backend_url: str) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(backend_url) as conn:
        yield conn


@pytest.fixture
def name() -> str:
    """A fresh lock name per test, so tests sharing a server never collide."""
    return f"t-{uuid.uuid4().hex}"


async def acquire_cancelled_after(lock: aiolock.Lock, steps: int) -> None:
    """Start ``lock.acquire()``, cancel it after ``steps`` loop steps, and release the
    lease if the acquire finished first: whatever step it lands on, nothing may leak."""
    task = asyncio.create_task(lock.acquire())
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()
    try:
        lease = await task
    except asyncio.CancelledError:
        return
    await lease.release()


def need(locks: aiolock.Locks, capability: Capability) -> None:
    if capability not in locks.capabilities:
        pytest.skip(f"{locks.url} does not offer {capability.value}")
