"""``zookeeper://[user:password@]host:port,host:port/chroot`` (also ``zk://``): ZooKeeper
via ``aiozk``.

Only ``aiozk.ZKClient``'s session is used; the recipes are our own (``aiozk``'s
``recipes.Lock`` leaks znodes on cancellation, misses deletes after a reconnect and
ignores session expiry).

Layout: every claim is one ephemeral sequential znode
``<chroot>/<escaped name>/<kind>-<owner>-<sequence>`` (kind ``lock``, ``read``,
``write`` or ``permit``; ``owner`` is the claim's per-acquisition id, so a node whose
create reply was lost -- a cancellation, a dropped connection -- is found again and
deleted). The name is percent-encoded into one path component. The parent is a
container node, removed by the server once empty.

Recipes (FIFO by sequence number, so every lock is fair):

* mutex and write side: granted when no earlier node of the family exists;
* read side: granted when no earlier ``write-`` node exists (a waiting writer blocks later
  readers, so writers are not starved);
* semaphore (Curator's ``InterProcessSemaphoreV2`` idea): granted among the first
  ``limit`` ``permit-`` nodes.

A waiter watches only the nodes whose deletion can grant it (its predecessor; for a
reader the last writer before it; for a permit the ``limit`` nodes before it), with a
*child* watch on that node (``getChildren`` of the lock node): lock nodes are ephemeral
and have no children, so the watch fires only when the node is deleted -- never on the
``setData`` of a renewal -- and exactly one watch fires per release. A waiter still
re-reads the children on a bounded timer and after every reconnect, so a missed watch
cannot strand it; a watch that fires while its node still exists (the server may do that
when watches are re-registered after a reconnect) just makes it look again. The fencing
token is the holder znode's ``czxid`` (monotonic across the ensemble).

Leases: a znode lives as long as its session, and also carries the lease's ``ttl``.
Renewal rewrites the node's data (``setData``); a contender that sees a *holding* node
unchanged for its whole ``ttl`` (measured on its own monotonic clock from when it first
saw it holding) deletes it with a version-conditional delete. So a holder that stopped
renewing (crashed, stalled, or a process whose session lives on) frees the lock within
``ttl``, like the other backends; a holder whose process died frees it at the latest
when its session expires. A grant or renewal is believed for ``min(ttl, session
timeout)`` from a moment no contender can have started counting before: the sending of
the create or renewal, or, for a waiter that became the holder, our last listing that
still showed it waiting. A handoff therefore costs one read after the watch fires (no
write: the watchdog's first renewal restamps the node); a renewal that comes right after
such a confirmation (the core renews at once when the session timeout cut the lease
below its ``ttl``) is answered from it without a request.

A claim keeps a place in the queue only while someone waits on it: its waiter listens,
or the core says it will (``Claim.waits``: the first try of an acquire that waits, which
then listens at once). A try that is not granted while nobody will listen for the claim
(a one-try ``acquire(timeout=0)``, or a first try from a core that cannot say) deletes
its node before it answers "busy", and a claim that stops listening without a grant (a
timeout, a cancellation) gives its place up at once. (A node kept while its claim did not
listen -- the old 0.5 s "unattended" timer -- stalled the lock: the release went to that
node, whose claim sat queued behind another task of its process, until the timer fired;
``tests/test_zk_wake.py``.) So nothing a try-lock loop did is left to block the lock, or
to show in ``status()``, once the try has returned. Such tries on a name found busy in
the last ``CONTENDED_HINT`` seconds only list the nodes (no write) and take a place only
if it looks free; the next one after that takes a place again and reads the holders'
lease clocks, so a try-lock loop also reaps a holder that stopped renewing.

Who may touch a lock (ACLs):

* ``zookeeper://user:password@host:port/chroot`` (percent-encoded; or ``username=`` and
  ``password=``) makes the session authenticate with the ``digest`` scheme on every
  connection it opens (ZooKeeper keeps auth per connection, so also after each
  reconnect), and every node aiolock creates -- the chroot and its missing ancestors,
  the per-name containers, the lock nodes -- gets the ACL ``digest:user:<base64 sha1 of
  user:password> cdrwa`` + ``world:anyone r`` (``acl="creator"``, the default with
  credentials). Other clients, unauthenticated or with other credentials (a wrong
  password is another identity), can read (``status()`` works) but can neither change
  nor delete a holder's node (deleting needs ``d`` on the container) nor take the lock
  (that needs ``c`` on the container): they get :class:`aiolock.AccessDenied`.
* Without credentials, or with ``acl="open"`` (also ``?acl=open``), nodes are created
  ``world:anyone:cdrwa`` as before: any client of the ensemble may delete them.
* Nodes that exist keep their ACL: a chroot or container made earlier without
  credentials stays open (a container is made again, with the ACL, once it was emptied
  and reaped by the server). Set the chroot's ACL yourself when it exists already.
* Least privileges: aiolock needs only ``c`` (create) on an existing chroot, for its
  containers -- e.g. ``setAcl /locks digest:user:<hash>:c`` -- and nothing else there,
  not even ``r`` (it never lists the chroot; ``status()`` reads the containers, which
  it makes readable by anyone). If the chroot does not exist, ``c`` on its nearest
  existing ancestor. Everything below the chroot it creates itself, with its own ACL.
  With less, the connect or the acquire fails with :class:`aiolock.AccessDenied` at
  once.
* A client passed in (``client=``) is used as it is: no credentials with it.

Error handling:

* the server refuses a request for want of permission (``NoAuth``, ``AuthFailed``):
  :class:`aiolock.AccessDenied`, wherever it happens (connect, acquire, renew, release,
  status), saying which user (never the password) and what to check. A renewal that is
  denied keeps failing, so the lease is lost at its last confirmed expiry.

* connection **suspended** (no server reachable, session maybe alive): leases are *at
  risk*; requests fail with :class:`aiolock.BackendUnavailable` after
  ``request_timeout``, so renewals fail and every lease is lost at its last confirmed
  expiry unless the connection comes back first. Waiters re-check after a reconnect.
* session **lost/expired**: the server deleted every ephemeral node of the session, so
  every lease of that session is lost (renewal reports them gone; ``async with`` bodies
  are cancelled and raise :class:`aiolock.LockLost`). A new session is opened for new
  acquisitions.
* an unreachable ensemble raises :class:`BackendUnavailable` within ``connect_timeout``
  (``aiozk`` itself would retry forever).
* a leader election (a server killed or restarted): the session survives if the
  clients reconnect within the session timeout. ``aiozk`` 0.32 would drop a live
  session when a server closes the connection during the handshake (as all do while
  they elect) and back off for seconds between rounds; the clients this backend makes
  retry the handshake on the next server with the same session id instead, every
  ``<= 0.5 s`` (a client passed in is used as it is).
* a release whose reply was lost with the connection is resent by ``aiozk`` after the
  reconnect; when the resent delete finds nothing in the same session, the first one
  did it: that is reported as a release, not a loss.

What to set: ``session_timeout`` (seconds, default 20; the server clamps it to
``[2, 20] x tickTime``). A lease is believed for at most ``session_timeout``, and the
watchdog renews every ``ttl/3``: keep ``session_timeout`` above ``ttl/3`` (ideally about
``ttl/2`` or more), and remember that a process killed while holding frees its locks
after ``min(ttl, session_timeout)``. For an ensemble, make it comfortably longer than a
leader election plus a reconnect (elections take a few seconds; 10 s or more): then
sessions, and leases, survive a failover; a lease is lost only if no renewal gets
through before its last confirmed expiry.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import random
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from ..abc import Backend, Busy, Capability, Claim, Granted, Kind, LockInfo, Waiter
from ..errors import AccessDenied, BackendUnavailable, LockError

try:
    import aiozk
    from aiozk import exc as zkexc
    from aiozk import protocol as zkproto
    from aiozk.connection import Connection as _ZKConnection
    from aiozk.connection import reply_header_struct as _REPLY_HEADER
    from aiozk.connection import size_struct as _SIZE
    from aiozk.protocol.acl import ACL as _ZKACL
    from aiozk.states import States
except ImportError as _exc:  # pragma: no cover - reported by aiolock.connect()
    raise ImportError(
        "the zookeeper:// backend needs aiozk: pip install 'aiolock[zookeeper]'", name="aiozk"
    ) from _exc

__all__ = ["ZooKeeperBackend", "zk_name"]

log = logging.getLogger("aiolock")

#: How long an abandoned claim's owner id is remembered, to delete a late-created node.
ABANDONED_KEEP = 120.0
#: At most this long between re-checks of a waiting claim (a missed watch costs this).
MAX_RECHECK = 5.0
#: After a try found a name busy, the next tries nobody listens for only look (a listing,
#: no node) for this long; then one takes a place again (and reads the holders' lease
#: clocks, so a holder that stopped renewing is still reaped).
CONTENDED_HINT = 2.0
#: A renewal within ``1 - RENEW_FRESH`` of the granted time after the last confirmation
#: is answered from that confirmation (no request).
RENEW_FRESH = 0.9
_SEQ_DIGITS = 10
_KIND_PREFIX = {
    Kind.LOCK: "lock", Kind.READ: "read", Kind.WRITE: "write", Kind.PERMIT: "permit", Kind.LEADER: "leader",
}
_PREFIX_KIND = {v: k for k, v in _KIND_PREFIX.items()}
_FAMILY_PREFIXES = {
    family: tuple(f"{_KIND_PREFIX[k]}-" for k in Kind if k.family == family)
    for family in {k.family for k in Kind}
}
#: ``acl=`` choices: ``creator`` (only our digest identity may change or delete the nodes
#: we create, anyone may read them; the default with credentials) or ``open``
#: (``world:anyone:cdrwa``; the default without credentials).
ACL_CHOICES = ("creator", "open")
_ALL_PERMS = 31  # cdrwa
_URL_FORM = "zookeeper://[user:password@]host:port,host:port/chroot[?acl=creator|open]"


# -- credentials and ACLs ------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class _Digest:
    """Digest credentials; the password never shows in a repr, a message or a log line."""

    user: str
    password: str = field(repr=False)

    @property
    def ident(self) -> str:
        """This identity in an ACL: ``user:base64(sha1(user:password))``."""
        raw = hashlib.sha1(f"{self.user}:{self.password}".encode()).digest()
        return f"{self.user}:{base64.b64encode(raw).decode()}"

    def request(self) -> Any:
        """The ``addAuth`` packet for a connection."""
        return _AuthRequest(type=0, scheme="digest", auth=f"{self.user}:{self.password}".encode())


class _AuthRequest(zkproto.AuthRequest):  # type: ignore[misc]
    """``addAuth``, shown without its secret (aiozk logs every packet at debug level)."""

    def __str__(self) -> str:
        return f"AuthRequest(scheme={self.scheme}, auth=<hidden>)"

    __repr__ = __str__


def _credentials(username: object, password: object) -> _Digest | None:
    """Both or neither; a digest user name cannot contain ':'."""
    if username is None and password is None:
        return None
    if not isinstance(username, str) or not isinstance(password, str) or not username or not password:
        raise ValueError("ZooKeeper digest auth needs both a user and a password (non-empty strings): "
                         "zookeeper://user:password@host:port/chroot, or username= and password=")
    if ":" in username:
        raise ValueError("a ZooKeeper digest user name cannot contain ':'")
    return _Digest(username, password)


def _node_acl(acl: object, digest: _Digest | None) -> list[Any]:
    """The ACL of every node we create, from the ``acl=`` choice (see :data:`ACL_CHOICES`)."""
    if acl is None:
        acl = "creator" if digest is not None else "open"
    if acl not in ACL_CHOICES:
        raise ValueError(f"acl must be one of {', '.join(map(repr, ACL_CHOICES))}, got {acl!r}")
    if acl == "open":
        return [zkproto.UNRESTRICTED_ACCESS]
    if digest is None:
        raise ValueError("acl='creator' needs credentials: zookeeper://user:password@host:port/chroot")
    owner = _ZKACL.make("digest", digest.ident, read=True, write=True, create=True, delete=True,
                        admin=True)
    return [owner, zkproto.WORLD_READABLE]


class _QuietDenials(logging.Filter):
    """Drop aiozk's "Send exception" log record for a request refused for want of
    permission: aiozk logs it at ERROR level with a traceback before raising it, but it
    reaches the caller as :class:`aiolock.AccessDenied` anyway (on the CLI, the traceback
    would come before its one-line message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (zkexc.NoAuth, zkexc.AuthFailed))


logging.getLogger("aiozk.session").addFilter(_QuietDenials())


def _redacted(url: str) -> str:
    """``url`` fit for a message: user kept, password and query left out."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{userinfo.partition(':')[0]}@{hosts}" if at else hosts
    return f"{parts.scheme}://{netloc}{parts.path}"


@functools.lru_cache(maxsize=1024)
def zk_name(name: str) -> str:
    """Escape a lock name (1..512 chars) into one valid znode name, reversibly.

    Everything but ASCII letters, digits and ``_.~-`` is percent-encoded (UTF-8), so
    ``/``, ``%``, control characters and unicode ranges ZooKeeper rejects never reach
    it; a leading ``.`` is encoded too, so ``.`` and ``..`` are never produced.
    """
    escaped = quote(name, safe="")
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    return escaped


@dataclass(slots=True, frozen=True)
class _Node:
    seq: int
    kind: Kind
    owner: str
    name: str  # the znode's own name


@functools.lru_cache(maxsize=8192)  # every listing parses the same names again
def _parse(child: str) -> _Node | None:
    prefix, sep, rest = child.partition("-")
    kind = _PREFIX_KIND.get(prefix)
    if kind is None or not sep or len(rest) < _SEQ_DIGITS + 2 or rest[-_SEQ_DIGITS - 1] != "-":
        return None
    seq = rest[-_SEQ_DIGITS:]
    if not seq.isdigit():
        return None
    return _Node(int(seq), kind, rest[: -_SEQ_DIGITS - 1], child)


def _family_nodes(children: Sequence[str], kind: Kind) -> list[_Node]:
    prefixes = _FAMILY_PREFIXES[kind.family]
    nodes = [n for c in children if c.startswith(prefixes) and (n := _parse(c)) is not None]
    nodes.sort(key=_seq)
    return nodes


def _seq(node: _Node) -> int:
    return node.seq


def _holders(nodes: list[_Node], limit: int) -> list[_Node]:
    """The nodes in a granted position (the holders, or the ones about to notice)."""
    if not nodes:
        return []
    family = nodes[0].kind.family
    if family == "lock":
        return nodes[:1]
    if family == "sem":
        return nodes[:limit]
    if nodes[0].kind is Kind.WRITE:
        return nodes[:1]
    out = []
    for node in nodes:
        if node.kind is Kind.WRITE:
            break
        out.append(node)
    return out


def _watch_targets(nodes: list[_Node], index: int, claim: Claim) -> list[_Node]:
    """The nodes whose deletion may grant the node at ``index`` (which is not granted)."""
    if claim.kind is Kind.READ:
        writers = [n for n in nodes[:index] if n.kind is Kind.WRITE]
        return writers[-1:]
    if claim.kind is Kind.PERMIT:
        return nodes[max(0, index - claim.limit) : index]
    return nodes[index - 1 : index]


async def _pipelined(requests: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Await ``requests`` sent at once, the first one without a task of its own (it is
    written before the others start); their results in order, like ``gather``."""
    rest = [asyncio.ensure_future(r) for r in requests[1:]]
    try:
        first = await requests[0]
        return [first, *[await t for t in rest]]
    finally:
        for task in rest:
            task.cancel()  # (no-op if done) whatever is left after a failure
            task.add_done_callback(_retrieved)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Done callback of a request nobody awaits: read its outcome, so asyncio does not
    log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def _encode_data(claim: Claim) -> bytes:
    return f"{claim.ttl_ms}:{claim.limit}".encode()


def _decode_data(data: bytes | None) -> tuple[int, int]:
    try:
        ttl, _, limit = (data or b"").decode().partition(":")
        return int(ttl), int(limit or 1)
    except (UnicodeDecodeError, ValueError):
        return 30_000, 1


class _Connection(_ZKConnection):  # type: ignore[misc]
    """``aiozk``'s connection with a leaner reader (the clients this backend makes).

    ``aiozk`` 0.32 reads every reply in three steps, two of them through
    ``asyncio.wait_for`` -- a task and a timer each, and an event-loop turn each even
    when the bytes are already buffered. Six replies or events per contended acquisition
    made that the largest client cost per acquisition (issue 10). Here a reply is read
    in one piece after its size: at once when it is buffered (it almost always is), else
    under one ``read_timeout``; errors as ``aiozk``'s (a short read is
    ``UnfinishedRead``, a closed connection ``ConnectionAbortedError``).
    """

    async def read_response(self, initial_connect: bool = False) -> tuple[Any, Any, Any]:
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
            return xid, zxid, zkproto.WatchEvent.deserialize(payload)
        return xid, zxid, zkproto.response_xref[self.opcode_xref.pop(xid)].deserialize(payload)


class _SessionRepair:
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

    def __init__(self, session: Any, auth: _Digest | None = None) -> None:
        self.session = session
        self.auth = auth
        #: the server refused our credentials (AuthFailed) on some connection
        self.auth_error: BaseException | None = None
        self._closing: set[asyncio.Task[Any]] = set()

    def install(self) -> None:
        self.session.find_server = self.find_server
        self.session.establish_session = self.establish_session

    def _close_later(self, conn: Any) -> None:
        task = asyncio.get_running_loop().create_task(conn.close(self.session.timeout))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def find_server(self, allow_read_only: bool) -> None:
        session = self.session
        delay = 0.02
        while True:
            for host, port in random.sample(session.hosts, len(session.hosts)):
                conn = _Connection(host, port, watch_handler=session.event_dispatch,
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


class _Delete(zkproto.DeleteRequest):  # type: ignore[misc]
    """A delete that counts how often it was sent (aiozk resends after a reconnect)."""

    sends = 0

    def serialize(self, xid: int | None = None) -> bytes:
        self.sends += 1
        return super().serialize(xid)  # type: ignore[no-any-return]


class ZooKeeperBackend(Backend):
    """Locks on a ZooKeeper ensemble, over one ``aiozk`` session.

    Build it from a URL with :func:`aiolock.connect` (``zookeeper://h1:2181,h2:2181/chroot``,
    ``zookeeper://user:password@h1:2181/chroot`` for digest auth) or pass an
    ``aiozk.ZKClient`` you already have (``ZooKeeperBackend(client=...)``; it is started if
    needed, used as it is -- no credentials -- and not closed for you). See the module doc
    for the recipes, the lease model, the ACLs and what session timeout to set.

    ``username``/``password``: digest credentials, sent on every connection. ``acl``:
    ``"creator"`` (the default with credentials: only that identity may change or delete
    the nodes aiolock creates, anyone may read them) or ``"open"`` (the default without).
    """

    schemes: ClassVar[tuple[str, ...]] = ("zookeeper", "zk")
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.FAIR, Capability.RWLOCK, Capability.SEMAPHORE, Capability.EVENTS,
         Capability.EXPIRY, Capability.DISTRIBUTED}
    )

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
        self._chroot = _check_chroot(chroot)
        self._digest = _credentials(username, password)
        self._acl = _node_acl(acl, self._digest)
        self._repair: _SessionRepair | None = None
        if client is None:
            if not hosts:
                raise ValueError("give ZooKeeper hosts ('host:port,host:port') or an aiozk client")
            _check_hosts(hosts)
            client = aiozk.ZKClient(hosts, session_timeout=session_timeout)
            self._repair = _SessionRepair(client.session, self._digest)
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
        self._sid: int | None = None  # the session our nodes belong to
        self._monitor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiters: dict[str, Waiter] = {}  # claim owner -> the waiter listening for it
        self._watching: dict[str, set[str]] = {}  # znode path -> owners woken by its deletion
        self._seen: dict[str, tuple[int, float]] = {}  # holder path -> (version, first seen)
        self._abandoned: dict[str, tuple[str, str, float]] = {}  # owner -> (parent, prefix, until)
        self._warned: set[int] = set()
        #: bumped at every suspension and reconnect: a Busy answer from before is stale
        self._epoch = 0
        #: lock node path -> until when a try nobody listens for only looks (see _peek)
        self._contended: dict[str, float] = {}

    @classmethod
    def from_url(
        cls, url: str, *, session_timeout: float = 20.0, connect_timeout: float = 5.0,
        request_timeout: float = 5.0, username: str | None = None, password: str | None = None,
        acl: str | None = None,
    ) -> ZooKeeperBackend:
        """``zookeeper://[user:password@]host:port[,host:port...][/chroot][?acl=...]`` or
        ``zk://...``; the chroot defaults to ``/aiolock``, the port to 2181. The user and
        password (percent-encoded in the URL, or given as ``username=``/``password=``)
        are digest credentials; ``acl`` (query or keyword) is ``creator`` or ``open``."""
        shown = _redacted(url)
        parts = urlsplit(url)
        if parts.scheme.lower() not in cls.schemes:
            raise ValueError(f"expected {_URL_FORM}, got {shown!r}")
        if parts.fragment:
            raise ValueError(f"zookeeper URLs take no fragment: expected {_URL_FORM}, got {shown!r}")
        query = parse_qsl(parts.query, keep_blank_values=True)
        for key, value in query:
            if key != "acl" or acl is not None:
                raise ValueError(f"zookeeper URLs take one query option, acl=creator|open; "
                                 f"got {key!r} in {shown!r}" + (" (and acl= as a keyword)"
                                                                if key == "acl" else ""))
            acl = value
        userinfo, at, netloc = parts.netloc.rpartition("@")
        if at:
            if username is not None or password is not None:
                raise ValueError(f"credentials given twice: in the URL {shown!r} and as keywords")
            user, colon, secret = userinfo.partition(":")
            username, password = unquote(user), (unquote(secret) if colon else None)
        if not netloc:
            raise ValueError(f"expected {_URL_FORM}, got {shown!r}")
        hosts = ",".join(h if ":" in h.rpartition("]")[2] else f"{h}:2181"
                         for h in netloc.split(","))
        chroot = parts.path if parts.path not in ("", "/") else "/aiolock"
        return cls(hosts, chroot, session_timeout=session_timeout,
                   connect_timeout=connect_timeout, request_timeout=request_timeout,
                   username=username, password=password, acl=acl)

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

    async def _ready(self) -> None:
        if self._closed:
            raise LockError(f"this connection to {self.url} is closed")
        if self._started:
            return
        async with self._start_lock:
            if self._started:
                return
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
        if session.conn is not None:
            with contextlib.suppress(Exception):
                session.conn.abort()
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
            if sid != self._sid:
                log.warning("ZooKeeper session expired (%s -> %s): its leases are lost",
                            _hex(self._sid), _hex(sid))
                self._sid = sid
                self._seen.clear()
            self._prune_callbacks()
            self._sweep_abandoned()
            for waiter in list(self._waiters.values()):  # never trust a watch across this
                waiter.wake()

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

    @contextlib.asynccontextmanager
    async def _bounded(self, what: str) -> AsyncIterator[None]:
        """Bound a request by ``request_timeout`` and map errors to aiolock's."""
        await self._ready()
        try:
            async with asyncio.timeout(self._request_timeout):
                yield
        except TimeoutError as exc:
            raise BackendUnavailable(
                f"ZooKeeper at {self.url} did not answer {what} within {self._request_timeout} s "
                f"(session {self._client.session.state.current_state})"
            ) from exc
        except (OSError, zkexc.ConnectError, zkexc.SessionLost, zkexc.FailedRetry,
                zkexc.UnfinishedRead, zkexc.TimeoutError, zkexc.ConnectionLoss, zkexc.SessionExpired,
                zkexc.OperationTimeout, zkexc.SessionMoved) as exc:
            raise BackendUnavailable(
                f"ZooKeeper at {self.url} is unavailable ({type(exc).__name__}: {exc})"
            ) from exc
        except (zkexc.NoAuth, zkexc.AuthFailed) as exc:
            raise self._denied(what, exc) from exc
        except zkexc.ZKError as exc:
            raise LockError(f"ZooKeeper at {self.url} refused {what}: {type(exc).__name__} {exc}") from exc

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

    async def _send(self, request: Any) -> Any:
        # session.send, not client.send: the client caches the stat of every path forever
        return await self._client.session.send(request)

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

    async def _create(self, parent: str, prefix: str, data: bytes) -> tuple[str, int]:
        req = zkproto.Create2Request(path=f"{parent}/{prefix}", data=data, acl=self._acl)
        req.set_flags(ephemeral=True, sequential=True)
        for _ in range(5):
            try:
                resp = await self._send(req)
            except zkexc.NoNode:  # the parent is missing (or its container was just reaped)
                await self._ensure_path(parent, container=True)
                continue
            return str(resp.path), int(resp.stat.created_zxid)
        raise LockError(f"could not create a node under {parent!r}")

    async def _children(self, parent: str) -> list[str]:
        try:
            resp = await self._send(zkproto.GetChildrenRequest(path=parent, watch=False))
        except zkexc.NoNode:
            return []
        return list(resp.children)

    async def _delete(self, path: str, version: int = -1) -> bool:
        try:
            await self._send(zkproto.DeleteRequest(path=path, version=version))
        except (zkexc.NoNode, zkexc.BadVersion):
            return False
        return True

    async def _get(self, path: str, watch: bool) -> tuple[bytes, Any] | None:
        try:
            resp = await self._send(zkproto.GetDataRequest(path=path, watch=watch))
        except zkexc.NoNode:
            return None
        return resp.data, resp.stat

    async def _watch_node(self, path: str) -> bool:
        """Set a child watch on the lock node ``path`` (fires only when it is deleted);
        False if it is gone already (then no watch was set)."""
        try:
            await self._send(zkproto.GetChildrenRequest(path=path, watch=True))
        except zkexc.NoNode:
            return False
        return True

    async def _stamp(self, claim: Claim, path: str) -> Any:
        """Rewrite our node's data (a renewal, or restarting the lease clock contenders
        keep); its stat, or None if the node is gone. Notes when it was sent."""
        sent = time.monotonic()
        try:
            resp = await self._send(zkproto.SetDataRequest(
                path=path, data=_encode_data(claim), version=-1))
        except zkexc.NoNode:
            return None
        claim.state["stamped"] = (sent, claim.ttl_ms)
        return resp.stat

    # -- watches ------------------------------------------------------------------------

    def _watch(self, claim: Claim, paths: set[str]) -> None:
        """Make ``paths`` the set whose deletion wakes ``claim``'s waiter.

        The server-side watch is a *child* watch on the node itself (``getChildren`` of
        the lock node, see :meth:`_watch_node`): an ephemeral node has no children, so it
        fires only when the node is deleted -- never on the ``setData`` of a renewal or a
        grant, as a data or exists watch would. One watch fires per release.
        """
        noted: set[str] = claim.state.get("watch", set())  # type: ignore[assignment]
        # (a watch that fired -- also spuriously, as after a reconnect -- is gone here)
        old = {p for p in noted if claim.owner in self._watching.get(p, ())}
        for path in old - paths:
            self._unwatch_path(path, claim.owner)
        for path in paths - old:
            owners = self._watching.get(path)
            if owners is None:
                owners = self._watching[path] = set()
                session = self._client.session
                session.add_watch_callback(zkproto.WatchEvent.DELETED, path, self._on_deleted)
                # aiozk re-registers CHILDREN_CHANGED callbacks as child watches after a
                # reconnect (the server answers "deleted" at once for a node gone meanwhile)
                session.add_watch_callback(zkproto.WatchEvent.CHILDREN_CHANGED, path, self._on_deleted)
            owners.add(claim.owner)
        claim.state["watch"] = set(paths)

    def _unwatch(self, claim: Claim) -> None:
        old: set[str] = claim.state.pop("watch", set())  # type: ignore[assignment]
        for path in old:
            self._unwatch_path(path, claim.owner)

    def _unwatch_path(self, path: str, owner: str) -> None:
        owners = self._watching.get(path)
        if owners is None:
            return
        owners.discard(owner)
        if not owners:
            self._drop_watch(path)

    def _drop_watch(self, path: str) -> set[str]:
        owners = self._watching.pop(path, set())
        session = self._client.session
        for event in (zkproto.WatchEvent.DELETED, zkproto.WatchEvent.CHILDREN_CHANGED):
            with contextlib.suppress(KeyError):
                session.remove_watch_callback(event, path, self._on_deleted)
        return owners

    def _prune_callbacks(self) -> None:
        """Drop the empty entries aiozk's dispatcher leaves behind (it indexes a
        defaultdict with every event, also for a watch whose callback we removed, and
        would re-register those as watches after every reconnect)."""
        callbacks = self._client.session.watch_callbacks
        for key in [k for k, v in callbacks.items() if not v]:
            del callbacks[key]

    def _on_deleted(self, path: str) -> None:
        # (also called for CHILDREN_CHANGED: an ephemeral node has no children, but the
        # server sends it for a child watch re-registered after a reconnect if the node
        # changed meanwhile; the waiters just look again)
        self._seen.pop(path, None)
        for owner in self._drop_watch(path):
            waiter = self._waiters.get(owner)
            if waiter is not None:
                waiter.wake()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- primitives ---------------------------------------------------------------------

    def _granted_ms(self, claim: Claim) -> int:
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

    def _forget_node(self, claim: Claim) -> None:
        for key in ("path", "sid", "czxid", "creating", "stamped", "releasing", "busy",
                    "granted", "waited"):
            claim.state.pop(key, None)

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        if claim.owner in self._abandoned:
            raise LockError(f"claim on {claim.name!r} was abandoned")
        busy = self._same_answer(claim)
        if busy is not None:
            return busy
        async with self._bounded("an acquire"):
            return await self._try_acquire(claim)

    def _same_answer(self, claim: Claim) -> Busy | None:
        """Asked again with nothing changed since the last answer (the core asks once more
        after listen(), and a local release wakes the local head): none of the watches
        fired, no reconnect, the re-check time not reached. Only the deletion of a node
        we watch can grant us, so the answer is the same, without a request."""
        busy = claim.state.pop("busy", None)
        if not isinstance(busy, tuple) or busy[0] != self._epoch or self._closed:
            return None
        left = busy[1] - time.monotonic()
        watched: set[str] = claim.state.get("watch", set())  # type: ignore[assignment]
        if (left <= 0 or not watched or claim.state.get("sid") != self._sid
                or not self._healthy()
                or not all(claim.owner in self._watching.get(p, ()) for p in watched)):
            return None
        claim.state["busy"] = busy
        return Busy(left)

    async def _try_acquire(self, claim: Claim) -> Granted | Busy:
        parent = self._parent(claim.name)
        prefix = f"{_KIND_PREFIX[claim.kind]}-{claim.owner}-"
        if claim.state.get("sid") not in (None, self._sid):
            self._forget_node(claim)  # made in an expired session: the server deleted it
        claim.state.pop("busy", None)
        attended = self._attended(claim)
        if (not attended and "path" not in claim.state
                and not claim.state.get("creating")
                and self._contended.get(parent, 0.0) > time.monotonic()):
            peeked = await self._peek(claim, parent)
            if peeked is not None:
                return peeked
        started = time.monotonic()
        first = False  # the first look after creating our node
        for _ in range(8):
            path = claim.state.get("path")
            children: list[str] | None = None
            listed = time.monotonic()
            if path is None and claim.state.get("creating"):
                # an earlier create may have happened with its reply lost: find it
                children = await self._children(parent)
                path = self._adopt_orphan(claim, parent, prefix, children)
            fresh = path is None
            if path is None:
                claim.state["creating"] = True
                sid = self._sid
                listed = sent = time.monotonic()
                # The listing goes right behind the create, in the same round trip: the
                # task starts when this one first waits, which is after the create was
                # written, and the server answers a session's requests in order, so the
                # listing sees our node (unless the create waited first: checked below).
                listing = asyncio.ensure_future(self._children(parent))
                try:
                    path, czxid = await self._create(parent, prefix, _encode_data(claim))
                except BaseException:
                    listing.cancel()
                    listing.add_done_callback(_retrieved)
                    raise
                claim.state.update(path=path, sid=sid, czxid=czxid, stamped=(sent, claim.ttl_ms))
                try:
                    children = await listing
                except Exception:  # listed again below, where a real failure raises
                    children = None
                if children is not None and path.rpartition("/")[2] not in children:
                    children = None  # the create made the parent first: list again
                first = True
            assert isinstance(path, str)
            if children is None:
                listed = time.monotonic()
                children = await self._children(parent)
            nodes = _family_nodes(children, claim.kind)
            await self._delete_strays(claim, parent, prefix, path, nodes)
            me = path.rpartition("/")[2]
            index = next((i for i, n in enumerate(nodes) if n.name == me), None)
            if index is None:  # our node is gone (reaped as stale, or session expired)
                self._forget_node(claim)
                continue
            holders = _holders([n for n in nodes if n.owner not in self._abandoned or n.name == me],
                               claim.limit)
            if any(n.name == me for n in holders):
                granted = self._granted(claim, fresh, started)
                if granted is None:
                    granted = await self._granted_stamped(claim, path)
                if granted is None:  # our node is gone (reaped as stale, or session expired)
                    self._forget_node(claim)
                    continue
                self._unwatch(claim)
                claim.state.pop("creating", None)
                claim.state["granted"] = True
                return granted
            self._note_contended(parent)
            if not attended:
                # nobody will wait on this place (one try, or a core that cannot say)
                busy = await self._give_way(claim, parent, path, nodes, holders)
                if busy is not None:
                    return busy
                continue  # a stale holder was reaped: try again, with a new node
            # not holding at `listed`: no contender can see us holding before that moment
            claim.state["waited"] = listed
            busy = await self._wait_on(claim, parent, nodes, index, holders, first)
            if busy is not None:
                return busy
            first = False
        return Busy(0.05)

    def _attended(self, claim: Claim) -> bool:
        """Someone will wait on this claim's place: its waiter listens, or the core says
        the claim waits if busy (``Claim.waits``: it listens right after this answer,
        without queueing behind a local waiter). Such a first try keeps its node and
        watches, and the next one is answered without a request: create, list, watch on
        the way in, one listing per wake-up, one delete on the way out (5 requests per
        contended acquisition, as aiozk's recipe; a try that gives its place up and
        takes a new one costs 2-3 more). A core without ``Claim.waits`` gets the old
        answer: a try nobody listens for keeps no place."""
        return claim.owner in self._waiters or getattr(claim, "waits", False) is True

    def _granted(self, claim: Claim, fresh: bool, started: float) -> Granted | None:
        """Grant without another request, if the lease is safe; None: stamp first.

        A contender reaps a holder whose node it saw unchanged for the node's ttl,
        counted from when it first saw it holding. A node created by this attempt is
        fine as it is (the create was sent after the attempt started). A node that
        waited became a holder only after our last listing that showed it waiting (sent
        at ``waited``), so no contender can reap it before ``waited + ttl``, nor can the
        session expire before ``waited + session timeout``: the grant counts from there,
        with no write on the way (the watchdog's first renewal, at a third of that, is
        the next stamp). After a long wait (less than half the lease would be left), or
        for an adopted orphan whose token is unknown, the node is stamped first (None).
        """
        ms = self._granted_ms(claim)
        czxid = claim.state.get("czxid")
        if not isinstance(czxid, int) or not czxid:
            return None
        if fresh:
            return Granted(czxid, ms)
        waited = claim.state.get("waited")
        if not isinstance(waited, float) or claim.state.get("sid") != self._sid:
            return None
        left = int(waited * 1000 + ms - started * 1000)
        if left < ms / 2:
            return None
        stamped = claim.state.get("stamped")
        if not isinstance(stamped, tuple) or stamped[0] < waited or stamped[1] != claim.ttl_ms:
            claim.state["stamped"] = (waited, claim.ttl_ms)  # what a renewal may count from
        return Granted(czxid, left)

    async def _granted_stamped(self, claim: Claim, path: str) -> Granted | None:
        stat = await self._stamp(claim, path)
        if stat is None:
            return None
        claim.state["czxid"] = int(stat.created_zxid)
        return Granted(int(stat.created_zxid), self._granted_ms(claim))

    def _adopt_orphan(self, claim: Claim, parent: str, prefix: str, children: list[str]) -> str | None:
        mine = sorted(c for c in children if c.startswith(prefix))
        if not mine:
            return None
        claim.state.update(path=f"{parent}/{mine[0]}", sid=self._sid)
        claim.state["czxid"] = 0  # looked up again when granted (the stamp returns it)
        return f"{parent}/{mine[0]}"

    async def _delete_strays(
        self, claim: Claim, parent: str, prefix: str, path: str, nodes: list[_Node]
    ) -> None:
        """Delete duplicates of our own node (a create retried by aiozk after a dropped
        connection) and nodes of claims abandoned here whose create landed late."""
        strays = [n for n in nodes if (n.owner == claim.owner and f"{parent}/{n.name}" != path)
                  or n.owner in self._abandoned]
        for node in strays:
            await self._delete(f"{parent}/{node.name}")

    async def _wait_on(
        self, claim: Claim, parent: str, nodes: list[_Node], index: int, holders: list[_Node],
        first: bool,
    ) -> Busy | None:
        """Not granted: watch what can grant us, reap stale holders. None: look again.

        The holders' data (lease ttl and version) is read to reap a holder that stopped
        renewing; on the first look after creating our node only for a holder we watch
        anyway (the next look, on the bounded timer, reads the others: a stale holder is
        found later, never early).
        """
        targets = {f"{parent}/{n.name}" for n in _watch_targets(nodes, index, claim)}
        holder_paths = self._holder_paths(claim, parent, nodes, holders)
        read = sorted(holder_paths & targets if first else holder_paths)
        self._watch(claim, targets)
        watched = sorted(targets)
        requests = [*(self._watch_node(p) for p in watched), *(self._get(p, watch=False) for p in read)]
        results: list[Any] = ([await requests[0]] if len(requests) == 1
                              else await _pipelined(requests))
        if not all(results[: len(watched)]):
            return None  # something we wait for went meanwhile (and set no watch): look again
        wait = await self._reap_stale(claim, read, results[len(watched):])
        if wait is None:
            return None
        claim.state["busy"] = (self._epoch, time.monotonic() + wait)
        return Busy(wait)

    async def _peek(self, claim: Claim, parent: str) -> Busy | None:
        """A try nobody listens for, on a name found busy a moment ago: list the nodes
        and answer Busy without taking a place if a new node would not be granted (no
        write at all: a try-lock loop, or the first try of an acquire that then listens
        and asks again, costs the server one read). None: it looks free, take a place."""
        nodes = [n for n in _family_nodes(await self._children(parent), claim.kind)
                 if n.owner not in self._abandoned]
        newcomer = _Node(1 << 62, claim.kind, claim.owner, "")
        if any(n is newcomer for n in _holders([*nodes, newcomer], claim.limit)):
            self._contended.pop(parent, None)
            return None
        return Busy(min(MAX_RECHECK, claim.ttl_ms / 3000, self.session_timeout / 3))

    def _note_contended(self, parent: str) -> None:
        now = time.monotonic()
        if parent not in self._contended and len(self._contended) >= 1024:
            for key in [k for k, until in self._contended.items() if until <= now]:
                del self._contended[key]
        self._contended[parent] = now + CONTENDED_HINT

    async def _give_way(
        self, claim: Claim, parent: str, path: str, nodes: list[_Node], holders: list[_Node],
    ) -> Busy | None:
        """Not granted, and nobody listens for ``claim``: delete its node before answering
        Busy, so that it blocks nobody (the core asks once and gives up for
        ``timeout=0``, calling nothing else for a non-fair claim; before waiting it
        listens first, then asks again, which takes a new place). The holders' data is
        read in the same round trip, so that a try-lock loop still reaps a holder that
        stopped renewing. None: one was reaped, look again.
        """
        read = sorted(self._holder_paths(claim, parent, nodes, holders))
        self._unwatch(claim)
        results = await _pipelined([self._delete(path), *(self._get(p, watch=False) for p in read)])
        self._forget_node(claim)
        wait = await self._reap_stale(claim, read, results[1:])
        return None if wait is None else Busy(wait)

    def _holder_paths(
        self, claim: Claim, parent: str, nodes: list[_Node], holders: list[_Node]
    ) -> set[str]:
        """The holders whose lease clock to read (forgetting the clocks of nodes gone)."""
        present = {f"{parent}/{n.name}" for n in nodes}
        for path in [p for p in self._seen if p.rpartition("/")[0] == parent and p not in present]:
            del self._seen[path]  # released since we last looked
        # Reap-clocks run only for nodes that hold in the full listing: a node that holds
        # only because our own abandoned (not yet deleted) nodes are left out does not
        # know it holds yet, and counts its lease from later than we would.
        real = {n.name for n in _holders(nodes, claim.limit)}
        return {f"{parent}/{n.name}" for n in holders if n.name in real}

    async def _reap_stale(
        self, claim: Claim, paths: Sequence[str], got: Sequence[tuple[bytes, Any] | None]
    ) -> float | None:
        """Run the lease clocks of the holders at ``paths`` (their data and stat in
        ``got``) and delete one unchanged for its whole ttl: None then (look again);
        else how long to wait before looking again."""
        now = time.monotonic()
        wait = min(MAX_RECHECK, claim.ttl_ms / 3000, self.session_timeout / 3)
        for path, node in zip(paths, got, strict=True):
            if node is None:  # released meanwhile: its successor takes over
                self._seen.pop(path, None)
                continue
            data, stat = node
            ttl_ms, _ = _decode_data(data)
            version = int(stat.version)
            seen = self._seen.get(path)
            if seen is None or seen[0] != version:
                self._seen[path] = seen = (version, now)
            stale_at = seen[1] + ttl_ms / 1000
            if now >= stale_at:
                # unchanged for its whole ttl: its owner stopped renewing (the owner itself
                # counts its lease from before its last renewal was sent, so it knows)
                if await self._delete(path, version):
                    log.info("reaped stale ZooKeeper lease node %s", path)
                self._seen.pop(path, None)
                return None
            wait = min(wait, stale_at - now + 0.002)
        return max(wait, 0.001)

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        await self._ready()
        state = self._client.session.state.current_state
        if state == States.LOST:
            return [None] * len(claims)  # the session is gone: so is every node it made
        if state != States.CONNECTED:
            raise BackendUnavailable(f"ZooKeeper connection to {self.url} is {state}: leases at risk")
        out: list[int | None] = []
        ask: list[tuple[int, Claim, str]] = []
        for i, claim in enumerate(claims):
            path = claim.state.get("path")
            if not isinstance(path, str) or claim.state.get("sid") != self._sid:
                out.append(None)
                continue
            out.append(self._renewed_lately(claim))
            if out[-1] is None:
                ask.append((i, claim, path))
        if ask:
            async with self._bounded("a renewal"):
                stamps = await asyncio.gather(*(self._stamp(c, p) for _, c, p in ask))
            for (i, claim, _), stat in zip(ask, stamps, strict=True):
                out[i] = None if stat is None else self._granted_ms(claim)
        return out

    def _renewed_lately(self, claim: Claim) -> int | None:
        """Confirmed a moment ago (the grant itself: the core renews at once when the
        session timeout cut the lease below its ttl): the ms left from that confirmation,
        counted from when it was sent, instead of another request; None: ask."""
        stamped = claim.state.get("stamped")
        if not isinstance(stamped, tuple) or stamped[1] != claim.ttl_ms:
            return None
        granted = self._granted_ms(claim)
        left = stamped[0] * 1000 + granted - time.monotonic() * 1000
        return int(left) if left >= granted * RENEW_FRESH else None

    async def release(self, claim: Claim) -> bool:
        path = claim.state.get("path")
        self._unwatch(claim)
        if not isinstance(path, str):
            return False
        sid = claim.state.get("sid")
        if sid != self._sid:
            self._forget_node(claim)
            return False
        # an earlier release of this claim sent its delete and was interrupted
        repeated = claim.state.get("releasing") == sid
        claim.state["releasing"] = sid
        request = _Delete(path=path, version=-1)
        async with self._bounded("a release"):
            try:
                await self._send(request)
                deleted = True
            except zkexc.NoNode:
                # A retry after a dropped connection (aiozk resends a request whose reply
                # was lost) finds nothing if the first attempt deleted the node: that is
                # a release, not a loss -- unless the session changed (expired: the server
                # deleted the node). A real loss by expiry shows in the lease's own clock.
                deleted = ((request.sends > 1 or repeated)
                           and self._client.session.session_id == sid)
        self._forget_node(claim)
        self._seen.pop(path, None)
        return deleted

    async def abandon(self, claim: Claim) -> None:
        parent = self._parent(claim.name)
        prefix = f"{_KIND_PREFIX[claim.kind]}-{claim.owner}-"
        # remembered first: a create still in flight is deleted whenever it shows up
        self._abandoned[claim.owner] = (parent, prefix, time.monotonic() + ABANDONED_KEEP)
        self._prune_abandoned()
        self._unwatch(claim)
        if len(self._client.session.watch_callbacks) > 2 * len(self._watching) + 64:
            self._prune_callbacks()
        waiter = self._waiters.get(claim.owner)
        if waiter is not None and waiter.claim is claim:
            del self._waiters[claim.owner]
        path = claim.state.get("path")
        creating = bool(claim.state.get("creating"))
        if path is None and not creating:
            return
        async with self._bounded("an abandon"):
            if isinstance(path, str):
                await self._delete(path)
            # a create may have been sent whose reply never came: find it by our id
            # (requests on one session run in order, so this listing sees it)
            for child in await self._children(parent):
                if child.startswith(prefix):
                    await self._delete(f"{parent}/{child}")
        self._forget_node(claim)

    def _prune_abandoned(self) -> None:
        now = time.monotonic()
        for owner in [o for o, (_, _, until) in self._abandoned.items() if until <= now]:
            del self._abandoned[owner]

    def _sweep_abandoned(self) -> None:
        self._prune_abandoned()
        parents = {parent for parent, _, _ in self._abandoned.values()}
        if parents:
            self._spawn(self._sweep(parents))

    async def _sweep(self, parents: set[str]) -> None:
        try:
            async with asyncio.timeout(self._request_timeout):
                for parent in parents:
                    for child in await self._children(parent):
                        node = _parse(child)
                        if node is not None and node.owner in self._abandoned:
                            await self._delete(f"{parent}/{child}")
        except Exception as exc:  # retried after the next reconnect
            log.debug("sweeping abandoned ZooKeeper nodes failed: %s", exc)

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        self._waiters[waiter.claim.owner] = waiter

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        claim = waiter.claim
        if self._waiters.get(claim.owner) is waiter:
            del self._waiters[claim.owner]
        self._unwatch(claim)
        if ("path" in claim.state or claim.state.get("creating")) and not claim.state.get("granted"):
            # The core stopped waiting without a grant (a timeout, a cancellation) and
            # abandons only fair claims and writers; but every claim here keeps a place
            # in the queue, which would block the lock: give it up.
            self._spawn(self._abandon_later(claim))

    async def _abandon_later(self, claim: Claim) -> None:
        if claim.owner in self._abandoned or self._closed:
            return  # the core abandoned it already
        try:
            await self.abandon(claim)
        except Exception as exc:  # the janitor of a reconnect (or session end) covers it
            log.debug("giving up a ZooKeeper claim on %r failed: %s", claim.name, exc)

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        parent = self._parent(name)
        async with self._bounded("an inspect"):
            # nodes of claims given up here whose deletion is still under way are nobody's
            nodes = [n for n in _family_nodes(await self._children(parent), kind)
                     if n.owner not in self._abandoned]
            if not nodes:
                return LockInfo(name, False)
            first = await self._get(f"{parent}/{nodes[0].name}", watch=False)
            limit = _decode_data(first[0])[1] if first is not None else 1
            holders = _holders(nodes, limit)
            stats = await asyncio.gather(*(self._get(f"{parent}/{n.name}", False) for n in holders))
        now_wall = time.time()
        now = time.monotonic()
        live: list[tuple[_Node, int, float]] = []
        for node, got in zip(holders, stats, strict=True):
            if got is None:
                continue
            ttl_ms, _ = _decode_data(got[0])
            stat = got[1]
            seen = self._seen.get(f"{parent}/{node.name}")
            if seen is not None and seen[0] == int(stat.version) and now - seen[1] >= ttl_ms / 1000:
                continue  # stale: its owner stopped renewing
            left = (int(stat.modified) + ttl_ms) / 1000 - now_wall  # server clock, roughly
            live.append((node, int(stat.created_zxid), min(max(left, 0.0), ttl_ms / 1000)))
        if not live:
            return LockInfo(name, False, waiters=len(nodes) - len(holders))
        exclusive = [czxid for node, czxid, _ in live if node.kind in (Kind.LOCK, Kind.WRITE)]
        return LockInfo(
            name, True, holders=len(live), token=exclusive[0] if exclusive else None,
            last_token=max(czxid for _, czxid, _ in live),
            ttl_left=max(left for _, _, left in live), waiters=len(nodes) - len(holders),
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.cancel()
            with contextlib.suppress(BaseException):
                await monitor
        for task in list(self._tasks):
            task.cancel()
        for path in list(self._watching):
            self._drop_watch(path)
        self._waiters.clear()
        if not self._owns_client:
            return
        if self._started and self._healthy():
            try:
                async with asyncio.timeout(self._request_timeout):
                    await self._client.close()  # ends the session: its nodes go at once
                return
            except Exception as exc:
                log.warning("closing the ZooKeeper session failed: %s", exc)
        await self._teardown()


def _hex(sid: int | None) -> str:
    return "none" if sid is None else hex(sid)


def _check_chroot(chroot: str) -> str:
    if not isinstance(chroot, str) or not chroot.startswith("/"):
        raise ValueError(f"the chroot must be an absolute path such as '/aiolock', got {chroot!r}")
    parts = chroot.split("/")[1:]
    if chroot != "/" and (not all(parts) or any(p in (".", "..") for p in parts)):
        raise ValueError(f"bad chroot {chroot!r}: no empty, '.' or '..' components")
    if chroot != "/" and parts[0] == "zookeeper":
        raise ValueError(f"bad chroot {chroot!r}: /zookeeper is reserved by the server")
    for ch in chroot:
        if ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F or 0xD800 <= ord(ch) <= 0xF8FF or ord(ch) >= 0xFFF0:
            raise ValueError(f"bad chroot {chroot!r}: character {ch!r} is not allowed in ZooKeeper")
    return chroot.rstrip("/") or "/"


def _check_hosts(hosts: str) -> None:
    for item in hosts.split(","):
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad ZooKeeper host {item!r} in {hosts!r}: expected host:port")
