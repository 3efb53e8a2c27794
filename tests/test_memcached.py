"""The memcached backend against a real ``memcached`` (started here on a free port).

What only this backend has: whole-second expiries, tombstones for abandoned claims,
a clock-seeded token counter, and its own pipelined meta-protocol client. Plus the fault
cases: a holder process killed with SIGKILL, the server restarted or paused while a lock
is held, and cancellation storms across connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import aiolock
from aiolock._holder import encode_holder
from aiolock.abc import REVOKED, Busy, Claim, Granted, Kind
from aiolock.backends._mc_proto import McClient, Value
from aiolock.backends.memcached import MemcachedBackend, exptime, granted_ms

from .conftest import acquire_cancelled_after
from .mc_server import MemcachedServer

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
HOLDER = ROOT / "tests" / "procs" / "holder.py"  # prints ACQUIRED <token>, then holds


@pytest.fixture
def server() -> Iterator[MemcachedServer]:
    """A server of the test's own, for tests that kill, restart or pause it."""
    with contextlib.closing(MemcachedServer().start()) as own:
        yield own


def connect(server: MemcachedServer, **options: object) -> aiolock.Locks:
    return aiolock.connect(MemcachedBackend.from_url(server.url, **options))


@pytest.fixture
async def locks(memcached_server: MemcachedServer) -> AsyncIterator[aiolock.Locks]:
    async with connect(memcached_server) as conn:
        yield conn


def mc(locks: aiolock.Locks) -> MemcachedBackend:
    backend = locks.backend
    assert isinstance(backend, MemcachedBackend)
    return backend


def claim(name: str, ttl_ms: int = 2000, kind: Kind = Kind.LOCK, limit: int = 1) -> Claim:
    return Claim(name, kind, uuid.uuid4().hex, ttl_ms, limit=limit)


# -- units ----------------------------------------------------------------------------------


def test_expiry_is_whole_seconds_rounded_up_plus_two() -> None:
    assert exptime(1) == 3 and exptime(1000) == 3 and exptime(1001) == 4 and exptime(30_000) == 32
    assert granted_ms(300) == 300 and granted_ms(1500) == 1500  # never more than asked
    assert granted_ms(1000) == 900 and granted_ms(30_000) == 29_900  # E - 2 s, less a margin
    assert exptime(10**12) == 30 * 24 * 3600  # larger would be read as a Unix date
    assert granted_ms(10**12) == (30 * 24 * 3600 - 2) * 1000 - 100


@pytest.mark.parametrize(
    "url", ["memcached://", "memcached://h:notaport", "memcached://h:1/db", "memcached://h?x=1"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ValueError, match="memcached"):
        MemcachedBackend.from_url(url)


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="accepted"):
        MemcachedBackend.from_url("memcached://h", nope=1)
    with pytest.raises(ValueError, match="prefix"):
        MemcachedBackend.from_url("memcached://h", prefix="has space")
    with pytest.raises(ValueError, match="request_timeout"):
        MemcachedBackend.from_url("memcached://h", request_timeout=0)
    assert MemcachedBackend.from_url("memcached://h").url == "memcached://h:11211"


def test_keys_are_valid_and_distinct() -> None:
    backend = MemcachedBackend()
    names = ["a", "a b", "ü", "x" * 512, "x" * 511, "\n", "=a", "#a", "T:=a", "a" * 230, "a" * 231]
    keys = {backend._key("L", n) for n in names}
    assert len(keys) == len(names)
    for key in keys:
        assert len(key) <= 250 and all(0x21 <= b <= 0x7E for b in key)
    assert backend._key("L", "orders:42") == b"aiolock:L:=orders:42"  # readable when possible


# -- the client -------------------------------------------------------------------------------


async def test_client_stays_in_step_when_callers_are_cancelled(memcached_server: MemcachedServer) -> None:
    client = McClient("127.0.0.1", memcached_server.port)
    try:
        keys = [f"cl-{uuid.uuid4().hex}".encode() for _ in range(300)]
        await client.request(*(b"ms %s 4 T60\r\n%04d\r\n" % (k, i) for i, k in enumerate(keys)))

        async def get(i: int) -> None:
            (reply,) = await client.request(b"mg %s v\r\n" % keys[i])
            assert reply.value == b"%04d" % i

        for _ in range(5):
            tasks = [asyncio.create_task(get(i)) for i in range(len(keys))]
            await asyncio.sleep(0)
            for task in random.sample(tasks, 150):
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(r is None or isinstance(r, asyncio.CancelledError) for r in results), results
    finally:
        await client.aclose()


async def test_paused_server_times_out(server: MemcachedServer, name: str) -> None:
    async with connect(server, request_timeout=0.5) as locks:
        await locks.status(name)  # connected
        server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(aiolock.BackendUnavailable):
                await locks.lock(name).acquire(timeout=5)
            assert time.monotonic() - started < 1.0
        finally:
            server.resume()
        lease = await locks.lock(name).acquire(timeout=2)  # reconnects
        await lease.release()


# -- the backend's primitives -----------------------------------------------------------------


async def test_repeated_try_acquire_regrants_same_token(locks: aiolock.Locks, name: str) -> None:
    backend = mc(locks)
    c = claim(name)
    first = await backend.try_acquire(c)
    again = await backend.try_acquire(c)
    assert isinstance(first, Granted) and isinstance(again, Granted)
    assert first.token == again.token and first.ttl_ms == again.ttl_ms == 1900
    other = await backend.try_acquire(claim(name))
    assert isinstance(other, Busy) and 0 < other.retry_after <= 0.05
    assert await backend.renew([c]) == [1900]
    assert await backend.release(c)
    assert not await backend.release(c)
    assert await backend.renew([c]) == [None]


async def test_renew_and_release_never_touch_a_later_holder(locks: aiolock.Locks, name: str) -> None:
    backend = mc(locks)
    mine = claim(name)
    assert isinstance(await backend.try_acquire(mine), Granted)
    await backend._request(b"md %s\r\n" % backend._key("L", name))  # "expired"
    theirs = claim(name)
    got = await backend.try_acquire(theirs)
    assert isinstance(got, Granted)
    assert await backend.renew([mine]) == [None]
    assert not await backend.release(mine)
    await backend.abandon(mine)
    info = await locks.status(name)
    assert info.held and info.token == got.token
    assert await backend.release(theirs)


async def test_abandon_after_a_lost_connection_bars_a_late_add(locks: aiolock.Locks, name: str) -> None:
    """The tombstone path: the add may still arrive, so a free key is barred for it; any
    other acquirer may take the tombstone over at once."""
    backend = mc(locks)
    late = claim(name)
    late.state["gen"] = -1  # "sent on a connection that is gone"
    await backend.abandon(late)
    assert not (await locks.status(name)).held  # a tombstone is not a holder
    raw = await backend._request(b"mg %s v\r\n" % backend._key("L", name))
    assert raw[0].value == f"~{late.owner}".encode()
    key = backend._key("L", name)
    (add,) = await backend._request(b"ms %s 32 T30 ME\r\n%s\r\n" % (key, late.owner.encode()))
    assert add.code == b"NS"  # the late add is refused
    with pytest.raises(aiolock.LockError, match="abandoned"):
        await backend.try_acquire(late)  # and the claim itself is never granted again
    lease = await locks.lock(name).acquire(timeout=0)  # others are not blocked
    await lease.release()


async def test_abandon_of_a_granted_claim_on_a_lost_connection_leaves_a_tombstone(
    locks: aiolock.Locks, name: str
) -> None:
    backend = mc(locks)
    c = claim(name)
    assert isinstance(await backend.try_acquire(c), Granted)
    c.state["gen"] = -1
    c.state.pop("cas")
    await backend.abandon(c)
    assert not (await locks.status(name)).held
    lease = await locks.lock(name).acquire(timeout=0)
    await lease.release()


async def test_semaphore_slots(locks: aiolock.Locks, name: str) -> None:
    sem = locks.semaphore(name, limit=3, ttl=2)
    leases = [await sem.acquire(timeout=0) for _ in range(3)]
    assert len({lease.token for lease in leases}) == 3
    with pytest.raises(aiolock.LockTimeout):
        await sem.acquire(timeout=0.1)
    info = await locks.status(name, Kind.PERMIT)
    assert info.held and info.holders == 3 and info.token is None
    assert info.last_token == max(lease.token for lease in leases)
    await leases[1].release()
    again = await sem.acquire(timeout=0)
    assert again.token > max(lease.token for lease in leases)
    for lease in (leases[0], leases[2], again):
        await lease.release()
    assert (await locks.status(name, Kind.PERMIT)).holders == 0


async def test_rwlock_and_fair_are_refused(locks: aiolock.Locks, name: str) -> None:
    with pytest.raises(ValueError, match="rwlock"):
        locks.rwlock(name)
    with pytest.raises(ValueError, match="fair"):
        locks.lock(name, fair=True)


async def test_any_name(locks: aiolock.Locks) -> None:
    names = ["with space", "ü" * 512, "x" * 512, "line\nbreak", "=", "#"]
    leases = [await locks.lock(n).acquire(timeout=0) for n in names]  # no collisions
    for n, lease in zip(names, leases, strict=True):
        info = await locks.status(n)
        assert info.held and info.token == lease.token
        await lease.release()


# -- holders, revocation, elections ----------------------------------------------------------


def test_held_values_round_trip_and_older_ones_still_read() -> None:
    value = Value("owner", 7, 1_700_000_000_000, '{"h":"x","d":"with spaces"}')
    assert Value.decode(value.encode()) == value
    assert Value.decode(Value("owner", None, 5).encode()) == Value("owner", None, 5, "")
    assert Value.decode(b"owner 12") == Value("owner", 12)  # written by an older aiolock
    assert Value.decode(b"~owner") == Value("~owner")  # a tombstone


async def test_a_holder_of_an_older_aiolock_is_listed_and_revocable(
    locks: aiolock.Locks, name: str
) -> None:
    key = mc(locks)._key("L", name)
    await mc(locks)._request(b"ms %s 8 T30\r\nolder 41\r\n" % key)
    info = await locks.status(name)
    assert info.held and info.token == 41
    assert info.held_by == (aiolock.Holder("", 0, None, "", None),)  # an unknown holder
    assert await locks.lock(name).force_release()
    assert not (await locks.status(name)).held


async def test_force_release_revokes_every_permit(locks: aiolock.Locks, name: str) -> None:
    backend = mc(locks)
    permits = [claim(name, kind=Kind.PERMIT, limit=3) for _ in range(2)]
    tokens = []
    for i, permit in enumerate(permits):
        permit.info = encode_holder(f"p{i}", None)
        granted = await backend.try_acquire(permit)
        assert isinstance(granted, Granted)
        tokens.append(granted.token)
    info = await locks.status(name, Kind.PERMIT)
    assert sorted(h.data for h in info.held_by) == ["p0", "p1"] and info.family == "sem"
    assert await locks.semaphore(name, 3).force_release()
    assert await backend.renew(permits) == [REVOKED, REVOKED]  # each holder learns it
    assert not await backend.set_info(permits[0])
    assert not await locks.semaphore(name, 3).force_release()  # nothing held any more
    again = await locks.semaphore(name, 3).acquire(timeout=0)
    assert again.token > max(tokens)  # tokens keep increasing
    await again.release()


async def test_since_counts_from_the_grant_not_the_first_attempt(
    locks: aiolock.Locks, name: str
) -> None:
    backend = mc(locks)
    first, second = claim(name), claim(name)
    assert isinstance(await backend.try_acquire(first), Granted)
    assert isinstance(await backend.try_acquire(second), Busy)
    await asyncio.sleep(1.0)
    assert await backend.release(first)
    assert isinstance(await backend.try_acquire(second), Granted)
    (holder,) = (await locks.status(name)).held_by
    assert holder.since is not None and holder.since < 0.5
    await backend.release(second)


async def test_an_election_and_a_lock_of_one_name_do_not_contend(
    locks: aiolock.Locks, name: str
) -> None:
    async with locks.lock(name, ttl=5, data="lock"), locks.election(name, ttl=5).campaign("lead"):
        info = await locks.status(name)
        leader = await locks.election(name).leader()
        assert info.held_by[0].data == "lock" and leader is not None and leader.data == "lead"
        since = info.held_by[0].since
        assert since is not None and 0 <= since < 5


# -- leases over time -----------------------------------------------------------------------


async def test_renewal_keeps_a_lease_over_many_ttls(server: MemcachedServer, name: str) -> None:
    async with connect(server) as locks, connect(server) as other:
        async with locks.lock(name, ttl=1) as lease:
            for _ in range(6):  # 6 s: 6 ttls, and 3 whole-second expiries each
                await asyncio.sleep(1)
                assert not lease.lost
                with pytest.raises(aiolock.LockTimeout):
                    await other.lock(name).acquire(timeout=0)
        assert not lease.lost
        assert not (await other.status(name)).held


async def test_unrenewed_lease_expires_on_the_server_within_a_rounded_ttl(
    locks: aiolock.Locks, name: str
) -> None:
    backend = mc(locks)
    c = claim(name, ttl_ms=1000)
    assert isinstance(await backend.try_acquire(c), Granted)
    started = time.monotonic()
    while (await locks.status(name)).held:
        await asyncio.sleep(0.02)
    assert 1.0 - 0.05 <= time.monotonic() - started <= 3.0 + 0.1  # (E-1, E] with E = 3, rarely E-2


async def test_killed_holder_process_frees_within_rounded_ttl_plus_two(
    server: MemcachedServer, name: str
) -> None:
    ttl = 1.0
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(HOLDER), server.url, name, str(ttl), stdout=asyncio.subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 10)
        assert line.startswith(b"ACQUIRED"), line
        old = int(line.split()[1])
        async with connect(server) as locks:
            await asyncio.sleep(2.5)  # the holder renews meanwhile
            with pytest.raises(aiolock.LockTimeout):
                await locks.lock(name).acquire(timeout=0)
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            killed = time.monotonic()
            lease = await locks.lock(name).acquire(timeout=5)
            waited = time.monotonic() - killed
            assert waited < math.ceil(ttl) + 2 + 0.2, waited  # the whole-second clock
            assert lease.token > old
            await lease.release()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_server_restart_loses_the_lease(server: MemcachedServer, name: str) -> None:
    async with connect(server) as locks:
        body_done = False
        started = time.monotonic()
        with pytest.raises(aiolock.LockLost):
            async with locks.lock(name, ttl=1) as lease:
                old = lease.token
                server.restart()
                await asyncio.sleep(5)
                body_done = True
        assert not body_done and lease.lost
        assert time.monotonic() - started < 1.5  # found at the next renewal (ttl/3)
        again = await locks.lock(name).acquire(timeout=1)
        # the counter was lost too; its clock seed keeps tokens increasing (best effort)
        assert again.token > old
        await again.release()


async def test_server_down_lease_lost_by_last_confirmed_expiry(server: MemcachedServer, name: str) -> None:
    async with connect(server, request_timeout=0.5) as locks:
        lease = await locks.lock(name, ttl=1).acquire()
        server.kill()
        started = time.monotonic()
        await asyncio.wait_for(lease.wait_lost(), 3)
        assert lease.lost and time.monotonic() - started <= 1.1
        server.start()
        await lease.release()  # a no-op: lost


# -- cancellation ---------------------------------------------------------------------------


async def test_cancellation_storm_across_connections_leaves_nothing_held(
    memcached_server: MemcachedServer, name: str
) -> None:
    conns = [connect(memcached_server) for _ in range(3)]
    for conn in conns:
        await conn.__aenter__()
    try:
        async def user(conn: aiolock.Locks, sem: bool) -> None:
            lock = conn.semaphore(name + "s", limit=2, ttl=10) if sem else conn.lock(name, ttl=10)
            async with lock:
                await asyncio.sleep(random.random() / 200)

        for _ in range(4):
            tasks = [
                asyncio.create_task(user(conns[i % 3], sem=i % 2 == 0)) for i in range(90)
            ]
            await asyncio.sleep(random.random() / 50)
            for task in random.sample(tasks, 60):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.1)  # background abandons of timed-out or cancelled claims
        assert not (await conns[0].status(name)).held
        assert (await conns[0].status(name + "s", Kind.PERMIT)).holders == 0
        lease = await conns[1].lock(name).acquire(timeout=0)
        await lease.release()
    finally:
        for conn in conns:
            await conn.aclose()


async def test_cancel_at_every_step_with_a_contender(locks: aiolock.Locks, name: str) -> None:
    """A waiter on another connection must get the lock promptly whatever step the
    cancelled acquire was at: nothing is left held, no tombstone blocks it for long."""
    lock = locks.lock(name, ttl=10)
    for steps in range(14):
        await acquire_cancelled_after(lock, steps)
        assert not (await locks.status(name)).held, f"leaked after {steps} steps"
