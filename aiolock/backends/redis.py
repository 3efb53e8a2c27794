"""``redis://host:port/db``, ``rediss://...``, ``unix:///path.sock``: Redis or Valkey.

One Lua script per primitive (see :mod:`aiolock.backends._redis_scripts`), run with
EVALSHA and loaded again on NOSCRIPT; release signals over one pub/sub connection (see
:mod:`aiolock.backends._redis_pubsub`). Built from a URL, the scripts run on one lean
pipelined connection (:mod:`aiolock.backends._resp`) and pub/sub on ``redis.asyncio``,
both with every option of the URL (:mod:`aiolock.backends._redis_options`; where the
lean connection cannot honour one, the scripts go through ``redis.asyncio`` too);
built from a ``redis.asyncio`` client you pass in, everything goes through that client.
Keys are ``<prefix>:<family>:{<name>}...`` (family ``lock``, ``rw``, ``sem`` or
``elect``) where the name is escaped (``%``, ``{``, ``}`` percent-encoded) so the braces
form a cluster hash tag covering every key of one lock. Waiting on a plain lock or an
election, and its hand-offs: :mod:`aiolock.backends._redis_handoff`; holder records,
``scan``, revocation and ``proclaim``: :mod:`aiolock.backends._redis_admin`.

Guarantees and limits: leases live on one Redis master. If it restarts without
persistence, or fails over to a replica that missed the latest writes, a held lease can
vanish: the watchdog then reports it lost at the next renewal, and the token counter
(if it was lost too) could repeat tokens -- where fencing matters keep AOF on with
``appendonly yes`` and ``appendfsync always`` (the default ``everysec`` can lose the
last second of acknowledged increments when the server is killed).

Errors (see :mod:`aiolock.backends._redis_errors`): connection failures, timeouts and
replies that mean "not now" (``LOADING``, ``READONLY``, ``BUSY``, ``MASTERDOWN``...) raise
:class:`aiolock.BackendUnavailable` (the connect timeout and request timeout bound every
call); refused credentials or ACL permissions raise :class:`aiolock.AccessDenied`; other
server errors raise :class:`aiolock.LockError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from hiredis import pack_command
from redis import exceptions as rexc

from ..abc import Backend, Busy, Capability, Claim, Granted, Kind, LockInfo, Waiter
from ..errors import LockError
from . import _redis_admin, _redis_handoff
from ._redis_errors import CONNECTING, redis_error
from ._redis_handoff import LOCAL_HANDOFF_S, LOCAL_HANDOFFS, Streak
from ._redis_options import resolve
from ._redis_pubsub import Signals
from ._redis_scripts import ACQUIRE, INSPECT, RELEASE, RENEW, Script
from ._redis_scripts_shared import ACQUIRE_SHARED, INSPECT_SHARED, RELEASE_SHARED
from ._resp import RespClient, ResponseError

__all__ = ["LOCAL_HANDOFFS", "LOCAL_HANDOFF_S", "RedisBackend", "redis_key_part",
           "warn_foreign_key"]

log = logging.getLogger("aiolock.backends.redis")

#: How long an abandoned claim stays barred from a late grant (ms), at least.
#: every script of the backend, loaded at connect (SCRIPT LOAD)
SCRIPTS = (ACQUIRE, RELEASE, RENEW, INSPECT, ACQUIRE_SHARED, RELEASE_SHARED, INSPECT_SHARED)
TOMBSTONE_MS = 60_000
#: How long a release through a redis-py client stays recognisable to its own resend (ms).
RELEASED_MARK_MS = 60_000
#: Names whose keys are kept made (see ``_keys``) at most; the cache is emptied beyond.
KEYS_CACHE = 1024
#: Requests in flight at once through a redis-py client (its pool holds at most 100 by
#: default in redis-py 8, and Sentinel's own pool is not configurable from a URL).
MAX_IN_FLIGHT = 64


def warn_foreign_key(key: str, name: str) -> None:
    """Log that a key of lock ``name`` holds a value aiolock did not write."""
    log.warning("the lock key %s of %r holds a value of another type, not aiolock's "
                "(WRONGTYPE: another client overwrote it): the claim is not held there, and "
                "the key is left as it is", key, name)


def redis_key_part(name: str) -> str:
    """Escape a lock name for use inside a ``{hash tag}``: no braces, reversible."""
    return name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


class RedisBackend(Backend):
    """Locks on one Redis (or Valkey) server.

    Build it from a URL with :func:`aiolock.connect`, or from a ``redis.asyncio.Redis``
    you already have: ``aiolock.connect(client)`` (that client is not closed for you).
    """

    schemes: ClassVar[tuple[str, ...]] = ("redis", "rediss", "unix")
    # plain locks, writers and candidates keep a place in the queue that inspect() counts
    waiting_counted: ClassVar[frozenset[Kind]] = frozenset({Kind.LOCK, Kind.WRITE, Kind.LEADER})
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.FAIR, Capability.RWLOCK, Capability.SEMAPHORE, Capability.EVENTS,
         Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS, Capability.SCAN,
         Capability.REVOKE, Capability.ELECTION}
    )

    #: Take a hand-off message (or a local hand-off's reply) as the grant, without a
    #: round trip. Sentinel does not: the round trip also finds the current master.
    trust_handoffs: ClassVar[bool] = True
    #: A PUBLISH's count of receivers tells whether a waiter's process still listens
    #: (see ``WAITER`` in ``_redis_scripts``): every subscriber is on the one server the
    #: scripts run on. Not on Cluster (a subscriber may sit on another node) nor
    #: Sentinel (on a replica, during a failover): their releases read waiter keys.
    publish_counts: ClassVar[bool] = True
    #: Register waiting claims on the server and hand the lock to them at release (one
    #: process woken per release, issue 10). Redlock turns it off for its nodes: a node
    #: must never grant one of its claims on its own, a majority decides.
    handoffs: bool = True

    def __init__(
        self, client: Any, *, prefix: str = "aiolock", request_timeout: float = 5.0,
        url: str | None = None, owns_client: bool = False, resp: RespClient | None = None,
        connect_timeout: float = 5.0, signals: Signals | None = None,
    ) -> None:
        if not isinstance(prefix, str) or not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must be a non-empty str without braces, got {prefix!r}")
        self._client = client
        self._prefix = prefix
        self._owns_client = owns_client
        self._url = url or _client_url(client)
        self._resp = resp
        self.ordered = resp is not None  # one pipelined connection carries every script
        self._connect_timeout = connect_timeout
        # A redis-py client's pool fails at once when all its connections are busy
        # (MaxConnectionsError): requests through one wait for one of MAX_IN_FLIGHT slots.
        self._raw_call: Callable[..., Awaitable[Any]] = client.execute_command
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._call: Callable[..., Awaitable[Any]] = (
            resp.call if resp is not None else self._limited_call
        )
        self._request_timeout = request_timeout
        self._gates: dict[tuple[str, str], _Gate] = {}  # see try_acquire
        self._streaks: dict[str, Streak] = {}  # lock key -> local hand-offs in a row
        self._fixed_keys: dict[tuple[str, Kind], tuple[str, ...]] = {}  # see _keys
        #: this process's pub/sub channel for the hand-offs of plain locks (see RELEASE)
        self.inbox = f"{prefix}:inbox:{uuid.uuid4().hex}"
        self.signals = signals if signals is not None else Signals(client, request_timeout)

    @classmethod
    def from_url(
        cls, url: str, *, connect_timeout: float | None = None,
        request_timeout: float | None = None, prefix: str | None = None,
        **redis_options: Any,
    ) -> RedisBackend:
        """``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS),
        ``unix:///path/to/redis.sock?db=0``. Every other option ``redis.asyncio``
        accepts for the URL (in its query or as a keyword: TLS files, credentials, a
        credential provider, client name...) applies to every connection; an unknown
        one raises ValueError (see :mod:`aiolock.backends._redis_options`)."""
        parts = urlsplit(url)
        safe = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2], query=""))
        if parts.scheme in ("redis", "rediss"):
            if not parts.hostname:
                raise ValueError(f"expected redis://host:port/db, got {safe!r}")
            try:
                parts.port  # noqa: B018 -- validates the port
            except ValueError as exc:
                raise ValueError(f"bad port in {safe!r}: {exc}") from None
            db = parts.path.strip("/")
            if db and not db.isdigit():
                raise ValueError(f"the database in {safe!r} must be a number, got {db!r}")
        elif not parts.path:
            raise ValueError(f"expected unix:///path/to/redis.sock, got {safe!r}")
        options = resolve(url, safe, redis_options, connect_timeout=connect_timeout,
                          request_timeout=request_timeout, prefix=prefix)
        client = options.client()  # pub/sub; and the scripts if the lean one cannot
        from ._redis_txn import scripting_class  # issue 15: ?scripting=off|on|auto, see there
        return scripting_class(cls, options.scripting)(
            client, prefix=options.prefix, request_timeout=options.request_timeout, url=safe,
            owns_client=True, resp=options.resp, connect_timeout=options.connect_timeout)

    @property
    def url(self) -> str:
        return self._url

    @property
    def client(self) -> Any:
        """The ``redis.asyncio`` client in use."""
        return self._client

    # -- keys -------------------------------------------------------------------------------

    def _base(self, name: str, kind: Kind = Kind.LOCK) -> str:
        return f"{self._prefix}:{kind.family}:{{{redis_key_part(name)}}}"

    def _keys(self, name: str, owner: str, kind: Kind = Kind.LOCK) -> list[str]:
        # the keys of a name are made once (each acquire and release asks for them),
        # in a cache emptied when it grows beyond KEYS_CACHE names
        fixed = self._fixed_keys.get((name, kind))
        if fixed is None:
            base = self._base(name, kind)
            fixed = (base, base + ":seq", base + ":q", base + ":qt", base + ":x:")
            if kind not in _HANDOFF:
                fixed += (base + ":h", base + ":ht")
            if len(self._fixed_keys) >= KEYS_CACHE:
                self._fixed_keys.clear()
            self._fixed_keys[name, kind] = fixed
        keys = list(fixed)
        keys[4] += owner
        return keys

    # -- running scripts ------------------------------------------------------------------

    async def _limited_call(self, *args: Any) -> Any:
        task = asyncio.current_task()
        asked = task.cancelling() if task is not None else 0
        async with self._in_flight:
            result = await self._raw_call(*args)
        if task is not None and task.cancelling() > asked:
            # redis-py writes through asyncio.wait_for(), which on Python 3.11 swallows a
            # cancellation that arrives as the write completes (gh-86296): the request ran,
            # but our caller was cancelled. Raise it here, so the core abandons the claim
            # the request may have granted, instead of carrying on as if not cancelled.
            # A step of the loop first: a canceller that cancels until it is heard (anyio's
            # cancel scopes) cancels again, with the message by which it knows its own.
            await asyncio.sleep(0)
            raise asyncio.CancelledError
        return result

    async def _run(
        self, script: Script, keys: Sequence[str], *args: Any,
        on_retry: Callable[[], object] | None = None,
    ) -> Any:
        resp = self._resp
        request = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            try:
                if resp is not None:  # as resp.call(), without its frame
                    return (await resp.send(pack_command(request), on_retry=on_retry))[0]
                return await self._call(*request)
            except (ResponseError, rexc.NoScriptError) as exc:
                if not str(exc).startswith("NOSCRIPT") and not isinstance(exc, rexc.NoScriptError):
                    raise
                await self._load_scripts(script)
                if resp is not None:
                    return await resp.call(*request, on_retry=on_retry)
                return await self._call(*request)
        except _ERRORS as exc:
            raise redis_error(exc, self._url, script.name) from exc

    async def _load_scripts(self, script: Script | None = None) -> None:
        """Load every script, not only the missing one: the server lost them all at once
        (first use, restart, ``SCRIPT FLUSH``), and on one ordered connection a release
        that waits to load its script must not be overtaken by an acquire whose script
        is already there (the core wakes that acquire as soon as the release is sent)."""
        scripts = SCRIPTS if script is None or script in SCRIPTS else (*SCRIPTS, script)
        if self.ordered:  # one pipelined burst
            await asyncio.gather(*(self._call("SCRIPT", "LOAD", s.source) for s in scripts))
        else:
            for each in scripts:
                await self._call("SCRIPT", "LOAD", each.source)

    # -- primitives -------------------------------------------------------------------------

    async def connect(self) -> None:
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self._call("PING")
                if self.ordered:
                    await self._load_scripts()  # now rather than at the first NOSCRIPT
        except _ERRORS as exc:
            raise redis_error(exc, self._url, CONNECTING) from exc

    def try_acquire(self, claim: Claim) -> Coroutine[Any, Any, Granted | Busy]:
        # not a coroutine itself: it hands back the one of the step that runs (a frame
        # less per attempt)
        if self.ordered or not (claim.fair or claim.kind is Kind.WRITE):
            return self._try_acquire(claim)
        return self._gated_try_acquire(claim)

    async def _gated_try_acquire(self, claim: Claim) -> Granted | Busy:
        # Claims that take a place in the server's queue must reach it in the order they
        # were made; a connection pool may reorder concurrent requests (one may wait for
        # a new connection), so those of one name go one at a time, first come first.
        key = (claim.kind.family, claim.name)
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = _Gate()
        gate.users += 1
        try:
            async with gate.lock:
                return await self._try_acquire(claim)
        finally:
            gate.users -= 1
            if not gate.users:
                del self._gates[key]

    def _try_acquire(self, claim: Claim) -> Coroutine[Any, Any, Granted | Busy]:
        if claim.kind in _HANDOFF:
            return _redis_handoff.try_lock(self, claim)
        return self._try_acquire_shared(claim)

    async def _try_acquire_shared(self, claim: Claim) -> Granted | Busy:
        keys = self._keys(claim.name, claim.owner, claim.kind)
        fair = "1" if claim.fair else "0"
        reply = await self._run(
            ACQUIRE_SHARED, keys, claim.owner, claim.ttl_ms, fair, claim.ttl_ms,
            _KIND[claim.kind], claim.limit, claim.info,
        )
        if reply[0] == 1:
            return Granted(int(reply[1]), int(reply[2]))
        if reply[0] == -1:
            raise LockError(f"claim on {claim.name!r} was abandoned")
        return Busy(max(int(reply[1]), 1) / 1000)

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        keys, args = self._renew_request(claims)
        reply = await self._run(RENEW, keys, *args)
        return [int(ms) or None for ms in reply]

    def _renew_request(self, claims: Sequence[Claim]) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV of one ``RENEW`` script call for ``claims``."""
        keys: list[str] = []
        args: list[Any] = []
        for claim in claims:
            base = self._base(claim.name, claim.kind)
            if claim.kind.exclusive:
                keys += (base, base)
                args += ("h", claim.owner, claim.ttl_ms)
            else:
                keys += (base + ":h", base + ":ht")
                args += ("z", claim.owner, claim.ttl_ms)
        return keys, args

    async def release(self, claim: Claim) -> bool:
        keys = self._keys(claim.name, claim.owner, claim.kind)
        handoffs = claim.kind in _HANDOFF
        noted = not handoffs and self.signals.note_local_release(keys[0], claim.owner)
        heir, local = (_redis_handoff.heir(self, claim, keys[0]) if handoffs and self.handoffs
                       else (None, []))
        handoff = None
        if heir is not None:  # its acquire waits for this release (see _redis_handoff)
            handoff = heir.state["handoff"] = asyncio.get_running_loop().create_future()
        released = False
        retried: list[bool] = []
        try:
            released = bool(await self._release(claim, keys, abandon=False, heir=heir,
                                                local=local, on_retry=lambda: retried.append(True)))
            # A retry after a dropped connection finds nothing if the first try already
            # released it: that is a release, not a loss (a real expiry shows in
            # Lease.lost from the client's own clock).
            released = released or bool(retried)
        finally:
            if noted and not released:
                self.signals.forget_local_release(claim.owner)  # nothing was published
            if handoff is not None:
                assert heir is not None
                heir.state.pop("handoff", None)
                handoff.set_result(None)
        return released

    async def abandon(self, claim: Claim) -> None:
        self.signals.claims.pop(claim.owner, None)
        try:
            await self._release(claim, self._keys(claim.name, claim.owner, claim.kind),
                                abandon=True)
        except BaseException:
            if claim.kind in _HANDOFF and self.handoffs:  # its queue entry may stay
                self.signals.orphan(claim, self.abandon)
            raise

    async def _release(
        self, claim: Claim, keys: list[str], *, abandon: bool, heir: Claim | None = None,
        local: Sequence[Claim] = (), on_retry: Callable[[], object] | None = None,
    ) -> Any:
        """Run RELEASE (abandon: as an abandon); the reply's first item, 1 if it held.
        A key of the lock that another client overwrote with another type (WRONGTYPE:
        the script stopped at its first read, changing nothing) is not held: 0, and a
        warning saying so (an abandon still bars a late grant of the claim)."""
        try:
            return await self._release_script(claim, keys, abandon=abandon, heir=heir,
                                              local=local, on_retry=on_retry)
        except LockError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
        warn_foreign_key(keys[0], claim.name)
        if abandon:
            with contextlib.suppress(Exception):  # best effort, as the abandon itself
                await self._call("SET", keys[4], "a", "PX", max(TOMBSTONE_MS, 2 * claim.ttl_ms))
        return 0

    def _release_script(
        self, claim: Claim, keys: list[str], *, abandon: bool, heir: Claim | None,
        local: Sequence[Claim], on_retry: Callable[[], object] | None,
    ) -> Coroutine[Any, Any, Any]:  # the script's coroutine (a frame less per release)
        flag = "1" if abandon else "0"
        # A redis-py client resends a request whose reply was lost (its retry policy),
        # and the resent RELEASE would find nothing: leave a marker it recognises. Our
        # own connection retries itself and tells us (on_retry): no marker needed.
        tomb = max(TOMBSTONE_MS, 2 * claim.ttl_ms) if abandon else (
            0 if self._resp is not None else RELEASED_MARK_MS)
        if claim.kind not in _HANDOFF:
            return self._run(
                RELEASE_SHARED, keys, claim.owner, keys[0], flag, tomb, _KIND[claim.kind],
                on_retry=on_retry,
            )
        return _redis_handoff.release_lock(self, claim, keys, flag, tomb, heir, local, on_retry)

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        channel = self._base(name, kind)
        if kind in _HANDOFF and self.handoffs:  # hand-offs come to the inbox (see RELEASE)
            await self.signals.listen(channel, waiter, self.inbox)
            if kind is not Kind.LEADER:
                return
        await self.signals.listen(channel, waiter)  # an election's changes: its channel

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        self.signals.unlisten(self._base(name, kind), waiter)

    # -- holders, listing, revocation (see _redis_admin) ----------------------------------

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        return await _redis_admin.inspect(self, name, kind)

    async def set_info(self, claim: Claim) -> bool:
        return await _redis_admin.set_info(self, claim)

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        return await _redis_admin.force_release(self, name, kind)

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        async for info in _redis_admin.scan(self, prefix):
            yield info

    async def _scan_keys(self, match: str) -> AsyncIterator[Any]:
        """Every key matching ``match`` (``SCAN``: never blocks the server)."""
        cursor: Any = 0
        while True:
            try:
                cursor, keys = await self._call("SCAN", cursor, "MATCH", match, "COUNT",
                                                _redis_admin.SCAN_COUNT)
            except _ERRORS as exc:
                raise redis_error(exc, self._url, "scan") from exc
            for key in keys:
                yield key
            if int(cursor) == 0:
                return

    async def aclose(self) -> None:
        await self.signals.aclose()
        if self._resp is not None:
            await self._resp.aclose()
        if self._owns_client:
            await self._client.aclose()


#: What a Redis I/O call may raise (mapped by redis_error).
_ERRORS: tuple[type[BaseException], ...] = (
    ConnectionError, TimeoutError, OSError, ResponseError, rexc.RedisError,
)
_KIND = {Kind.READ: "r", Kind.WRITE: "w", Kind.PERMIT: "p"}
#: Kinds kept in a plain lock's keys and scripts (ACQUIRE/RELEASE, hand-offs to waiters).
_HANDOFF = frozenset({Kind.LOCK, Kind.LEADER})


class _Gate:
    """Queued acquire attempts of one name, sent one at a time (see try_acquire)."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


def _client_url(client: Any) -> str:
    try:
        kwargs = client.connection_pool.connection_kwargs
        if "path" in kwargs:
            return f"unix://{kwargs['path']}"
        return f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    except AttributeError:
        return f"redis://<{type(client).__name__}>"
