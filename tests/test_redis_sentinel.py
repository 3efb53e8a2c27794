"""``redis+sentinel://`` on a real master, replica and sentinel (``tests/redis_topology.py``).

The shared contract suite runs on it too (``pytest tests/test_contract.py -k
redis-sentinel``). These tests fail over while a lock is held: the backend must follow
the new master (scripts and pub/sub), a replicated lease survives, an unreplicated one
is reported lost -- and its token repeats, which is what fencing can and cannot catch.
Each failover test has its own servers (function-scoped), so the shared ones stay put.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
import redis.asyncio as aioredis

import aiolock
from aiolock.backends.redis_sentinel import RedisSentinelBackend
from aiolock.fencing import MemoryFencedResource

from .redis_topology import RedisSentinelServers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def own_sentinel() -> Iterator[RedisSentinelServers]:
    servers = RedisSentinelServers().start()
    yield servers
    servers.close()


@pytest.fixture
async def locks(redis_sentinel: RedisSentinelServers) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(redis_sentinel.url) as conn:
        yield conn


def backend_of(locks: aiolock.Locks) -> RedisSentinelBackend:
    assert isinstance(locks.backend, RedisSentinelBackend)
    return locks.backend


async def until(what: str, check: Callable[[], Awaitable[bool]], timeout: float) -> None:
    """Poll the async ``check()`` until true, for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.1)


async def subscribed(port: int, channel: str) -> bool:
    """Does anyone subscribe to ``channel`` on the server at ``port``?"""
    async with aioredis.Redis(port=port) as node:
        counts = await node.pubsub_numsub(channel)
    return int(counts[0][1]) > 0


def on_master(locks: aiolock.Locks, port: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return backend_of(locks).master_address == ("127.0.0.1", port)

    return check


# -- URLs and connecting -------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "redis+sentinel://h:26379",
    "redis+sentinel://h:26379/",
    "redis+sentinel://h:26379/a/b",
    "redis+sentinel://h:port/mymaster",
    "redis+sentinel://h:26379/mymaster?db=x",
    "redis+sentinel://h:26379/mymaster?bogus=1",
    "redis+sentinel://:pw@h:26379/mymaster?password=pw2",
])
def test_bad_urls_raise_value_error(url: str) -> None:
    with pytest.raises(ValueError, match=r"redis\+sentinel|port|db|option|password"):
        aiolock.connect(url)


def test_url_forms_and_options() -> None:
    backend = RedisSentinelBackend.from_url(
        "redis+sentinel://user:secret@s1,s2:26380/svc?db=2&sentinel_password=x"
    )
    assert backend.url == "redis+sentinel://s1:26379,s2:26380/svc"
    kwargs = backend.client.connection_pool.connection_kwargs
    assert (kwargs["db"], kwargs["username"], kwargs["password"]) == (2, "user", "secret")
    assert backend.sentinel.sentinels[0].connection_pool.connection_kwargs["password"] == "x"
    other = RedisSentinelBackend.from_url("redis+sentinel://s1/svc?password=pw")
    assert other.client.connection_pool.connection_kwargs["password"] == "pw"
    for bad in ({"wait_replicas": -1}, {"wait_replicas": True}, {"request_timeout": 0}):
        with pytest.raises(ValueError):
            RedisSentinelBackend.from_url("redis+sentinel://s1/svc", **bad)


async def test_unknown_service_raises_backend_unavailable(redis_sentinel: RedisSentinelServers) -> None:
    url = redis_sentinel.url.rsplit("/", 1)[0] + "/no-such-service"
    with pytest.raises(aiolock.BackendUnavailable):
        async with aiolock.connect(url, connect_timeout=2.0):
            pass


async def test_db_option_selects_the_database(redis_sentinel: RedisSentinelServers, name: str) -> None:
    async with aiolock.connect(redis_sentinel.url + "?db=3") as locks, locks.lock(name):
        key = backend_of(locks)._base(name)
        async with aioredis.Redis(port=redis_sentinel.master_port(), db=3) as master:
            assert await master.exists(key)


async def test_wait_replicas_grants_and_renews(redis_sentinel: RedisSentinelServers, name: str) -> None:
    async with aiolock.connect(redis_sentinel.url, wait_replicas=1) as locks:
        async with locks.lock(name, ttl=0.6) as lease:
            await asyncio.sleep(1.5)  # renewed (each renewal WAITs for the replica)
            await lease.extend(5)
            assert not lease.lost
        assert not lease.lost


# -- failover ------------------------------------------------------------------------------


async def test_graceful_failover_while_held_lease_survives_and_waiter_follows(
    own_sentinel: RedisSentinelServers, name: str
) -> None:
    servers = own_sentinel
    async with aiolock.connect(servers.url) as a, aiolock.connect(servers.url) as b:
        lease = await a.lock(name, ttl=30).acquire()
        await asyncio.to_thread(servers.wait_replicated)  # the grant and its token reached the replica
        waiter = asyncio.create_task(b.lock(name, ttl=30).acquire(timeout=50))
        await asyncio.sleep(0.2)
        new = await asyncio.to_thread(servers.failover)

        # the holder follows: its next renewal asks the sentinels, and lands on the new master
        await lease.extend(30)
        assert backend_of(a).master_address == ("127.0.0.1", new)
        key = backend_of(a)._base(name)
        async with aioredis.Redis(port=new) as master:
            assert await master.hget(key, "token") == str(lease.token).encode()
            assert await master.pttl(key) > 20_000
        assert not lease.lost and not waiter.done()  # no second holder

        # the waiter's pub/sub connection moves to the new master (the sentinel kills
        # client connections on the demoted one) and resubscribes there (a plain lock's
        # waiter listens on its process's inbox)
        inbox = backend_of(b).inbox
        await until("the waiter subscribed on the new master",
                    lambda: subscribed(new, inbox), 30)
        assert not waiter.done()
        released = time.monotonic()
        await lease.release()
        other = await waiter
        assert time.monotonic() - released < 2.0  # woken by the release, not the 30 s ttl
        assert other.token > lease.token and not lease.lost
        await other.release()
        again = await a.lock(name).acquire(timeout=5)  # new acquisitions work
        assert again.token > other.token
        await again.release()


async def test_master_killed_while_held_lease_survives(
    own_sentinel: RedisSentinelServers, name: str
) -> None:
    servers = own_sentinel
    async with aiolock.connect(servers.url) as a, aiolock.connect(servers.url) as b:
        lease = await a.lock(name, ttl=10).acquire()
        await asyncio.to_thread(servers.wait_replicated)

        async def contender() -> aiolock.Lease:
            while True:  # as an application would: an outage ends a wait with an error
                try:
                    return await b.lock(name, ttl=10).acquire(timeout=50)
                except aiolock.BackendUnavailable:
                    await asyncio.sleep(0.2)

        waiter = asyncio.create_task(contender())
        await asyncio.sleep(0.2)
        new = await asyncio.to_thread(servers.kill_master)
        # renewals failed while no master was up; they are retried, and land on the new one
        await until("a renewal on the new master",
                    on_master(a, new), 15)
        await asyncio.sleep(1.0)
        assert not lease.lost and not waiter.done()  # survived: never a second holder
        await lease.release()
        other = await asyncio.wait_for(waiter, 15)
        assert other.token > lease.token
        await other.release()


async def test_unreplicated_grant_is_lost_in_failover_and_its_token_repeats(
    own_sentinel: RedisSentinelServers, name: str
) -> None:
    """What a failover loses without ``wait_replicas``, and what fencing makes of it."""
    servers = own_sentinel
    async with aiolock.connect(servers.url, wait_replicas=1, request_timeout=1.0) as safe, \
            aiolock.connect(servers.url) as a:
        first = await safe.lock(name).acquire()  # WAITed: its token reached the replica
        await first.release()
        await asyncio.to_thread(servers.cut_replication)

        stale = await a.lock(name, ttl=3).acquire()  # granted on the master only
        assert stale.token == first.token + 1
        # with wait_replicas, an unreplicated grant is refused (and abandoned), not given
        with pytest.raises(aiolock.BackendUnavailable, match="replica"):
            await safe.lock(name + "-other").acquire(timeout=5)
        async def other_free() -> bool:  # the refused grant is abandoned in the background
            return not await a.lock(name + "-other").locked()

        await until("the refused grant abandoned", other_free, 5)

        await asyncio.to_thread(servers.failover)  # to the replica that missed both
        async with aiolock.connect(servers.url) as b:
            other = await b.lock(name, ttl=3).acquire(timeout=5)
            # the counter increment was lost with the lease: the token REPEATS
            assert other.token == stale.token
            # the stale holder finds out at its next renewal (ttl/3), not before
            await asyncio.wait_for(stale.wait_lost(), 5)
            assert stale.lost

            # fencing rejects LOWER tokens only: the stale holder's writes with the same
            # token still pass -- this is the case wait_replicas exists for
            resource = MemoryFencedResource()
            assert await resource.write(other.token, "new holder")
            assert await resource.write(stale.token, "stale holder")
            assert not await resource.write(first.token, "older holder")
            await other.release()


async def test_release_whose_reply_is_late_fails_within_the_request_timeout(
    own_sentinel: RedisSentinelServers, name: str
) -> None:
    """The master freezes under a release: it is not sent again after its timeout (the
    request timeout is the caller's bound; redis-py's retry policy did, doubling it), so
    it raises BackendUnavailable in about request_timeout and the lease is reported lost;
    the lock is free again by its ttl at the latest once the master is back."""
    async with aiolock.connect(own_sentinel.url, request_timeout=0.5, connect_timeout=1) as locks:
        lock = locks.lock(name, ttl=2)
        lease = await lock.acquire()
        own_sentinel.master.pause()
        try:
            started = time.monotonic()
            with pytest.raises(aiolock.BackendUnavailable):
                await lease.release()
            assert time.monotonic() - started < 0.5 + 0.6
            assert lease.lost
        finally:
            own_sentinel.master.resume()

        async def free() -> bool:
            return not await lock.locked()

        await until("the lock is free", free, timeout=2 + 1)


# -- revocation ----------------------------------------------------------------------------


async def test_waiter_handed_a_lock_revoked_before_it_heard_waits_on(
    redis_sentinel: RedisSentinelServers, name: str
) -> None:
    """A revocation hands the lock to the waiter; a second revokes it before the waiter
    (which asks the server before believing a hand-off) has heard. The waiter never held
    it for its caller: its acquire must still end in a lease (or LockTimeout), not in
    LockError("... abandoned")."""
    async with aiolock.connect(redis_sentinel.url) as holder, \
            aiolock.connect(redis_sentinel.url) as waiter, \
            aiolock.connect(redis_sentinel.url) as operator:
        first = await holder.lock(name, ttl=1.5).acquire()
        op = operator.lock(name)
        await asyncio.gather(op.locked(), op.locked())  # two connections, both open
        task = asyncio.create_task(waiter.lock(name, ttl=10).acquire(timeout=3))
        await until("the waiter is registered",
                    lambda: _waiters(operator, name), timeout=3)
        # both sent at once: the second runs before the waiter's next request can
        revoked = await asyncio.gather(op.force_release(), op.force_release())
        assert revoked == [True, True]
        lease = await task
        try:
            if lease.token == first.token + 1:
                # it asked between the two revocations (a waiter told of a hand-over asks
                # at once): granted, then revoked -- it learns so at its next renewal
                await asyncio.wait_for(lease.wait_lost(), 5)
            else:
                assert lease.token > first.token + 1  # not the token revoked under it
                assert not lease.lost
                assert await waiter.lock(name).locked()
        finally:
            await lease.release()
        await asyncio.wait_for(first.wait_lost(), 3)


async def _waiters(locks: aiolock.Locks, name: str) -> bool:
    return (await locks.status(name)).waiters > 0
