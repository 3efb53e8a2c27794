"""``redis+cluster://`` on a real 3-master Redis Cluster (``tests/redis_topology.py``).

The shared contract suite runs on it too (``pytest tests/test_contract.py -k
redis-cluster``); these tests check what is particular to a cluster: locks spread over
every master, a renewal batch split per slot and put back in order, release signals
crossing nodes, and the pub/sub connection moving to another node when it fails.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import MovedError

import aiolock
from aiolock.abc import Claim, Granted, Kind
from aiolock.backends.redis_cluster import RedisClusterBackend

from .redis_topology import RedisClusterServers
from .servers import free_port
from .test_contract import release_wakes_waiter

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def locks(redis_cluster: RedisClusterServers) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(redis_cluster.url) as conn:
        yield conn


def backend_of(locks: aiolock.Locks) -> RedisClusterBackend:
    assert isinstance(locks.backend, RedisClusterBackend)
    return locks.backend


def names_on_every_master(
    cluster: RedisClusterServers, backend: RedisClusterBackend, per_master: int = 1,
    kind: Kind = Kind.LOCK,
) -> dict[int, list[str]]:
    """Fresh lock names, ``per_master`` on each master (keyed by the master's port)."""
    found: dict[int, list[str]] = {port: [] for port in cluster.ports}
    while any(len(names) < per_master for names in found.values()):
        name = f"spread-{uuid.uuid4().hex[:12]}"
        owner = cluster.owner_of(backend.slot(name, kind))
        if len(found[owner]) < per_master:
            found[owner].append(name)
    return found


async def key_exists_on(port: int, key: str) -> bool:
    """EXISTS on that node; a node that does not serve the key's slot says MOVED."""
    async with aioredis.Redis(port=port) as node:
        return bool(await node.exists(key))


# -- URLs and connecting -------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    "redis+cluster://",
    "redis+cluster://host:port",
    "redis+cluster://h1:1,,h2:2",
    "redis+cluster://h1:70000",
    "redis+cluster://h1:6379/3",
    "redis+cluster://h1:6379?db=1",
])
def test_bad_urls_raise_value_error(url: str) -> None:
    with pytest.raises(ValueError, match=r"redis\+cluster|port|database|host"):
        aiolock.connect(url)


def test_url_forms_and_options() -> None:
    backend = RedisClusterBackend.from_url("redis+cluster://u:secret@a:7000,[::1]:7001,b")
    assert backend.url == "redis+cluster://a:7000,[::1]:7001,b:6379"
    assert "secret" not in backend.url
    kwargs = backend.cluster.connection_kwargs
    assert (kwargs["username"], kwargs["password"]) == ("u", "secret")
    only_password = RedisClusterBackend.from_url("redis+cluster://:p%40ss@a:7000")
    assert only_password.cluster.connection_kwargs["password"] == "p@ss"
    assert only_password.cluster.connection_kwargs.get("username") is None
    for bad in ({"connect_timeout": 0}, {"request_timeout": "1"}, {"prefix": "a{b"}):
        with pytest.raises(ValueError):
            RedisClusterBackend.from_url("redis+cluster://a:7000", **bad)


async def test_one_reachable_seed_is_enough(redis_cluster: RedisClusterServers, name: str) -> None:
    url = f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{redis_cluster.ports[1]}"
    async with aiolock.connect(url) as locks, locks.lock(name) as lease:
        assert (await locks.status(name)).token == lease.token


# -- keys and slots ------------------------------------------------------------------------


async def test_locks_spread_over_all_masters(
    locks: aiolock.Locks, redis_cluster: RedisClusterServers
) -> None:
    backend = backend_of(locks)
    spread = names_on_every_master(redis_cluster, backend)
    assert len(spread) == 3
    for port, (name,) in spread.items():
        async with locks.lock(name) as lease:
            key = backend._base(name)
            # every key of one lock is in one slot, held by that slot's master only
            slots = {backend.cluster.keyslot(k) for k in backend._keys(name, "owner", Kind.WRITE)}
            assert slots == {backend.slot(name)}
            assert await key_exists_on(port, key)
            for other in redis_cluster.ports:
                if other != port:
                    with pytest.raises(MovedError):
                        await key_exists_on(other, key)
            assert (await locks.status(name)).token == lease.token


async def test_renew_batch_is_split_per_slot_and_reassembled_in_order(
    locks: aiolock.Locks, redis_cluster: RedisClusterServers
) -> None:
    backend = backend_of(locks)
    spread = names_on_every_master(redis_cluster, backend, per_master=2)
    claims: list[Claim] = []
    for i, name in enumerate(n for names in spread.values() for n in names):
        kind = Kind.PERMIT if i % 2 else Kind.LOCK
        claim = Claim(name, kind, owner=uuid.uuid4().hex, ttl_ms=10_000 + i, limit=2)
        assert isinstance(await backend.try_acquire(claim), Granted)
        claims.append(claim)
    stranger = Claim(claims[3].name, claims[3].kind, owner="not-held", ttl_ms=5_000)
    batch = [*claims[:3], stranger, *claims[3:]]
    try:
        granted = await backend.renew(batch)
        assert granted == [c.ttl_ms for c in claims[:3]] + [None] + [c.ttl_ms for c in claims[3:]]
        # a master that lost its script cache gets the script again, group by group
        for port in redis_cluster.ports:
            async with aioredis.Redis(port=port) as node:
                await node.script_flush()
        assert await backend.renew(batch) == granted
    finally:
        for claim in claims:
            await backend.release(claim)


async def test_watchdog_batches_per_master_keep_leases_on_every_master_alive(
    locks: aiolock.Locks, redis_cluster: RedisClusterServers
) -> None:
    backend = backend_of(locks)
    spread = names_on_every_master(redis_cluster, backend, per_master=2)
    batches: list[set[int]] = []
    renew = backend.renew

    async def recording_renew(claims: Sequence[Claim]) -> list[int | None]:
        batches.append({redis_cluster.owner_of(backend.slot(c.name, c.kind)) for c in claims})
        return await renew(claims)

    backend.renew = recording_renew  # type: ignore[method-assign]
    names = [n for ns in spread.values() for n in ns]
    leases = await asyncio.gather(*(locks.lock(n, ttl=0.6).acquire() for n in names))
    await asyncio.sleep(3.0)  # 5 ttls
    assert not any(lease.lost for lease in leases)
    for name in names:
        assert (await locks.status(name)).held
    # one batch per master, every master renewed
    assert all(len(masters) == 1 for masters in batches), batches
    assert set().union(*batches) == set(redis_cluster.ports), batches
    for lease in leases:
        await lease.release()
    assert not any(lease.lost for lease in leases)


async def test_renewals_go_direct_to_each_master_and_follow_a_moved_slot(
    locks: aiolock.Locks, redis_cluster: RedisClusterServers
) -> None:
    """A batch goes to each master on a connection of the backend's own (one per
    master); when a slot moves, the old master's MOVED sends that group through
    redis-py, which follows it, and the next batch goes direct to the new master."""
    backend = backend_of(locks)
    spread = names_on_every_master(redis_cluster, backend)
    claims = [Claim(n, Kind.LOCK, owner=uuid.uuid4().hex, ttl_ms=20_000) for ns in spread.values()
              for n in ns]
    for claim in claims:
        assert isinstance(await backend.try_acquire(claim), Granted)
    try:
        assert await backend.renew(claims) == [20_000] * 3
        assert {port for _, port in backend._direct} == set(redis_cluster.ports)
        moved = claims[0]
        slot = backend.slot(moved.name)
        src = redis_cluster.owner_of(slot)
        dst = next(p for p in redis_cluster.ports if p != src)
        await move_slot(redis_cluster, slot, src, dst)
        assert redis_cluster.owner_of(slot) == dst
        assert await backend.renew(claims) == [20_000] * 3  # MOVED, then through redis-py
        assert backend.cluster.nodes_manager.get_node_from_slot(slot).port == dst
        assert await backend.renew(claims) == [20_000] * 3
        assert await key_exists_on(dst, backend._base(moved.name))
    finally:
        for claim in claims:
            await backend.release(claim)


async def move_slot(cluster: RedisClusterServers, slot: int, src: int, dst: int) -> None:
    """Move ``slot`` and its keys from master ``src`` to master ``dst`` (as
    ``redis-cli --cluster reshard`` does)."""
    async with aioredis.Redis(port=src) as s, aioredis.Redis(port=dst) as d:
        src_id = (await s.execute_command("CLUSTER", "MYID")).decode()
        dst_id = (await d.execute_command("CLUSTER", "MYID")).decode()
        await d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        await s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        keys = await s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if keys:
            await s.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
        for port in cluster.ports:
            async with aioredis.Redis(port=port) as node:
                await node.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


async def test_a_paused_master_loses_only_its_own_leases(
    redis_cluster: RedisClusterServers,
) -> None:
    """The watchdog renews each master's leases in batches of their own: while one
    master does not answer (SIGSTOP, shorter than the cluster's node timeout), its
    lease is lost at its last confirmed expiry and the leases on the others live on."""
    async with aiolock.connect(redis_cluster.url, request_timeout=3) as locks:
        backend = backend_of(locks)
        spread = names_on_every_master(redis_cluster, backend)
        leases = {port: await locks.lock(name, ttl=0.9, on_lost="raise").acquire()
                  for port, (name,) in spread.items()}
        assert len({backend.renewal_group(lease._hold.claim) for lease in leases.values()}) == 3
        await asyncio.sleep(0.5)  # a renewal on every master before the pause
        paused = redis_cluster.ports[0]
        node = next(n for n in redis_cluster.nodes if n.port == paused)
        node.pause()
        try:
            await asyncio.sleep(2.0)  # over two ttls, under the 5 s node timeout
            assert leases[paused].lost
            for port, lease in leases.items():
                if port != paused:
                    assert not lease.lost, f"lease on master {port} lost with {paused} paused"
        finally:
            node.resume()
        for port, lease in leases.items():
            if port != paused:
                assert (await locks.status(lease.name)).held
            await lease.release()


# -- release signals -----------------------------------------------------------------------


async def test_release_wakes_waiter_on_another_connection_for_every_master(
    redis_cluster: RedisClusterServers,
) -> None:
    async with aiolock.connect(redis_cluster.url) as a, aiolock.connect(redis_cluster.url) as b:
        spread = names_on_every_master(redis_cluster, backend_of(a))
        for (name,) in spread.values():  # the release crosses the cluster bus
            await release_wakes_waiter(a, b, name, 2.0)


async def test_pubsub_moves_to_another_node_when_its_connection_dies(
    redis_cluster: RedisClusterServers, name: str
) -> None:
    async with aiolock.connect(redis_cluster.url) as a, aiolock.connect(redis_cluster.url) as b:
        lease = await a.lock(name, ttl=30).acquire()
        waiter = asyncio.create_task(b.lock(name, ttl=30).acquire(timeout=20))
        await asyncio.sleep(0.2)
        signals: Any = backend_of(b).signals
        first = signals.node
        assert first is not None
        async with aioredis.Redis(port=int(first.rsplit(":", 1)[1])) as node:
            await node.client_kill_filter(_type="pubsub")
        for _ in range(100):  # moves on after a short backoff
            await asyncio.sleep(0.05)
            if signals.node != first and all(f.done() for f in signals._confirmed.values()):
                break
        assert signals.node != first
        assert not waiter.done()
        released = time.monotonic()
        await lease.release()
        other = await waiter
        assert time.monotonic() - released < 2.0
        await other.release()


# -- other primitives ----------------------------------------------------------------------


async def test_rwlock_and_semaphore_across_connections(redis_cluster: RedisClusterServers) -> None:
    async with aiolock.connect(redis_cluster.url) as a, aiolock.connect(redis_cluster.url) as b:
        spread = names_on_every_master(redis_cluster, backend_of(a), kind=Kind.READ)
        for (name,) in spread.values():
            r1 = await a.rwlock(name, ttl=5).read().acquire(timeout=1)
            r2 = await b.rwlock(name, ttl=5).read().acquire(timeout=1)
            writer = asyncio.create_task(b.rwlock(name, ttl=5).write().acquire(timeout=5))
            await asyncio.sleep(0.1)
            assert not writer.done()
            await r1.release()
            await r2.release()
            w = await asyncio.wait_for(writer, 3)
            assert w.token > max(r1.token, r2.token)
            await w.release()

        spread = names_on_every_master(redis_cluster, backend_of(a), kind=Kind.PERMIT)
        for (name,) in spread.values():
            inside = peak = 0

            async def user(conn: aiolock.Locks, sem_name: str = name) -> None:
                nonlocal inside, peak
                async with conn.semaphore(sem_name, limit=2, ttl=5):
                    inside += 1
                    peak = max(peak, inside)
                    await asyncio.sleep(0.02)
                    inside -= 1

            await asyncio.wait_for(asyncio.gather(*(user(c) for c in (a, b) * 5)), 20)
            assert peak == 2


async def test_scan_finds_held_names_on_every_master(
    locks: aiolock.Locks, redis_cluster: RedisClusterServers
) -> None:
    """scan() walks every master (SCAN on each), not only the node it asks first."""
    backend = backend_of(locks)
    spread = names_on_every_master(redis_cluster, backend, per_master=2)
    names = [n for group in spread.values() for n in group]
    prefix = "spread-"  # every name of names_on_every_master
    leases = [await locks.lock(n, ttl=5, data=n).acquire() for n in names]
    try:
        found = {info.name: info async for info in locks.scan(prefix)}
        assert set(names) <= set(found)  # (other tests' "spread-" names may be held too)
        assert all(found[n].held_by[0].data == n for n in names)
        assert await locks.lock(names[0]).force_release()  # and revoke on any master
        assert names[0] not in {info.name async for info in locks.scan(prefix)}
    finally:
        for lease in leases:
            await lease.release()
