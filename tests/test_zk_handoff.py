"""ZooKeeper handoff without a listing: a waiter told by its watch that every node before
it is gone holds at once (no node can join before it: sequence numbers only grow); a
waiter whose predecessor merely gave up its place must still wait for the holder."""

from __future__ import annotations

import asyncio

import pytest

import aiolock

from .zk_server import ZooKeeperServer, zookeeper_classpath

pytest.importorskip("aiozk")

from aiolock.backends.zookeeper import ZooKeeperBackend

if zookeeper_classpath() is None:
    pytest.skip("ZooKeeper is not installed (apt-get install zookeeper)", allow_module_level=True)


@pytest.fixture
def url(zk_server: ZooKeeperServer) -> str:  # (zk_server: tests/conftest.py)
    return zk_server.fresh_url()


def _count_listings(locks: aiolock.Locks) -> list[str]:
    backend = locks.backend
    assert isinstance(backend, ZooKeeperBackend)
    listed: list[str] = []
    real = backend._children

    async def children(parent: str, sent: object = None) -> list[str]:
        if sent is None:  # (else it was sent already, and counted there)
            listed.append(parent)
        return await real(parent, sent)  # type: ignore[arg-type]

    backend._children = children  # type: ignore[method-assign]
    return listed


async def test_the_next_in_line_holds_without_a_listing(url: str) -> None:
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        held = await a.lock("n", ttl=5).acquire()
        waiting = asyncio.create_task(b.lock("n", ttl=5).acquire(timeout=5))
        await asyncio.sleep(0.3)
        listed = _count_listings(b)
        await held.release()
        lease = await waiting
        assert lease.token > held.token and listed == []
        await lease.release()


async def _in_line(a: aiolock.Locks, b: aiolock.Locks, c: aiolock.Locks) -> tuple[
        aiolock.Lease, asyncio.Task[aiolock.Lease], asyncio.Task[aiolock.Lease]]:
    """``a`` holds "n"; ``b`` waits for it, giving up after 0.6 s; then ``c`` waits."""
    held = await a.lock("n", ttl=5).acquire()
    quitter = asyncio.create_task(b.lock("n", ttl=5).acquire(timeout=0.6))
    await asyncio.sleep(0.2)
    return held, quitter, asyncio.create_task(c.lock("n", ttl=5).acquire(timeout=5))


async def test_a_predecessor_giving_up_grants_nothing(url: str) -> None:
    async with (aiolock.connect(url) as a, aiolock.connect(url) as b,
                aiolock.connect(url) as c):
        held, quitter, last = await _in_line(a, b, c)
        with pytest.raises(aiolock.LockTimeout):
            await quitter  # its node, just before c's, is deleted
        await asyncio.sleep(0.3)
        assert not last.done() and not held.lost
        await held.release()
        lease = await last
        assert lease.token > held.token
        await lease.release()


async def test_a_woken_waiter_lists_as_the_event_is_read(url: str) -> None:
    """A deletion event is handled as the connection's reader reads it (not through
    aiozk's dispatch, a turn of the event loop later), and the listing the waiter's next
    look needs is sent right then; the look uses it (no second listing)."""
    async with (aiolock.connect(url) as a, aiolock.connect(url) as b,
                aiolock.connect(url) as c):
        held, quitter, last = await _in_line(a, b, c)
        await asyncio.sleep(0.2)
        backend = c.backend
        assert isinstance(backend, ZooKeeperBackend) and backend._repair is not None
        prefetched: list[object] = []
        list_now, dispatch = backend._list_now, backend._repair._dispatch
        fell_through: list[object] = []

        def sent_at_once(parent: str) -> object:
            prefetched.append(list_now(parent))
            return prefetched[-1]

        def to_aiozk(event: object) -> None:
            fell_through.append(event)
            dispatch(event)

        backend._list_now = sent_at_once  # type: ignore[method-assign,assignment]
        backend._repair._dispatch = to_aiozk
        listed = _count_listings(c)
        with pytest.raises(aiolock.LockTimeout):
            await quitter  # its node, just before c's, is deleted: c's watch fires
        await asyncio.sleep(0.3)
        assert len(prefetched) == 1 and prefetched[0] is not None and listed == []
        assert not fell_through and not last.done()  # (a still holds)
        await held.release()
        lease = await last
        assert lease.token > held.token
        await lease.release()
