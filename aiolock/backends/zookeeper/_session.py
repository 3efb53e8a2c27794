"""The ``aiozk`` repairs, in one place: a leaner reply reader, a session that survives a
leader election, a delete that counts its sends, and a log filter for refused requests.
They are installed only on the clients this backend makes (a client passed in is used
as it is).

Tested with ``aiozk`` >= 0.32, < 0.33 (:data:`AIOZK_TESTED`): each repair replaces an
``aiozk`` method or reads one of its internals (``Connection.read_response``,
``Session.find_server``/``establish_session``/``set_heartbeat``/``event_dispatch``,
``Session.watch_callbacks``,
``Connection.read_loop_task``, ``opcode_xref``, ``pending_specials``); check them again
before widening the range.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Coroutine
from typing import Any

from aiozk import exc as zkexc
from aiozk import protocol as zkproto
from aiozk.connection import Connection as _ZKConnection
from aiozk.connection import reply_header_struct as _REPLY_HEADER
from aiozk.connection import size_struct as _SIZE
from aiozk.session import HEARTBEAT_FREQUENCY as _HEARTBEAT_FREQUENCY
from aiozk.states import States

from ._options import Digest
from ._wire import FAST_REPLIES, Delete, watch_event

__all__ = [
    "AIOZK_TESTED", "Connection", "CountedDelete", "SessionRepair", "pipelined", "retrieved",
]

#: The ``aiozk`` versions these repairs were written for and tested with: ``[low, high)``.
AIOZK_TESTED = ("0.32", "0.33")

log = logging.getLogger("aiolock.backends.zookeeper")
_CONN_LOG = logging.getLogger("aiozk.connection")  # aiozk's own loggers, for its messages
_PAYLOAD_LOG = logging.getLogger("aiozk.connection.payload")


class _QuietDenials(logging.Filter):
    """Drop aiozk's "Send exception" log record for a request refused for want of
    permission: aiozk logs it at ERROR level with a traceback before raising it, but it
    reaches the caller as :class:`aiolock.AccessDenied` anyway (on the CLI, the traceback
    would come before its one-line message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (zkexc.NoAuth, zkexc.AuthFailed))


logging.getLogger("aiozk.session").addFilter(_QuietDenials())


async def pipelined(requests: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Await ``requests`` sent at once, the first one without a task of its own (it is
    written before the others start); their results in order, like ``gather``."""
    rest = [asyncio.ensure_future(r) for r in requests[1:]]
    try:
        first = await requests[0]
        return [first, *[await t for t in rest]]
    finally:
        for task in rest:
            task.cancel()  # (no-op if done) whatever is left after a failure
            task.add_done_callback(retrieved)


def retrieved(fut: asyncio.Future[Any]) -> None:
    """Done callback of a request nobody awaits: read its outcome, so asyncio does not
    log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()



class Connection(_ZKConnection):  # type: ignore[misc]
    """``aiozk``'s connection with a leaner reader, and writes that can be held back
    (the clients this backend makes).

    ``aiozk`` 0.32 reads every reply in three steps, two of them through
    ``asyncio.wait_for`` -- a task and a timer each, and an event-loop turn each even
    when the bytes are already buffered. Six replies or events per contended acquisition
    made that the largest client cost per acquisition (issue 10). Here a reply is read
    in one piece after its size: at once when it is buffered (it almost always is), else
    under one ``read_timeout``; errors as ``aiozk``'s (a short read is
    ``UnfinishedRead``, a closed connection ``ConnectionAbortedError``).
    """

    #: while a list: what :meth:`send` would write, for :meth:`flush` to write at once
    held: list[bytes] | None = None

    def send(self, request: Any, xid: int | None = None) -> asyncio.Future[Any]:
        """``aiozk``'s ``send``, which can also hold the bytes back (:attr:`held`): a
        create and the listing behind it then go out in one write (one system call
        here, one read on the server)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.closing:
            fut.set_exception(zkexc.ConnectError(self.host, self.port))
            return fut
        if request.special_xid:
            xid = request.special_xid
        _PAYLOAD_LOG.debug("[SEND] (xid: %s) %s", xid, request)
        body = request.serialize(xid)
        self.opcode_xref[xid] = request.opcode
        if xid in zkproto.SPECIAL_XIDS:
            self.pending_specials[xid].append(fut)
        else:
            self.pending[xid] = fut
        if self.held is not None:
            self.held.append(_SIZE.pack(len(body)) + body)
        else:
            self._write(_SIZE.pack(len(body)) + body)
        return fut

    def flush(self) -> None:
        """Write what was held back, and stop holding."""
        held, self.held = self.held, None
        if held:
            self._write(b"".join(held))

    def _write(self, payload: bytes) -> None:
        try:
            self.writer.write(payload)
        except Exception:
            _CONN_LOG.exception("Exception during write")
            self.abort()

    async def read_response(self, initial_connect: bool = False) -> tuple[Any, Any, Any]:
        while True:
            xid, zxid, reply = await self._read_reply(initial_connect)
            if (xid is None or xid == zkproto.WATCH_XID or xid in zkproto.SPECIAL_XIDS
                    or xid in self.pending):
                return xid, zxid, reply
            # the reply to a request that abort() failed already: aiozk's read loop
            # would die on it (a KeyError no one retrieves) and read nothing more
            log.debug("dropped the late reply to ZooKeeper request %s (failed already)", xid)

    async def _read_reply(self, initial_connect: bool) -> tuple[Any, Any, Any]:
        reader = self.reader
        try:
            size = _SIZE.unpack(await reader.readexactly(_SIZE.size))[0]
            if len(getattr(reader, "_buffer", b"")) >= size:
                raw = await reader.readexactly(size)  # buffered: returns without waiting
            else:
                try:
                    async with asyncio.timeout(self.read_timeout):
                        raw = await reader.readexactly(size)
                except TimeoutError:
                    raise zkexc.UnfinishedRead from None
        except asyncio.IncompleteReadError:
            raise ConnectionAbortedError from None
        # connect and close replies have no reply header
        if initial_connect or self.pending_specials[zkproto.CLOSE_XID]:
            return None, None, zkproto.ConnectResponse.deserialize(raw)
        xid, zxid, error_code = _REPLY_HEADER.unpack_from(raw)
        if error_code:
            self.opcode_xref.pop(xid)
            return xid, zxid, zkexc.get_response_error(error_code)
        payload = raw[_REPLY_HEADER.size:]
        if xid == zkproto.WATCH_XID:
            return xid, zxid, watch_event(payload)
        opcode = self.opcode_xref.pop(xid)
        fast = FAST_REPLIES.get(opcode)
        if fast is not None:
            return xid, zxid, fast(payload)
        return xid, zxid, zkproto.response_xref[opcode].deserialize(payload)


class SessionRepair:
    """Keep an ``aiozk`` session alive through a leader election (installed on the
    clients this backend makes).

    ``aiozk`` 0.32 loses the session on the way: when a server closes the connection
    during the connect handshake -- every server does that while an election runs, and
    a server that lags behind the client's last zxid does it too -- it takes the session
    for expired, drops it and opens a new one (every ephemeral node, so every lease, is
    gone although the session was alive); and between rounds over the server list it
    backs off exponentially (2, 4, 8... s), often past the session timeout. Here the
    handshake is tried on the next server with the same session id, and rounds are
    retried after at most ``min(0.5 s, session timeout / 10)``. Only the server's own
    answer (session id 0) means the session expired.
    """

    def __init__(self, session: Any, auth: Digest | None = None) -> None:
        self.session = session
        self.auth = auth
        #: the server refused our credentials (AuthFailed) on some connection
        self.auth_error: BaseException | None = None
        self._closing: set[asyncio.Task[Any]] = set()
        self._beat_due = 0.0  # when the next ping is due (loop time), see set_heartbeat
        #: the backend's handler of watch events: True if it handled one (see event_dispatch)
        self.direct: Callable[[int, str], bool] | None = None
        self._dispatch: Callable[[Any], None] = session.event_dispatch

    def install(self) -> None:
        self.session.find_server = self.find_server
        self.session.establish_session = self.establish_session
        self.session.set_heartbeat = self.set_heartbeat
        self._dispatch = self.session.event_dispatch
        self.session.event_dispatch = self.event_dispatch  # (read by find_server)

    def event_dispatch(self, event: Any) -> None:
        """A watch event, from the connection's reader: to :attr:`direct` first, which
        handles it at once if it is its own (``aiozk`` runs every callback a turn of the
        event loop later; a waiter's wake-up is on a handoff's critical path), else to
        ``aiozk``'s dispatch."""
        direct = self.direct
        if not (event.type and direct is not None and direct(event.type, event.path)):
            self._dispatch(event)

    def set_heartbeat(self) -> None:
        """Ping ``timeout / 3`` after the last reply, as ``aiozk`` does, with one timer
        moved lazily: ``aiozk`` cancels its timer and makes a new one after every reply
        (a heap push and a cancelled handle per request)."""
        session = self.session
        loop = asyncio.get_running_loop()
        due = loop.time() + session.timeout / _HEARTBEAT_FREQUENCY
        self._beat_due = due
        handle = session.heartbeat_handle
        if handle is not None and not handle.cancelled():
            if handle.when() <= due:
                return  # it fires earlier and moves itself to ``due``
            handle.cancel()  # the timeout shrank (a new session)
        session.heartbeat_handle = loop.call_at(due, self._beat)

    def _beat(self) -> None:
        session = self.session
        session.heartbeat_handle = None
        loop = asyncio.get_running_loop()
        if loop.time() < self._beat_due:  # a reply came since: not idle yet
            session.heartbeat_handle = loop.call_at(self._beat_due, self._beat)
        else:
            session.create_heartbeat()

    def _close_later(self, conn: Any) -> None:
        task = asyncio.get_running_loop().create_task(conn.close(self.session.timeout))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def find_server(self, allow_read_only: bool) -> None:
        session = self.session
        delay = 0.02
        while True:
            for host, port in random.sample(session.hosts, len(session.hosts)):
                conn = Connection(host, port, watch_handler=session.event_dispatch,
                                   read_timeout=session.read_timeout)
                try:
                    # a 'srvr' probe, then the real connection; bounded, or a host that
                    # drops packets would hold up the others
                    await asyncio.wait_for(conn.connect(), min(5.0, max(1.0, (session.timeout or 10) / 3)))
                except Exception as exc:  # down, not serving (no quorum), or silent
                    log.debug("ZooKeeper server %s:%s unavailable: %r", host, port, exc)
                    if conn.writer is not None:
                        with contextlib.suppress(Exception):
                            conn.writer.close()
                    continue
                if conn.start_read_only and not allow_read_only:
                    self._close_later(conn)
                    continue
                old, session.conn = session.conn, conn
                if old is not None:
                    self._close_later(old)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5, max(0.05, (session.timeout or 10) / 10))

    async def establish_session(self) -> None:
        session = self.session
        try:
            while True:
                reply = await session.conn.send_connect(zkproto.ConnectRequest(
                    protocol_version=0, last_seen_zxid=session.last_zxid or 0,
                    timeout=int((session.timeout or 0) * 1000), session_id=session.session_id or 0,
                    password=session.password, read_only=session.allow_read_only,
                ))
                if reply is not None:
                    break
                # closed during the handshake: not serving (an election), or behind our
                # last zxid. The session may well be alive: try the next server.
                log.info("ZooKeeper server %s:%s closed the connection during the handshake; "
                         "trying the next one", session.conn.host, session.conn.port)
                self._close_later(session.conn)
                await asyncio.sleep(0.05)
                await self.find_server(session.allow_read_only)
        except asyncio.CancelledError:
            # aiozk gave up (the session timeout passed): it opens a new session next,
            # which any server may take, however far behind
            session.last_zxid = None
            raise
        zxid, response = reply
        session.last_zxid = zxid
        if response.session_id == 0:  # the server says: expired
            if session.state.current_state != States.LOST:
                session.state.transition_to(States.LOST)
            raise zkexc.SessionLost()
        session.session_id = response.session_id
        session.password = response.password
        session.timeout = response.timeout / 1000
        if self.auth is not None:
            self._authenticate()

    def _authenticate(self) -> None:
        """Send ``addAuth`` on the new connection. ZooKeeper keeps auth per connection,
        not per session, so this is done on every (re)connect; it is written before the
        session counts as connected, so the server has it before any other request on
        this connection (it handles auth packets as they arrive)."""
        assert self.auth is not None
        reply = self.session.conn.send(self.auth.request())
        reply.add_done_callback(self._authenticated)

    def _authenticated(self, reply: asyncio.Future[Any]) -> None:
        if reply.cancelled():
            return
        exc = reply.exception()  # (a dropped connection: the next one authenticates again)
        if isinstance(exc, zkexc.AuthFailed):
            self.auth_error = exc
            log.error("ZooKeeper refused the credentials of user %r", self.auth and self.auth.user)


class CountedDelete(Delete):
    """A delete that counts how often it was sent (aiozk resends after a reconnect)."""

    sends = 0

    def serialize(self, xid: int | None = None) -> bytes:
        self.sends += 1
        return super().serialize(xid)

