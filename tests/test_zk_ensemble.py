"""ZooKeeper failover: a 3-node ensemble on loopback, its leader killed (``kill -9``)
while a lock is held and waiters wait.

What must hold whatever the timing (other tests may load the machine): never two
holders at once (a shared in-test counter, raised inside the lock and lowered on the
way out), tokens strictly increasing in holding order across the failover, the holder
either keeps its lease (its session outlives the election) or learns that it lost it,
the waiters proceed after the release, and the killed node rejoins with the same data.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

import aiolock

from .zk_server import ZooKeeperEnsemble, zookeeper_classpath

pytest.importorskip("aiozk")

if zookeeper_classpath() is None:
    pytest.skip("ZooKeeper is not installed (apt-get install zookeeper)", allow_module_level=True)

#: Above the election time (about 1 s here, a few s on a loaded machine), so sessions
#: outlive the failover; a lease is believed for at most this long between renewals.
SESSION_TIMEOUT = 10.0
#: Renewed every 4 s; a renewal that fails during the election is retried within 1 s.
TTL = 12.0


@pytest.fixture(scope="module")
def ensemble() -> Iterator[ZooKeeperEnsemble]:
    zk = ZooKeeperEnsemble(size=3).start()
    yield zk
    zk.close()


@contextlib.asynccontextmanager
async def _clients(url: str, n: int) -> AsyncIterator[list[aiolock.Locks]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(
            aiolock.connect(url, session_timeout=SESSION_TIMEOUT, connect_timeout=15,
                            request_timeout=15))
            for _ in range(n)]


def _session_id(locks: aiolock.Locks) -> int:
    return int(locks.backend.client.session.session_id)  # type: ignore[attr-defined]


class Record:
    """What the holders saw, in the order they held the lock."""

    def __init__(self) -> None:
        self.holders = 0
        self.max_holders = 0
        self.tokens: list[int] = []
        self.who: list[str] = []
        self.lost: list[str] = []

    @contextlib.contextmanager
    def holding(self, who: str, token: int) -> Iterator[None]:
        self.holders += 1
        self.max_holders = max(self.max_holders, self.holders)
        self.tokens.append(token)
        self.who.append(who)
        try:
            yield
        finally:
            self.holders -= 1


async def test_leader_killed_while_held_and_waiters_wait(ensemble: ZooKeeperEnsemble) -> None:
    name = f"failover-{uuid.uuid4().hex[:8]}"
    chroot = f"/aiolock-{uuid.uuid4().hex[:8]}"
    url = ensemble.url(chroot)
    record = Record()
    release_holder = asyncio.Event()

    async def hold(locks: aiolock.Locks, who: str, until: asyncio.Event | None) -> None:
        try:
            async with locks.lock(name, ttl=TTL) as lease:
                with record.holding(who, lease.token):
                    if until is not None:
                        await until.wait()
                    else:
                        await asyncio.sleep(0.2)
        except aiolock.LockLost:
            record.lost.append(who)  # learned that it lost the lease: allowed, and safe

    async with _clients(url, 4) as (a, *others):
        holder = asyncio.create_task(hold(a, "holder", release_holder))
        for _ in range(100):
            if record.holders:
                break
            await asyncio.sleep(0.05)
        assert record.who == ["holder"]
        waiters = [asyncio.create_task(hold(c, f"waiter{i}", None)) for i, c in enumerate(others)]
        await asyncio.sleep(0.5)
        assert not any(w.done() for w in waiters) and record.who == ["holder"]

        sid = _session_id(a)
        leader = await asyncio.to_thread(ensemble.leader_index)
        killed_at = time.monotonic()
        await asyncio.to_thread(ensemble.kill, leader)
        await asyncio.to_thread(ensemble.wait_quorum, 45)
        elected = time.monotonic() - killed_at
        await asyncio.sleep(1.0)  # the clients reconnect; the holder's renewals resume
        assert record.who == ["holder"], "a waiter got in while the holder held"
        release_holder.set()
        await asyncio.wait_for(holder, 30)
        await asyncio.wait_for(asyncio.gather(*waiters), 45)

        assert record.max_holders == 1, record.who
        assert sorted(record.who) == ["holder", "waiter0", "waiter1", "waiter2"]
        assert record.who[0] == "holder"
        assert record.tokens == sorted(set(record.tokens)), record.tokens
        # The session outlives an election well within its timeout; the lease is kept
        # if a renewal got through in time, else the holder was told (record.lost):
        # either way nobody else held meanwhile (checked above).
        if elected < SESSION_TIMEOUT / 2:
            assert _session_id(a) == sid, "the session did not survive the failover"
        if elected < 2.0:  # clients back within about a second, the lease 6 s from expiry
            assert not record.lost, (record.lost, elected)

        # the ensemble goes on with two nodes: a new acquisition, a higher token
        async with a.lock(name, ttl=TTL, timeout=30) as lease:
            assert lease.token > record.tokens[-1]
            last = lease.token

    # the killed node rejoins, with the data (the token counter is the zxid)
    await asyncio.to_thread(ensemble.restart, leader)
    assert (await asyncio.to_thread(ensemble.modes))[leader] in ("leader", "follower")
    only = f"zookeeper://127.0.0.1:{ensemble.client_ports[leader]}{chroot}"
    async with _clients(only, 1) as (c,):
        async with c.lock(name, ttl=TTL, timeout=30) as lease:
            assert lease.token > last
        assert not await c.lock(name).locked()


async def test_requests_in_flight_through_a_failover(ensemble: ZooKeeperEnsemble) -> None:
    """Many short acquisitions by several clients run on while the leader is killed and
    brought back: no double holder, tokens increase, everyone finishes."""
    name = f"churn-{uuid.uuid4().hex[:8]}"
    url = ensemble.url(f"/aiolock-{uuid.uuid4().hex[:8]}")
    record = Record()
    stop = asyncio.Event()

    async def churn(locks: aiolock.Locks, who: str) -> None:
        while not stop.is_set():
            try:
                async with locks.lock(name, ttl=TTL, timeout=40) as lease:
                    with record.holding(who, lease.token):
                        await asyncio.sleep(0.01)
            except aiolock.LockLost:
                record.lost.append(who)
            except aiolock.BackendUnavailable:
                await asyncio.sleep(0.2)  # a request timed out during the election: retry

    async with _clients(url, 3) as clients:
        tasks = [asyncio.create_task(churn(c, f"c{i}")) for i, c in enumerate(clients)]
        await asyncio.sleep(1.0)
        before = len(record.tokens)
        leader = await asyncio.to_thread(ensemble.leader_index)
        await asyncio.to_thread(ensemble.kill, leader)
        await asyncio.to_thread(ensemble.wait_quorum, 45)
        await asyncio.sleep(1.5)
        await asyncio.to_thread(ensemble.restart, leader)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

    assert record.max_holders == 1
    assert len(record.tokens) > before + 10, "little progress after the failover"
    assert record.tokens == sorted(set(record.tokens))
