"""ZooKeeper: a try-lock loop (``acquire(timeout=0)`` + a short sleep) gets a lock that
was just released, promptly, for every kind of lock (issue 9, item 4).

A one-try acquire must leave nothing behind that delays the next try: no node in the
queue once ``acquire(timeout=0)`` has raised, and ``status()`` shows no phantom holder or
waiter.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import pytest

import aiolock
from aiolock.abc import Kind

from .zk_server import ZooKeeperServer, zookeeper_classpath

pytest.importorskip("aiozk")

if zookeeper_classpath() is None:
    pytest.skip("ZooKeeper is not installed (apt-get install zookeeper)", allow_module_level=True)

#: How soon after the release a try-lock loop must have the lock (its sleep is 0.1 s).
PROMPT = 0.5

MakeLock = Callable[[aiolock.Locks, str], aiolock.Lock]

#: (holder's lock, the try-lock loop's lock, the kind status() reports for the loop's side)
KINDS: dict[str, tuple[MakeLock, MakeLock, Kind]] = {
    "lock": (lambda c, n: c.lock(n, ttl=10), lambda c, n: c.lock(n, ttl=10), Kind.LOCK),
    "fair": (lambda c, n: c.lock(n, ttl=10),
             lambda c, n: c.lock(n, ttl=10, fair=True), Kind.LOCK),
    "write": (lambda c, n: c.rwlock(n, ttl=10).write(),
              lambda c, n: c.rwlock(n, ttl=10).write(), Kind.WRITE),
    "read": (lambda c, n: c.rwlock(n, ttl=10).write(),
             lambda c, n: c.rwlock(n, ttl=10).read(), Kind.READ),
    "semaphore": (lambda c, n: c.semaphore(n, limit=1, ttl=10),
                  lambda c, n: c.semaphore(n, limit=1, ttl=10), Kind.PERMIT),
}


@pytest.fixture
def url(zk_server: ZooKeeperServer) -> str:
    return f"zookeeper://{zk_server.hosts}/aiolock-{uuid.uuid4().hex[:8]}"


async def _try_loop(
    lock: aiolock.Lock, until: float, *, release: bool = False
) -> tuple[float, aiolock.Lease] | None:
    """``acquire(timeout=0)`` every 0.1 s until it succeeds or ``until`` passes; (when,
    lease), released at once if ``release``."""
    while time.monotonic() < until:
        try:
            lease = await lock.acquire(timeout=0)
        except aiolock.LockTimeout:
            await asyncio.sleep(0.1)
            continue
        got = time.monotonic()
        if release:
            await lease.release()
        return got, lease
    return None


@pytest.mark.parametrize("kind", list(KINDS))
async def test_try_lock_loop_gets_the_lock_promptly(url: str, kind: str) -> None:
    make_holder, make_trier, status_kind = KINDS[kind]
    name = f"t-{uuid.uuid4().hex}"
    async with aiolock.connect(url) as a, aiolock.connect(url) as b, aiolock.connect(url) as c:
        holder = await make_holder(a, name).acquire()
        trier = make_trier(b, name)
        # tries that fail while the lock is held leave nothing behind: no waiter, one holder
        for _ in range(5):
            with pytest.raises(aiolock.LockTimeout):
                await trier.acquire(timeout=0)
            info = await c.status(name, status_kind)
            assert info.held and info.holders == 1 and info.waiters == 0, info
            await asyncio.sleep(0.1)
        loop = asyncio.create_task(_try_loop(trier, time.monotonic() + 10))
        await asyncio.sleep(0.55)
        assert not loop.done()
        released = time.monotonic()
        await holder.release()
        got = await loop
        assert got is not None, "the try-lock loop never got the free lock"
        took = got[0] - released
        assert took < PROMPT, f"the try-lock loop got the lock {took:.2f} s after the release"
        info = await c.status(name, status_kind)
        assert info.held and info.holders == 1 and info.waiters == 0, info
        assert info.token == got[1].token or status_kind in (Kind.READ, Kind.PERMIT)
        await got[1].release()
        info = await c.status(name, status_kind)
        assert not info.held and info.waiters == 0, info


@pytest.mark.parametrize("kind", ["lock", "fair", "semaphore"])
async def test_three_try_lock_loops_one_gets_it_promptly(url: str, kind: str) -> None:
    make_holder, make_trier, status_kind = KINDS[kind]
    name = f"t-{uuid.uuid4().hex}"
    conns = [aiolock.connect(url) for _ in range(4)]
    for conn in conns:
        await conn.__aenter__()
    try:
        holder = await make_holder(conns[0], name).acquire()
        until = time.monotonic() + 10
        loops = [asyncio.create_task(_try_loop(make_trier(conn, name), until, release=True))
                 for conn in conns[1:]]
        await asyncio.sleep(0.6)
        assert not any(t.done() for t in loops)
        info = await conns[0].status(name, status_kind)
        assert info.holders == 1 and info.waiters <= 3, info  # at most one try each in flight
        released = time.monotonic()
        await holder.release()
        results = await asyncio.gather(*loops)
        assert all(r is not None for r in results), results  # each got it, in turn
        took = min(r[0] for r in results if r is not None) - released
        assert took < PROMPT, f"the first of three try-lock loops got it {took:.2f} s after the release"
        info = await conns[0].status(name, status_kind)
        assert not info.held and info.waiters == 0, info
    finally:
        for conn in conns:
            await conn.aclose()


async def test_try_lock_loop_reaps_a_holder_that_stopped_renewing(url: str) -> None:
    """Tries that only look (no node) while the lock is busy still take a place now and
    then and read the holder's lease clock: a holder whose session lives on but which no
    longer renews (here: watchdog off, ttl 1 s) is reaped, and the loop gets the lock."""
    name = f"t-{uuid.uuid4().hex}"
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        stale = await a.lock(name, ttl=1, watchdog=False).acquire()
        started = time.monotonic()
        got = await _try_loop(b.lock(name, ttl=5), started + 8, release=True)
        assert got is not None, "the try-lock loop never reaped the stale holder"
        assert got[0] - started < 1 + 2 + 1.0  # ttl + CONTENDED_HINT + margin
        assert got[1].token > stale.token


@pytest.mark.parametrize("kind", ["lock", "fair", "semaphore"])
async def test_timed_out_waiter_is_no_waiter(url: str, kind: str) -> None:
    """An acquire that timed out while waiting is counted by no status(), right away on
    its own connection, and within a moment on any other."""
    make_holder, make_trier, status_kind = KINDS[kind]
    name = f"t-{uuid.uuid4().hex}"
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        holder = await make_holder(a, name).acquire()
        for _ in range(3):
            with pytest.raises(aiolock.LockTimeout):
                await make_trier(b, name).acquire(timeout=0.3)
            info = await b.status(name, status_kind)
            assert info.holders == 1 and info.waiters == 0, info
            for _ in range(20):
                info = await a.status(name, status_kind)
                if info.waiters == 0:
                    break
                await asyncio.sleep(0.01)
            assert info.holders == 1 and info.waiters == 0, info
        await holder.release()
        assert not (await b.status(name, status_kind)).held
