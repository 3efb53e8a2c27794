"""Issue 9, Redis side: every option honoured or refused, refused credentials reported
as AccessDenied, server states that mean "not now" reported as BackendUnavailable, a
burst of 50,000 acquires on one connection, clients passed in, least-privilege ACL.

Each test runs against its own real redis-server (TLS, requirepass, ACL users, a
replica) started here; nothing uses a server someone started by hand.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection

import aiolock
from aiolock import AccessDenied, BackendUnavailable, LockError
from aiolock.abc import Kind

from .servers import RedisServer, TlsRedisServer

# -- servers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server() -> Iterator[TlsRedisServer]:
    server = TlsRedisServer().start()
    yield server
    server.close()


#: The least privileges aiolock needs on plain Redis with the default prefix (README).
ACL_COMMANDS = ("+ping", "+evalsha", "+script|load", "+subscribe", "+unsubscribe",
                "+publish", "+scan")
#: What the Lua scripts run (Redis checks a script's commands against the ACL too).
ACL_SCRIPT_COMMANDS = ("+get", "+set", "+del", "+exists", "+incr", "+pexpire", "+pttl",
                       "+hget", "+hmget", "+hset", "+hdel", "+lindex", "+llen", "+lpop",
                       "+lpos", "+lrem",
                       "+rpush", "+zadd", "+zcard", "+zcount", "+zrange", "+zrangebyscore",
                       "+zrem", "+zscore", "+time")
ACL_LINE = ("user aiolock on >s3cret-pw resetkeys ~aiolock:* resetchannels &aiolock:* -@all "
            + " ".join(ACL_COMMANDS + ACL_SCRIPT_COMMANDS))


def _acl_file(directory: Path) -> str:
    lines = [
        "user default on >admin-pw ~* &* +@all",
        ACL_LINE,
        # one command less each
        ACL_LINE.replace("user aiolock ", "user noevalsha ").replace(" +evalsha", ""),
        ACL_LINE.replace("user aiolock ", "user nosubscribe ").replace(" +subscribe", ""),
        ACL_LINE.replace("user aiolock ", "user nochannels ").replace(" &aiolock:*", ""),
    ]
    path = directory / "users.acl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.args = ["--aclfile", _acl_file(server.dir)]
    server.start()
    yield server
    server.close()


def _url(server: RedisServer, userinfo: str = "") -> str:
    return f"redis://{userinfo}127.0.0.1:{server.port}/0"


def _name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


async def _contend(locks: aiolock.Locks, *, kinds: tuple[str, ...] = ("lock",)) -> None:
    """A holder and a waiter from another connection: the waiter gets the lock soon
    after the release (by the release message, not by its ttl-bounded retry)."""
    name = _name()
    lock = locks.lock(name, ttl=30)
    async with lock:
        waiter = asyncio.ensure_future(locks.lock(name, ttl=30).acquire(timeout=10))
        await asyncio.sleep(0.3)
        assert not waiter.done()
    t0 = time.monotonic()
    lease = await waiter
    assert time.monotonic() - t0 < 2.0
    await lease.release()


# -- 1. TLS and every option on every connection --------------------------------------


async def test_tls_options_in_query(tls_server: TlsRedisServer) -> None:
    tls = tls_server.tls
    url = (f"{tls_server.url}?ssl_ca_certs={tls['ca']}&ssl_certfile={tls['client_cert']}"
           f"&ssl_keyfile={tls['client_key']}")
    async with aiolock.connect(url, connect_timeout=3, request_timeout=3) as locks:
        await _contend(locks)


async def test_tls_options_as_keywords(tls_server: TlsRedisServer) -> None:
    tls = tls_server.tls
    async with aiolock.connect(
        tls_server.url, ssl_ca_certs=tls["ca"], ssl_certfile=tls["client_cert"],
        ssl_keyfile=tls["client_key"], ssl_cert_reqs="required", connect_timeout=3,
        request_timeout=3,
    ) as locks:
        await _contend(locks)
        assert locks.backend.ordered  # the lean connection honours them all


async def test_tls_ca_data_and_key_password(tls_server: TlsRedisServer) -> None:
    tls = tls_server.tls
    with open(tls["ca"]) as f:  # noqa: ASYNC230 -- a small local file
        ca_data = f.read()
    if "ssl_password" not in inspect.signature(SSLConnection.__init__).parameters:
        # an older redis-py has no key password for asyncio: refused, naming it
        with pytest.raises(ValueError, match="ssl_password"):
            aiolock.connect(tls_server.url, ssl_password="key-pw")
        return
    async with aiolock.connect(
        tls_server.url, ssl_ca_data=ca_data, ssl_certfile=tls["client_cert"],
        ssl_keyfile=tls["client_key_encrypted"], ssl_password="key-pw", connect_timeout=3,
    ) as locks:
        await _contend(locks)
    with pytest.raises(ValueError, match="TLS") as info:  # a wrong key password: at once
        aiolock.connect(tls_server.url, ssl_ca_certs=tls["ca"], ssl_certfile=tls["client_cert"],
                        ssl_keyfile=tls["client_key_encrypted"], ssl_password="nope-pw")
    assert "nope-pw" not in str(info.value)


async def test_redlock_over_tls(tls_server: TlsRedisServer) -> None:
    tls = tls_server.tls
    others = [TlsRedisServer(tls=tls).start() for _ in range(2)]
    try:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in (tls_server, *others))
        url = (f"redlock://{hosts}?ssl=true&ssl_ca_certs={tls['ca']}"
               f"&ssl_certfile={tls['client_cert']}&ssl_keyfile={tls['client_key']}")
        async with aiolock.connect(url, connect_timeout=3, request_timeout=3) as locks:
            await _contend(locks)
    finally:
        for server in others:
            server.close()


async def test_unix_socket_with_options(tmp_path: Path) -> None:
    sock = str(tmp_path / "redis.sock")
    server = RedisServer(args=["--unixsocket", sock, "--unixsocketperm", "700"]).start()
    tag = f"app-{uuid.uuid4().hex[:6]}"
    try:
        async with aiolock.connect(f"unix://{sock}?db=3&client_name={tag}") as locks:
            assert locks.backend.ordered
            await _contend(locks)
            admin = aioredis.Redis(port=server.port)
            try:
                mine = [c for c in await admin.client_list() if c.get("name") == tag]
            finally:
                await admin.aclose()
            assert len(mine) >= 2 and all(c["db"] == "3" for c in mine), mine
    finally:
        server.close()


async def test_tls_wrong_ca_fails_fast(tls_server: TlsRedisServer) -> None:
    tls = tls_server.tls
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable):
        async with aiolock.connect(
            tls_server.url, ssl_ca_certs=tls["other_ca"], ssl_certfile=tls["client_cert"],
            ssl_keyfile=tls["client_key"], connect_timeout=2, request_timeout=2,
        ):
            pass
    assert time.monotonic() - t0 < 4


async def test_tls_without_client_certificate_fails_fast(tls_server: TlsRedisServer) -> None:
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable):
        async with aiolock.connect(tls_server.url, ssl_ca_certs=tls_server.tls["ca"],
                                   connect_timeout=2, request_timeout=2) as locks:
            await locks.lock(_name()).acquire(timeout=0)
    assert time.monotonic() - t0 < 6


async def test_client_name_on_every_connection(redis_server: RedisServer) -> None:
    tag = f"app-{uuid.uuid4().hex[:6]}"
    async with aiolock.connect(redis_server.url, client_name=tag) as locks:
        await _contend(locks)  # the pub/sub connection is open now
        admin = aioredis.Redis(port=redis_server.port)
        try:
            clients = await admin.client_list()
        finally:
            await admin.aclose()
        names = [c for c in clients if c.get("name") == tag]
        assert len(names) >= 2, clients  # the scripts' connection and pub/sub's


async def test_credential_provider_runs_scripts_through_redis_py(acl_server: RedisServer) -> None:
    from redis.credentials import UsernamePasswordCredentialProvider

    provider = UsernamePasswordCredentialProvider("aiolock", "s3cret-pw")
    async with aiolock.connect(_url(acl_server), credential_provider=provider) as locks:
        assert not locks.backend.ordered  # the lean connection cannot ask a provider
        await _contend(locks)


@pytest.mark.parametrize("query", ["health_check_interval=5", "retry_on_timeout=true",
                                   "protocol=3", "decode_responses=true&protocol=3"])
async def test_options_only_redis_py_honours(redis_server: RedisServer, query: str) -> None:
    """The scripts then run through redis.asyncio, with the option; everything works."""
    async with aiolock.connect(f"{redis_server.url}?{query}") as locks:
        assert not locks.backend.ordered
        await _contend(locks)
        name = _name()
        rw = locks.rwlock(name, ttl=5)
        async with rw.read():
            assert (await locks.status(name, Kind.READ)).holders == 1


async def test_credential_provider_refused_is_access_denied(acl_server: RedisServer) -> None:
    from redis.credentials import UsernamePasswordCredentialProvider

    provider = UsernamePasswordCredentialProvider("aiolock", "wrong-pw")
    with pytest.raises(AccessDenied, match="WRONGPASS") as info:
        async with aiolock.connect(_url(acl_server), credential_provider=provider,
                                   connect_timeout=2):
            pass
    assert "wrong-pw" not in str(info.value)


async def test_socket_timeout_aliases(redis_server: RedisServer) -> None:
    async with aiolock.connect(redis_server.url + "?socket_timeout=2&socket_connect_timeout=2") as locks:
        await _contend(locks)
    with pytest.raises(ValueError, match="request_timeout"):
        aiolock.connect(redis_server.url, socket_timeout=2, request_timeout=3)


# -- 2. unknown options refused -------------------------------------------------------

_SCHEMES = [
    "redis://127.0.0.1:1/0", "rediss://127.0.0.1:1/0", "unix:///tmp/nothing.sock",
    "redis+cluster://127.0.0.1:1", "redis+sentinel://127.0.0.1:1/svc",
    "redlock://127.0.0.1:1,127.0.0.1:2,127.0.0.1:3",
]


@pytest.mark.parametrize("url", _SCHEMES)
async def test_misspelled_keyword_refused(url: str) -> None:
    with pytest.raises(ValueError, match="conect_timeout") as info:
        aiolock.connect(url, conect_timeout=1)
    assert "connect_timeout" in str(info.value).replace("conect_timeout", "")


@pytest.mark.parametrize("url", _SCHEMES)
async def test_misspelled_query_option_refused(url: str) -> None:
    sep = "&" if "?" in url else "?"
    with pytest.raises(ValueError, match="conect_timeout") as info:
        aiolock.connect(url + sep + "conect_timeout=1")
    assert "connect_timeout" in str(info.value).replace("conect_timeout", "")


async def test_tls_option_on_plain_redis_refused() -> None:
    with pytest.raises(ValueError, match=r"ssl_ca_certs.*rediss://"):
        aiolock.connect("redis://127.0.0.1:1/0", ssl_ca_certs="/x.pem")


async def test_subscription_refused_surfaces(acl_server: RedisServer) -> None:
    """No right to SUBSCRIBE: the waiting acquire fails, it does not poll by ttl."""
    url = _url(acl_server, "nosubscribe:s3cret-pw@")
    async with aiolock.connect(url, connect_timeout=2, request_timeout=2) as locks:
        name = _name()
        async with locks.lock(name, ttl=30):
            t0 = time.monotonic()
            with pytest.raises(AccessDenied, match=r"(?i)subscribe"):
                await asyncio.ensure_future(locks.lock(name, ttl=30).acquire(timeout=10))
            assert time.monotonic() - t0 < 3


# -- 3. refused credentials ----------------------------------------------------------


@pytest.fixture(scope="module")
def password_server() -> Iterator[RedisServer]:
    server = RedisServer(args=["--requirepass", "right-pw"]).start()
    yield server
    server.close()


@pytest.mark.parametrize(("userinfo", "what"), [
    ("", "NOAUTH"), (":wrong-pw@", "WRONGPASS"), ("nobody:wrong-pw@", "WRONGPASS"),
])
async def test_refused_credentials_are_access_denied(
    password_server: RedisServer, userinfo: str, what: str,
) -> None:
    with pytest.raises(AccessDenied) as info:
        async with aiolock.connect(_url(password_server, userinfo), connect_timeout=2):
            pass
    assert what in str(info.value) and "password" in str(info.value)
    assert "wrong-pw" not in str(info.value) and "right-pw" not in str(info.value)
    # and the first acquire of a connection not entered with `async with`
    locks = aiolock.connect(_url(password_server, userinfo), connect_timeout=2)
    try:
        with pytest.raises(AccessDenied):
            await locks.lock(_name()).acquire(timeout=0)
    finally:
        await locks.aclose()


async def test_missing_command_is_access_denied(acl_server: RedisServer) -> None:
    url = _url(acl_server, "noevalsha:s3cret-pw@")
    with pytest.raises(AccessDenied, match=r"(?i)evalsha") as info:
        async with aiolock.connect(url, connect_timeout=2) as locks:
            await locks.lock(_name()).acquire(timeout=0)
    assert "s3cret-pw" not in str(info.value)


async def test_redlock_refused_credentials_are_access_denied() -> None:
    servers = [RedisServer(args=["--requirepass", "right-pw"]).start() for _ in range(3)]
    try:
        url = "redlock://:wrong-pw@" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
        with pytest.raises(AccessDenied) as info:
            async with aiolock.connect(url, connect_timeout=2):
                pass
        assert "WRONGPASS" in str(info.value) and "wrong-pw" not in str(info.value)
    finally:
        for server in servers:
            server.close()


@pytest.mark.parametrize("userinfo", ["", ":wrong-pw@"])
def test_cli_status_refused(password_server: RedisServer, userinfo: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "aiolock", "status", "--url", _url(password_server, userinfo),
         "some-lock"], capture_output=True, text=True, timeout=30, env=env,
    )
    assert proc.returncode == 77, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "wrong-pw" not in proc.stderr


# -- 12. a burst on one connection; "not now" replies ----------------------------------


@pytest.mark.parametrize("burst", [10_000, pytest.param(50_000, marks=pytest.mark.slow)])
async def test_burst_of_acquires(redis_server: RedisServer, burst: int) -> None:
    """Thousands of acquires at once on one connection all succeed (none is refused for
    want of room in flight); 10,000 in the default run, 50,000 in the slow tier."""
    async with aiolock.connect(redis_server.url) as locks:
        prefix = _name()
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                lease = await locks.lock(f"{prefix}:{i}", ttl=60).acquire(timeout=0)
                await lease.release()
            except Exception as exc:
                errors.append(exc)

        await asyncio.gather(*(one(i) for i in range(burst)))
        assert not errors, (len(errors), errors[:3])


async def _fake_server(reply: bytes) -> tuple[asyncio.Server, int]:
    """A server that answers every command with ``reply`` (e.g. ``-LOADING ...``)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(reply * max(1, data.count(b"*")))  # one per command (no nesting)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("error", [
    "LOADING Redis is loading the dataset in memory",
    "READONLY You can't write against a read only replica.",
    "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSCRIPT.",
    "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN The cluster is down",
])
async def test_not_now_replies_are_backend_unavailable(error: str) -> None:
    server, port = await _fake_server(f"-{error}\r\n".encode())
    try:
        for enter in (True, False):
            locks = aiolock.connect(f"redis://127.0.0.1:{port}/0", connect_timeout=1,
                                    request_timeout=1)
            try:
                with pytest.raises(BackendUnavailable, match=error.split()[0]):
                    if enter:
                        await locks.__aenter__()
                    else:
                        await locks.lock(_name()).acquire(timeout=0)
            finally:
                await locks.aclose()
    finally:
        server.close()


async def test_readonly_replica_is_backend_unavailable(redis_server: RedisServer) -> None:
    replica = RedisServer(args=["--replicaof", "127.0.0.1", str(redis_server.port)]).start()
    try:
        async with aiolock.connect(replica.url, connect_timeout=2, request_timeout=2) as locks:
            with pytest.raises(BackendUnavailable, match="READONLY"):
                await locks.lock(_name()).acquire(timeout=0)
    finally:
        replica.close()


async def test_busy_script_is_backend_unavailable() -> None:
    server = RedisServer(args=["--busy-reply-threshold", "100"]).start()
    admin = aioredis.Redis(port=server.port)
    try:
        async with aiolock.connect(server.url, connect_timeout=2, request_timeout=2) as locks:
            busy = asyncio.ensure_future(admin.eval("while true do end", 0))
            await asyncio.sleep(0.4)
            with pytest.raises(BackendUnavailable, match="BUSY"):
                await locks.lock(_name()).acquire(timeout=0)
            killer = aioredis.Redis(port=server.port)
            await killer.script_kill()
            await killer.aclose()
            with pytest.raises(redis.ResponseError):
                await busy
    finally:
        await admin.aclose()
        server.close()


# -- 10. clients passed in -------------------------------------------------------------


async def test_fakeredis_client_end_to_end() -> None:
    fakeredis = pytest.importorskip("fakeredis")
    client = fakeredis.FakeAsyncRedis()
    async with aiolock.connect(client) as locks:
        await _contend(locks)
    await client.aclose()


class _MyRedis(aioredis.Redis):
    pass


async def test_redis_subclass_end_to_end(redis_server: RedisServer) -> None:
    client = _MyRedis(port=redis_server.port)
    async with aiolock.connect(client) as locks:
        await _contend(locks)
    await client.aclose()


def test_sync_client_refused(redis_server: RedisServer) -> None:
    with pytest.raises(ValueError, match=r"redis\.asyncio"):
        aiolock.connect(redis.Redis(port=redis_server.port))


# -- 14. least privileges ---------------------------------------------------------------


@pytest.fixture
async def acl_locks(acl_server: RedisServer) -> AsyncIterator[aiolock.Locks]:
    async with aiolock.connect(_url(acl_server, "aiolock:s3cret-pw@"), connect_timeout=2,
                               request_timeout=2) as locks:
        yield locks


async def test_least_privilege_acl_lock_and_fair(acl_locks: aiolock.Locks) -> None:
    await _contend(acl_locks)
    name = _name()
    async with acl_locks.lock(name, ttl=5, fair=True) as lease:
        waiter = asyncio.ensure_future(acl_locks.lock(name, ttl=5, fair=True).acquire(timeout=5))
        await asyncio.sleep(0.2)
        info = await acl_locks.status(name)
        assert info.held and info.waiters == 1
        token = lease.token
    second = await waiter
    assert second.token > token
    await second.release()


async def test_least_privilege_acl_rwlock_and_semaphore(acl_locks: aiolock.Locks) -> None:
    rw = acl_locks.rwlock(_name(), ttl=5)
    readers = await asyncio.gather(*(asyncio.ensure_future(rw.read().acquire(timeout=5))
                                     for _ in range(2)))
    writer = asyncio.ensure_future(rw.write().acquire(timeout=5))
    await asyncio.sleep(0.2)
    assert not writer.done()
    for lease in readers:
        await lease.release()
    await (await writer).release()
    sem = acl_locks.semaphore(_name(), 2, ttl=5)
    permits = await asyncio.gather(*(asyncio.ensure_future(sem.acquire(timeout=5))
                                     for _ in range(2)))
    third = asyncio.ensure_future(sem.acquire(timeout=5))
    await asyncio.sleep(0.2)
    assert not third.done()
    await permits[0].release()
    await (await third).release()
    await permits[1].release()


async def test_least_privilege_acl_coordination(acl_locks: aiolock.Locks) -> None:
    """Holders, scan (SCAN: +scan), revocation and an election under the same ACL."""
    name = _name()
    lease = await acl_locks.lock(name, ttl=5, data="d").acquire()
    assert [h.data for h in (await acl_locks.status(name)).held_by] == ["d"]
    assert [i.name async for i in acl_locks.scan(name)] == [name]
    assert await acl_locks.lock(name).force_release()
    await lease.release()
    election = acl_locks.election(name, ttl=5)
    async with election.campaign(data="a") as term:
        await term.proclaim("b")
        leader = await election.leader()
        assert leader is not None and leader.data == "b"


@pytest.mark.parametrize("user", ["noevalsha", "nochannels"])
async def test_least_privilege_one_less_is_access_denied(acl_server: RedisServer, user: str) -> None:
    url = _url(acl_server, f"{user}:s3cret-pw@")
    with pytest.raises(AccessDenied):
        async with aiolock.connect(url, connect_timeout=2, request_timeout=2) as locks:
            name = _name()
            async with locks.lock(name, ttl=30):
                await asyncio.ensure_future(locks.lock(name, ttl=30).acquire(timeout=5))


def test_every_error_is_a_lock_error() -> None:
    assert issubclass(AccessDenied, LockError) and issubclass(BackendUnavailable, LockError)



# -- 1. the same for Cluster, Sentinel and Redlock ---------------------------------------


async def _named_connections(ports: list[int], tag: str) -> int:
    count = 0
    for port in ports:
        admin = aioredis.Redis(port=port)
        try:
            count += sum(1 for c in await admin.client_list() if c.get("name") == tag)
        finally:
            await admin.aclose()
    return count


async def test_redlock_options_reach_every_node(redlock_servers: list[RedisServer]) -> None:
    tag = f"app-{uuid.uuid4().hex[:6]}"
    url = "redlock://" + ",".join(f"127.0.0.1:{s.port}" for s in redlock_servers)
    async with aiolock.connect(url + f"?client_name={tag}") as locks:
        await _contend(locks)
        ports = [s.port for s in redlock_servers]
        assert await _named_connections(ports, tag) >= 2 * len(ports)  # scripts + pub/sub


async def test_cluster_options_reach_pubsub(redis_cluster: Any) -> None:
    tag = f"app-{uuid.uuid4().hex[:6]}"
    async with aiolock.connect(redis_cluster.url + f"?client_name={tag}") as locks:
        await _contend(locks)
        node = locks.backend.signals.node
        port = node.rpartition(":")[2]
        assert await _named_connections([int(port)], tag) >= 1  # the pub/sub connection


async def test_sentinel_options_reach_the_master(redis_sentinel: Any) -> None:
    tag = f"app-{uuid.uuid4().hex[:6]}"
    async with aiolock.connect(redis_sentinel.url + f"?client_name={tag}") as locks:
        await _contend(locks)
        port = redis_sentinel.master_port()
        assert await _named_connections([port], tag) >= 2  # scripts and pub/sub
    with pytest.raises(ValueError, match="conect_timeout"):
        aiolock.connect(redis_sentinel.url, sentinel_kwargs={"conect_timeout": 1})
