"""A missed wake-up on Redis (README "Waiting"): "Each wait is still bounded by the
holder's remaining TTL, so a lost message costs at most one lease length; after a pub/sub
reconnect every waiter retries at once."

The waiting process's pub/sub connection is killed on the server (``CLIENT KILL``) just
before, or just after, the holder releases: the hand-off message may never reach it.
It must still get the lock within the holder's remaining ttl (+ slack), and the lease it
gets -- perhaps one handed to it while it was not listening -- must be a real one, kept
alive by its watchdog past its ttl.
"""

from __future__ import annotations

import time
import uuid

import pytest
import redis.asyncio as aioredis

import aiolock

from .conftest import Agent, Agents, Backend, backend, client_ports, go_in_order, redis_ports

pytestmark = pytest.mark.timeout(120)

TTL = 2.0
SLACK = 1.5
RECONNECT = 5.0  # s: a pub/sub reconnect and the retry "at once" after it, on a loaded box


async def kill_pubsub(b: Backend, agent: Agent) -> int:
    """``CLIENT KILL`` every pub/sub connection of ``agent``'s process; how many."""
    killed = 0
    for port in redis_ports(b):
        mine = client_ports([agent.pid], [port])
        r = aioredis.Redis(host="127.0.0.1", port=port)
        try:
            for c in await r.client_list():
                local = int(str(c["addr"]).rsplit(":", 1)[1])
                subscribed = int(c.get("sub", 0)) + int(c.get("psub", 0)) + int(c.get("ssub", 0))
                if local in mine and ("P" in str(c["flags"]) or subscribed):
                    await r.client_kill_filter(_id=c["id"])
                    killed += 1
        finally:
            await r.aclose()
    return killed


#: when the pub/sub connection is cut, the holder's ttl, the bound (s): with a short holder
#: ttl the wait is bounded by it; with a long one only the retry after the pub/sub
#: reconnect ("at once") or the waiter's own lease length saves the waiter
CUTS = [
    pytest.param("before", TTL, TTL + SLACK, id="before-release-holder-ttl2"),
    pytest.param("after", TTL, TTL + SLACK, id="after-release-holder-ttl2"),
    pytest.param("before", 30.0, RECONNECT, id="before-release-holder-ttl30"),
    pytest.param("after", 30.0, TTL + RECONNECT, id="after-release-holder-ttl30"),
]


@pytest.mark.parametrize(("when", "holder_ttl", "bound"), CUTS)
@pytest.mark.parametrize("key", [
    pytest.param("redis", id="redis"),
    pytest.param("redis-cluster", id="redis-cluster", marks=pytest.mark.slow),
    pytest.param("redis-sentinel", id="redis-sentinel", marks=pytest.mark.slow),
])
async def test_waiter_whose_wake_up_is_lost_still_gets_the_lock(
        request: pytest.FixtureRequest, agents: Agents, key: str, when: str,
        holder_ttl: float, bound: float) -> None:
    """Attacks "a lost message costs at most one lease length" and "after a pub/sub
    reconnect every waiter retries at once": the waiter's pub/sub connection is cut just
    before or just after the release (the hand-off message then may never arrive)."""
    b = backend(request, key)
    name = f"a10-lost-{uuid.uuid4().hex[:10]}"
    async with aiolock.connect(b.url) as locks:
        held = await locks.lock(name, ttl=holder_ttl).acquire()
        waiter = (await agents.start("once", b.url, name, 1, ttl=TTL, hold=2.5 * TTL))[0]
        await go_in_order([waiter], 0.4)
        released = time.monotonic()
        if when == "before":
            assert await kill_pubsub(b, waiter) >= 1, "found no pub/sub connection to cut"
            await held.release()
        else:
            await held.release()
            await kill_pubsub(b, waiter)
        got = await waiter.got(bound + 30)
        await waiter.drain(1.2 * TTL)  # past the lease's first ttl: renewed or lost
        info = await locks.status(name)
    waited = got.at - released
    assert waited <= bound, (
        f"the waiter whose wake-up was cut got the lock {waited:.2f}s after the release "
        f"(holder's ttl {holder_ttl}s, bound {bound}s)")
    assert got.token > held.token
    lost = [ln for ln in waiter.lines if ln.startswith("HB ") and ln.split()[2] == "1"]
    assert not lost, f"the lease got after the lost wake-up was lost while held: {lost[:3]}"
    assert info.held and [h.pid for h in info.held_by] == [waiter.pid], info
