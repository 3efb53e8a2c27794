"""URLs and options on both new backends: percent-encoded credentials, options that
reach every connection of the transaction path, redis.asyncio-only options, unix
sockets, databases without the tables or the privileges."""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import aiolock

from ..adversarial.servers import PasswordRedis
from .conftest import SECRET, user_url

pytestmark = pytest.mark.timeout(60)
ODD_PW = "p@ss:w/rd%?#&=+;"  # ASCII: the mariadb CLI would re-encode anything else


@pytest.fixture
def name() -> str:
    return f"u15-{uuid.uuid4().hex[:12]}"


async def _exclusive(url: str, name: str, **options: Any) -> None:
    async with aiolock.connect(url, **options) as a, aiolock.connect(url, **options) as b:
        lease = await a.lock(name, ttl=2).acquire(timeout=0)
        with pytest.raises(aiolock.LockTimeout):
            await b.lock(name, ttl=2).acquire(timeout=0)
        waiter = asyncio.create_task(b.lock(name, ttl=2).acquire(timeout=3))
        await asyncio.sleep(0.1)
        await lease.release()
        got = await waiter
        assert got.token > lease.token
        await got.release()


# -- Redis -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_redis() -> Iterator[PasswordRedis]:
    """redis-server with a user whose password needs percent-encoding, no @scripting,
    and a unix socket."""
    server = PasswordRedis(users=["default on nopass ~* &* +@all",
                                  f"odd on >{ODD_PW} ~* &* +@all -@scripting"])
    server.extra = ["--unixsocket", str(server.dir / "redis.sock"), "--unixsocketperm", "700"]
    server.start()
    yield server
    server.close()


async def test_redis_percent_encoded_password(odd_redis: PasswordRedis, name: str,
                                              caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    pw = urllib.parse.quote(ODD_PW, safe="")
    url = f"redis://odd:{pw}@127.0.0.1:{odd_redis.port}/0"
    await _exclusive(url, name)
    bad = f"redis://odd:{pw}x@127.0.0.1:{odd_redis.port}/0"
    with pytest.raises(aiolock.AccessDenied) as err:
        async with aiolock.connect(bad) as locks:
            await locks.lock(name, ttl=1).acquire(timeout=0)
    for shown in (str(err.value), caplog.text):
        assert ODD_PW not in shown and pw not in shown


async def test_redis_unix_socket_transaction_path(odd_redis: PasswordRedis, name: str) -> None:
    sock = odd_redis.dir / "redis.sock"
    await _exclusive(f"unix://{sock}?db=0&scripting=off", name)
    pw = urllib.parse.quote(ODD_PW, safe="")
    await _exclusive(f"unix://odd:{pw}@{sock}?db=0", name)


@pytest.mark.parametrize("query", ["protocol=3", "health_check_interval=1", "client_name=adv15-tx"])
async def test_redis_py_options_on_transaction_path(tx_redis: Any, query: str, name: str) -> None:
    """Options that route the transactions through redis.asyncio: still exclusive."""
    await _exclusive(user_url(tx_redis, "noscript", f"?{query}"), name)
    await _exclusive(user_url(tx_redis, "default", f"?scripting=off&{query}"), name)


async def test_client_name_reaches_every_connection(tx_redis: Any, raw_redis: Any,
                                                    name: str) -> None:
    """client_name applies to every connection aiolock opens for the URL (transactions,
    renewals, releases, pub/sub)."""
    tag = f"adv15-{uuid.uuid4().hex[:6]}"
    before = {c["id"] for c in await raw_redis.client_list()}
    url = user_url(tx_redis, "noscript", f"?client_name={tag}")
    async with aiolock.connect(url) as a, aiolock.connect(url) as b:
        lease = await a.lock(name, ttl=0.6).acquire()
        waiter = asyncio.create_task(b.lock(name, ttl=2).acquire(timeout=3))
        await asyncio.sleep(0.5)  # renewals, a waiter on pub/sub
        new = [c for c in await raw_redis.client_list() if c["id"] not in before]
        await lease.release()
        await (await waiter).release()
    assert new
    unnamed = [(c["name"], c["cmd"]) for c in new if c["name"] != tag]
    assert not unnamed, f"connections without client_name: {unnamed}"


# -- MySQL -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_mysql(mysql_server: Any) -> Iterator[Any]:
    """Users on the session's MariaDB: one with a password that needs percent-encoding
    (all on the aiolock database), one with only SELECT/INSERT/UPDATE/DELETE on a fresh
    database without the tables."""
    esc = ODD_PW.replace("\\", "\\\\").replace("'", "\\'")
    mysql_server.sql(
        f"CREATE USER IF NOT EXISTS 'adv15odd'@'127.0.0.1' IDENTIFIED BY '{esc}';"
        f" GRANT ALL ON `{mysql_server.database}`.* TO 'adv15odd'@'127.0.0.1';"
        " CREATE DATABASE IF NOT EXISTS adv15low;"
        " CREATE USER IF NOT EXISTS 'adv15low'@'127.0.0.1' IDENTIFIED BY 'lowpw';"
        " GRANT SELECT, INSERT, UPDATE, DELETE ON adv15low.* TO 'adv15low'@'127.0.0.1';"
        " GRANT ALL ON adv15low.* TO 'aiolock'@'127.0.0.1';")
    yield mysql_server


@pytest.mark.parametrize("mode", ["lock", "row"])
async def test_mysql_percent_encoded_password(odd_mysql: Any, mode: str, name: str,
                                              caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    pw = urllib.parse.quote(ODD_PW, safe="")
    base = f"127.0.0.1:{odd_mysql.port}/{odd_mysql.database}?mode={mode}"
    await _exclusive(f"mysql://adv15odd:{pw}@{base}", name)
    with pytest.raises(aiolock.AccessDenied) as err:
        async with aiolock.connect(f"mariadb://adv15odd:{pw}x@{base}") as locks:
            await locks.lock(name, ttl=1).acquire(timeout=0)
    for shown in (str(err.value), caplog.text):
        assert ODD_PW not in shown and pw not in shown


@pytest.mark.parametrize("mode", ["lock", "row"])
async def test_mysql_missing_tables_without_create(odd_mysql: Any, mode: str, name: str) -> None:
    """No tables and no CREATE: AccessDenied (not a hang, not another error); once an
    account with CREATE made them, the four privileges are enough."""
    low = f"mysql://adv15low:lowpw@127.0.0.1:{odd_mysql.port}/adv15low?mode={mode}"
    odd_mysql.sql("DROP TABLE IF EXISTS adv15low.aiolock_tokens, adv15low.aiolock_holders,"
                  " adv15low.aiolock_rows")
    with pytest.raises(aiolock.AccessDenied):
        async with asyncio.timeout(10), aiolock.connect(low) as locks:
            await locks.lock(name, ttl=1).acquire(timeout=0)
    full = f"mysql://aiolock:s3cret-pw@127.0.0.1:{odd_mysql.port}/adv15low?mode={mode}"
    async with aiolock.connect(full) as locks, locks.lock(f"{name}-init", ttl=1):
        pass
    await _exclusive(low, name)


async def test_mysql_unknown_database_is_a_clear_error(mysql_server: Any) -> None:
    url = f"mysql://aiolock:s3cret-pw@127.0.0.1:{mysql_server.port}/no_such_db"
    with pytest.raises(aiolock.LockError) as err:
        async with asyncio.timeout(10), aiolock.connect(url) as locks:
            await locks.lock("x", ttl=1).acquire(timeout=0)
    assert not isinstance(err.value, aiolock.LockTimeout)
    assert "s3cret-pw" not in str(err.value)


del SECRET


async def test_prefix_shared_by_both_paths_and_acl_keys(tx_redis: Any, name: str) -> None:
    """prefix= moves both paths' keys together; a user whose ACL keys do not cover the
    prefix gets AccessDenied, not a hang or a silently unguarded lock."""
    lua = user_url(tx_redis, "default", "?prefix=adv15p")
    tx = user_url(tx_redis, "noscript", "?prefix=adv15p")
    other = user_url(tx_redis, "noscript", "?prefix=adv15q")
    async with aiolock.connect(lua) as a, aiolock.connect(tx) as b, aiolock.connect(other) as c:
        lease = await b.lock(name, ttl=2).acquire(timeout=0)
        with pytest.raises(aiolock.LockTimeout):
            await a.lock(name, ttl=2).acquire(timeout=0)
        free = await c.lock(name, ttl=2).acquire(timeout=0)  # another prefix: another lock
        await free.release()
        await lease.release()
    with pytest.raises(aiolock.AccessDenied):
        async with asyncio.timeout(10), \
                aiolock.connect(user_url(tx_redis, "minimal", "?prefix=elsewhere")) as locks:
            await locks.lock(name, ttl=1).acquire(timeout=0)


async def test_mysql_semaphore_limit_across_connections(mysql_server: Any, name: str) -> None:
    inside = 0
    peak = 0
    tokens: list[int] = []

    async def one(locks: aiolock.Locks) -> None:
        nonlocal inside, peak
        for _ in range(4):
            async with locks.semaphore(name, limit=2, ttl=5, timeout=10) as lease:
                inside += 1
                peak = max(peak, inside)
                tokens.append(lease.token)
                await asyncio.sleep(0.01)
                inside -= 1

    conns = [aiolock.connect(mysql_server.url) for _ in range(3)]
    try:
        await asyncio.gather(*(one(conns[i % 3]) for i in range(6)))
    finally:
        for locks in conns:
            await locks.aclose()
    assert peak == 2
    assert len(tokens) == 24 and len(set(tokens)) == 24


@pytest.mark.parametrize(("query", "keyword"), [("row", "lock"), ("lock", "row")])
async def test_mysql_mode_in_query_and_keyword_disagree(mysql_server: Any, query: str,
                                                        keyword: str) -> None:
    """`?mode=X` with mode=Y: refused, or the connection says the mode it really uses."""
    try:
        locks = aiolock.connect(f"{mysql_server.url}?mode={query}", mode=keyword)
    except ValueError:
        return
    async with locks:
        used = "lock" if aiolock.Capability.SEMAPHORE in locks.capabilities else "row"
        shown = "row" if "mode=row" in locks.url else "lock"
        assert shown == used, f"locks.url {locks.url!r} but the backend runs mode={used}"
