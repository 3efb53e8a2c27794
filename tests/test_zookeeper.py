"""ZooKeeper backend: the shared contract suite on a real server, plus ZooKeeper faults.

Runs only when Debian's ``zookeeper`` package (and java) is installed; the server is
our own child process on a free loopback port (:mod:`tests.zk_server`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import aiolock
from aiolock import _connect
from aiolock.abc import Claim, Kind

from .faults.common import expire_zk_session
from .zk_server import ZooKeeperServer, four_letter, zookeeper_classpath

aiozk = pytest.importorskip("aiozk")

from aiolock.backends.zookeeper import ZooKeeperBackend, zk_name  # noqa: E402

if zookeeper_classpath() is None:
    pytest.skip("ZooKeeper is not installed (apt-get install zookeeper)", allow_module_level=True)

# Until the lead wires the scheme into aiolock/_connect.py (harmless once it is there).
for _scheme in ("zookeeper", "zk"):
    _connect.SCHEMES.setdefault(_scheme, ("aiolock.backends.zookeeper", "ZooKeeperBackend", "zookeeper"))

# The shared contract suite, collected again here with the fixtures below -- until
# conftest.BACKENDS lists "zookeeper" (then test_contract.py runs it; no double run).
from . import conftest  # noqa: E402

if "zookeeper" not in conftest.BACKENDS:
    from .test_contract import *  # noqa: F403


@pytest.fixture(scope="module")
def zk_server() -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer().start()
    yield server
    server.close()


@pytest.fixture
def backend_url(zk_server: ZooKeeperServer) -> str:
    # a fresh chroot per test: nothing a test leaves behind can disturb the next one
    return f"zookeeper://{zk_server.hosts}/aiolock-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def locks(backend_url: str) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(backend_url) as conn:
        yield conn


def _backend(locks: aiolock.Locks) -> ZooKeeperBackend:
    backend = locks.backend
    assert isinstance(backend, ZooKeeperBackend)
    return backend


async def _children(locks: aiolock.Locks, name: str) -> list[str]:
    backend = _backend(locks)
    return await backend._children(backend._parent(name))


# -- URL and names -----------------------------------------------------------------------


def test_url_parsing_and_validation() -> None:
    b = ZooKeeperBackend.from_url("zookeeper://h1:2181,h2:2182/app/locks")
    assert b.url == "zookeeper://h1:2181,h2:2182/app/locks"
    assert ZooKeeperBackend.from_url("zk://h1").url == "zookeeper://h1:2181/aiolock"
    for bad in ("zookeeper://", "zookeeper://h1:2181/a//b", "zookeeper://h1:2181/zookeeper",
                "zookeeper://h1:2181/a?x=1", "zookeeper://h1:notaport/a", "zookeeper://h1:2181/a/.."):
        with pytest.raises(ValueError):
            ZooKeeperBackend.from_url(bad)
    with pytest.raises(ValueError):
        ZooKeeperBackend.from_url("zk://h1:2181", session_timeout=0)


def test_name_escaping() -> None:
    for name in ("a/b", "%", ".", "..", ".hidden", "x" * 512, "\x00\x01", "é ☃ \ud7ff", "zookeeper"):
        escaped = zk_name(name)
        assert "/" not in escaped and escaped not in (".", "..") and escaped.isascii()
        assert escaped.isprintable()
    assert zk_name("a/b") != zk_name("a%2Fb")


async def test_awkward_names_work(locks: aiolock.Locks) -> None:
    for name in ("a/b/c", "%2F", ".", "..", "zookeeper", "é☃", "x" * 512):
        async with locks.lock(name) as lease:
            assert (await locks.status(name)).token == lease.token


# -- ZooKeeper specifics -----------------------------------------------------------------


async def test_czxid_tokens_increase_across_connections(backend_url: str, name: str) -> None:
    async with aiolock.connect(backend_url) as a, aiolock.connect(backend_url) as b:
        tokens = []
        for i in range(6):
            conn = (a, b)[i % 2]
            async with conn.lock(name) as lease:
                tokens.append(lease.token)
        assert tokens == sorted(set(tokens))


async def test_many_cancelled_waiters_leave_no_znodes(backend_url: str, name: str) -> None:
    conns = [aiolock.connect(backend_url) for _ in range(4)]
    for conn in conns:
        await conn.__aenter__()
    try:
        holder = await conns[0].lock(name).acquire()
        tasks = [asyncio.create_task(conns[i % 4].lock(name, fair=True).acquire())
                 for i in range(60)]
        await asyncio.sleep(0.3)
        assert len(await _children(conns[0], name)) > 30  # fair waiters each hold a place
        for i, task in enumerate(tasks):
            task.cancel()
            if i % 7 == 0:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks, return_exceptions=True)
        assert len(await _children(conns[0], name)) == 1  # only the holder
        await holder.release()
        assert await _children(conns[0], name) == []
        # cancellation at every step of a contended acquire
        holder = await conns[0].lock(name).acquire()
        for steps in range(15):
            task = asyncio.create_task(conns[1].lock(name).acquire())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.01)
        assert len(await _children(conns[0], name)) == 1
        await holder.release()
        assert await _children(conns[0], name) == []
    finally:
        for conn in conns:
            await conn.aclose()


async def test_watch_fires_once_per_release(backend_url: str, name: str) -> None:
    """A chain of waiters: each release wakes exactly the next one (no herd)."""
    conns = [aiolock.connect(backend_url) for _ in range(5)]
    for conn in conns:
        await conn.__aenter__()
    wakes: list[str] = []
    originals: list[Any] = []
    for conn in conns:
        backend = _backend(conn)
        original = backend._on_deleted
        originals.append(original)

        def counting(path: str, _orig: Any = original, _b: ZooKeeperBackend = backend) -> None:
            if path in _b._watching:
                wakes.append(path)
            _orig(path)

        backend._on_deleted = counting  # type: ignore[method-assign]
    try:
        first = await conns[0].lock(name, ttl=5).acquire()
        order: list[int] = []

        async def waiter(i: int) -> None:
            async with conns[i].lock(name, ttl=5):
                order.append(i)
                await asyncio.sleep(0.05)

        tasks = []
        for i in range(1, 5):
            tasks.append(asyncio.create_task(waiter(i)))
            await asyncio.sleep(0.1)
        await first.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert order == [1, 2, 3, 4]
        assert len(wakes) == 4, wakes  # one watch fired per release, on the next waiter only
    finally:
        for conn in conns:
            await conn.aclose()


async def test_rwlock_and_semaphore_nodes(locks: aiolock.Locks, name: str) -> None:
    sem = locks.semaphore(name, limit=2, ttl=5)
    a = await sem.acquire()
    b = await sem.acquire()
    waiter = asyncio.create_task(sem.acquire(timeout=5))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    info = await locks.status(name, Kind.PERMIT)
    assert info.held and info.holders == 2
    await b.release()
    c = await asyncio.wait_for(waiter, 2)
    assert c.token > b.token
    await a.release()
    await c.release()
    assert await _children(locks, name) == []


async def test_session_expiry_while_holding_loses_the_lease(backend_url: str, name: str) -> None:
    async with aiolock.connect(backend_url, session_timeout=2) as a, aiolock.connect(backend_url) as b:
        backend = _backend(a)
        old_sid = backend.client.session.session_id
        reached = False
        with pytest.raises(aiolock.LockLost):
            async with a.lock(name, ttl=3) as lease:
                expired = time.monotonic()
                assert await asyncio.shield(expire_zk_session(a))
                await asyncio.sleep(15)
                reached = True
        assert not reached and lease.lost
        assert time.monotonic() - expired < 3.5  # noticed by the next renewal (ttl/3)
        other = await b.lock(name).acquire(timeout=10)  # the node went with the session
        assert other.token > lease.token
        await other.release()
        # the backend goes on with a new session
        for _ in range(100):
            if backend._sid not in (None, old_sid) and backend._healthy():
                break
            await asyncio.sleep(0.1)
        async with a.lock(name) as again:
            assert again.token > other.token


async def test_dropped_connection_with_surviving_session(backend_url: str, name: str) -> None:
    async with aiolock.connect(backend_url, session_timeout=10) as a, \
            aiolock.connect(backend_url, session_timeout=10) as b:
        holder = await a.lock(name, ttl=10).acquire()
        waiter = asyncio.create_task(b.lock(name, ttl=10).acquire(timeout=15))
        await asyncio.sleep(0.3)
        sid = _backend(b).client.session.session_id
        _backend(b).client.session.conn.writer.transport.abort()  # the waiter's connection drops
        await asyncio.sleep(0.1)
        await holder.release()  # released while the waiter is disconnected
        lease = await asyncio.wait_for(waiter, 10)  # no hang: re-checked after the reconnect
        assert _backend(b).client.session.session_id == sid  # same session survived
        assert lease.token > holder.token and not lease.lost
        # and the holder side: drop its connection while holding; the lease survives
        _backend(b).client.session.conn.writer.transport.abort()
        await asyncio.sleep(1.0)
        assert not lease.lost and await a.lock(name).locked()
        await lease.release()
        assert not await a.lock(name).locked()


HOLDER = textwrap.dedent("""
    import asyncio, sys
    import aiolock
    from aiolock import _connect
    _connect.SCHEMES.setdefault("zookeeper", ("aiolock.backends.zookeeper", "ZooKeeperBackend", "zookeeper"))

    async def main():
        locks = aiolock.connect(sys.argv[1], session_timeout=float(sys.argv[3]))
        lease = await locks.lock(sys.argv[2], ttl=60).acquire()
        print(lease.token, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start_holder(url: str, name: str, *, session_timeout: float) -> subprocess.Popen[bytes]:
    """A separate process that takes the lock (ttl 60 s) and prints its token."""
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, url, name, str(session_timeout)], stdout=subprocess.PIPE,
        cwd=ROOT,
    )


async def test_kill_9_holder_frees_after_session_timeout(backend_url: str, name: str) -> None:
    proc = _start_holder(backend_url, name, session_timeout=2)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        token = int(line)
        async with aiolock.connect(backend_url) as locks:
            assert await locks.lock(name).locked()
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            lease = await locks.lock(name).acquire(timeout=15)  # ttl is 60: the session frees it
            elapsed = time.monotonic() - killed
            assert elapsed < 2 + 2.5, elapsed
            assert lease.token > token
            await lease.release()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_server_restart_while_waiting(zk_server: ZooKeeperServer, backend_url: str,
                                            name: str) -> None:
    """The server goes away and comes back (sessions survive): no double holder, the
    waiter proceeds after the release."""
    async with aiolock.connect(backend_url, session_timeout=10) as a, \
            aiolock.connect(backend_url, session_timeout=10) as b:
        holder = await a.lock(name, ttl=20).acquire()
        waiter = asyncio.create_task(b.lock(name, ttl=20).acquire(timeout=30))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(zk_server.restart, down_for=0.5)
        await asyncio.sleep(1.5)
        assert not waiter.done() and not holder.lost
        await holder.release()
        lease = await asyncio.wait_for(waiter, 15)
        assert lease.token > holder.token
        await lease.release()


async def test_abandon_finds_node_whose_create_reply_was_lost(locks: aiolock.Locks, name: str) -> None:
    backend = _backend(locks)
    claim = Claim(name, Kind.LOCK, uuid.uuid4().hex, 5000)
    task = asyncio.create_task(backend.try_acquire(claim))
    for _ in range(3):  # the create is written, its reply not read yet
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await backend.abandon(claim)
    await asyncio.sleep(0.1)
    assert await _children(locks, name) == []


async def test_release_whose_reply_was_lost_is_a_release(backend_url: str, name: str) -> None:
    """The delete reaches the server, its reply is lost with the connection, aiozk sends it
    again after reconnecting and finds nothing: that is a release, not a lost lease."""
    async with aiolock.connect(backend_url, session_timeout=10) as a, aiolock.connect(backend_url) as b:
        session = _backend(a).client.session
        sid = session.session_id
        dropped = asyncio.Event()

        async def drop_once_deleted() -> None:
            while await b.lock(name).locked():  # until the server applied the delete
                await asyncio.sleep(0.005)
            conn.writer.transport.abort()  # ... whose reply was never read
            dropped.set()

        async with a.lock(name, ttl=10) as lease:  # raises LockLost if the release says lost
            conn = session.conn
            conn.writer.transport.pause_reading()
            helper = asyncio.create_task(drop_once_deleted())
        await asyncio.wait_for(helper, 10)
        assert dropped.is_set() and lease.released and not lease.lost
        assert session.session_id == sid  # the same session: the resent delete found nothing
        # a cancelled release finishing in the background counts as a release as well
        lease = await a.lock(name, ttl=10).acquire()
        task = asyncio.create_task(lease.release())
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await lease.release()
        assert lease.released and not lease.lost
        assert not await b.lock(name).locked()


async def test_spurious_watch_event_does_not_strand_a_waiter(backend_url: str, name: str) -> None:
    """A watch may fire while its node still exists (after a reconnect the server answers a
    re-registered child watch with "children changed"); the waiter looks again and must
    watch the node again, or the release would only be seen at the next timed re-check."""
    from aiozk.protocol import WatchEvent

    async with aiolock.connect(backend_url, session_timeout=20) as a, aiolock.connect(backend_url) as b:
        holder = await a.lock(name, ttl=30).acquire()
        waiter = asyncio.create_task(b.lock(name, ttl=30).acquire(timeout=30))
        await asyncio.sleep(0.3)
        backend = _backend(b)
        (path,) = backend._watching
        backend.client.session.event_dispatch(
            WatchEvent(type=WatchEvent.CHILDREN_CHANGED, state=3, path=path))
        await asyncio.sleep(0.3)  # it looks again: still busy, it watches again
        for _ in range(100):  # (a busy machine may take longer)
            if path in backend._watching:
                break
            await asyncio.sleep(0.05)
        assert not waiter.done() and path in backend._watching
        released = time.monotonic()
        await holder.release()
        lease = await asyncio.wait_for(waiter, 30)
        assert time.monotonic() - released < 2.5  # the watch, not the 5 s re-check
        await lease.release()


def _changed_watches(server: ZooKeeperServer) -> int:
    """How many watchers data changes have triggered on the server so far (``mntr``)."""
    for line in four_letter(server.port, "mntr", 2.0).splitlines():
        key, _, value = line.partition("\t")
        if key == "zk_sum_node_changed_watch_count":
            return int(value)
    raise AssertionError("no zk_sum_node_changed_watch_count in mntr")


async def test_renewals_and_grants_fire_no_watch(zk_server: ZooKeeperServer, backend_url: str,
                                                 name: str) -> None:
    """Waiters watch their predecessor with a child watch: a renewal (setData) of the
    node they wait for triggers no watch on the server and wakes nobody; only its
    deletion does."""
    async with aiolock.connect(backend_url) as a, aiolock.connect(backend_url) as b, \
            aiolock.connect(backend_url) as c:
        fired: list[str] = []
        for conn in (b, c):
            backend = _backend(conn)
            original = backend._on_deleted

            def counting(path: str, _orig: Any = original) -> None:
                fired.append(path)
                _orig(path)

            backend._on_deleted = counting  # type: ignore[method-assign]

        async def renew_a_few_times(lease: aiolock.Lease) -> None:
            for ttl in (7, 8, 7, 8):  # a new ttl each time: a setData on the server
                await lease.extend(ttl)

        changed = await asyncio.to_thread(_changed_watches, zk_server)
        holder = await a.lock(name, ttl=8).acquire()
        first = asyncio.create_task(b.lock(name, ttl=8).acquire(timeout=20))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(c.lock(name, ttl=8).acquire(timeout=20))
        await asyncio.sleep(0.2)
        await renew_a_few_times(holder)
        await asyncio.sleep(0.2)
        assert fired == [] and not first.done() and not second.done()
        await holder.release()
        lease = await asyncio.wait_for(first, 10)  # granted: the next one watches it
        await renew_a_few_times(lease)
        await asyncio.sleep(0.2)
        assert len(fired) == 1 and not second.done()
        await lease.release()
        await (await asyncio.wait_for(second, 10)).release()
        assert len(fired) == 2
        assert await asyncio.to_thread(_changed_watches, zk_server) == changed


async def test_try_once_on_a_busy_lock_leaves_no_node(backend_url: str, name: str) -> None:
    """``acquire(timeout=0)`` on a held lock gives up after one try; the node that try put
    in the queue goes too, so it cannot block the lock after the holder releases."""
    async with aiolock.connect(backend_url) as a, aiolock.connect(backend_url) as b:
        holder = await a.lock(name, ttl=30).acquire()
        with pytest.raises(aiolock.LockTimeout):
            await b.lock(name, ttl=30).acquire(timeout=0)
        with pytest.raises(aiolock.LockTimeout):
            await b.lock(name, ttl=30).acquire(timeout=0.2)
        for _ in range(100):
            if len(await _children(a, name)) == 1:
                break
            await asyncio.sleep(0.05)
        assert len(await _children(a, name)) == 1
        await holder.release()
        lease = await a.lock(name).acquire(timeout=0)
        await lease.release()
