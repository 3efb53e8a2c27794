"""ZooKeeper: who may touch a lock (issue 9, items 13 and 14), on a real server.

With ``zookeeper://user:password@host:port/chroot`` every node aiolock creates (the
chroot if it makes it, the per-name containers, the lock nodes) carries the ACL
``digest:user:<sha1> cdrwa`` + ``world:anyone r``, and the session authenticates with
that digest on every connection. Other clients can read (``status()``) but can neither
delete a holder's node nor take the lock; refusals are :class:`aiolock.AccessDenied`
and never show the password. Least privileges: ``c`` on a chroot that exists.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import pytest

import aiolock

from .servers import free_port
from .zk_server import ZooKeeperServer, zookeeper_classpath

pytest.importorskip("aiozk")

from aiozk import exc as zkexc
from aiozk import protocol as zkproto
from aiozk.protocol.acl import ACL

from aiolock.backends.zookeeper import ZooKeeperBackend

if zookeeper_classpath() is None:
    pytest.skip("ZooKeeper is not installed (apt-get install zookeeper)", allow_module_level=True)

PASSWORD = "s3cr:t/p@ss%w0rd"  # percent-encoded in URLs; ':' '/' '@' '%' must survive
ALL = 31  # cdrwa
READ = ACL.READ_PERM
CREATE = ACL.CREATE_PERM


def _digest(user: str, password: str) -> str:
    return f"{user}:" + base64.b64encode(hashlib.sha1(f"{user}:{password}".encode()).digest()).decode()


def _url(zk: ZooKeeperServer, chroot: str, user: str | None = None, password: str = PASSWORD) -> str:
    auth = "" if user is None else f"{quote(user, safe='')}:{quote(password, safe='')}@"
    return f"zookeeper://{auth}{zk.hosts}{chroot}"


@pytest.fixture
def chroot() -> str:
    return f"/acl-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def admin(zk_server: ZooKeeperServer) -> AsyncIterator[ZooKeeperBackend]:
    """An unauthenticated backend for raw requests (creating nodes with given ACLs)."""
    backend = ZooKeeperBackend(zk_server.hosts, "/")
    await backend.connect()
    yield backend
    await backend.aclose()


def _acl(node_acl: Any) -> set[tuple[str, str, int]]:
    return {(a.id.scheme, a.id.id, a.perms) for a in node_acl}


async def _get_acl(backend: ZooKeeperBackend, path: str) -> set[tuple[str, str, int]]:
    resp = await backend._send(zkproto.GetACLRequest(path=path))
    return _acl(resp.acl)


def _make_acl(*entries: tuple[str, str, int]) -> list[Any]:
    acl = []
    for scheme, ident, perms in entries:
        entry = ACL.make(scheme, ident)
        entry.perms = perms
        acl.append(entry)
    return acl


async def _create(backend: ZooKeeperBackend, path: str, acl: list[Any]) -> None:
    await backend._send(zkproto.CreateRequest(path=path, data=b"", acl=acl, flags=0))


# -- URL and options (no server) ---------------------------------------------------------


def test_credentials_from_the_url_and_keywords() -> None:
    b = ZooKeeperBackend.from_url(f"zookeeper://alice:{quote(PASSWORD, safe='')}@h1:2181,h2/app")
    assert b.url == "zookeeper://alice@h1:2181,h2:2181/app"  # the password is never shown
    assert b.acl == [("digest", _digest("alice", PASSWORD), ALL), ("world", "anyone", READ)]
    k = ZooKeeperBackend.from_url("zk://h1/app", username="alice", password=PASSWORD)
    assert k.acl == b.acl and k.url == "zookeeper://alice@h1:2181/app"
    assert ZooKeeperBackend.from_url("zk://h1/app").acl == [("world", "anyone", ALL)]
    opened = ZooKeeperBackend.from_url("zk://alice:pw@h1/app?acl=open")
    assert opened.acl == [("world", "anyone", ALL)]
    assert ZooKeeperBackend.from_url("zk://alice:pw@h1/app", acl="open").acl == opened.acl
    assert opened.url == "zookeeper://alice@h1:2181/app"
    bad: list[tuple[str, dict[str, Any]]] = [
        ("zk://alice@h1/app", {}),  # a user without a password
        ("zk://:Xyzzy42@h1/app", {}),  # a password without a user
        ("zk://h1/app", {"acl": "creator"}),  # creator ACL needs credentials
        ("zk://alice:Xyzzy42@h1/app", {"acl": "everyone"}),
        ("zk://alice:Xyzzy42@h1/app?acl=nope", {}),
        ("zk://alice:Xyzzy42@h1/app?other=1", {}),
        ("zk://alice:Xyzzy42@h1/a//b", {}),
        ("zk://alice:Xyzzy42@h1/app", {"username": "bob", "password": "Xyzzy42"}),  # twice
        ("zk://h1/app", {"username": "a:b", "password": "Xyzzy42"}),  # ':' ends a digest user
    ]
    for url, options in bad:
        with pytest.raises(ValueError) as info:
            ZooKeeperBackend.from_url(url, **options)
        assert "Xyzzy42" not in str(info.value), info.value  # no password in any message
    with pytest.raises(ValueError, match="acl"):
        ZooKeeperBackend.from_url("zk://alice:pw@h1/app", acl="everyone")
    with pytest.raises(ValueError):
        ZooKeeperBackend(client=object(), username="alice", password="pw")


# -- ACLs on the nodes -------------------------------------------------------------------


async def _held(locks: aiolock.Locks, **options: Any) -> tuple[ZooKeeperBackend, aiolock.Lease, str, str]:
    """Lock ``n`` acquired: the backend, the lease, the lock's parent path and the name of
    its one node there."""
    backend = locks.backend
    assert isinstance(backend, ZooKeeperBackend)
    lease = await locks.lock("n", **options).acquire()
    parent = backend._parent("n")
    (node,) = await backend._children(parent)
    return backend, lease, parent, node


async def test_every_node_is_acld_to_the_identity(
    zk_server: ZooKeeperServer, chroot: str, admin: ZooKeeperBackend
) -> None:
    async with aiolock.connect(_url(zk_server, chroot, "alice")) as locks:
        backend, lease, parent, node = await _held(locks)
        want = {("digest", _digest("alice", PASSWORD), ALL), ("world", "anyone", READ)}
        for path in (chroot, parent, f"{parent}/{node}"):
            # (read as alice: the server shows others a digest as 'alice:x')
            assert await _get_acl(backend, path) == want, path
        await lease.release()


async def test_without_credentials_nodes_stay_open(
    zk_server: ZooKeeperServer, chroot: str, admin: ZooKeeperBackend
) -> None:
    async with aiolock.connect(_url(zk_server, chroot)) as locks:
        backend = locks.backend
        assert isinstance(backend, ZooKeeperBackend)
        async with locks.lock("n"):
            parent = backend._parent("n")
            (node,) = await admin._children(parent)
            for path in (chroot, parent, f"{parent}/{node}"):
                assert await _get_acl(admin, path) == {("world", "anyone", ALL)}


async def test_others_can_neither_delete_nor_take_the_lock(
    zk_server: ZooKeeperServer, chroot: str, admin: ZooKeeperBackend,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    payload = logging.getLogger("aiozk.connection.payload")
    old_level = payload.level
    payload.setLevel(logging.DEBUG)  # even aiozk's packet log must not show the password
    try:
        async with aiolock.connect(_url(zk_server, chroot, "alice")) as alice:
            lease = await alice.lock("n", ttl=10).acquire()
            rw = await alice.rwlock("rw", ttl=10).write().acquire()
            permit = await alice.semaphore("sem", limit=1, ttl=10).acquire()
            backend = alice.backend
            assert isinstance(backend, ZooKeeperBackend)
            parent = backend._parent("n")
            (node,) = await backend._children(parent)
            others = {
                "no credentials": _url(zk_server, chroot),
                "other user": _url(zk_server, chroot, "bob", "bobs-password"),
                "wrong password": _url(zk_server, chroot, "alice", "not-" + PASSWORD),
            }
            for who, url in others.items():
                async with aiolock.connect(url) as other:
                    ob = other.backend
                    assert isinstance(ob, ZooKeeperBackend)
                    info = await other.status("n")  # reading works for anyone
                    assert info.held and info.token == lease.token, who
                    for make in (lambda: other.lock("n"), lambda: other.lock("n", fair=True),
                                 lambda: other.rwlock("rw").read(),
                                 lambda: other.semaphore("sem", limit=1),
                                 lambda: other.lock("a-new-name")):
                        started = time.monotonic()
                        for timeout in (0, 0.3):
                            with pytest.raises(aiolock.AccessDenied) as denied:
                                await make().acquire(timeout=timeout)
                            message = str(denied.value)
                            assert "denied" in message and PASSWORD not in message, message
                            assert isinstance(denied.value, PermissionError)
                        assert time.monotonic() - started < 3.0
                    with pytest.raises(zkexc.NoAuth):  # the server itself refuses the delete
                        await ob._send(zkproto.DeleteRequest(path=f"{parent}/{node}", version=-1))
                    with pytest.raises(zkexc.NoAuth):  # ... and a renewal-like write
                        await ob._send(zkproto.SetDataRequest(
                            path=f"{parent}/{node}", data=b"1:1", version=-1))
            assert (await alice.status("n")).token == lease.token and not lease.lost
            for held in (lease, rw, permit):
                await held.release()
            assert not await alice.lock("n").locked()
    finally:
        payload.setLevel(old_level)
    assert PASSWORD not in caplog.text and quote(PASSWORD, safe="") not in caplog.text


async def test_holder_works_end_to_end_through_a_reconnect(
    zk_server: ZooKeeperServer, chroot: str
) -> None:
    """The digest is sent again on every new connection of the session: after a dropped
    connection, renewals (setData), a release (delete) and new nodes (create) still pass
    the ACLs, and a waiter is handed the lock."""
    url = _url(zk_server, chroot, "alice")
    async with aiolock.connect(url, session_timeout=10) as a, \
            aiolock.connect(url, session_timeout=10) as b:
        ab = a.backend
        assert isinstance(ab, ZooKeeperBackend)
        lease = await a.lock("n", ttl=1.5).acquire()
        waiter = asyncio.create_task(b.lock("n", ttl=1.5).acquire(timeout=10))
        sid = ab.client.session.session_id
        for _ in range(2):
            ab.client.session.conn.writer.transport.abort()
            await asyncio.sleep(1.6)  # renewals (every 0.5 s) go over the new connection
            assert ab.client.session.session_id == sid
            assert not lease.lost
        await lease.release()
        again = await asyncio.wait_for(waiter, 5)
        assert again.token > lease.token
        await again.release()
        async with a.lock("n2", ttl=1.5) as other:  # a new container and node, after it all
            assert other.token > again.token
    # a new session (the old one expired) authenticates too
    async with aiolock.connect(url, session_timeout=2) as c:
        cb = c.backend
        assert isinstance(cb, ZooKeeperBackend)
        session = cb.client.session
        sid, hosts = session.session_id, list(session.hosts)
        session.hosts = [("127.0.0.1", free_port())]  # nowhere to go back to, for a while
        session.conn.writer.transport.abort()
        await asyncio.sleep(3.0)  # past the session timeout: the server expires it
        session.hosts = hosts
        for _ in range(100):
            if cb._sid not in (None, sid) and cb._healthy():
                break
            await asyncio.sleep(0.1)
        assert cb._sid not in (None, sid)
        async with c.lock("n", ttl=1.5) as fresh:
            await asyncio.sleep(0.7)  # a renewal (setData) in the new session
            assert fresh.token > other.token and not fresh.lost


# -- denied requests are AccessDenied everywhere ------------------------------------------


async def test_release_renew_and_status_denied(
    zk_server: ZooKeeperServer, chroot: str, admin: ZooKeeperBackend
) -> None:
    async with aiolock.connect(_url(zk_server, chroot, "alice")) as alice:
        backend, lease, parent, node = await _held(alice, ttl=10, watchdog=False)
        read_only = _make_acl(("world", "anyone", READ))
        # an operator takes alice's rights away (she may: she has 'a' on them)
        await backend._send(zkproto.SetACLRequest(path=f"{parent}/{node}", acl=read_only, version=-1))
        with pytest.raises(aiolock.AccessDenied, match="denied"):
            await lease.extend(5)  # setData on the node
        await backend._send(zkproto.SetACLRequest(path=parent, acl=read_only, version=-1))
        with pytest.raises(aiolock.AccessDenied, match="denied"):
            await lease.release()  # delete in the container
        # a container nobody may read: status() is denied too
        await _create(backend, f"{chroot}/secret", _make_acl(("digest", _digest("carol", "x"), ALL)))
        backend2 = ZooKeeperBackend(zk_server.hosts, chroot)
        try:
            with pytest.raises(aiolock.AccessDenied, match="denied"):
                await backend2.inspect("secret")
        finally:
            await backend2.aclose()


# -- least privileges (item 14) ------------------------------------------------------------


async def test_least_privileges_create_on_the_chroot(
    zk_server: ZooKeeperServer, chroot: str, admin: ZooKeeperBackend
) -> None:
    """A chroot made by an operator with exactly ``digest:alice:c`` (not even read) is all
    aiolock needs: every primitive works, handoffs included, and anyone can read."""
    await _create(admin, chroot, _make_acl(("digest", _digest("alice", PASSWORD), CREATE)))
    url = _url(zk_server, chroot, "alice")
    async with aiolock.connect(url) as a, aiolock.connect(url) as b, \
            aiolock.connect(_url(zk_server, chroot)) as reader:
        for make in (lambda c: c.lock("m", ttl=2), lambda c: c.lock("f", ttl=2, fair=True),
                     lambda c: c.rwlock("rw", ttl=2).write(),
                     lambda c: c.rwlock("rw", ttl=2).read(),
                     lambda c: c.semaphore("s", limit=1, ttl=2)):
            lease = await make(a).acquire()
            waiter = asyncio.create_task(make(b).acquire(timeout=5))
            await asyncio.sleep(0.2)
            lock = make(reader)
            assert (await reader.status(lock.name, lock.kind)).held
            await lease.release()
            await (await waiter).release()
        with pytest.raises(aiolock.AccessDenied):  # and the reader may not take anything
            await reader.lock("m").acquire(timeout=0)


async def test_without_create_on_the_chroot_access_is_denied_not_a_hang(
    zk_server: ZooKeeperServer, chroot: str, admin: ZooKeeperBackend
) -> None:
    await _create(admin, chroot, _make_acl(("digest", _digest("alice", PASSWORD), ALL & ~CREATE),
                                           ("world", "anyone", READ)))
    async with aiolock.connect(_url(zk_server, chroot, "alice")) as alice:
        started = time.monotonic()
        for timeout in (0, 2, None):
            with pytest.raises(aiolock.AccessDenied, match="denied"):
                await asyncio.wait_for(alice.lock("n").acquire(timeout=timeout), 5)
        assert time.monotonic() - started < 3.0
        assert not (await alice.status("n")).held
    # a chroot that does not exist, under a node where alice may not create: at connect
    await _create(admin, chroot + "-ro", _make_acl(("world", "anyone", READ)))
    started = time.monotonic()
    with pytest.raises(aiolock.AccessDenied, match="denied"):
        async with aiolock.connect(_url(zk_server, chroot + "-ro/locks", "alice")):
            pass
    assert time.monotonic() - started < 3.0


async def test_cli_with_a_wrong_password_exits_denied_in_one_line(
    zk_server: ZooKeeperServer, chroot: str
) -> None:
    """``aiolock run`` with a wrong password on a lock held by its owner: one line on
    stderr, exit 77 (EX_NOPERM), the password nowhere; ``status`` works for anyone."""
    async with aiolock.connect(_url(zk_server, chroot, "alice")) as alice, alice.lock("job"):
        wrong = _url(zk_server, chroot, "alice", "Wr0ng-" + PASSWORD)
        run = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "aiolock", "run", "--url", wrong,
                             "--timeout", "0", "job", "--", "true"],
            capture_output=True, text=True, timeout=30,
        )
        assert run.returncode == 77, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert "denied" in run.stderr and "Wr0ng" not in run.stderr + run.stdout
        status = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "aiolock", "status", "--url", wrong, "job"],
            capture_output=True, text=True, timeout=30,
        )
        assert status.returncode == 0, status.stderr
        assert "Wr0ng" not in status.stderr + status.stdout
