"""The ZooKeeper backend's bottom layer: the ``aiozk`` session (start, follow, tear
down), single requests, and the one map from ``aiozk``'s errors to aiolock's
(:meth:`_Io._bounded`). The layers above (:mod:`._watches`, :mod:`._acquire`,
:mod:`._backend`) never touch ``aiozk``'s errors themselves."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any
from urllib.parse import quote

import aiozk
from aiozk import exc as zkexc
from aiozk import protocol as zkproto
from aiozk.states import States

from ...abc import Backend, Claim, Waiter
from ...errors import AccessDenied, BackendUnavailable, LockError
from .._own_task import cancelled_by_close, in_own_task
from ._claim import state_of
from ._options import check_chroot, check_hosts, credentials, node_acl
from ._recipe import encode_data, zk_name
from ._session import Connection, SessionRepair, retrieved
from ._wire import Children, Create2, Delete, GetData, SetData

log = logging.getLogger("aiolock.backends.zookeeper")

#: aiozk's errors that mean "no server answers now" (worth retrying): BackendUnavailable.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError, zkexc.ConnectError, zkexc.SessionLost, zkexc.FailedRetry, zkexc.UnfinishedRead,
    zkexc.TimeoutError, zkexc.ConnectionLoss, zkexc.SessionExpired, zkexc.OperationTimeout,
    zkexc.SessionMoved,
)
#: refused for want of permission: AccessDenied.
_DENIED: tuple[type[BaseException], ...] = (zkexc.NoAuth, zkexc.AuthFailed)


class _Io(Backend):
    """Session and requests; see the module doc."""

    def __init__(
        self, hosts: str | None = None, chroot: str = "/aiolock", *, client: Any = None,
        session_timeout: float = 20.0, connect_timeout: float = 5.0,
        request_timeout: float = 5.0, username: str | None = None, password: str | None = None,
        acl: str | None = None,
    ) -> None:
        for what, value in (("session_timeout", session_timeout),
                            ("connect_timeout", connect_timeout),
                            ("request_timeout", request_timeout)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{what} must be a number of seconds > 0, got {value!r}")
        self._chroot = check_chroot(chroot)
        self._digest = credentials(username, password)
        self._acl = node_acl(acl, self._digest)
        self._repair: SessionRepair | None = None
        if client is None:
            if not hosts:
                raise ValueError("give ZooKeeper hosts ('host:port,host:port') or an aiozk client")
            check_hosts(hosts)
            client = aiozk.ZKClient(hosts, session_timeout=session_timeout)
            self._repair = SessionRepair(client.session, self._digest)
            self._repair.install()
            self._owns_client = True
        else:
            if self._digest is not None:
                raise ValueError("credentials are for the client aiolock makes from hosts or a URL; "
                                 "a client passed in is used as it is")
            self._owns_client = False
            hosts = ",".join(f"{h}:{p}" for h, p in client.session.hosts)
        self._client = client
        self._hosts = hosts
        self._connect_timeout = float(connect_timeout)
        self._request_timeout = float(request_timeout)
        self._started = False
        self._start_lock = asyncio.Lock()
        self._closed = False
        self._starting: asyncio.Future[None] | None = None  # the session's start, in flight
        self._sid: int | None = None  # the session our nodes belong to
        self._monitor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiters: dict[str, Waiter] = {}  # claim owner -> the waiter listening for it
        self._warned: set[int] = set()
        #: bumped at every suspension and reconnect: a Busy answer from before is stale
        self._epoch = 0

    @property
    def url(self) -> str:
        """``zookeeper://[user@]hosts/chroot``: never the password."""
        user = f"{quote(self._digest.user, safe='')}@" if self._digest is not None else ""
        return f"zookeeper://{user}{self._hosts}{self._chroot}"

    @property
    def acl(self) -> list[tuple[str, str, int]]:
        """The ACL every node aiolock creates gets, as ``(scheme, id, perms)`` triples
        (perms: ZooKeeper's bits, ``cdrwa`` = 31)."""
        return [(a.id.scheme, a.id.id, a.perms) for a in self._acl]

    @property
    def client(self) -> Any:
        """The ``aiozk.ZKClient`` in use."""
        return self._client

    @property
    def session_timeout(self) -> float:
        """The session timeout the server granted (seconds)."""
        return float(self._client.session.timeout)

    # -- session ------------------------------------------------------------------------

    async def connect(self) -> None:
        await self._ready()

    def _open(self) -> None:
        """Raise LockError once :meth:`aclose` ran."""
        if self._closed:
            raise LockError(f"this connection to {self.url} is closed")

    async def _ready(self) -> None:
        self._open()
        if self._started:
            return
        async with self._start_lock:
            self._open()  # closed while another call was connecting
            if self._started:
                return
            # in a task of its own, which aclose() cancels: a close while connecting
            # ends every caller at once (aiozk would wait for the connect timeout)
            starting = asyncio.ensure_future(self._start())
            self._starting = starting
            try:
                await in_own_task(starting, lambda task: task.cancel())
            except asyncio.CancelledError:
                if cancelled_by_close(starting, self._closed):
                    raise LockError(f"this connection to {self.url} was closed while connecting") from None
                raise
            finally:
                self._starting = None

    async def _start(self) -> None:
        """Start the session and make the chroot (under ``_start_lock``)."""
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self._client.session.start()
                await self._ensure_path(self._chroot, container=False)
                if self._repair is not None and self._repair.auth_error is not None:
                    raise self._repair.auth_error
        except (zkexc.NoAuth, zkexc.AuthFailed) as exc:
            if self._owns_client:
                await self._teardown()
            raise self._denied(f"creating the chroot {self._chroot}", exc) from exc
        except (TimeoutError, OSError, zkexc.ZKError) as exc:
            if self._owns_client:
                await self._teardown()
            raise BackendUnavailable(
                f"cannot reach ZooKeeper at {self.url} within {self._connect_timeout} s "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        self._sid = self._client.session.session_id
        self._started = True
        self._monitor = asyncio.get_running_loop().create_task(self._watch_session())
        if self.session_timeout < 1.0:
            log.warning("ZooKeeper session timeout is only %.1f s", self.session_timeout)

    async def _teardown(self) -> None:
        """Stop a client that never connected (``aiozk.close`` would wait for a server)."""
        session = self._client.session
        session.closing = True
        for task in (session.repair_loop_task, session.heartbeat_task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if session.heartbeat_handle is not None:
            session.heartbeat_handle.cancel()
            session.heartbeat_handle = None
        conn = session.conn
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.abort()
            with contextlib.suppress(Exception):
                conn.writer.close()  # its read loop ends (the socket is not left open)
            reader = getattr(conn, "read_loop_task", None)
            if reader is not None and not reader.done():
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
        session.started = False
        session.closing = False

    async def _watch_session(self) -> None:
        """Follow the session: note suspension, detect expiry, re-check after reconnect."""
        session = self._client.session
        state = session.state
        while not self._closed:
            if state == States.CONNECTED:
                await self._watch_connection()
            await state.wait_for(States.SUSPENDED, States.LOST)
            self._epoch += 1
            if self._closed:
                return
            log.warning("ZooKeeper connection to %s %s: held leases are at risk",
                        self._hosts, state.current_state)
            await state.wait_for(States.CONNECTED)
            self._epoch += 1
            sid = session.session_id
            expired = sid != self._sid
            if expired:
                log.warning("ZooKeeper session expired (%s -> %s): its leases are lost",
                            _hex(self._sid), _hex(sid))
                self._sid = sid
            self._after_reconnect(expired)

    async def _watch_connection(self) -> None:
        """Return once the connection is no longer usable.

        ``aiozk`` ends its read loop quietly when the server closes the connection (a
        server killed or restarted) and only notices at its next failed heartbeat, up to
        a session timeout later, while requests hang. Notice it at once instead: fail the
        pending requests (``aiozk`` retries them after reconnecting) and suspend.
        """
        session = self._client.session
        state = session.state
        conn = session.conn
        reader = getattr(conn, "read_loop_task", None)
        suspended = state.wait_for(States.SUSPENDED, States.LOST)
        try:
            if reader is None:
                await suspended
                return
            await asyncio.wait({reader, suspended}, return_when=asyncio.FIRST_COMPLETED)
            moved_on = suspended.done()
        finally:
            if not suspended.done():
                suspended.cancel()
        if (reader.done() and not moved_on and session.conn is conn
                and not session.closing and not self._closed and state == States.CONNECTED):
            log.warning("ZooKeeper server %s:%s closed the connection", conn.host, conn.port)
            conn.abort()
            state.transition_to(States.SUSPENDED)

    def _healthy(self) -> bool:
        return bool(self._client.session.state == States.CONNECTED)


    def _after_reconnect(self, expired: bool) -> None:
        """Called once the connection is back: with the same session, or (``expired``)
        a new one."""

    def _bounded(self, what: str) -> _Bounded:
        """``async with self._bounded(what):`` bounds the requests inside by
        ``request_timeout`` and maps ``aiozk``'s errors to aiolock's (:meth:`_mapped`)."""
        return _Bounded(self, what)

    def _mapped(self, what: str, exc: BaseException) -> BaseException | None:
        """aiolock's error for ``exc`` raised by ``what``; None: not ``aiozk``'s."""
        if isinstance(exc, TimeoutError):  # (the bound passed)
            return BackendUnavailable(
                f"ZooKeeper at {self.url} did not answer {what} within {self._request_timeout} s "
                f"(session {self._client.session.state.current_state})"
            )
        if isinstance(exc, _UNAVAILABLE):
            return BackendUnavailable(
                f"ZooKeeper at {self.url} is unavailable ({type(exc).__name__}: {exc})"
            )
        if isinstance(exc, _DENIED):
            return self._denied(what, exc)
        if isinstance(exc, zkexc.ZKError):
            return LockError(f"ZooKeeper at {self.url} refused {what}: {type(exc).__name__} {exc}")
        return None

    def _denied(self, what: str, exc: BaseException) -> AccessDenied:
        """The error for a request the server refused for want of permission."""
        if isinstance(exc, zkexc.AuthFailed):
            return AccessDenied(
                f"ZooKeeper at {self.url} denied {what}: it refused the credentials of user "
                f"{self._digest.user if self._digest else None!r} (AuthFailed)"
            )
        who = (f"user {self._digest.user!r} (with the password given)" if self._digest is not None
               else "an unauthenticated client")
        return AccessDenied(
            f"ZooKeeper at {self.url} denied {what} ({type(exc).__name__}): the ACL of a node "
            f"under {self._chroot} does not let {who} do it. Nodes made with credentials may be "
            f"changed only by that user and password; aiolock needs create ('c') on the chroot. "
            f"Check the URL's credentials and the chroot's ACL"
        )

    def _send_now(self, request: Any) -> asyncio.Future[Any] | None:
        """Write ``request`` now, if the session is connected (and the client is ours):
        the future of its raw reply, for :meth:`_send`; None: send it with :meth:`_send`.

        ``aiozk``'s ``send`` runs three coroutines, a retry-policy entry and a heartbeat
        timer per request before it writes; on the clients made here (retry policy
        ``forever``) a connected session's request goes straight to the connection.
        """
        session = self._client.session
        conn = session.conn
        if (self._repair is None or session.state.current_state is not States.CONNECTED
                or conn is None or conn.closing):
            return None
        xid = session.xid + 1
        if xid > 0x7FFFFFFF:  # (as aiozk: positive, 32-bit)
            xid = 1
        session.xid = xid
        reply: asyncio.Future[Any] = conn.send(request, xid=xid)
        return reply

    def _send_both_now(
        self, first: Any, second: Any,
    ) -> tuple[asyncio.Future[Any], tuple[Any, asyncio.Future[Any]]] | None:
        """:meth:`_send_now` of two requests, written at once (one system call): the
        first's reply future, and the second with its (for ``_children``); None if the
        session is not connected (nothing was sent)."""
        conn = self._client.session.conn
        if not isinstance(conn, Connection):
            return None
        conn.held = []
        try:
            one = self._send_now(first)
            # (nothing is written before the flush, so nothing changes in between)
            two = None if one is None else self._send_now(second)
        finally:
            conn.flush()
        if one is None:
            return None
        assert two is not None
        two.add_done_callback(retrieved)  # (dropped unread if the create fails)
        return one, (second, two)

    async def _send(self, request: Any, sent: asyncio.Future[Any] | None = None) -> Any:
        """Send one request (or await ``sent``, its :meth:`_send_now`) and return its
        reply; errors as ``aiozk``'s. ``session.send``, not ``client.send``: the client
        caches the stat of every path forever. A dropped connection falls back to
        ``session.send``, which waits for the reconnect and sends again, as it would
        have."""
        session = self._client.session
        if sent is None:
            sent = self._send_now(request)
            if sent is None:
                self._open()
                return await session.send(request)
        try:
            zxid, response = await sent
        except zkexc.ConnectError:
            self._open()  # aclose() dropped it: no reconnect is coming
            return await session.send(request)
        session.last_zxid = zxid
        session.set_heartbeat()
        return response

    # -- paths --------------------------------------------------------------------------

    def _parent(self, name: str) -> str:
        escaped = zk_name(name)
        if self._chroot == "/" and escaped == "zookeeper":
            escaped = "%7Aookeeper"  # /zookeeper is the server's own
        return f"{self._chroot.rstrip('/')}/{escaped}"

    async def _ensure_path(self, path: str, *, container: bool) -> None:
        """Create ``path`` with our ACL, and its missing ancestors (plain nodes); ``path``
        itself a container if ``container``. Bottom-up, so one request when the parent
        exists. A node that exists is fine also where we may not create: the server
        checks the create permission on the parent before it looks for the node, so a
        NoAuth is followed by an ``exists``."""
        if path == "/":
            return
        req = zkproto.CreateRequest(path=path, data=b"", acl=self._acl)
        req.set_flags(container=container)
        try:
            await self._send(req)
        except zkexc.NodeExists:
            pass
        except zkexc.NoNode:
            await self._ensure_path(path.rpartition("/")[0] or "/", container=False)
            with contextlib.suppress(zkexc.NodeExists):
                await self._send(req)
        except zkexc.NoAuth:
            if not await self._exists(path):
                raise

    async def _exists(self, path: str) -> bool:
        try:
            await self._send(zkproto.ExistsRequest(path=path, watch=False))
        except zkexc.NoNode:
            return False
        return True

    def _create_request(self, parent: str, prefix: str, data: bytes) -> Any:
        """The create of a claim's node (ephemeral, sequential) under ``parent``."""
        req = Create2(path=f"{parent}/{prefix}", data=data, acl=self._acl)
        req.set_flags(ephemeral=True, sequential=True)
        return req

    async def _create(self, req: Any, sent: asyncio.Future[Any] | None = None) -> tuple[str, int]:
        """The path and czxid of the node ``req`` (a ``_create_request``) makes, making
        its parent first if need be; ``sent``: its ``_send_now``."""
        parent = req.path.rpartition("/")[0]
        for _ in range(5):
            try:
                resp = await self._send(req, sent)
            except zkexc.NoNode:  # the parent is missing (or its container was just reaped)
                sent = None
                await self._ensure_path(parent, container=True)
                continue
            return str(resp.path), int(resp.stat.created_zxid)
        raise LockError(f"could not create a node under {parent!r}")

    def _list_now(self, parent: str) -> tuple[Any, asyncio.Future[Any]] | None:
        """Send a listing of ``parent`` now (see :meth:`_send_now`): for ``_children``."""
        request = Children(path=parent, watch=False)
        sent = self._send_now(request)
        if sent is None:
            return None
        sent.add_done_callback(retrieved)  # (dropped unread if the claim moves on)
        return request, sent

    async def _children(
        self, parent: str, sent: tuple[Any, asyncio.Future[Any]] | None = None,
    ) -> list[str]:
        """The children of ``parent`` ([] if it is gone); ``sent``: from ``_list_now``."""
        try:
            if sent is None:
                resp = await self._send(Children(path=parent, watch=False))
            else:
                resp = await self._send(*sent)
        except zkexc.NoNode:
            return []
        return list(resp.children)

    async def _delete(self, path: str, version: int = -1) -> bool:
        try:
            await self._send(Delete(path=path, version=version))
        except (zkexc.NoNode, zkexc.BadVersion):
            return False
        return True

    async def _get(self, path: str, watch: bool) -> tuple[bytes, Any] | None:
        try:
            resp = await self._send(GetData(path=path, watch=watch))
        except zkexc.NoNode:
            return None
        return resp.data, resp.stat

    async def _watch_node(self, path: str) -> bool:
        """Set a child watch on the lock node ``path`` (fires only when it is deleted);
        False if it is gone already (then no watch was set)."""
        try:
            await self._send(Children(path=path, watch=True))
        except zkexc.NoNode:
            return False
        return True

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _granted_ms(self, claim: Claim) -> int:
        """How long a grant or renewal of ``claim`` is believed: at most its ttl and at
        most the session timeout (the server deletes the node when the session ends)."""
        session_ms = int(self.session_timeout * 1000)
        if claim.ttl_ms / 3 >= session_ms * 0.8 and claim.ttl_ms not in self._warned:
            self._warned.add(claim.ttl_ms)
            log.warning(
                "lease ttl %.1f s is too long for the ZooKeeper session timeout %.1f s: a lease "
                "is believed for at most the session timeout but renewed every ttl/3, so it "
                "will be lost; use ttl < 2.4 x session_timeout (or a longer session_timeout)",
                claim.ttl_ms / 1000, self.session_timeout,
            )
        return max(1, min(claim.ttl_ms, session_ms))

    async def _stamp(self, claim: Claim, path: str) -> Any:
        """Rewrite our node's data (a renewal, or restarting the lease clock contenders
        keep); its stat, or None if the node is gone. Notes when it was sent."""
        sent = time.monotonic()
        try:
            resp = await self._send(SetData(
                path=path, data=encode_data(claim.ttl_ms, claim.limit, claim.info), version=-1))
        except zkexc.NoNode:
            return None
        state_of(claim).stamped = (sent, claim.ttl_ms)
        return resp.stat



def _hex(sid: int | None) -> str:
    return "none" if sid is None else hex(sid)


class _Bounded:
    """:meth:`_Io._bounded`: ``asyncio.timeout(request_timeout)`` and the error map, as
    a plain class (a generator-based context manager costs several calls per use, and
    every acquire attempt uses one)."""

    __slots__ = ("_io", "_timeout", "_what")

    def __init__(self, io: _Io, what: str) -> None:
        self._io = io
        self._what = what
        self._timeout: asyncio.Timeout | None = None

    async def __aenter__(self) -> None:
        io = self._io
        if io._closed or not io._started:
            await io._ready()
        self._timeout = asyncio.timeout(io._request_timeout)
        await self._timeout.__aenter__()

    async def __aexit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                        tb: Any) -> None:
        assert self._timeout is not None
        try:
            await self._timeout.__aexit__(typ, exc, tb)  # (the bound passed: TimeoutError)
        except TimeoutError as expired:
            exc = expired
        if exc is None:
            return
        mapped = self._io._mapped(self._what, exc)
        if mapped is not None:
            raise mapped from exc
