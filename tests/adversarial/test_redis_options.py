"""Every Redis option honoured or refused (SPEC §1): typos, TLS files, client name,
credentials as keywords, on every connection aiolock opens. Written from the README and
SPEC only."""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.credentials import CredentialProvider

import aiolock

from ..servers import RedisServer
from .conftest import SECRET
from .servers import PasswordRedis, TLSRedis

DEAD = "127.0.0.1:1"  # nothing listens: a backend that connects eagerly fails fast
TRIO = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"


async def _refused(target: str, **options: Any) -> ValueError:
    """connect() (or at the latest its ``async with``) refuses with ValueError."""
    async with asyncio.timeout(15):
        with pytest.raises(ValueError) as info:
            locks = aiolock.connect(target, **options)
            async with locks:
                pass
    return info.value


@pytest.mark.parametrize("url", [
    f"redis://{DEAD}/0", f"rediss://{DEAD}/0", f"redis+cluster://{DEAD}",
    f"redis+sentinel://{DEAD}/mymaster", f"redlock://{TRIO}",
])
async def test_misspelled_keyword_refused_naming_it(url: str) -> None:
    err = await _refused(url, conect_timeout=1)
    assert "conect_timeout" in str(err)
    assert "connect_timeout" in str(err), f"should list what is accepted: {err}"


@pytest.mark.parametrize("url", [
    f"redis://{DEAD}/0?conect_timeout=1", f"redis://{DEAD}/0?ssl_certs_reqs=none",
    f"rediss://{DEAD}/0?ssl_ca_cert=/x.pem", f"redis+cluster://{DEAD}?bogus=1",
    f"redlock://{TRIO}?drift_factr=0.1",
    "postgresql://u@127.0.0.1:1/db?mod=row", "zookeeper://127.0.0.1:1/x?session_timout=3",
    "memcached://127.0.0.1:1?timeout=1", "memory://?x=1",
])
async def test_misspelled_query_parameter_refused(url: str) -> None:
    bad = url.rsplit("?", 1)[1].split("=")[0]
    err = await _refused(url)
    assert bad in str(err)


@pytest.mark.parametrize("url", ["zookeeper://127.0.0.1:1/x", "memcached://127.0.0.1:1",
                                 "postgresql://u@127.0.0.1:1/db", "memory://"])
async def test_misspelled_keyword_refused_other_backends(url: str) -> None:
    err = await _refused(url, sesion_timeout=3)
    assert "sesion_timeout" in str(err)


async def test_typo_in_option_value_refused(redis_server: RedisServer) -> None:
    for bad in ({"connect_timeout": -1}, {"request_timeout": float("nan")},
                {"connect_timeout": "soon"}):
        await _refused(redis_server.url, **bad)


# --- TLS -------------------------------------------------------------------------------


def _tls_query(tls: TLSRedis) -> str:
    f = tls.files
    return (f"ssl_ca_certs={f['ca']}&ssl_certfile={f['client']}&ssl_keyfile={f['client_key']}")


async def _handoff(locks: aiolock.Locks) -> float:
    """Hold a lock, start a waiter, release: seconds the waiter took to get it (pub/sub)."""
    name = f"tls-{uuid.uuid4().hex}"
    lease = await locks.lock(name, ttl=20).acquire()
    waiter = asyncio.create_task(locks.lock(name, ttl=20).acquire())
    await asyncio.sleep(0.3)
    assert not waiter.done()
    t0 = time.monotonic()
    await lease.release()
    async with asyncio.timeout(10):
        second = await waiter
    took = time.monotonic() - t0
    assert second.token > lease.token
    await second.release()
    info = await locks.status(name)
    assert not info.held
    return took


async def test_tls_private_ca_and_client_cert_in_query(tls_redis: TLSRedis) -> None:
    url = f"{tls_redis.url}?{_tls_query(tls_redis)}"
    # redis-py itself connects with this URL
    client = redis.asyncio.Redis.from_url(url)
    assert await client.ping()
    await client.aclose()
    async with asyncio.timeout(20), aiolock.connect(url, connect_timeout=3) as locks:
        took = await _handoff(locks)
    assert took < 2.0, f"waiter woke after {took:.1f}s: pub/sub not on TLS?"


async def test_tls_private_ca_and_client_cert_as_keywords(tls_redis: TLSRedis) -> None:
    f = tls_redis.files
    async with asyncio.timeout(20), aiolock.connect(
        tls_redis.url, connect_timeout=3, ssl_ca_certs=str(f["ca"]),
        ssl_certfile=str(f["client"]), ssl_keyfile=str(f["client_key"]),
        ssl_cert_reqs="required", ssl_check_hostname=True,
    ) as locks:
        took = await _handoff(locks)
    assert took < 2.0


async def test_tls_ca_data_keyword(tls_redis: TLSRedis) -> None:
    f = tls_redis.files
    async with asyncio.timeout(20), aiolock.connect(
        tls_redis.url, connect_timeout=3, ssl_ca_data=f["ca"].read_text(),
        ssl_certfile=str(f["client"]), ssl_keyfile=str(f["client_key"]),
    ) as locks:
        await _handoff(locks)


async def test_tls_cert_reqs_none(tls_redis: TLSRedis) -> None:
    """ssl_cert_reqs=none (no server verification) with a client certificate connects."""
    f = tls_redis.files
    url = (f"{tls_redis.url}?ssl_cert_reqs=none&ssl_certfile={f['client']}"
           f"&ssl_keyfile={f['client_key']}")
    async with asyncio.timeout(20), aiolock.connect(url, connect_timeout=3) as locks:
        await _handoff(locks)


async def test_tls_without_client_cert_fails_bounded(tls_redis: TLSRedis) -> None:
    """The server demands a client certificate: a LockError in bounded time, not a hang
    or a bare ssl error."""
    f = tls_redis.files
    t0 = time.monotonic()
    async with asyncio.timeout(15):
        with pytest.raises(aiolock.LockError):
            async with aiolock.connect(f"{tls_redis.url}?ssl_ca_certs={f['ca']}",
                                       connect_timeout=2, request_timeout=2) as locks:
                await locks.lock(f"x-{uuid.uuid4().hex}").acquire(timeout=0)
    assert time.monotonic() - t0 < 6


async def test_tls_unknown_ca_fails_bounded(tls_redis: TLSRedis) -> None:
    """Default verification against the system CAs must refuse our private CA."""
    f = tls_redis.files
    async with asyncio.timeout(15):
        with pytest.raises(aiolock.LockError):
            async with aiolock.connect(tls_redis.url, connect_timeout=2, request_timeout=2,
                                       ssl_certfile=str(f["client"]),
                                       ssl_keyfile=str(f["client_key"])) as locks:
                await locks.lock(f"x-{uuid.uuid4().hex}").acquire(timeout=0)


# --- options applied to every connection -----------------------------------------------


def _clients(server: RedisServer) -> list[dict[str, Any]]:
    admin = redis.Redis(port=server.port, decode_responses=True)
    try:
        me = admin.client_id()
        return [c for c in admin.client_list() if int(c["id"]) != me]
    finally:
        admin.close()


class _Refused(Exception):
    pass


async def _honoured_or_refused(names: tuple[str, ...], url: str, **options: Any) -> Any:
    """SPEC §1: an option is honoured on every connection, or refused with a ValueError
    naming it. Returns the open Locks (caller closes), or raises _Refused."""
    try:
        locks = aiolock.connect(url, **options)
        await locks.__aenter__()
    except ValueError as exc:
        assert any(n in str(exc) for n in names), f"ValueError not naming {names}: {exc}"
        raise _Refused from exc
    return locks


async def _new_clients(server: RedisServer, before: set[str], url: str,
                       names: tuple[str, ...], **options: Any) -> list[dict[str, Any]] | None:
    try:
        locks = await _honoured_or_refused(names, url, **options)
    except _Refused:
        return None
    try:
        await _handoff(locks)  # opens the script connection and the pub/sub one
        ours = [c for c in _clients(server) if c["id"] not in before]
    finally:
        await locks.aclose()
    assert len(ours) >= 2, f"expected the script and pub/sub connections, saw {ours}"
    return ours


async def test_client_name_on_every_connection(redis_server: RedisServer) -> None:
    label = f"adv-{uuid.uuid4().hex[:8]}"
    before = {c["id"] for c in _clients(redis_server)}
    ours = await _new_clients(redis_server, before, f"{redis_server.url}?client_name={label}",
                              ("client_name",))
    if ours is not None:
        names = sorted(c["name"] for c in ours)
        assert all(n == label for n in names), f"connections named {names}, want {label!r}"


async def test_credentials_as_keywords(acl_redis: PasswordRedis) -> None:
    """The server's default user may do everything: an ignored username/password would
    go unnoticed but for the user each connection is logged in as."""
    before = {c["id"] for c in _clients(acl_redis)}
    ours = await _new_clients(acl_redis, before, acl_redis.url, ("username", "password"),
                              username="full", password=SECRET)
    if ours is not None:
        users = sorted(c["user"] for c in ours)
        assert all(u == "full" for u in users), f"connections logged in as {users}"


class _Provider(CredentialProvider):
    def __init__(self) -> None:
        self.calls = 0

    def get_credentials(self) -> tuple[str, str]:
        self.calls += 1
        return ("full", SECRET)


async def test_credential_provider(acl_redis: PasswordRedis) -> None:
    provider = _Provider()
    before = {c["id"] for c in _clients(acl_redis)}
    ours = await _new_clients(acl_redis, before, acl_redis.url, ("credential_provider",),
                              credential_provider=provider)
    if ours is not None:
        users = sorted(c["user"] for c in ours)
        assert all(u == "full" for u in users), f"connections logged in as {users}"


async def test_socket_keepalive_and_health_check(redis_server: RedisServer) -> None:
    try:
        locks = await _honoured_or_refused(("socket_keepalive", "health_check_interval"),
                                           redis_server.url, socket_keepalive=True,
                                           health_check_interval=10)
    except _Refused:
        return
    try:
        await _handoff(locks)
    finally:
        await locks.aclose()


async def test_db_number_is_honoured(redis_server: RedisServer) -> None:
    """/1 and /2 are different data: the same name is a different lock in each, and
    the keys land in the db the URL names."""
    name = f"db-{uuid.uuid4().hex}"
    base = f"redis://127.0.0.1:{redis_server.port}"
    admin = redis.Redis(port=redis_server.port, db=7)
    try:
        before = admin.dbsize()
        async with aiolock.connect(f"{base}/7") as seven, aiolock.connect(f"{base}/8") as eight:
            lease7 = await seven.lock(name, ttl=5).acquire(timeout=0)
            lease8 = await eight.lock(name, ttl=5).acquire(timeout=0)
            assert admin.dbsize() > before, "no key written in db 7"
            assert lease7.token == lease8.token == 1 or lease8.token == 1
            await lease7.release()
            await lease8.release()
    finally:
        admin.close()


async def test_unix_socket_url_with_db() -> None:
    server = PasswordRedis(extra=["--unixsocket", "SOCK"])
    server.extra[1] = str(server.dir / "redis.sock")
    server.start()
    try:
        url = f"unix://{server.dir / 'redis.sock'}?db=3"
        async with asyncio.timeout(20), aiolock.connect(url) as locks:
            await _handoff(locks)
        admin = redis.Redis(unix_socket_path=str(server.dir / "redis.sock"), db=3)
        try:
            assert admin.dbsize() > 0, "the token counter should live in db 3"
        finally:
            admin.close()
    finally:
        server.close()


@pytest.fixture
def encrypted_key(tls_redis: TLSRedis, tmp_path: Path) -> Path:
    enc = tmp_path / "client_key_enc.pem"
    subprocess.run(["openssl", "pkey", "-in", str(tls_redis.files["client_key"]), "-aes256",
                    "-passout", f"pass:{SECRET}", "-out", str(enc)],
                   check=True, capture_output=True)
    return enc


async def test_tls_encrypted_client_key_with_password(tls_redis: TLSRedis,
                                                      encrypted_key: Path) -> None:
    """ssl_password decrypts the client key (README lists it): honoured or refused."""
    f = tls_redis.files
    try:
        locks = await _honoured_or_refused(("ssl_password",), tls_redis.url,
                                           ssl_ca_certs=str(f["ca"]),
                                           ssl_certfile=str(f["client"]),
                                           ssl_keyfile=str(encrypted_key), ssl_password=SECRET,
                                           connect_timeout=3)
    except _Refused:
        return
    try:
        async with asyncio.timeout(20):
            await _handoff(locks)
    finally:
        await locks.aclose()
