"""MySQL / MariaDB-specific behaviour, on a private MariaDB started here (tests/mysql_server.py).

The shared contract suite runs on MariaDB through the ``locks`` fixture; these tests cover
what only this backend has: the lease is bound to a connection (holder killed -9, its
connection killed on the server, holder paused, server restarted), tokens kept in a
table, cancelled waits that must not stay queued on the server, URL parsing and errors.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
import time
from typing import Any

import pytest

pytest.importorskip("asyncmy")

import aiolock
from aiolock.backends.mysql import MySQLBackend, MySQLRowBackend, lock_key

from .mysql_server import PASSWORD, MariaDBServer, find_mariadbd
from .servers import free_port
from .sql_children import start_holder, stop

pytestmark = pytest.mark.skipif(find_mariadbd() is None, reason="MariaDB is not installed")

@pytest.fixture
def db(mysql_server: MariaDBServer) -> MariaDBServer:
    return mysql_server


def holder_conn(db: MariaDBServer, name: str) -> int:
    out = db.sql(
        f"SELECT conn FROM `{db.database}`.aiolock_holders WHERE family = 'lock' AND name = '{name}'"
    )
    return int(out.split()[0])


def user_lock_waits(db: MariaDBServer) -> int:
    """Sessions of our test user now waiting in GET_LOCK."""
    out = db.sql(
        "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE USER = 'aiolock'"
        " AND STATE LIKE '%user lock%'"
    )
    return int(out.split()[0])


# -- the lease lives and dies with its connection ------------------------------------------


async def test_kill_9_of_holder_process_frees_lock_at_once(db: MariaDBServer, name: str) -> None:
    proc, token = start_holder(db.url, name, ttl=30)
    try:
        async with aiolock.connect(db.url) as locks:
            assert await locks.lock(name).locked()
            proc.send_signal(signal.SIGKILL)
            started = time.monotonic()
            lease = await locks.lock(name, ttl=30).acquire(timeout=5)
            assert time.monotonic() - started < 1.0  # the socket closed: not the 30 s ttl
            assert lease.token > token
            await lease.release()
    finally:
        stop(proc)


async def test_connection_killed_on_the_server_loses_the_lease(db: MariaDBServer, name: str) -> None:
    async with aiolock.connect(db.url) as a, aiolock.connect(db.url) as b:
        lease = await a.lock(name, ttl=1.5).acquire()
        waiting = asyncio.create_task(b.lock(name, ttl=5).acquire(timeout=5))
        await asyncio.sleep(0.1)
        db.sql(f"KILL {holder_conn(db, name)}")
        other = await waiting  # freed at once on the server
        await asyncio.wait_for(lease.wait_lost(), 1.5)  # and the holder learns at its renewal
        assert lease.lost and other.token > lease.token
        await other.release()


async def test_async_with_body_cancelled_when_connection_killed(db: MariaDBServer, name: str) -> None:
    async with aiolock.connect(db.url) as locks:
        reached = False
        with pytest.raises(aiolock.LockLost):
            async with locks.lock(name, ttl=0.6):
                db.sql(f"KILL {holder_conn(db, name)}")
                await asyncio.sleep(3)
                reached = True
        assert not reached


async def test_paused_holder_is_cut_off_by_the_session_timeout(db: MariaDBServer, name: str) -> None:
    proc, token = start_holder(db.url, name, ttl=1)
    try:
        async with aiolock.connect(db.url) as locks:
            proc.send_signal(signal.SIGSTOP)
            started = time.monotonic()
            lease = await locks.lock(name, ttl=5).acquire(timeout=5)
            waited = time.monotonic() - started
            assert waited < 1 + 1.0, waited  # wait_timeout = ceil(ttl) after its last renewal
            assert lease.token > token
            await lease.release()
    finally:
        proc.send_signal(signal.SIGCONT)
        stop(proc)


async def test_server_restart_loses_leases_and_tokens_keep_increasing(name: str) -> None:
    server = MariaDBServer().start()
    try:
        async with aiolock.connect(server.url) as locks:
            lease = await locks.lock(name, ttl=1).acquire()
            sem = await locks.semaphore(name, limit=2, ttl=1).acquire()
            server.restart()
            await asyncio.wait_for(lease.wait_lost(), 3)
            await asyncio.wait_for(sem.wait_lost(), 3)
            again = await locks.lock(name, ttl=1).acquire(timeout=5)
            assert again.token > lease.token
            await again.release()
    finally:
        server.close()


# -- waiting on the server, and cancelling it ----------------------------------------------


async def test_cancelled_waits_leave_no_lock_and_no_waiting_session(
    db: MariaDBServer, name: str
) -> None:
    async with aiolock.connect(db.url) as locks, aiolock.connect(db.url) as other:
        lock = locks.lock(name, ttl=10)
        rng = random.Random(15)
        for _ in range(16):
            holder = await lock.acquire()

            async def wait() -> None:
                lease = await other.lock(name, ttl=10).acquire(timeout=10)
                await lease.release()

            task = asyncio.create_task(wait())
            if rng.random() < 0.5:
                await asyncio.sleep(rng.random() / 50)  # anywhere in acquire()
            else:
                deadline = time.monotonic() + 3
                while user_lock_waits(db) == 0:  # queued in GET_LOCK on the server
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.005)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            # an unneeded wait is ended in the background (KILL CONNECTION): gone within
            # moments. (MariaDB also notices a closed socket during GET_LOCK, ~0.5-1 s
            # later: the bound is generous for a loaded machine, not a test of the KILL.)
            deadline = time.monotonic() + 3
            while user_lock_waits(db):
                assert time.monotonic() < deadline, "a cancelled wait stayed queued"
                await asyncio.sleep(0.01)
            await holder.release()
            assert not await lock.locked()
        lease = await lock.acquire(timeout=1)
        await lease.release()


async def test_waiter_is_granted_by_the_server_on_release(db: MariaDBServer, name: str) -> None:
    async with aiolock.connect(db.url) as a, aiolock.connect(db.url) as b:
        lease = await a.lock(name, ttl=30).acquire()
        task = asyncio.create_task(b.lock(name, ttl=30).acquire(timeout=5))
        deadline = time.monotonic() + 2
        while user_lock_waits(db) == 0:  # queued in GET_LOCK, not polling
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await lease.release()
        other = await task
        assert other.token == lease.token + 1
        await other.release()


# -- tokens, keys, inspect -----------------------------------------------------------------


def test_lock_keys_fit_get_lock_and_keep_families_apart() -> None:
    long = "x" * 512
    keys = {lock_key("lock", long), lock_key("sem", long, 0), lock_key("sem", long, 1),
            lock_key("rw", long), lock_key("lock", "A"), lock_key("lock", "a")}
    assert len(keys) == 6
    assert all(len(k) <= 64 for k in keys)
    assert lock_key("lock", "a") == lock_key("lock", "a")  # stable across processes


async def test_tokens_increase_across_connections(db: MariaDBServer, name: str) -> None:
    tokens = []
    for _ in range(3):
        async with aiolock.connect(db.url) as locks, locks.lock(name) as lease:
            tokens.append(lease.token)
    assert tokens == sorted(set(tokens))


async def test_inspect_and_semaphore_across_connections(db: MariaDBServer, name: str) -> None:
    async with aiolock.connect(db.url) as a, aiolock.connect(db.url) as b:
        first = await a.semaphore(name, limit=2, ttl=5).acquire()
        second = await b.semaphore(name, limit=2, ttl=5).acquire()
        with pytest.raises(aiolock.LockTimeout):
            await a.semaphore(name, limit=2).acquire(timeout=0.2)
        info = await a.backend.inspect(name, aiolock.abc.Kind.PERMIT)
        assert info.held and info.holders == 2
        await first.release()
        third = await b.semaphore(name, limit=2).acquire(timeout=2)
        await second.release()
        await third.release()
        assert not (await a.backend.inspect(name, aiolock.abc.Kind.PERMIT)).held


async def test_row_mode_excludes_waits_and_frees_on_kill(db: MariaDBServer, name: str) -> None:
    url = db.url + "?mode=row"
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        assert isinstance(a.backend, MySQLRowBackend)
        lease = await a.lock(name, ttl=2).acquire()
        with pytest.raises(aiolock.LockTimeout):
            await b.lock(name).acquire(timeout=0.2)
        waiting = asyncio.create_task(b.lock(name, ttl=5).acquire(timeout=5))
        await asyncio.sleep(0.1)
        db.sql(f"KILL {holder_conn(db, name)}")
        other = await waiting
        await asyncio.wait_for(lease.wait_lost(), 2)
        assert other.token > lease.token
        await other.release()


# -- URLs and errors -----------------------------------------------------------------------


def test_url_parsing_and_options() -> None:
    backend = MySQLBackend.from_url("mariadb://u:pw@db.example:3307/locks?connect_timeout=2")
    assert "pw" not in backend.url and backend.url.startswith("mariadb://u@db.example:3307/locks")
    assert isinstance(MySQLBackend.from_url("mysql://u@h/db?mode=row"), MySQLRowBackend)
    with pytest.raises(ValueError, match="accepted: mode, connect_timeout"):
        MySQLBackend.from_url("mysql://u@h/db?sslmode=on")
    with pytest.raises(ValueError, match="mode must be"):
        MySQLBackend.from_url("mysql://u@h/db?mode=advisory")
    with pytest.raises(ValueError, match="database"):
        MySQLBackend.from_url("mysql://u:secret@h:3306/")
    with pytest.raises(ValueError) as info:
        MySQLBackend.from_url("mysql://u:secret@h:3306/db?request_timeout=-1")
    assert "secret" not in str(info.value)
    with pytest.raises(ValueError, match="unknown URL scheme"):
        aiolock.connect("mysqlx://u@h/db")


async def test_unreachable_server_is_backend_unavailable_in_bounded_time() -> None:
    url = f"mysql://u:secret@127.0.0.1:{free_port()}/db?connect_timeout=1"
    started = time.monotonic()
    with pytest.raises(aiolock.BackendUnavailable) as info:
        async with aiolock.connect(url):
            pass
    assert time.monotonic() - started < 3
    assert "secret" not in str(info.value)


async def test_refused_credentials_are_access_denied(db: MariaDBServer) -> None:
    url = db.url.replace(PASSWORD, "wrong-pw")
    with pytest.raises(aiolock.AccessDenied) as info:
        async with aiolock.connect(url):
            pass
    assert "wrong-pw" not in str(info.value) and PASSWORD not in str(info.value)
    assert isinstance(info.value, aiolock.LockError) and isinstance(info.value, PermissionError)


def test_missing_client_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "asyncmy", None)
    with pytest.raises(ImportError, match=r"pip install 'aiolock\[mysql\]'"):
        aiolock.connect("mysql://u@127.0.0.1:3306/db")


@pytest.mark.parametrize("mode", ["", "?mode=row"])
async def test_status_after_a_lost_lease_waits_for_its_clean_up(
    db: MariaDBServer, name: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with aiolock.connect(db.url + mode) as locks:
        backend: Any = locks.backend
        unlock = backend._unlock

        async def slow_unlock(*args: Any) -> bool:
            await asyncio.sleep(0.3)  # a slow network: the give-back is still in flight
            return bool(await unlock(*args))

        monkeypatch.setattr(backend, "_unlock", slow_unlock)
        with pytest.raises(aiolock.LockLost):
            async with locks.lock(name, ttl=0.2, watchdog=False):
                await asyncio.sleep(1)
        assert not await locks.lock(name).locked()
