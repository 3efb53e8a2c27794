"""``status(name)`` on ``redlock://`` reports the owner and token a majority agrees on,
never a minority's grant. Written from README.md, SPEC.md, docs/redlock.md and
docs/backends/index.md only.

docs/redlock.md: "Each node runs Redlock's own Lua scripts on the key layout of
``redis://``" and "``status()`` reports the owner a majority agrees on, with the record
most of its nodes keep". A minority grant is made here with a plain ``redis://``
connection to one node (the same key layout), its counter far ahead of the others.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

import aiolock

from ..faults.proxy import Proxy
from ..servers import RedisServer
from .conftest import set_counter, url_of

# found nothing when written (README+SPEC-only pass on Redlock): slow tier
pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]


async def test_status_reports_the_majority_owner_not_a_minority_grant(
    servers: list[RedisServer], proxies: Callable[[RedisServer], Awaitable[Proxy]], name: str,
) -> None:
    """Node 0 holds a minority grant (token > 10,000, data "minority"); A is granted by
    nodes 1 and 2, node 2 answering 0.2 s after the others: status() (from A's and
    another connection) must wait for a majority that agrees and report A."""
    await set_counter(servers[0].port, name, 10_000)
    slow = await proxies(servers[2])
    url = url_of([servers[0].port, servers[1].port, slow.port])
    async with aiolock.connect(servers[0].url) as node0, aiolock.connect(servers[1].url) as node1, \
            aiolock.connect(url) as a, aiolock.connect(url) as b:
        intruder = await node0.lock(name, ttl=10, data="minority").acquire(timeout=2)
        assert intruder.token > 10_000
        assert not (await b.status(name)).held  # one node of three holds it
        lease = await a.lock(name, ttl=5, data="majority").acquire(timeout=3)  # nodes 1 and 2
        assert lease.token < 10_000
        slow.set_faults(delay=0.1)  # node 2 answers after nodes 0 (intruder) and 1 (A)
        for observer in (a, b):
            info = await observer.status(name)
            assert info.held, info
            assert info.token == lease.token, info
            assert [h.data for h in info.held_by] == ["majority"], info
        assert [i.token async for i in b.scan(name)] == [lease.token]
        await lease.release()
        info = await b.status(name)
        assert not info.held, info  # only the minority grant is left
        # two nodes held by two different minority owners: no majority agrees
        other = await node1.lock(name, ttl=10, data="other").acquire(timeout=2)
        info = await b.status(name)
        assert not info.held, info
        assert [i async for i in b.scan(name)] == []
        with pytest.raises(aiolock.LockTimeout):
            await b.lock(name, ttl=5).acquire(timeout=0.3)
        await other.release()
        await intruder.release()
        again = await b.lock(name, ttl=5).acquire(timeout=3)
        assert again.token > lease.token
        await again.release()
