"""Single-attempt operations against a FROZEN server (SIGSTOP: the kernel still accepts
TCP connections, nothing answers) must raise ``BackendUnavailable`` within about
``request_timeout`` (+ ``connect_timeout`` where a new connection is needed), not a
multiple of it (README "Errors", docs/concepts.md "Errors", each docs/backends page).
"""

from __future__ import annotations

import asyncio
import time

import aiolock
from aiolock import Capability

from .conftest import ALL, CT, RT, SLACK, Target, assert_unavailable, backends, timed, warm


def request_bound(target: Target) -> float:
    """One request on an open connection: ``request_timeout`` plus slack; Redis Cluster
    documents up to ``4 x request_timeout`` plus a quarter second (docs/backends/redis-cluster.md)."""
    if target.id == "redis-cluster":
        return 4 * RT + 0.25 + SLACK
    return RT + SLACK


def fresh_bound(target: Target) -> float:
    """A new connection, then one request."""
    return CT + request_bound(target)


# DEFECT (redis-sentinel): a frozen master makes this take 2 x request_timeout (2.00 s
# measured for request_timeout=1; a hidden retry), not one request_timeout
@backends(ALL, default=("redis", "redis-sentinel"))
async def test_status_on_idle_pooled_connection(target: Target, name: str) -> None:
    async with target.connect() as locks:
        await warm(locks, name)
        with target.frozen():
            out = await timed(lambda: locks.status(name))
        assert_unavailable(out, request_bound(target), f"{target.id} status, idle connection, frozen")


@backends(ALL)
async def test_status_on_fresh_lazy_connection(target: Target, name: str) -> None:
    locks = target.connect()  # connects lazily: the first request opens the connection
    try:
        with target.frozen():
            out = await timed(lambda: locks.status(name))
    finally:
        await timed(locks.aclose, 10)
    assert_unavailable(out, fresh_bound(target), f"{target.id} status, fresh connection, frozen")


@backends(ALL)
async def test_connect_to_frozen_server(target: Target) -> None:
    async def enter() -> None:
        async with target.connect():
            pass

    with target.frozen():
        out = await timed(enter)
    assert_unavailable(out, fresh_bound(target), f"{target.id} async with connect(), frozen")


# DEFECT (redis-sentinel): a frozen master makes this take 2 x request_timeout (2.00 s
# measured for request_timeout=1; a hidden retry), not one request_timeout
@backends(ALL, default=("redis-sentinel",))
async def test_try_acquire_on_idle_pooled_connection(target: Target, name: str) -> None:
    async with target.connect() as locks:
        await warm(locks, name)
        with target.frozen():
            out = await timed(lambda: locks.lock(name, ttl=5).acquire(timeout=0))
        assert_unavailable(out, request_bound(target), f"{target.id} acquire(timeout=0), frozen")


@backends(ALL)
async def test_try_acquire_while_holding_another_lease(target: Target, name: str) -> None:
    """The connection (SQL: one of the pool) already holds a lease; SQL backends need a
    second connection for a second claim, so a new connection may be needed."""
    async with target.connect() as locks:
        held = await locks.lock(name + "-held", ttl=10).acquire(timeout=5)
        try:
            with target.frozen():
                out = await timed(lambda: locks.lock(name, ttl=5).acquire(timeout=0))
        finally:
            await timed(held.release, 10)
        assert_unavailable(out, fresh_bound(target), f"{target.id} acquire(timeout=0) beside a lease")


# DEFECT (redis-sentinel): a frozen master makes this take 2 x request_timeout (2.00 s
# measured for request_timeout=1; a hidden retry), not one request_timeout
@backends(ALL, default=("redis-sentinel",))
async def test_async_with_try_lock(target: Target, name: str) -> None:
    async with target.connect() as locks:
        await warm(locks, name)

        async def body() -> None:
            async with locks.lock(name, ttl=5, timeout=0):
                raise AssertionError("granted by a frozen server")

        with target.frozen():
            out = await timed(body)
        assert_unavailable(out, request_bound(target), f"{target.id} async with lock(timeout=0)")


# DEFECT (redis-sentinel): a frozen master makes this take 2 x request_timeout (2.00 s
# measured for request_timeout=1; a hidden retry), not one request_timeout
@backends(ALL, default=("redis-sentinel",))
async def test_release_of_held_lease(target: Target, name: str) -> None:
    async with target.connect() as locks:
        lease = await locks.lock(name, ttl=10).acquire(timeout=5)
        with target.frozen():
            out = await timed(lease.release)
        what = f"{target.id} lease.release(), frozen"
        if target.id.startswith(("postgres", "mysql")) and out.error is None:
            # a SQL lock belongs to its connection: a release that gives up by dropping the
            # connection frees the lock (docs/backends/postgresql.md, mysql.md), so
            # returning is fine -- in bounded time
            assert out.elapsed < request_bound(target), f"{what}: {out.describe()}"
        else:
            assert_unavailable(out, request_bound(target), what)
        await timed(lease.release, 10)


# DEFECT (redis-sentinel): a frozen master makes this take 2 x request_timeout (2.00 s
# measured for request_timeout=1; a hidden retry), not one request_timeout
@backends(ALL, default=("redis-sentinel",))
async def test_force_release(target: Target, name: str) -> None:
    async with target.connect() as locks:
        if Capability.REVOKE not in locks.capabilities:
            return
        await warm(locks, name)
        with target.frozen():
            out = await timed(lambda: locks.lock(name).force_release())
        assert_unavailable(out, request_bound(target), f"{target.id} force_release(), frozen")


# DEFECT (redis-sentinel): a frozen master makes this take 2 x request_timeout (2.00 s
# measured for request_timeout=1; a hidden retry), not one request_timeout
# DEFECT (redis-cluster): every master frozen, scan() raises a plain LockError ("refused
# scan: Redis Cluster cannot be connected"), not BackendUnavailable, after 4.01 s
@backends(ALL, default=("redis-cluster", "redis-sentinel"))
async def test_scan(target: Target, name: str) -> None:
    async with target.connect() as locks:
        if Capability.SCAN not in locks.capabilities:
            return
        await warm(locks, name)

        async def scan() -> list[aiolock.LockInfo]:
            return [info async for info in locks.scan(prefix=name)]

        with target.frozen():
            out = await timed(scan)
        assert_unavailable(out, request_bound(target), f"{target.id} scan(), frozen")


# DEFECT (redis-sentinel): a frozen master makes this take 2 x request_timeout (2.00 s
# measured for request_timeout=1; a hidden retry), not one request_timeout
@backends(ALL, default=("redis-sentinel",))
async def test_election_leader(target: Target, name: str) -> None:
    async with target.connect() as locks:
        if Capability.ELECTION not in locks.capabilities:
            return
        election = locks.election(name, ttl=5)
        await election.leader()
        with target.frozen():
            out = await timed(election.leader)
        assert_unavailable(out, request_bound(target), f"{target.id} election.leader(), frozen")


@backends(ALL)
async def test_acquire_with_positive_timeout(target: Target, name: str) -> None:
    """acquire(timeout=2.5) on a frozen server: BackendUnavailable (about one request
    timeout) or LockTimeout (at 2.5 s), never later than the timeout + slack."""
    timeout = 2.5
    async with target.connect() as locks:
        await warm(locks, name)
        with target.frozen():
            out = await timed(lambda: locks.lock(name, ttl=5).acquire(timeout=timeout))
    assert isinstance(out.error, aiolock.BackendUnavailable | aiolock.LockTimeout), \
        f"{target.id} acquire(timeout={timeout}), frozen: {out.describe()}"
    bound = max(timeout, request_bound(target) - SLACK) + SLACK
    assert out.elapsed < bound, f"{target.id} acquire(timeout={timeout}), frozen: {out.describe()}"


@backends(ALL)
async def test_waiter_whose_server_freezes_mid_wait(target: Target, name: str) -> None:
    """A waiter queued behind a holder (another connection); the server freezes during the
    wait: the acquire still ends near its timeout (an abandoned claim may need one more
    request: README "Cancellation safety"), with LockTimeout or BackendUnavailable."""
    timeout = 2.5
    if target.max_freeze < timeout + RT + SLACK + 0.5:
        timeout = 1.5
    async with target.connect() as holder_conn, target.connect() as locks:
        held = await holder_conn.lock(name, ttl=30).acquire(timeout=5)
        try:
            waiter = asyncio.create_task(timed(lambda: locks.lock(name, ttl=5).acquire(timeout=timeout)))
            start = time.monotonic()
            await asyncio.sleep(0.5)
            assert not waiter.done(), f"{target.id}: the waiter ended early: {waiter.result().describe()}"
            with target.frozen():
                out = await waiter
            elapsed = time.monotonic() - start
        finally:
            await timed(held.release, 10)
    assert isinstance(out.error, aiolock.BackendUnavailable | aiolock.LockTimeout), \
        f"{target.id} waiter frozen mid-wait: {out.describe()}"
    bound = timeout + request_bound(target)
    assert elapsed < bound, f"{target.id} waiter frozen mid-wait: {out.describe()}, bound {bound:.2f} s"
