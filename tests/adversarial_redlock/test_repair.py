"""A node that lost (or never got) a lease that a majority still holds gets it back in
the background, also when it always answers after the others, so the lock again
survives the loss of another node. Written from README.md, SPEC.md, docs/redlock.md
and docs/backends/index.md only.

docs/redlock.md: "A node that denies a lease a majority still confirms (it restarted
empty) gets it back in the background, so the lock again survives the loss of another
node -- also when it answers after the majority decided (a node slower than the
others)."; docs/backends/index.md: "a node that lost its data must rejoin only after the
longest TTL [...] then it gets held leases back".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

import aiolock

from ..faults.proxy import Proxy
from ..servers import RedisServer
from .conftest import node_state, token_on_nodes, url_of, wait_for

pytestmark = pytest.mark.timeout(60)


async def test_a_slow_node_restarted_empty_gets_the_lease_back_then_another_node_dies(
    servers: list[RedisServer], proxies: Callable[[RedisServer], Awaitable[Proxy]], name: str,
) -> None:
    """Node 0 answers 0.2 s after the others and restarts empty while the lease is held:
    it must get the lease (and counter) back although every renewal is decided before
    it answers; then node 1 dies and the lease still holds for several ttls."""
    slow = await proxies(servers[0])
    ports = [s.port for s in servers]
    url = url_of([slow.port, servers[1].port, servers[2].port])
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        lease = await a.lock(name, ttl=1.5).acquire(timeout=5)
        await token_on_nodes(ports, name, lease.token)
        slow.set_faults(delay=0.1)  # each way
        servers[0].restart()  # empty
        slow.reset()
        await token_on_nodes(ports, name, lease.token, timeout=4.0)
        servers[1].kill()
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            assert not lease.lost
            with pytest.raises(aiolock.LockTimeout):
                await b.lock(name, ttl=1).acquire(timeout=0)
            await asyncio.sleep(0.3)
        info = await b.status(name)
        assert info.held and info.token == lease.token
        waiter = asyncio.create_task(b.lock(name, ttl=1.5).acquire(timeout=5))
        await asyncio.sleep(0.1)
        await lease.release()
        nxt = await waiter
        assert nxt.token > lease.token
        await nxt.release()


async def test_a_handover_while_the_slow_node_still_holds_the_old_lease_is_repaired_there(
    servers: list[RedisServer], proxies: Callable[[RedisServer], Awaitable[Proxy]], name: str,
) -> None:
    """Node 0 answers 0.5 s after the others. A releases; B (another connection, woken
    by the release) is granted by nodes 1 and 2 while node 0 may still hold A's lease.
    Node 0 must end up holding B's lease, so that B survives node 1's death."""
    slow = await proxies(servers[0])
    ports = [s.port for s in servers]
    url = url_of([slow.port, servers[1].port, servers[2].port], "connect_timeout=2&request_timeout=2")
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        first = await a.lock(name, ttl=1.5).acquire(timeout=5)
        await token_on_nodes(ports, name, first.token)
        slow.set_faults(delay=0.25)
        waiter = asyncio.create_task(b.lock(name, ttl=1.5).acquire(timeout=5))
        await asyncio.sleep(0.7)
        await first.release()
        lease = await waiter
        assert lease.token > first.token

        async def on_slow_node() -> bool:
            return (await node_state(servers[0].port, name))[1] == lease.token

        await wait_for(on_slow_node, 4.0, "B's lease on the slow node")
        servers[1].kill()
        await asyncio.sleep(2.5)  # well over a ttl: renewed by nodes 0 and 2
        assert not lease.lost
        with pytest.raises(aiolock.LockTimeout):
            await a.lock(name, ttl=1).acquire(timeout=0)
        await lease.release()
