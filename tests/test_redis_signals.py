"""Release signals on every Redis flavour (plain, Cluster, Sentinel): the pub/sub layer
the three backends share (``aiolock/backends/_redis_pubsub.py``)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

import aiolock
from aiolock.abc import Claim, Kind
from aiolock.backends.redis import RedisBackend

pytestmark = pytest.mark.timeout(60)

SERVERS = {"redis": "redis_server", "redis-cluster": "redis_cluster", "redis-sentinel": "redis_sentinel"}


@pytest.fixture(params=list(SERVERS))
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[RedisBackend]:
    server: Any = request.getfixturevalue(SERVERS[request.param])
    async with aiolock.connect(server.url) as locks:
        assert isinstance(locks.backend, RedisBackend)
        yield locks.backend


class _Waiter:
    claim: Claim

    def __init__(self) -> None:
        self.woken = asyncio.Event()

    def wake(self, hint: str | None = None) -> None:
        self.woken.set()


async def test_listeners_on_many_names_subscribing_at_once_are_all_woken(backend: RedisBackend) -> None:
    """Ten first listeners subscribe concurrently: the one pub/sub connection must carry
    them all (redis-py once read only the last of several concurrent subscribes). Per-lock
    channels serve read-write locks and semaphores; plain locks listen via one inbox."""
    waiters = [_Waiter() for _ in range(10)]
    names = [f"many-{uuid.uuid4().hex[:12]}" for _ in waiters]
    async with asyncio.timeout(3):
        await asyncio.gather(*(backend.listen(n, Kind.READ, w) for n, w in zip(names, waiters, strict=True)))
    publisher = getattr(backend, "cluster", None) or backend.client
    for n in names:
        await publisher.publish(backend._base(n, Kind.READ), "someone|")
    async with asyncio.timeout(3):
        await asyncio.gather(*(w.woken.wait() for w in waiters))
    for n, w in zip(names, waiters, strict=True):
        backend.unlisten(n, Kind.READ, w)


async def test_idle_channels_are_unsubscribed_under_steady_traffic(
    backend: RedisBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel nobody listens to any more is dropped even while another channel gets a
    message every fraction of a second (the subscription set must not grow forever)."""
    from aiolock.backends import _redis_pubsub

    monkeypatch.setattr(_redis_pubsub, "IDLE_UNSUBSCRIBE", 0.3)
    busy, idle = _Waiter(), _Waiter()
    busy_name, idle_name = f"busy-{uuid.uuid4().hex[:8]}", f"idle-{uuid.uuid4().hex[:8]}"
    await backend.listen(busy_name, Kind.READ, busy)
    await backend.listen(idle_name, Kind.READ, idle)
    backend.unlisten(idle_name, Kind.READ, idle)
    publisher = getattr(backend, "cluster", None) or backend.client
    signals: Any = backend.signals
    for _ in range(20):  # 3 s of traffic, a message every 0.15 s
        await publisher.publish(backend._base(busy_name, Kind.READ), "someone|")
        await asyncio.sleep(0.15)
        if backend._base(idle_name, Kind.READ) not in signals._confirmed:
            break
    assert backend._base(idle_name, Kind.READ) not in signals._confirmed
    assert backend._base(busy_name, Kind.READ) in signals._confirmed
    backend.unlisten(busy_name, Kind.READ, busy)


async def test_many_concurrent_requests_queue_instead_of_failing(backend: RedisBackend) -> None:
    """More requests at once than a redis-py pool holds (100) wait for a connection
    instead of failing with MaxConnectionsError (Cluster, Sentinel; plain Redis pipelines)."""
    locks = aiolock.connect(backend)
    names = [f"burst-{uuid.uuid4().hex[:8]}-{i}" for i in range(150)]
    leases = await asyncio.gather(*(locks.lock(n, ttl=10).acquire(timeout=10) for n in names))
    assert not any(lease.lost for lease in leases)
    await asyncio.gather(*(lease.release() for lease in leases))
    await locks.aclose()  # closes the backend too; the fixture's second close is a no-op



@pytest.fixture(params=list(SERVERS))
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(SERVERS[request.param]).url)


async def test_observe_is_woken_by_the_server_not_by_polling(url: str) -> None:
    """An election's grants, proclaims and resignations are published on its channel:
    observe() sees each within a fraction of a second, where its ttl (30 s) would let a
    poller wait 15 s; another connection makes the changes."""
    name = f"obs-{uuid.uuid4().hex}"
    seen: list[str | None] = []
    changed = asyncio.Event()

    async def watch(locks: aiolock.Locks) -> None:
        async for leader in locks.election(name, ttl=30).observe():
            seen.append(None if leader is None else leader.data)
            changed.set()

    async def settled(value: str | None) -> None:
        async with asyncio.timeout(3):
            while not (seen and seen[-1] == value):
                changed.clear()
                await changed.wait()

    async with aiolock.connect(url) as observer, aiolock.connect(url) as other:
        watcher = asyncio.create_task(watch(observer))
        try:
            await settled(None)
            term = await other.election(name, ttl=30).campaign(data="one").acquire()
            await settled("one")
            await term.proclaim("two")
            await settled("two")
            await term.release()
            await settled(None)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
