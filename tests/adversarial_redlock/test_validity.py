"""A ``redlock://`` lease is never believed longer than a majority granted it, counted
from when the renewal was *sent*, also when a majority answers late and is then cut
off. Written from README.md, SPEC.md, docs/redlock.md and docs/backends/index.md only.

README: "Each renewal's expiry is counted on the monotonic clock from the moment that
request was *sent*. If no renewal is confirmed before that instant, the lease is lost.
``lease.lost`` reads the clock itself"; docs/redlock.md: "a lock is renewed if a
majority confirmed, until ``sent + ttl - drift``; [...] if a majority cannot answer, the
renewal fails and the lease is lost at its last confirmed expiry".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

import aiolock

from ..faults.proxy import Proxy
from ..servers import RedisServer
from .conftest import url_of

# found nothing when written (README+SPEC-only pass on Redlock): slow tier
pytestmark = [pytest.mark.timeout(60), pytest.mark.slow]


async def test_a_late_then_cut_off_majority_never_leaves_two_believing_holders(
    servers: list[RedisServer], proxies: Callable[[RedisServer], Awaitable[Proxy]], name: str,
) -> None:
    """A reaches nodes 1 and 2 through proxies that hold every byte 0.35 s each way, so
    each renewal there lands 0.35 s after it was sent and is confirmed 0.7 s after; then
    both proxies stop forwarding to the servers. Nodes 1 and 2 let A's lease expire
    about ``ttl`` after the last renewal *reached* them; B, connected directly, takes the
    lock as soon as it can. When B is granted, A must already know its lease is lost (a
    client counting from the reply would believe in it 0.7 s too long), and B's
    token is greater than A's."""
    ttl = 1.5
    p1, p2 = await proxies(servers[1]), await proxies(servers[2])
    a_url = url_of([servers[0].port, p1.port, p2.port], "connect_timeout=5&request_timeout=5")
    b_url = url_of([s.port for s in servers])
    async with aiolock.connect(a_url) as a, aiolock.connect(b_url) as b:
        lease = await a.lock(name, ttl=ttl).acquire(timeout=3)
        for proxy in (p1, p2):
            proxy.set_faults(delay=0.35)
        await asyncio.sleep(1.6)  # renewals now confirmed 0.7 s after they were sent
        assert not lease.lost
        for proxy in (p1, p2):
            proxy.set_faults(up=True)  # nothing more reaches nodes 1 and 2
        cut = time.monotonic()
        while True:
            try:
                other = await b.lock(name, ttl=ttl).acquire(timeout=0)
            except aiolock.LockTimeout:
                assert time.monotonic() - cut < 2 * ttl + 2, "never freed"
                await asyncio.sleep(0.01)
                continue
            a_lost = lease.lost
            break
        assert a_lost, (
            f"B granted {time.monotonic() - cut:.2f} s after the cut while A still "
            f"believes in its lease ({lease.expires_in:.2f} s left)")
        assert other.token > lease.token  # a hand-over by expiry: fencing still orders it
        await other.release()
        for proxy in (p1, p2):
            proxy.heal()  # let A's connection close without waiting for its timeouts
