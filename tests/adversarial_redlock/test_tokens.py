"""Fencing tokens of ``redlock://`` across hand-overs while nodes are slow, paused or
restarted empty (a minority at a time). Written from README.md, SPEC.md,
docs/redlock.md and docs/backends/index.md only.

docs/redlock.md: "Let A be granted with token T, and let B's acquisition reach its
nodes after A's lock there was released or had expired [...] Then B's token is greater
than T, provided the nodes that confirmed T kept their counters." and "the other nodes
are raised too, in the background"; "A node that grants after the attempt was decided
gets its grant labelled with the lease's token once that grant is in".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from itertools import pairwise

import pytest

import aiolock

from ..faults.proxy import Proxy
from ..servers import RedisServer
from .conftest import node_state, set_counter, token_on_nodes, url_of

pytestmark = pytest.mark.timeout(60)


@pytest.mark.slow  # found nothing when written: slow tier
async def test_tokens_increase_across_handovers_with_rolling_empty_restarts_and_a_slow_node(
    servers: list[RedisServer], proxies: Callable[[RedisServer], Awaitable[Proxy]], name: str,
) -> None:
    """Node 2 always answers 0.1 s after the others. Each round: the holder's lease is
    on every node (late grant labelled, counters raised), one node (in turn, the slow one
    too) is restarted empty while it is held, a waiter of another connection is not let
    in, and gets the lock at the release with a greater token."""
    slow = await proxies(servers[2])
    slow.set_faults(delay=0.05)  # each way
    ports = [s.port for s in servers]
    url = url_of([servers[0].port, servers[1].port, slow.port])
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        conns = [a, b]
        lease = await a.lock(name, ttl=1.5).acquire(timeout=5)
        tokens = [lease.token]
        for round_ in range(6):
            await token_on_nodes(ports, name, lease.token)
            servers[round_ % 3].restart()  # a minority, without its data
            waiter = asyncio.create_task(conns[(round_ + 1) % 2].lock(name, ttl=1.5).acquire(timeout=8))
            done, _ = await asyncio.wait({waiter}, timeout=0.6)
            assert not done, "a second holder while one node restarted empty"
            assert not lease.lost
            await lease.release()
            lease = await waiter
            assert lease.token > tokens[-1], [*tokens, lease.token]
            raised = [(await node_state(p, name))[2] >= lease.token for p in ports]
            assert sum(raised) >= 2, f"counters not raised on a majority before the grant: {raised}"
            tokens.append(lease.token)
        await lease.release()


@pytest.mark.parametrize("slow_counter", [3, 500], ids=["slow-node-behind", "slow-node-ahead"])
async def test_a_late_grant_on_a_slow_node_carries_the_leases_token(
    servers: list[RedisServer], proxies: Callable[[RedisServer], Awaitable[Proxy]], name: str,
    slow_counter: int,
) -> None:
    """Node 0 answers 0.3 s after the others (counters: node 1 at 50, node 2 at 7): the
    attempt is decided by nodes 1 and 2, so node 2 is raised to the token 51 before the
    grant returns; node 0 grants later, and its grant must carry the lease's token (its
    counter at least that token), whether its own counter was behind or ahead. status()
    reports that token, and the next hand-over gets a greater one."""
    slow = await proxies(servers[0])
    await set_counter(servers[0].port, name, slow_counter)
    await set_counter(servers[1].port, name, 50)
    await set_counter(servers[2].port, name, 7)
    slow.set_faults(delay=0.15)
    ports = [s.port for s in servers]
    url = url_of([slow.port, servers[1].port, servers[2].port])
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        lease = await a.lock(name, ttl=3).acquire(timeout=5)
        assert lease.token == 51  # the highest counter of the granting majority (1, 2)
        # "raised on a majority before the grant returns": node 0 has not answered yet
        assert [(await node_state(s.port, name))[2] >= 51 for s in servers[1:]] == [True, True]
        info = await b.status(name)
        assert info.held and info.token == lease.token, info
        await token_on_nodes(ports, name, lease.token)
        _owner, token, seq = await node_state(servers[0].port, name)
        assert token == lease.token and seq >= lease.token
        info = await b.status(name)
        assert info.held and info.token == lease.token
        waiter = asyncio.create_task(b.lock(name, ttl=3).acquire(timeout=5))
        await asyncio.sleep(0.2)
        await lease.release()
        nxt = await waiter
        assert nxt.token > lease.token
        await nxt.release()


@pytest.mark.slow  # found nothing when written: slow tier
async def test_tokens_increase_while_a_node_is_paused_and_after_it_resumes(
    servers: list[RedisServer], name: str,
) -> None:
    """Node 0 is stopped (SIGSTOP) while the lock is held, hands over several times,
    then node 0 resumes with the requests queued for it: tokens keep increasing in
    hold order, and the resumed node ends with the current holder's token."""
    ports = [s.port for s in servers]
    url = url_of(ports)
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        conns = [a, b]
        lease = await a.lock(name, ttl=1.2).acquire(timeout=5)
        await token_on_nodes(ports, name, lease.token)
        tokens = [lease.token]
        servers[0].pause()
        try:
            for i in range(4):
                waiter = asyncio.create_task(conns[(i + 1) % 2].lock(name, ttl=1.2).acquire(timeout=5))
                await asyncio.sleep(0.5 if i == 0 else 0.05)  # the first: across a renewal
                assert not lease.lost
                await lease.release()
                lease = await waiter
                tokens.append(lease.token)
        finally:
            servers[0].resume()
        for i in range(4):
            waiter = asyncio.create_task(conns[i % 2].lock(name, ttl=1.2).acquire(timeout=5))
            await asyncio.sleep(0.05)
            await lease.release()
            lease = await waiter
            tokens.append(lease.token)
        assert all(x < y for x, y in pairwise(tokens)), tokens
        await token_on_nodes(ports, name, lease.token)
        await lease.release()
