"""``fair=True`` is first come, first served *across processes* (README "Waiting", and the
"Guarantees and limits" table: Redis "``lock(fair=True)`` strict FIFO"; ZooKeeper and
etcd "always (sequence order)"; PostgreSQL "yes (the server's lock queue)").

Local hand-offs are what a fair lock must not do: a task of the holder's own process that
came after a waiting process must not be handed the lock before it."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

import aiolock

from .conftest import Agents, backend, go_in_order

pytestmark = pytest.mark.timeout(90)

#: backends and the ``fair`` flag that makes them first come, first served
FAIR = [
    pytest.param("redis", True, id="redis"),
    pytest.param("zookeeper", False, id="zookeeper"),
    pytest.param("postgres", True, id="postgres"),
    pytest.param("etcd", False, id="etcd"),
    pytest.param("redis-cluster", True, id="redis-cluster"),
    pytest.param("redis-sentinel", True, id="redis-sentinel"),
]


@pytest.mark.parametrize(("key", "fair"), FAIR)
async def test_later_local_task_does_not_overtake_an_earlier_process(
        request: pytest.FixtureRequest, agents: Agents, key: str, fair: bool) -> None:
    """Attacks "first come, first served across processes" against local hand-offs: the
    test process holds the lock, another process comes to wait, then a second task of the
    test process asks for the lock. At the release, the other process (earlier) must be
    served before the local task (later), tokens in that order."""
    b = backend(request, key)
    name = f"a10-fair-{uuid.uuid4().hex[:10]}"
    async with aiolock.connect(b.url) as locks:
        lock = locks.lock(name, ttl=10, fair=fair)
        held = await lock.acquire()
        (other,) = await agents.start("once", b.url, name, 1, ttl=10, fair=fair, hold=0.3)
        await go_in_order([other], 0.5)
        local_got: list[tuple[float, int]] = []

        async def local() -> None:
            lease = await lock.acquire(timeout=30)
            local_got.append((time.monotonic(), lease.token))
            await lease.release()

        late = asyncio.create_task(local())
        await asyncio.sleep(0.5)  # the local task is queued (locally or on the server)
        await held.release()
        got = await other.got(30)
        await late
    local_at, local_token = local_got[0]
    assert got.at < local_at and got.token < local_token, (
        f"the holder's own later task (token {local_token}) was served before the process "
        f"that came first (token {got.token}): not first come, first served")
