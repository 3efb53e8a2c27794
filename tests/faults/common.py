"""Shared pieces of the fault harness: the checker's wire protocol, the per-backend nonce
echo (a round trip through the backend's own connection, to catch a reply read by the
wrong caller), ZooKeeper session expiry, and small helpers.

Every time stamp is ``time.monotonic()``: CLOCK_MONOTONIC on Linux, one clock for every
process of the host, so times taken in the workers, the checker and the orchestrator
compare exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiolock

__all__ = ["ECHOES", "CheckerClient", "echo", "expire_zk_session", "mono", "pause", "percentile"]

mono = time.monotonic


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` (nearest rank), None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


class CheckerClient:
    """One connection to the checker process (a Unix socket, JSON lines).

    Reports (``report``) get no reply. Fenced accesses (``read``/``write``) get one reply,
    matched by request id, so a caller cancelled while it waited (``on_lost="cancel"``)
    never makes the next caller read its reply.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._ids = 0
        self._lock = asyncio.Lock()
        self._replies: dict[int, Any] = {}

    async def open(self) -> CheckerClient:
        self._reader, self._writer = await asyncio.open_unix_connection(self.path, limit=1 << 24)
        return self

    def report(self, *fields: Any) -> None:
        """Send one record (no reply)."""
        assert self._writer is not None
        self._writer.write(json.dumps(list(fields)).encode() + b"\n")

    def send_now(self, *fields: Any) -> int:
        """Send a request without waiting for anything; returns its id."""
        assert self._writer is not None
        self._ids += 1
        self._writer.write(json.dumps([fields[0], self._ids, *fields[1:]]).encode() + b"\n")
        return self._ids

    async def reply(self, rid: int) -> Any:
        """The reply to request ``rid`` (others read meanwhile are kept for their callers;
        a caller that gave up leaves one small entry behind)."""
        assert self._reader is not None
        async with self._lock:
            while rid not in self._replies:
                line = await self._reader.readline()
                if not line:
                    raise ConnectionError("the checker went away")
                got = json.loads(line)
                self._replies[got[0]] = got[1]
            return self._replies.pop(rid)

    async def call(self, *fields: Any) -> Any:
        return await self.reply(self.send_now(*fields))

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()


# -- nonce echo: one round trip through the backend's own connection -----------------------


def _same(got: Any, nonce: str) -> bool:
    return bool(got == nonce.encode() or got == nonce)


async def _echo_redis(backend: Any, nonce: str) -> bool:
    return _same(await backend._call("ECHO", nonce), nonce)


async def _echo_cluster(backend: Any, nonce: str) -> bool:
    # ECHO has no key to route by: a script with a key, on the master of its slot
    slot_key = f"aiolock-faults:echo:{nonce}"
    return _same(await backend._call("EVAL", "return ARGV[1]", 1, slot_key, nonce), nonce)


async def _echo_redlock(backend: Any, nonce: str) -> bool:
    # every node's connection: a wrong reply on any is a desync; nodes cut off by a
    # fault are left out (an error only if no node answered)
    answered, last = 0, None
    for node in backend.nodes:
        try:
            async with asyncio.timeout(2):
                got = await node._call("ECHO", nonce)
        except Exception as exc:
            last = exc
            continue
        answered += 1
        if not _same(got, nonce):
            return False
    if not answered:
        raise last or ConnectionError("no node answered")
    return True


async def _echo_memcached(backend: Any, nonce: str) -> bool:
    key = f"aiolock-faults:echo:{nonce}".encode()
    value = nonce.encode()
    stored, read = await backend._client.request(
        b"ms " + key + b" %d T30 O" % len(value) + value + b"\r\n" + value + b"\r\n",
        b"mg " + key + b" v O" + value + b"\r\n",
    )
    return bool(stored.code == b"HD" and stored.flags.get("O") == nonce
                and read.value == value and read.flags.get("O") == nonce)


async def _pooled(backend: Any, query: Callable[[Any], Awaitable[Any]]) -> Any:
    """``query(conn)`` on a connection of the SQL backend's pool (dropped on error)."""
    conn = await backend._pool.get()
    try:
        async with asyncio.timeout(5):
            got = await query(conn)
    except BaseException:
        backend._pool.discard(conn)
        raise
    backend._pool.put(conn)
    return got


async def _echo_mysql(backend: Any, nonce: str) -> bool:
    async def query(conn: Any) -> Any:
        async with conn.cursor() as cur:
            await cur.execute("SELECT %s", (nonce,))
            return (await cur.fetchone())[0]

    return bool(await _pooled(backend, query) == nonce)


async def _echo_postgres(backend: Any, nonce: str) -> bool:
    return bool(await _pooled(backend, lambda conn: conn.fetchval("SELECT $1::text", nonce)) == nonce)


async def _echo_zookeeper(backend: Any, nonce: str) -> bool:
    from aiozk import protocol as zkproto

    path = f"{backend._chroot.rstrip('/')}/echo-{nonce}"
    async with backend._bounded("echo"):
        req = zkproto.CreateRequest(path=path, data=nonce.encode(), acl=[zkproto.UNRESTRICTED_ACCESS])
        req.set_flags(ephemeral=True)
        created = await backend._send(req)
        got = await backend._send(zkproto.GetDataRequest(path=path, watch=False))
        await backend._send(zkproto.DeleteRequest(path=path, version=-1))
    return bool(str(created.path) == path and got.data == nonce.encode())


async def _echo_etcd(backend: Any, nonce: str) -> bool:
    from aiolock.backends.etcd._wire import pb

    key = f"{backend._prefix}/echo/{nonce}".encode()
    txn = pb.TxnRequest(success=[pb.RequestOp(request_put=pb.PutRequest(key=key, value=nonce.encode())),
                                 pb.RequestOp(request_range=pb.RangeRequest(key=key))])
    async with backend._bounded("echo"):
        reply = await backend._unary("KV", "Txn", txn, "echo")
        await backend._unary("KV", "DeleteRange", pb.DeleteRangeRequest(key=key), "echo")
    kvs = reply.responses[1].response_range.kvs
    return bool(len(kvs) == 1 and kvs[0].value == nonce.encode())


#: BackendSpec.echo -> how to send a nonce through that backend's own connection
ECHOES: dict[str, Callable[[Any, str], Awaitable[bool]]] = {
    "redis": _echo_redis, "redis-cluster": _echo_cluster, "redlock": _echo_redlock,
    "memcached": _echo_memcached, "mysql": _echo_mysql, "postgres": _echo_postgres,
    "zookeeper": _echo_zookeeper, "etcd": _echo_etcd,
}


async def echo(locks: aiolock.Locks, kind: str) -> bool:
    """Send a fresh nonce through ``locks``' backend connection and check the reply is
    ours. False means a desync (a reply meant for another caller); errors propagate."""
    if kind not in ECHOES:
        raise ValueError(f"no echo for backend {kind!r}")
    return await ECHOES[kind](locks.backend, secrets.token_hex(8))


async def pause(rng: random.Random, rtt: float, min_steps: int = 0) -> None:
    """A random delay in [0, 2 x RTT]; below a millisecond as event-loop steps (at least
    ``min_steps``: a task cancelled before it ever ran did not call anything)."""
    delay = rng.uniform(0, 2 * rtt)
    if delay < 0.001:
        for _ in range(max(min_steps, round(delay / max(rtt, 1e-6) * 4))):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(delay)


# -- ZooKeeper: expire a session from the server side --------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def expire_zk_session(locks: aiolock.Locks, server: tuple[str, int] | None = None) -> bool:
    """Expire the session of ``locks``' ZooKeeper backend from the server side: join it on
    a raw connection (same id and password) and close it there; repeat until a join is
    refused (the server answers session id 0). Meanwhile the client's host list points at
    a closed port so that it does not take the session back first (as in
    tests/test_zookeeper.py). ``server`` is where to join (default: the client's first
    host). True once the session is gone."""
    import aiozk
    from aiozk import protocol
    from aiozk.connection import Connection

    backend: Any = locks.backend
    session = backend.client.session
    real_hosts = list(session.hosts)
    sid, password, timeout_ms = session.session_id, session.password, int(session.timeout * 1000)
    host, port = server or real_hosts[0]
    session.hosts = [("127.0.0.1", _free_port())]
    try:
        for _ in range(20):
            conn = Connection(host, port, watch_handler=lambda _event: None, read_timeout=3)
            try:
                await asyncio.wait_for(conn.connect(), 5)
                reply = await asyncio.wait_for(conn.send_connect(protocol.ConnectRequest(
                    protocol_version=0, last_seen_zxid=0, timeout=timeout_ms,
                    session_id=sid, password=password, read_only=False)), 5)
                if reply is not None and reply[1].session_id == 0:
                    return True
                if reply is not None:
                    payload = protocol.CloseRequest().serialize(protocol.CLOSE_XID)
                    conn.writer.write(struct.pack("!i", len(payload)) + payload)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.reader.read(), 2)
            except (TimeoutError, OSError, aiozk.exc.ZKError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    conn.writer.close()
            await asyncio.sleep(0.1)
        return False
    finally:
        session.hosts = real_hosts
