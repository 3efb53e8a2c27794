"""ZooKeeper: holder records, revocation and elections beyond the shared contract (which
tests/test_contract_coordination.py runs here too): the record rides in the create's
data, observers are woken by watches (not their ttl/2 timer), a revoked holder is told
so while one reaped as stale is not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

import pytest

import aiolock
from aiolock.abc import REVOKED

from .zk_server import ZooKeeperServer, zookeeper_classpath

aiozk = pytest.importorskip("aiozk")

from aiozk import protocol as zkproto  # noqa: E402

from aiolock.backends.zookeeper import ZooKeeperBackend  # noqa: E402

if zookeeper_classpath() is None:
    pytest.skip("ZooKeeper is not installed (apt-get install zookeeper)", allow_module_level=True)


@pytest.fixture
def url(zk_server: ZooKeeperServer) -> str:  # (zk_server: tests/conftest.py)
    return zk_server.fresh_url()


def _zk(locks: aiolock.Locks) -> ZooKeeperBackend:
    backend = locks.backend
    assert isinstance(backend, ZooKeeperBackend)
    return backend


async def test_the_holder_record_is_in_the_created_node(url: str) -> None:
    async with aiolock.connect(url) as locks, locks.lock("n", ttl=5, data="job 7") as lease:
        backend = _zk(locks)
        parent = backend._parent("n")
        (child,) = await backend._children(parent)
        got = await backend._send(zkproto.GetDataRequest(path=f"{parent}/{child}", watch=False))
        assert got.stat.version == 0  # written by the create itself, no second request
        assert b'"d":"job 7"' in got.data and lease.holder.data == "job 7"


async def test_observers_are_woken_by_watches_not_their_timer(url: str) -> None:
    """ttl 30: the observer's fallback re-read comes every 15 s, so each change seen
    within a second came through a watch (a candidate, a proclaim, a resignation)."""
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        election = a.election("sched", ttl=30)
        seen: list[tuple[float, aiolock.Leader | None]] = []
        changed = asyncio.Event()

        async def observe() -> None:
            async for leader in election.observe():
                seen.append((time.monotonic(), leader))
                changed.set()

        async def after(action: Awaitable[object]) -> aiolock.Leader | None:
            changed.clear()
            t0 = time.monotonic()
            await action
            await asyncio.wait_for(changed.wait(), 2)
            assert seen[-1][0] - t0 < 1
            return seen[-1][1]

        watcher = asyncio.create_task(observe())
        try:
            await asyncio.wait_for(changed.wait(), 5)
            assert seen[-1][1] is None
            campaign = b.election("sched", ttl=30).campaign(data="one")
            got: list[aiolock.Leadership] = []

            async def win() -> None:
                got.append(await campaign.acquire())

            leader = await after(win())
            assert leader is not None and leader.data == "one" and leader.token == got[0].token
            leader = await after(got[0].proclaim("two"))
            assert leader is not None and leader.data == "two"
            assert await after(got[0].release()) is None
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


async def test_revoked_is_told_apart_from_reaped(url: str) -> None:
    async with aiolock.connect(url) as locks:
        backend = _zk(locks)
        lease = await locks.lock("r", ttl=3, watchdog=False).acquire()
        claim = lease._hold.claim
        assert await locks.lock("r").force_release()
        await asyncio.sleep(0.4)  # (a renewal right after the grant is answered from it)
        assert await backend.renew([claim]) == [REVOKED]
        # a node whose lease ran out (a contender reaped it as stale) is just gone
        other = await locks.lock("s", ttl=0.3, watchdog=False).acquire()
        await asyncio.sleep(0.4)
        taken = await locks.lock("s", ttl=3).acquire(timeout=3)  # reaps it
        assert await backend.renew([other._hold.claim]) == [None]
        await taken.release()


async def test_scan_skips_free_names_and_reads_every_family(url: str) -> None:
    async with aiolock.connect(url) as locks:
        await _scan_checks(locks)


async def _scan_checks(locks: aiolock.Locks) -> None:
    held = [await locks.lock("a:1", ttl=5).acquire(),
            await locks.semaphore("a:1", 2, ttl=5, data="p").acquire(),
            await locks.election("a:2", ttl=5).campaign(data="L").acquire()]
    found = sorted([(i.name, i.family) async for i in locks.scan("a:")])
    assert found == [("a:1", "lock"), ("a:1", "sem"), ("a:2", "elect")]
    for lease in held:
        await lease.release()
    assert [i async for i in locks.scan("a:")] == []
