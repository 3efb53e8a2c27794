"""PostgreSQL-specific behaviour, on a real server started here (see tests/pg_server.py).

The shared contract suite runs on PostgreSQL through the ``locks`` fixture; these tests
cover what only this backend has: the lease is bound to a connection (dropped, killed,
paused, server restarted), tokens kept in a table, the ``?mode=row`` row-lock mode, the
bounded pool and URL parsing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("asyncpg")

import asyncpg

import aiolock
from aiolock.backends.postgres import PostgresBackend, PostgresRowBackend, advisory_key

from .pg_server import PostgresServer, find_pg_bin
from .servers import free_port
from .sql_children import start_holder, stop

pytestmark = pytest.mark.skipif(find_pg_bin() is None, reason="PostgreSQL is not installed")

@pytest.fixture
def pg(postgres_server: PostgresServer) -> PostgresServer:
    return postgres_server


def connect(url: str, **options: object) -> aiolock.Locks:
    return aiolock.connect(PostgresBackend.from_url(url, **options))


@pytest.fixture
async def locks(pg: PostgresServer) -> AsyncIterator[aiolock.Locks]:
    async with connect(pg.url) as conn:
        yield conn


async def holder_pid(url: str, name: str) -> int:
    conn = await asyncpg.connect(url)
    try:
        pid = await conn.fetchval(
            "SELECT pid FROM aiolock_holders WHERE family = 'lock' AND name = $1", name
        )
    finally:
        await conn.close()
    assert isinstance(pid, int)
    return pid


async def terminate(url: str, pid: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SELECT pg_terminate_backend($1, 2000)", pid)
    finally:
        await conn.close()


# -- the lease lives and dies with its connection ------------------------------------------


async def test_dropped_connection_loses_lease_promptly(pg: PostgresServer, name: str) -> None:
    async with connect(pg.url) as a, connect(pg.url) as b:
        lease = await a.lock(name, ttl=3).acquire()
        waiting = asyncio.create_task(b.lock(name, ttl=3).acquire(timeout=10))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        dropped = time.monotonic()
        await terminate(pg.url, await holder_pid(pg.url, name))
        other = await asyncio.wait_for(waiting, 5)
        assert time.monotonic() - dropped < 0.5  # the server freed it at once: no ttl wait
        assert other.token > lease.token
        await asyncio.wait_for(lease.wait_lost(), 3 / 3 + 0.5)  # found at the next renewal
        assert lease.lost and "no longer has it" in repr(lease._hold.lost_reason)
        await other.release()
        await lease.release()  # a no-op on a lost lease


async def test_async_with_body_cancelled_when_connection_drops(pg: PostgresServer, name: str) -> None:
    async with connect(pg.url) as locks:
        reached = False
        started = time.monotonic()
        with pytest.raises(aiolock.LockLost):
            async with locks.lock(name, ttl=1.5):
                await terminate(pg.url, await holder_pid(pg.url, name))
                await asyncio.sleep(5)
                reached = True
        assert not reached and time.monotonic() - started < 1.5


async def test_kill_9_of_holder_process_frees_lock_within_a_second(pg: PostgresServer, name: str) -> None:
    proc, token = start_holder(pg.url, name, ttl=30)
    try:
        async with connect(pg.url) as locks:
            assert await locks.lock(name).locked()
            waiting = asyncio.create_task(locks.lock(name).acquire(timeout=10))
            await asyncio.sleep(0.2)
            assert not waiting.done()
            killed = time.monotonic()
            proc.send_signal(signal.SIGKILL)
            lease = await asyncio.wait_for(waiting, 5)
            assert time.monotonic() - killed < 1.0  # not the 30 s ttl
            assert lease.token > token
            await lease.release()
    finally:
        stop(proc)


async def test_paused_holder_loses_lock_after_ttl(pg: PostgresServer, name: str) -> None:
    """SIGSTOP keeps the TCP connection open: the server's idle timeout ends it."""
    proc, token = start_holder(pg.url, name, ttl=1.0)
    try:
        async with connect(pg.url) as locks:
            os.kill(proc.pid, signal.SIGSTOP)
            paused = time.monotonic()
            lease = await locks.lock(name).acquire(timeout=5)
            assert time.monotonic() - paused < 1.0 + 0.5
            assert lease.token > token
            await lease.release()
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        stop(proc)


async def test_server_restart_while_held_loses_lease_then_recovers() -> None:
    server = PostgresServer().start()
    try:
        async with connect(server.url) as locks:
            name = "restart-me"
            lease = await locks.lock(name, ttl=1.5).acquire()
            await asyncio.to_thread(server.restart)
            await asyncio.wait_for(lease.wait_lost(), 1.5 + 0.5)
            assert lease.lost
            again = await locks.lock(name).acquire(timeout=5)  # pooled connections are replaced
            assert again.token > lease.token  # the token table survived the restart
            await again.release()
            await lease.release()
    finally:
        server.close()


async def test_unreachable_server_is_backend_unavailable_in_bounded_time() -> None:
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/aiolock"
    started = time.monotonic()
    with pytest.raises(aiolock.BackendUnavailable):
        async with connect(url, connect_timeout=0.5):
            pass
    assert time.monotonic() - started < 2.0
    with pytest.raises(aiolock.BackendUnavailable):
        await connect(url, connect_timeout=0.5).lock("x").acquire(timeout=0)


async def test_pool_exhausted_is_backend_unavailable(pg: PostgresServer, name: str) -> None:
    async with connect(pg.url, max_connections=2, pool_timeout=0.3) as locks:
        a = await locks.lock(name + "a").acquire()
        b = await locks.lock(name + "b").acquire()
        started = time.monotonic()
        with pytest.raises(aiolock.BackendUnavailable, match="max_connections"):
            await locks.lock(name + "c").acquire(timeout=0)
        assert time.monotonic() - started < 1.0
        await a.release()
        c = await locks.lock(name + "c").acquire(timeout=0)
        await c.release()
        await b.release()


# -- tokens, keys, inspect --------------------------------------------------------------------


async def test_tokens_strictly_increase_across_connections_and_families(
    pg: PostgresServer, name: str
) -> None:
    seen: list[int] = []
    for _ in range(3):
        async with connect(pg.url) as locks:
            for _ in range(3):
                async with locks.lock(name) as lease:
                    seen.append(lease.token)
    assert seen == sorted(set(seen)) and len(seen) == 9
    conn = await asyncpg.connect(pg.url)
    try:
        stored = await conn.fetchval(
            "SELECT token FROM aiolock_tokens WHERE family = 'lock' AND name = $1", name
        )
    finally:
        await conn.close()
    assert stored == seen[-1]
    async with connect(pg.url) as locks:  # lock, rwlock and semaphore of one name are apart
        held = [
            await locks.lock(name).acquire(timeout=0),
            await locks.rwlock(name).write().acquire(timeout=0),
            await locks.semaphore(name, 1).acquire(timeout=0),
        ]
        for lease in held:
            await lease.release()


def test_keys_are_stable_and_namespaced() -> None:
    assert advisory_key("lock", "a") == advisory_key("lock", "a")
    assert len({advisory_key("lock", "a"), advisory_key("rw", "a"), advisory_key("sem", "a", 0),
                advisory_key("sem", "a", 1)}) == 4
    assert -(2**63) <= advisory_key("lock", "é" * 512) < 2**63
    assert advisory_key("lock", "orders:42") == -1772657702827564156  # never changes: data compat


async def test_inspect_reports_holder_token_ttl_and_waiters(pg: PostgresServer, name: str) -> None:
    async with connect(pg.url) as locks, connect(pg.url) as other_conn:
        lease = await locks.lock(name, ttl=10).acquire()
        waiting = asyncio.create_task(other_conn.lock(name).acquire(timeout=5))
        await asyncio.sleep(0.2)
        info = await locks.status(name)
        assert info.held and info.holders == 1 and info.token == lease.token
        assert info.last_token == lease.token and 0 < (info.ttl_left or 0) <= 10
        assert info.waiters == 1  # queued in the server's lock queue
        await lease.release()
        other = await waiting
        await other.release()
        info = await locks.status(name)
        assert not info.held and info.last_token == other.token and info.waiters == 0


async def test_semaphore_across_connections(pg: PostgresServer, name: str) -> None:
    async with connect(pg.url) as a, connect(pg.url) as b:
        p1 = await a.semaphore(name, limit=2).acquire()
        p2 = await b.semaphore(name, limit=2).acquire()
        with pytest.raises(aiolock.LockTimeout):
            await a.semaphore(name, limit=2).acquire(timeout=0.1)
        assert (await a.status(name, aiolock.Kind.PERMIT)).holders == 2
        waiting = asyncio.create_task(a.semaphore(name, limit=2).acquire(timeout=5))
        await p2.release()  # released on another connection: NOTIFY wakes the waiter
        started = time.monotonic()
        p3 = await asyncio.wait_for(waiting, 1)
        assert time.monotonic() - started < 0.3  # not the 0.5 s poll
        await p1.release()
        await p3.release()


# -- row-lock mode -------------------------------------------------------------------------


async def test_row_mode_reads_never_disturb_a_try(pg: PostgresServer, name: str) -> None:
    """status() and scan() tell who holds a row without locking it (the row's xmax and
    pg_locks): single tries (timeout=0) of a free row, made while another connection
    reads it in a loop, all succeed, and each read sees held or free with its holder."""
    url = pg.url + "?mode=row"
    async with aiolock.connect(url) as a, aiolock.connect(url) as b, aiolock.connect(url) as c:
        assert isinstance(a.backend, PostgresRowBackend)
        with pytest.raises(ValueError, match="not supported"):
            a.rwlock(name)
        stop = asyncio.Event()
        seen: set[tuple[bool, tuple[str, ...]]] = set()

        async def read() -> None:
            while not stop.is_set():
                info = await b.status(name)
                seen.add((info.held, tuple(h.data for h in info.held_by)))
                async for _ in b.scan(name):
                    pass

        reader = asyncio.create_task(read())
        try:
            for _ in range(25):
                lease = await a.lock(name, ttl=5, data="mine").acquire(timeout=0)
                await asyncio.sleep(0.005)
                await lease.release()
        finally:
            stop.set()
            await reader
        assert seen <= {(False, ()), (True, ("mine",)), (True, ())}, seen
        assert (True, ("mine",)) in seen and (False, ()) in seen
        # waiters are counted from pg_locks too: the first waits on the holder's
        # transaction id, the next ones on the row's tuple lock
        async def take(locks: aiolock.Locks) -> None:
            async with locks.lock(name, ttl=5, timeout=10):
                pass

        lease = await a.lock(name, ttl=5).acquire()
        waiting = [asyncio.create_task(take(s)) for s in (b, c)]
        await asyncio.sleep(0.3)
        assert (await a.status(name)).waiters == 2
        assert [info.waiters async for info in a.scan(name)] == [2]
        await lease.release()
        await asyncio.gather(*waiting)


async def test_row_mode_dead_holder_frees_within_ttl(pg: PostgresServer, name: str) -> None:
    url = pg.url + "?mode=row"
    async with aiolock.connect(PostgresBackend.from_url(url)) as locks:
        crashed = aiolock.connect(PostgresBackend.from_url(url))
        await crashed.__aenter__()
        old = await crashed.lock(name, ttl=0.5).acquire()
        crashed._engine.abandon_for_demo()  # stops renewing, keeps its connection open
        started = time.monotonic()
        lease = await locks.lock(name).acquire(timeout=3)
        assert time.monotonic() - started < 0.5 + 0.7  # ttl 0.5 s, not a default minutes long
        assert lease.token > old.token
        await lease.release()
        await crashed.backend.aclose()


@pytest.mark.parametrize("size", [1, 2])
async def test_row_mode_pool_of_n_holds_n_leases(pg: PostgresServer, name: str, size: int) -> None:
    """A grant needs no second pooled connection (its token is committed beside the pool
    when none is free): max_connections=n holds n row-mode leases, and proclaims."""
    url = pg.url + f"?mode=row&max_connections={size}&pool_timeout=0.3"
    async with aiolock.connect(PostgresBackend.from_url(url)) as locks:
        held = [await locks.lock(f"{name}-{i}", ttl=5).acquire(timeout=0) for i in range(size)]
        with pytest.raises(aiolock.BackendUnavailable, match="max_connections"):
            await locks.lock(f"{name}-x", ttl=5).acquire(timeout=0)
        await held[-1].release()
        election = locks.election(f"{name}-e", ttl=5)
        leader = await election.campaign("one", timeout=1).acquire()
        await leader.proclaim("two")  # the pool is full: beside it too
        for lease in held[:-1]:
            await lease.release()
        if size > 1:
            info = await locks.status(f"{name}-e", aiolock.Kind.LEADER)
            assert [h.data for h in info.held_by] == ["two"]
        await leader.release()


async def test_row_mode_wait_cut_off_in_its_begin_pools_no_transaction(
        pg: PostgresServer, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queued wait cancelled while its ``BEGIN`` is on the wire: asyncpg still reports
    the connection outside a transaction (the BEGIN completes on the server after the
    cancel), so its clean-up must ROLLBACK whatever asyncpg says. It used to trust it:
    the connection went back to the pool inside a transaction never committed, the next
    grants recorded on it were seen by nobody (their holders found their leases revoked)
    and kept the token row locked, and the name's waiters hung behind it (issue: the
    random-cancellation contract test in row mode)."""
    execute = asyncpg.Connection.execute
    cut: list[asyncio.Task[object]] = []

    async def cut_begin(conn: asyncpg.Connection, query: str, *args: object,
                        **kwargs: object) -> str:
        task = asyncio.current_task()
        assert task is not None
        if (not cut and query.startswith("BEGIN")
                and task.get_coro().__qualname__.endswith("._blocking_wait")):
            cut.append(task)
            task.cancel()  # lands once the BEGIN is sent, before its reply is read
        return await execute(conn, query, *args, **kwargs)  # type: ignore[no-any-return]

    url = pg.url + "?mode=row"
    async with aiolock.connect(url) as locks, aiolock.connect(url) as holder:
        lock = locks.lock(name, ttl=5)
        held = await holder.lock(name, ttl=5).acquire(timeout=0)  # so the next one queues
        monkeypatch.setattr(asyncpg.Connection, "execute", cut_begin)
        waiting = asyncio.create_task(lock.acquire(timeout=10))
        async with asyncio.timeout(5):
            while not cut:
                await asyncio.sleep(0.01)
            await asyncio.wait(cut)  # its clean-up ran (the connection went back)
        monkeypatch.undo()
        pool = locks.backend._pool  # type: ignore[attr-defined]
        assert not [c for c in pool._idle if c.is_in_transaction()], "pooled in a transaction"
        others = [await locks.lock(f"{name}-{i}", ttl=5, data="other").acquire(timeout=0)
                  for i in range(3)]  # grants recorded on pooled connections
        for lease in others:
            info = await locks.status(lease.name)
            assert info.held and [h.data for h in info.held_by] == ["other"], info
            await lease.release()
        waiting.cancel()  # its wait was cut off by the test, not by a release: give up
        await asyncio.gather(waiting, return_exceptions=True)
        await held.release()
        assert not await lock.locked()
        assert not [c for c in pool._idle if c.is_in_transaction()]


async def test_two_modes_keep_their_own_holder_records(pg: PostgresServer, name: str) -> None:
    """Advisory and row mode are two lock mechanisms: a name held in both at once keeps
    each holder's record, token and lease (renewals of either never revoke the other)."""
    async with aiolock.connect(PostgresBackend.from_url(pg.url)) as adv, \
            aiolock.connect(PostgresBackend.from_url(pg.url + "?mode=row")) as row:
        a = await adv.lock(name, ttl=1, data="advisory").acquire(timeout=0)
        b = await row.lock(name, ttl=1, data="row").acquire(timeout=0)
        await asyncio.sleep(0.7)  # renewals of both
        assert not a.lost and not b.lost
        sa, sb = await adv.status(name), await row.status(name)
        assert ([h.data for h in sa.held_by], sa.token) == (["advisory"], a.token)
        assert ([h.data for h in sb.held_by], sb.token) == (["row"], b.token)
        await b.release()
        await asyncio.sleep(0.5)
        assert not a.lost
        assert [h.data for h in (await adv.status(name)).held_by] == ["advisory"]
        await a.release()


# -- URLs ----------------------------------------------------------------------------------------


def test_url_parsing() -> None:
    backend = PostgresBackend.from_url("postgres://u:secret@db.example:6543/app?connect_timeout=2")
    assert type(backend) is PostgresBackend
    assert "secret" not in backend.url and backend.url.startswith("postgres://u@db.example:6543/app")
    assert type(PostgresBackend.from_url("postgresql://h/db?mode=row")) is PostgresRowBackend
    for bad in ("postgresql:///db", "postgresql://h:99999/db", "postgresql://h/db?mode=x",
                "postgresql://h/db?connect_timeout=0", "postgresql://h/db?max_connections=1.5"):
        with pytest.raises(ValueError):
            PostgresBackend.from_url(bad)
