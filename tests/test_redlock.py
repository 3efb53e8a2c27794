"""The Redlock backend against 3 and 5 real redis-servers: URLs, quorum, validity, token
agreement, partial grants, and nodes killed, restarted empty or paused while a lock is held.

The shared contract suite runs on ``redlock://`` too (``test_contract.py -k redlock``).
Each test here starts its own servers (they get killed), with short TTLs and timeouts,
and asserts what a bug would break; time bounds are generous (other suites may share the
machine).
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

import aiolock
from aiolock.abc import Busy, Claim, Granted, Kind
from aiolock.backends.redlock import RedlockBackend

from .servers import RedisServer

pytestmark = pytest.mark.timeout(60)

WORKER = Path(__file__).parent / "procs" / "worker.py"

FAST = "connect_timeout=1&request_timeout=1"


@pytest.fixture(params=[3, 5], ids=["3-nodes", "5-nodes"])
def servers(request: pytest.FixtureRequest) -> Iterator[list[RedisServer]]:
    """Fresh redis-servers of our own (tests kill, restart and pause them)."""
    started: list[RedisServer] = []
    try:
        for _ in range(request.param):
            started.append(RedisServer().start())
        yield started
    finally:
        for server in started:
            server.close()  # SIGKILL: also ends a paused (SIGSTOPped) server


three = pytest.mark.parametrize("servers", [3], indirect=True, ids=["3-nodes"])


def url_of(servers: list[RedisServer], query: str = FAST) -> str:
    return ports_url([s.port for s in servers], query)


def ports_url(ports: list[int], query: str = FAST) -> str:
    """The URL of the nodes listening on ``ports`` (a server's, or a proxy's before it)."""
    return "redlock://" + ",".join(f"127.0.0.1:{port}" for port in ports) + f"?{query}"


@pytest.fixture
async def locks(servers: list[RedisServer]) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(url_of(servers)) as conn:
        yield conn


def backend(locks: aiolock.Locks) -> RedlockBackend:
    assert isinstance(locks.backend, RedlockBackend)
    return locks.backend


async def node_state(server: RedisServer, name: str) -> tuple[str | None, int | None, int]:
    """(owner, token) of the lock hash and the counter on one node, read directly."""
    client = aioredis.Redis(port=server.port, decode_responses=True)
    try:
        base = f"aiolock:lock:{{{name}}}"
        owner, token = await client.hmget(base, "owner", "token")
        seq = await client.get(base + ":seq")
        return owner, (int(token) if token else None), int(seq or 0)
    finally:
        await client.aclose()


async def wait_for(predicate: Any, timeout: float, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(step)


async def held_everywhere(servers: list[RedisServer], name: str, token: int) -> None:
    """Wait until every node holds the grant: the attempt returns once a majority granted,
    and a late grant still on its way would otherwise race with what a test does next."""

    async def everywhere() -> bool:
        return all([(await node_state(s, name))[1] == token for s in servers])

    await wait_for(everywhere, 3)


async def handed_over(lease: aiolock.Lease, lock: aiolock.Lock, *, waited: bool = False) -> aiolock.Lease:
    """Release ``lease``; ``lock`` (same name) gets it next, with a higher token. With
    ``waited``, ``lock`` already waits and must be woken by the release, not a timer."""
    waiter = asyncio.create_task(lock.acquire(timeout=10))
    if waited:
        done, _ = await asyncio.wait({waiter}, timeout=0.3)
        assert not done  # held by ``lease`` until now
    released = time.monotonic()
    await lease.release()
    nxt = await waiter
    assert time.monotonic() - released < 1.0
    assert nxt.token > lease.token
    return nxt


# -- URLs and arguments ----------------------------------------------------------------------


#: bad URL -> what its ValueError says
BAD_URLS = {
    "redlock://h1:1,h2:2": "at least 3",
    "redlock://h1:1,h2:2,h1:1": "appears twice",
    "redlock://h1:1,h2:2,h3:99999": "bad port",
    "redlock://h1:1,h2:x,h3:3": "bad port",
    "redlock://h1:1,,h3:3": "bad node",
    "redlock://h1:1,h2:2,h3:3/zero": "must be a number",
    "redlock://h1:1,h2:2,h3:3?bogus=1": "unknown option",
    "redlock://h1:1,h2:2,h3:3?drift_factor=2": "drift_factor",
    "redlock://h1:1,h2:2,h3:3?request_timeout=-1": "request_timeout",
    "redlock://user:s3cret@h1:1,h2:2": "at least 3",
}


@pytest.mark.parametrize("url", BAD_URLS)
def test_bad_urls_say_what_is_accepted(url: str) -> None:
    with pytest.raises(ValueError, match=BAD_URLS[url]) as refused:
        RedlockBackend.from_url(url)
    assert "s3cret" not in str(refused.value)


async def test_url_forms() -> None:
    b = RedlockBackend.from_url(
        "redlock://user:secret@h1,[::1]:7001,H3:7002/2?drift_factor=0.05", request_timeout=2
    )
    try:
        assert b.url == "redlock://h1:6379,[::1]:7001,h3:7002/2"  # no password
        assert [n.url for n in b.nodes] == [
            "redis://h1:6379/2", "redis://[::1]:7001/2", "redis://h3:7002/2"
        ]
        assert b.quorum == 2 and b.drift_factor == 0.05
        assert b.drift_ms(1000) == pytest.approx(52.0)
        assert aiolock.Capability.FAIR not in b.capabilities
    finally:
        await b.aclose()
    with pytest.raises(ValueError, match="at least 3"):
        RedlockBackend(b.nodes[:2])


# -- mutual exclusion and tokens -------------------------------------------------------------


async def test_mutual_exclusion_two_connections(servers: list[RedisServer], name: str) -> None:
    url = url_of(servers)
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        inside = peak = 0
        tokens: list[int] = []

        async def worker(conn: aiolock.Locks) -> None:
            nonlocal inside, peak
            for _ in range(8):
                async with conn.lock(name, ttl=5) as lease:
                    inside += 1
                    peak = max(peak, inside)
                    tokens.append(lease.token)
                    await asyncio.sleep(0.001)
                    inside -= 1

        await asyncio.wait_for(asyncio.gather(*(worker(c) for c in (a, b) for _ in range(10))), 40)
    assert peak == 1
    assert len(tokens) == 160 and all(x < y for x, y in pairwise(tokens)), tokens


async def test_mutual_exclusion_across_processes(
    servers: list[RedisServer], name: str, tmp_path: Path
) -> None:
    """With one node down: contenders in different processes now split votes (each
    holding a minority), and must still exclude each other and make progress."""
    nprocs, ntasks, duration = 3, 4, 2.0
    url = url_of(servers)
    servers[0].kill()
    files = [tmp_path / f"worker-{i}.jsonl" for i in range(nprocs)]
    workers = [  # tests/procs/worker.py: READY, then GO <stop>, then DONE <n>
        await asyncio.create_subprocess_exec(
            sys.executable, str(WORKER), url, name, str(ntasks), str(f),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        for f in files
    ]
    try:
        async with asyncio.timeout(duration + 30):
            for w in workers:
                assert w.stdout is not None and (await w.stdout.readline()).startswith(b"READY")
            stop = time.monotonic() + duration
            for w in workers:
                assert w.stdin is not None
                w.stdin.write(f"GO {stop}\n".encode())
                await w.stdin.drain()
            for w in workers:
                assert await w.wait() == 0
    finally:
        for w in workers:
            if w.returncode is None:
                w.kill()
                await w.wait()
    records = sorted(
        (tuple(json.loads(line)) for f in files for line in f.read_text().splitlines()),
        key=lambda r: r[1],
    )
    print(f"critical sections: {len(records)} by {len({r[3] for r in records})} processes")
    overlaps = [(a, b) for a, b in pairwise(records) if b[1] < a[2]]
    assert not overlaps, f"{len(overlaps)} overlapping critical sections, e.g. {overlaps[:3]}"
    tokens = [r[0] for r in records]
    assert all(x < y for x, y in pairwise(tokens)), "tokens not strictly increasing in hold order"
    assert len(records) >= 50 and len({r[3] for r in records}) >= 2, len(records)


@three
async def test_differing_counters_are_raised_to_the_token(
    servers: list[RedisServer], locks: aiolock.Locks, name: str
) -> None:
    """The token is the highest counter of the granting majority, and those nodes are
    raised to it before the grant returns: the next grant is higher even after the node
    that had the highest counter is gone."""
    client = aioredis.Redis(port=servers[0].port)
    await client.set(f"aiolock:lock:{{{name}}}:seq", 100)
    await client.aclose()
    other = Claim(name, Kind.LOCK, "other-owner", 10_000)
    assert isinstance(await backend(locks).nodes[1].try_acquire(other), Granted)
    lease = await locks.lock(name).acquire(timeout=2)  # granted by nodes 0 (101) and 2 (1)
    assert lease.token == 101
    assert (await node_state(servers[2], name))[1:] == (101, 101)  # raised, not in the background
    info = await locks.status(name)
    assert info.held and info.token == 101 and info.last_token == 101
    await lease.release()
    await backend(locks).nodes[1].release(other)
    servers[0].kill()
    second = await locks.lock(name).acquire(timeout=2)  # nodes 1 (counter 1) and 2
    assert second.token == 102
    await second.release()


async def _everywhere(clients: list[aioredis.Redis], key: str, token: bytes) -> bool:
    return all([await c.hget(key, "token") == token for c in clients])


@three
async def test_status_reports_the_token_a_majority_keeps(
    servers: list[RedisServer], locks: aiolock.Locks, name: str
) -> None:
    """A node that granted after the majority decided carries its own count until the RAISE
    that follows relabels it; status and leader() read meanwhile report the lease's token,
    not that node's (CI saw leader().token == lease.token + 1 under load)."""
    from aiolock.backends._redlock_node import keys

    for kind, take in ((Kind.LOCK, locks.lock(name, ttl=5).acquire),
                       (Kind.LEADER, locks.election(name, ttl=5).campaign().acquire)):
        lease = await take(timeout=2)
        key = keys(backend(locks).nodes[2], name, kind)[0]
        clients = [aioredis.Redis(port=s.port) for s in servers]
        try:
            want = str(lease.token).encode()
            await wait_for(functools.partial(_everywhere, clients, key, want), 3)
            await clients[2].hset(key, "token", lease.token + 1)  # as a late grant before its RAISE
        finally:
            for c in clients:
                await c.aclose()
        if kind is Kind.LOCK:
            info = await locks.status(name)
            assert info.held and info.token == lease.token
        else:
            leader = await locks.election(name).leader()
            assert leader is not None and leader.token == lease.token
        await lease.release()


# -- holders, listing, revocation, elections ---------------------------------------------------


@three
async def test_holders_scan_and_revocation_with_a_node_down(
    servers: list[RedisServer], locks: aiolock.Locks, name: str
) -> None:
    servers[0].kill()
    lock = locks.lock(f"{name}:a", ttl=3, data="a{1}%")
    async with locks.lock(f"{name}:b", ttl=5):
        assert [i.name async for i in locks.scan(name)] == [f"{name}:b"]
    assert [i async for i in locks.scan(name)] == []  # released: no longer listed
    with pytest.raises(aiolock.LockLost, match="revoked"):
        async with lock as lease:
            info = await locks.status(lock.name)
            assert [h.data for h in info.held_by] == ["a{1}%"] and info.token == lease.token
            assert [i.name async for i in locks.scan(f"{name}:")] == [lock.name]
            revoked = time.monotonic()
            assert await lock.force_release()
            await asyncio.sleep(5)  # cancelled at the next renewal
    assert time.monotonic() - revoked < 3 / 3 + 0.6  # at the next renewal (ttl/3)
    assert [i async for i in locks.scan(name)] == []
    assert not await lock.force_release()
    async with lock as again:
        assert again.token > lease.token


@three
async def test_a_minority_holder_is_not_listed(
    servers: list[RedisServer], locks: aiolock.Locks, name: str
) -> None:
    """A claim held on one node only (a partial grant) is neither a holder nor listed; on
    two it is, though written by the Redis backend's own script (no holder record)."""
    other = Claim(name, Kind.LOCK, "other-owner", 10_000)
    nodes = backend(locks).nodes
    assert isinstance(await nodes[0].try_acquire(other), Granted)
    assert [i async for i in locks.scan(name)] == []
    assert isinstance(await nodes[1].try_acquire(other), Granted)
    (info,) = [i async for i in locks.scan(name)]
    assert info.held and info.held_by == (aiolock.Holder("", 0, None, "", None),)
    assert await locks.lock(name).force_release()
    assert not (await locks.status(name)).held


@three
async def test_observers_are_woken_by_events_not_the_ttl(
    servers: list[RedisServer], name: str
) -> None:
    url = url_of(servers)
    async with aiolock.connect(url) as watcher, aiolock.connect(url) as candidate:
        seen: asyncio.Queue[str | None] = asyncio.Queue()

        async def observe() -> None:
            async for leader in watcher.election(name, ttl=10).observe():
                await seen.put(None if leader is None else leader.data)

        task = asyncio.create_task(observe())
        try:
            assert await asyncio.wait_for(seen.get(), 2) is None
            term = await candidate.election(name, ttl=10).campaign("one").acquire()
            # a poll would take ttl / 2 = 5 s: the grant and the proclaim are published
            assert await asyncio.wait_for(seen.get(), 1) == "one"
            await term.proclaim("two")
            assert await asyncio.wait_for(seen.get(), 1) == "two"
            await term.release()
            assert await asyncio.wait_for(seen.get(), 1) is None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


# -- validity and partial grants ---------------------------------------------------------------


@three
async def test_ttl_shorter_than_the_acquisition_is_not_granted(
    servers: list[RedisServer], locks: aiolock.Locks, name: str
) -> None:
    with pytest.raises(aiolock.LockTimeout):  # 1 ms < the 2 ms drift allowance: never valid
        await locks.lock(name, ttl=0.001).acquire(timeout=0)
    # two nodes answer only after 1 s: a majority granted, but after the 0.5 s ttl
    for server in servers[1:]:
        server.pause()
    patient = aiolock.connect(url_of(servers, "request_timeout=5"))
    try:
        attempt = asyncio.create_task(patient.lock(name, ttl=0.5).acquire(timeout=0))
        await asyncio.sleep(1.0)
    finally:
        for server in servers[1:]:
            server.resume()
    try:
        with pytest.raises(aiolock.LockTimeout):
            await asyncio.wait_for(attempt, 5)
    finally:
        await patient.aclose()

    async def gone() -> bool:  # a node still answering gets its release right after
        return [(await node_state(s, name))[0] for s in servers] == [None, None, None]

    await wait_for(gone, 0.4, 0.02)  # well before their late 0.5 s grants would expire
    lease = await locks.lock(name).acquire(timeout=2)  # and nothing blocks the next one
    await lease.release()


@three
async def test_minority_grant_is_released_and_busy_is_bounded(
    servers: list[RedisServer], locks: aiolock.Locks, name: str
) -> None:
    """Another claim holds two nodes: we get one node, must give it back at once, and
    retry no later than the holder's lease ends (plus jitter)."""
    other = Claim(name, Kind.LOCK, "other-owner", 1500)
    for node in backend(locks).nodes[1:]:
        assert isinstance(await node.try_acquire(other), Granted)
    mine = Claim(name, Kind.LOCK, "mine", 10_000)
    result = await backend(locks).try_acquire(mine)
    assert isinstance(result, Busy) and 0 < result.retry_after <= 1.5 + 0.05, result
    assert await node_state(servers[0], name) == (None, None, 1)  # granted there, then released
    assert (await locks.status(name)).held  # the other claim holds a majority
    started = time.monotonic()
    lease = await locks.lock(name, ttl=5).acquire(timeout=5)  # free once its lease ends
    assert time.monotonic() - started < 1.5 + 1.0
    await lease.release()
    # a minority holder alone is not a holder (a new claim: ``other`` may still hold a
    # node whose copy of its lease has not expired yet)
    minority = Claim(name, Kind.LOCK, "minority-owner", 1500)
    assert isinstance(await backend(locks).nodes[0].try_acquire(minority), Granted)
    assert not (await locks.status(name)).held


# -- nodes failing while a lock is held ------------------------------------------------------------


async def test_node_killed_while_held(servers: list[RedisServer], name: str) -> None:
    url = url_of(servers)
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        lease = await a.lock(name, ttl=1).acquire(timeout=2)
        servers[0].kill()
        await asyncio.sleep(2.5)  # several renewals with one node gone
        assert not lease.lost and await b.lock(name).locked()
        second = await handed_over(lease, b.lock(name, ttl=1), waited=True)
        await (await handed_over(second, a.lock(name))).release()


@three
async def test_node_restarted_empty_while_held(servers: list[RedisServer], name: str) -> None:
    """No second holder while one node lost the lease; the watchdog puts the lease back
    on that node, so losing another node afterwards is still survived.

    The lease must be on all three nodes first: one held on exactly a majority loses it
    when one of those restarts empty (see docs/redlock.md, "delayed restarts")."""
    url = url_of(servers)
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        lease = await a.lock(name, ttl=1).acquire(timeout=2)
        await held_everywhere(servers, name, lease.token)
        servers[0].restart()  # empty: no persistence
        with pytest.raises(aiolock.LockTimeout):
            await b.lock(name).acquire(timeout=0.5)

        async def repaired() -> bool:
            return (await node_state(servers[0], name))[1] == lease.token

        await wait_for(repaired, 3)  # owner's lease and counter are back on the node
        servers[1].kill()
        await asyncio.sleep(1.5)
        assert not lease.lost
        with pytest.raises(aiolock.LockTimeout):
            await b.lock(name).acquire(timeout=0.3)
        await (await handed_over(lease, b.lock(name))).release()


@three
async def test_majority_restarted_empty_loses_the_lease(servers: list[RedisServer], name: str) -> None:
    async with aiolock.connect(url_of(servers)) as locks:
        reached = False
        with pytest.raises(aiolock.LockLost):
            async with locks.lock(name, ttl=1) as lease:
                await held_everywhere(servers, name, lease.token)
                for server in servers[:2]:
                    server.restart()
                started = time.monotonic()
                await asyncio.sleep(10)  # cancelled when the lease is found lost
                reached = True
        assert lease.lost and not reached
        assert time.monotonic() - started < 1 + 1.0  # found at the next renewal


async def test_majority_killed_loses_lease_and_acquire_fails_fast(
    servers: list[RedisServer], name: str
) -> None:
    async with aiolock.connect(url_of(servers)) as locks:
        lease = await locks.lock(name, ttl=1).acquire(timeout=2)
        expires = time.monotonic() + lease.expires_in
        majority = len(servers) // 2 + 1
        for server in servers[:majority]:
            server.kill()
        await asyncio.wait_for(lease.wait_lost(), 3)
        assert lease.lost and time.monotonic() < expires + 1 + 0.5  # within the validity window
        started = time.monotonic()
        with pytest.raises(aiolock.BackendUnavailable, match="needs"):
            await locks.lock(name).acquire(timeout=10)
        with pytest.raises(aiolock.BackendUnavailable):
            await locks.status(name)
        with pytest.raises(aiolock.BackendUnavailable):
            await locks.lock(name).force_release()
        with pytest.raises(aiolock.BackendUnavailable):
            [i async for i in locks.scan()]
        assert time.monotonic() - started < 2 * 1 + 1.0  # connect/request timeouts are 1 s
    with pytest.raises(aiolock.BackendUnavailable):
        async with aiolock.connect(url_of(servers)):
            pass


@three
async def test_majority_paused_is_unavailable_within_the_request_timeout(
    servers: list[RedisServer], name: str
) -> None:
    async with aiolock.connect(url_of(servers, "connect_timeout=0.5&request_timeout=0.5")) as locks:
        for server in servers[1:]:
            server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(aiolock.BackendUnavailable):
                await locks.lock(name).acquire(timeout=10)
            assert time.monotonic() - started < 0.5 + 1.0
        finally:
            for server in servers[1:]:
                server.resume()
        lease = await locks.lock(name).acquire(timeout=3)  # back to normal
        await lease.release()


@three
async def test_one_paused_node_does_not_slow_anything_down(
    servers: list[RedisServer], name: str
) -> None:
    """A majority answering is enough: acquire, renew, status and release do not wait
    for the request timeout of a stopped node."""
    async with aiolock.connect(url_of(servers, "connect_timeout=3&request_timeout=3")) as locks:
        lock = locks.lock(name, ttl=1)
        servers[0].pause()
        try:
            for _ in range(2):
                started = time.monotonic()
                lease = await lock.acquire(timeout=2)
                assert (await locks.status(name)).held
                assert [i.name async for i in locks.scan(name)] == [name]
                await asyncio.sleep(1.2)  # renewals (a 3 s wait for node 0 would lose it)
                assert not lease.lost
                await lease.release()
                assert time.monotonic() - started - 1.2 < 1.0  # nothing waited 3 s
        finally:
            servers[0].resume()


@three
async def test_a_node_slower_than_the_majority_that_lost_the_lease_gets_it_back(
    servers: list[RedisServer], name: str
) -> None:
    """Node 0 answers every request 0.2 s after the others (a proxy delays it), so each
    renewal is decided by nodes 1 and 2 before it answers; when node 0 loses the lease
    (its key deleted), its late "not held" still makes the watchdog put the lease back
    there, as it does for a node that answers in time."""
    from .faults.proxy import Proxy

    proxy = await Proxy(servers[0].port).start()
    try:
        url = ports_url([proxy.port, servers[1].port, servers[2].port])
        # ttl 2: renewals every 0.67 s, still decided before node 0 answers, and a stall
        # of the loaded CI machine does not let nodes 1 and 2 expire it (it did at ttl 1)
        async with aiolock.connect(url) as locks, locks.lock(name, ttl=2) as lease:
            await held_everywhere(servers, name, lease.token)
            proxy.set_faults(delay=0.1)  # each way
            direct = aioredis.Redis(port=servers[0].port, decode_responses=True)
            try:
                await direct.delete(f"aiolock:lock:{{{name}}}")
            finally:
                await direct.aclose()
            await held_everywhere(servers, name, lease.token)
            assert not lease.lost
    finally:
        await proxy.aclose()


@three
async def test_a_late_grant_carries_the_leases_token(servers: list[RedisServer]) -> None:
    """Node 0 (behind a proxy, its scripts flushed) is still connecting when the others
    grant: its grant, made after the lease was decided, is labelled with the lease's
    token and its counter is not pushed past it (a RAISE that overtook the acquire made
    that node's token the lease's + 1, about one time in ten)."""
    from .faults.proxy import Proxy

    proxy = await Proxy(servers[0].port).start()
    direct = aioredis.Redis(port=servers[0].port, decode_responses=True)
    try:
        url = ports_url([proxy.port, servers[1].port, servers[2].port])
        for _ in range(25):
            await direct.script_flush()
            name = f"t-{uuid.uuid4().hex}"
            async with aiolock.connect(url) as locks, locks.lock(name, ttl=5) as lease:
                await held_everywhere(servers, name, lease.token)
                assert [(await node_state(s, name))[2] for s in servers] == [lease.token] * 3
    finally:
        await direct.aclose()
        await proxy.aclose()
