"""``postgresql://user@host:port/db`` (also ``postgres://``): PostgreSQL with ``asyncpg``.

How it works
------------
* **Advisory mode** (default): a lock is a *session* advisory lock on a 64-bit key, the
  first 8 bytes of ``blake2b(family NUL name)`` as a signed int64, so ``lock()``,
  ``rwlock()`` and ``semaphore()`` of one name never collide. ``rwlock().read()`` takes
  the shared advisory lock, ``write()`` the exclusive one. A semaphore of ``limit`` has
  ``limit`` slot keys and a permit is any free slot.
* An advisory lock belongs to a connection, so **every held claim keeps its own
  connection** from a bounded pool (``max_connections``, default 50) for the whole lease;
  when the pool is exhausted for ``pool_timeout`` seconds, :class:`BackendUnavailable`.
* **Fencing tokens** come from ``aiolock_tokens(name, family, token)`` (upsert ... RETURNING
  in the same statement that takes the lock): strictly increasing per name and family, as
  long as the table is kept. ``aiolock_holders`` records who holds what for ``inspect()``.
* **Expiry on the server**: while a claim is held its session has
  ``idle_session_timeout = ttl``; each renewal is a statement on that session and so
  restarts the timer. A holder that stops renewing (paused, partitioned, or its event loop
  stuck) is disconnected by the server ``ttl`` after its last renewal, which frees the lock.
  A holder whose process dies frees it at once (its socket closes).
* **Waiting** happens in PostgreSQL's own lock queue: a waiting claim (the head of the
  local queue, or every fair claim) issues a blocking ``pg_advisory_lock`` on a pooled
  connection, so it is granted the moment the lock frees -- released, expired, or its
  holder's connection dropped -- with no polling and no missed signal. That queue is first
  come, first served, and a queued writer blocks new readers (PostgreSQL does not let a new
  request jump a queued conflicting one), so **fair=True is supported and waiting writers
  are not starved**. Semaphore waiters cannot queue for "any slot": a release sends
  ``NOTIFY aiolock_sem`` (one ``LISTEN`` connection per backend carries them), and since
  a dead holder sends nothing they also retry every ``poll_interval`` (default 0.5 s).
* **Holder records** (``Capability.HOLDERS``): the grant statement also writes the
  claim's record (``Claim.info``), the grant time on the server's clock and the advisory
  key into its ``aiolock_holders`` row -- no extra round trip. ``inspect()`` lists, in
  ``held_by``, every row whose session holds the lock (each reader, each permit), with
  ``since`` from the server's clock. Tables made by an older aiolock get the new columns
  (:data:`MIGRATE_SQL`) from their owner's first connection; under least privileges that
  is :class:`aiolock.AccessDenied` at connect, naming the statement to run.
* **Listing** (``Capability.SCAN``): one plain ``SELECT`` of the holder rows whose session
  holds the advisory lock (joined with ``pg_locks``), names matched with ``LIKE`` (the
  prefix's ``%``, ``_`` and ``!`` escaped). It locks no row and blocks no writer.
* **Revocation** (``Capability.REVOKE``): ``force_release`` deletes the holder rows of the
  name's family; each holder's next renewal (within ``ttl/3``) finds its row gone, answers
  ``REVOKED``, and the holder unlocks on its connection as the core abandons the lease.
  Sessions are **not** terminated (``pg_terminate_backend`` needs the holder's role or
  ``pg_signal_backend``, and would hide the reason): a revoked holder that is paused keeps
  the advisory lock until its ``idle_session_timeout`` (``ttl``) ends its session. Tokens
  live in ``aiolock_tokens``, untouched: they keep increasing.
* **Elections** (``Capability.ELECTION``): the leadership is an exclusive advisory lock
  in family ``"elect"``; candidates queue on the server (first come, first served), the
  term is the token. A grant of the leadership ``NOTIFY``s in its grant statement, as do
  ``set_info`` (``proclaim``), a release and a revocation, on the channel semaphores use:
  observers are woken through the backend's one ``LISTEN`` connection (re-opened by
  itself if it drops), and read the leader with ``inspect()``. A dead leader sends
  nothing, but its successor's grant does.
* **Row mode** (``?mode=row``, :class:`PostgresRowBackend`): the ``SELECT ... FOR UPDATE``
  row lock of the design notes. The claim's connection holds a transaction open on one
  row of ``aiolock_rows`` (``FOR UPDATE NOWAIT`` to try, plain ``FOR UPDATE`` to wait);
  server expiry is ``idle_in_transaction_session_timeout``. Mutex only (no rwlock or
  semaphore), tokens committed on a second connection. It keeps holder records
  (``HOLDERS``), but offers no ``SCAN`` (a row lock is not in ``pg_locks``: telling held
  from free takes a locking probe per name, which would make a concurrent ``NOWAIT``
  try fail), no ``REVOKE`` (not built: its renewals would have to look for their holder
  row, and telling live rows from stale ones takes that same probe), and no ``ELECTION``
  (mutex only).

Guarantees and limits
---------------------
* A lease is lost when its connection drops (server restart, network failure, idle
  timeout): PostgreSQL frees the lock at once, and this holder learns it at its next
  renewal (at most ``ttl/3`` later), when ``renew`` finds the connection gone. Between the
  two it still believes it holds the lock: **fencing tokens are what protect a resource**.
* A paused holder keeps its advisory lock as long as its TCP connection lives and the
  ``idle_session_timeout`` has not fired, i.e. at most ``ttl`` after its last renewal; a
  half-open TCP connection (host gone without a FIN) is ended by that same timeout.
* ``ttl_ms`` granted is nominal: the server enforces it as the idle timeout of the
  session, counted from the end of the last statement, which is never earlier than the
  moment the client sent it (so the client's view of the expiry is conservative).
* Tokens survive server restarts (the table is WAL-logged); a restart loses every lease.
* Each held lease and each waiting head costs one server connection: size
  ``max_connections`` of the server accordingly. Session advisory locks need a direct
  session: a pooler in transaction mode (PgBouncer ``pool_mode=transaction``) breaks them.
* Needs PostgreSQL 14 or later (``idle_session_timeout``); row mode works from 9.6.

Options (URL query or keyword): ``connect_timeout`` (s, 5), ``request_timeout`` (s, 5),
``max_connections`` (50), ``pool_timeout`` (s, defaults to ``connect_timeout``),
``poll_interval`` (s, 0.5), ``mode`` (``advisory`` or ``row``). Connection errors raise
:class:`aiolock.BackendUnavailable`; other server errors :class:`aiolock.LockError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import hashlib
import importlib
import inspect
import logging
import math
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .._holder import Holder, decode_holder
from ..abc import (
    FAMILY_KIND,
    REVOKED,
    Backend,
    Busy,
    Capability,
    Claim,
    Granted,
    Kind,
    LockInfo,
    Waiter,
)
from ..errors import AccessDenied, BackendUnavailable, LockError
from ._pool import Pool

try:
    _ASYNCPG: Any = importlib.import_module("asyncpg")
except ImportError as _exc:  # reported by aiolock.connect() with the extra to install
    raise ImportError(
        "the postgresql:// backend needs asyncpg: pip install 'aiolock[postgres]'", name="asyncpg"
    ) from _exc

__all__ = ["PostgresBackend", "PostgresRowBackend", "advisory_key"]

log = logging.getLogger("aiolock")

#: A ``Busy.retry_after`` while a blocking wait is queued on the server: the wait itself
#: wakes the waiter; this only bounds an in-memory re-check.
QUEUED_RECHECK = 5.0

_SCHEMA_KEY_TEXT = "aiolock\0schema"
#: The NOTIFY channel of semaphore releases; the payload is the semaphore's base key.
_CHANNEL = "aiolock_sem"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS aiolock_tokens (
    name text NOT NULL,
    family text NOT NULL,
    token bigint NOT NULL,
    PRIMARY KEY (family, name)
);
CREATE TABLE IF NOT EXISTS aiolock_holders (
    family text NOT NULL,
    name text NOT NULL,
    owner text NOT NULL,
    kind text NOT NULL,
    token bigint NOT NULL,
    pid integer NOT NULL,
    expires_at timestamptz NOT NULL,
    info text,
    since timestamptz,
    key bigint,
    PRIMARY KEY (family, name, owner)
);
CREATE TABLE IF NOT EXISTS aiolock_rows (
    family text NOT NULL,
    name text NOT NULL,
    PRIMARY KEY (family, name)
);
"""

#: Brings an ``aiolock_holders`` made by aiolock before holder records up to date (the
#: table's owner must run it; :data:`_SCHEMA` alone does not change an existing table).
MIGRATE_SQL = (
    "ALTER TABLE aiolock_holders ADD COLUMN IF NOT EXISTS info text,"
    " ADD COLUMN IF NOT EXISTS since timestamptz, ADD COLUMN IF NOT EXISTS key bigint;"
)

#: ``(tables, columns)``: every table of :data:`_SCHEMA` exists on the search path, and
#: ``aiolock_holders`` has the columns :data:`MIGRATE_SQL` adds.
_TABLES_PRESENT = """
SELECT to_regclass('aiolock_tokens') IS NOT NULL AND to_regclass('aiolock_holders') IS NOT NULL
   AND to_regclass('aiolock_rows') IS NOT NULL AS tables,
   (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass('aiolock_holders')
     AND attname IN ('info', 'since', 'key') AND NOT attisdropped) = 3 AS columns
"""

#: Record the grant: bump the token, note the holder (its record ``$8`` and the grant
#: time on the server clock), start the server-side expiry, and for an election's leader
#: NOTIFY its observers -- all in the statement that takes the lock (no extra round trip).
#: ``$1`` family, ``$2`` name, ``$3`` owner, ``$4`` kind, ``$5`` ttl ms, ``$6`` the
#: timeout setting to arm (idle_session_timeout, or the in-transaction one in row mode),
#: ``$8`` the holder record (``Claim.info``).
_GRANT_CTES = """
t AS (
    INSERT INTO aiolock_tokens AS t (name, family, token)
    SELECT $2, $1, 1 FROM l WHERE l.ok
    ON CONFLICT (family, name) DO UPDATE SET token = t.token + 1
    RETURNING t.token
),
gone AS (
    DELETE FROM aiolock_holders
    WHERE family = $1 AND name = $2 AND expires_at < clock_timestamp() - interval '1 minute'
),
h AS (
    INSERT INTO aiolock_holders AS h (family, name, owner, kind, token, pid, expires_at, info,
                                      since, key)
    SELECT $1, $2, $3, $4, t.token, pg_backend_pid(),
           clock_timestamp() + $5::bigint * interval '1 millisecond', $8::text, clock_timestamp(),
           l.k
    FROM t CROSS JOIN l
    ON CONFLICT (family, name, owner) DO UPDATE
        SET token = excluded.token, pid = excluded.pid, expires_at = excluded.expires_at,
            info = excluded.info, since = excluded.since, key = excluded.key
    RETURNING h.token
)
SELECT l.ok, l.k, (SELECT token FROM h) AS token,
       CASE WHEN l.ok AND $6 <> '' THEN set_config($6, $5::bigint::text, false) END AS armed,
       CASE WHEN l.ok AND $4 = 'leader' THEN pg_notify('""" + _CHANNEL + """', l.k::text)::text
       END AS notified
FROM l
"""

#: Try one key (``$7``), exclusive or shared.
_TRY_EXCLUSIVE = (
    "WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock($7::bigint) AS ok, $7::bigint AS k),"
    + _GRANT_CTES
)
_TRY_SHARED = (
    "WITH l AS MATERIALIZED (SELECT pg_try_advisory_lock_shared($7::bigint) AS ok, $7::bigint AS k),"
    + _GRANT_CTES
)
#: Try the slot keys ``$7`` in order; the first free one is taken (a semaphore permit).
_TRY_SLOTS = (
    "WITH f AS MATERIALIZED (SELECT u.k FROM unnest($7::bigint[]) WITH ORDINALITY AS u(k, i)"
    " WHERE pg_try_advisory_lock(u.k) ORDER BY u.i LIMIT 1),"
    " l AS MATERIALIZED (SELECT (SELECT k FROM f) IS NOT NULL AS ok, (SELECT k FROM f) AS k),"
    + _GRANT_CTES
)
#: Record a grant already held by this session (after a blocking wait, or in row mode).
_GRANT_HELD = "WITH l AS MATERIALIZED (SELECT true AS ok, $7::bigint AS k)," + _GRANT_CTES

#: Extend a held claim; ``kept`` is false when its holder row is gone: an operator
#: revoked it (``force_release`` deletes the rows of the holders it revokes).
_RENEW = """
WITH u AS (
    UPDATE aiolock_holders SET expires_at = clock_timestamp() + $4::bigint * interval '1 millisecond'
    WHERE family = $1 AND name = $2 AND owner = $3
    RETURNING 1
)
SELECT set_config($5, $4::bigint::text, false), EXISTS (SELECT 1 FROM u) AS kept
"""

_FORGET_HOLDER = "DELETE FROM aiolock_holders WHERE family = $1 AND name = $2 AND owner = $3"

_UNLOCK_ALL = (
    "SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', '0', false),"
    " set_config('idle_in_transaction_session_timeout', '0', false)"
)

_INSPECT_LOCKS = """
SELECT l.pid, l.mode, l.granted
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY($1::bigint[])
"""

_INSPECT_ROWS = """
SELECT (SELECT token FROM aiolock_tokens WHERE family = $1 AND name = $2) AS last,
       h.owner, h.kind, h.token, h.pid, h.info,
       extract(epoch FROM h.expires_at - clock_timestamp()) AS left_s,
       extract(epoch FROM clock_timestamp() - h.since) AS since_s
FROM (SELECT 1) AS one
LEFT JOIN aiolock_holders h ON h.family = $1 AND h.name = $2
ORDER BY h.token
"""

#: True where session ``pid`` holds the advisory lock ``key`` (any key: a row from before
#: the ``key`` column). A plain read of ``pg_locks``: it blocks no one.
_HOLDS = """EXISTS (
    SELECT 1 FROM pg_locks l
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 AND l.pid = {pid}
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND ({key} IS NULL OR ((l.classid::bigint << 32) | l.objid::bigint) = {key}))"""

#: ``scan``: every holder row whose session really holds its advisory lock, for names
#: ``LIKE $1`` (the prefix with ``!``, ``%`` and ``_`` escaped), with the name's last token
#: and how many wait on the server for the holder's key. Plain SELECTs: no row is locked.
_SCAN = """
SELECT h.family, h.name, h.kind, h.token, h.info,
       extract(epoch FROM h.expires_at - clock_timestamp()) AS left_s,
       extract(epoch FROM clock_timestamp() - h.since) AS since_s,
       (SELECT t.token FROM aiolock_tokens t WHERE t.family = h.family AND t.name = h.name) AS last,
       (SELECT count(*) FROM pg_locks w
        WHERE w.locktype = 'advisory' AND NOT w.granted AND w.objsubid = 1
          AND ((w.classid::bigint << 32) | w.objid::bigint) = h.key) AS waiting
FROM aiolock_holders h
WHERE h.name LIKE $1 ESCAPE '!' AND """ + _HOLDS.format(pid="h.pid", key="h.key") + """
ORDER BY h.name, h.family, h.token
"""

#: ``force_release``: delete every holder row of ``$1``/``$2`` (each holder's next renewal
#: then finds its row gone: revoked), counting those whose session held the lock; NOTIFY
#: ``$3`` (the name's signal key, for elections and semaphores) when it is not null.
_REVOKE = """
WITH d AS (
    DELETE FROM aiolock_holders h WHERE h.family = $1 AND h.name = $2 RETURNING h.pid, h.key
)
SELECT (SELECT count(*) FROM d WHERE """ + _HOLDS.format(pid="d.pid", key="d.key") + """) AS live,
       CASE WHEN $3::text IS NOT NULL THEN pg_notify('""" + _CHANNEL + """', $3::text)::text
       END AS notified
"""

#: ``set_info`` (an elected leader's ``proclaim``): replace the record, NOTIFY observers.
_SET_INFO = """
WITH u AS (
    UPDATE aiolock_holders SET info = $4 WHERE family = $1 AND name = $2 AND owner = $3
    RETURNING 1
)
SELECT EXISTS (SELECT 1 FROM u) AS kept, pg_notify('""" + _CHANNEL + """', $5::text)::text
"""


def advisory_key(family: str, name: str, slot: int | None = None) -> int:
    """The signed 64-bit advisory lock key of ``name`` in ``family`` (and a slot)."""
    text = f"{family}\0{name}" if slot is None else f"{family}\0{name}\0{slot}"
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _signal_key(kind: Kind, name: str) -> int | None:
    """The NOTIFY payload key of ``name``'s releases (semaphores) and of its leadership
    changes (elections); None for the kinds whose waiters queue on the server."""
    if kind is Kind.PERMIT:
        return advisory_key("sem", name)
    if kind is Kind.LEADER:
        return advisory_key("elect", name)
    return None


def _escape_like(prefix: str) -> str:
    """``prefix`` as a ``LIKE ... ESCAPE '!'`` pattern matching names that start with it."""
    return prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%"


def _asyncpg() -> Any:
    """``asyncpg``, imported with this module (it has no type information)."""
    return _ASYNCPG


def _check_keywords(names: set[str], ours: set[str]) -> None:
    """Keyword options that are neither ours nor ``asyncpg.connect``'s are refused."""
    theirs = {n for n in inspect.signature(_asyncpg().connect).parameters
              if n not in ("dsn", "timeout", "connection_class", "record_class", "loop")}
    unknown = sorted(names - theirs)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for postgresql://; accepted: "
            f"{', '.join(sorted(ours))}, and asyncpg.connect()'s: {', '.join(sorted(theirs))}"
        )


def _check_query(url: str, names: list[str], ours: set[str]) -> None:
    """Query parameters that are not ours go to asyncpg (libpq keywords such as
    ``sslmode``; anything else becomes a server setting, checked by the server at
    connect). One that looks like a misspelling of ours is refused now."""
    for name in names:
        close = difflib.get_close_matches(name, sorted(ours), n=1, cutoff=0.75)
        if close:
            raise ValueError(
                f"unknown option {name!r} in {_safe_url(url)!r}: did you mean {close[0]!r}? "
                f"aiolock's options: {', '.join(sorted(ours))}"
            )


def _is_denied(exc: BaseException) -> bool:
    """A refused login or a missing privilege (SQLSTATE 28000, 28P01, 42501)."""
    errors = _asyncpg().exceptions
    return isinstance(exc, (errors.InsufficientPrivilegeError, errors.InvalidPasswordError,
                            errors.InvalidAuthorizationSpecificationError))


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    apg = _asyncpg()
    return isinstance(
        exc,
        (apg.PostgresConnectionError, apg.InterfaceError, apg.exceptions.OperatorInterventionError,
         apg.exceptions.ConnectionDoesNotExistError),
    ) and not isinstance(exc, apg.exceptions.QueryCanceledError)


async def _close(conn: Any) -> None:
    try:
        await conn.close(timeout=1.0)
    except BaseException:
        conn.terminate()
        raise


@dataclass(slots=True, eq=False)
class _State:
    """What this backend keeps on a :class:`Claim` (in ``claim.state["pg"]``)."""

    keys: list[int]
    conn: Any = None  #: the connection holding the lock once granted
    key: int = 0  #: the key actually held (the slot, for a semaphore)
    token: int = 0
    mutex: asyncio.Lock = field(default_factory=asyncio.Lock)  #: one statement at a time on conn
    op: asyncio.Task[Any] | None = None  #: an attempt in flight (shielded from cancellation)
    wait: asyncio.Task[Any] | None = None  #: a blocking wait queued on the server
    waiter: Waiter | None = None
    cleanup: asyncio.Task[None] | None = None
    release: asyncio.Task[bool] | None = None
    abandoned: bool = False


def _number(what: str, value: object, *, integer: bool = False) -> float:
    if isinstance(value, str):
        try:
            value = int(value) if integer else float(value)
        except ValueError:
            raise ValueError(f"{what} must be a {'whole ' if integer else ''}number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or (
        integer and not isinstance(value, int)
    ) or not math.isfinite(value):
        raise ValueError(f"{what} must be a {'whole ' if integer else ''}number > 0, got {value!r}")
    return value


class PostgresBackend(Backend):
    """Locks on one PostgreSQL database: session advisory locks (see the module doc).

    ``PostgresBackend.from_url("postgresql://user@host:5432/db")``; ``?mode=row`` gives
    :class:`PostgresRowBackend`.
    """

    schemes: ClassVar[tuple[str, ...]] = ("postgresql", "postgres")
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.FAIR, Capability.RWLOCK, Capability.SEMAPHORE, Capability.EVENTS,
         Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS, Capability.SCAN,
         Capability.REVOKE, Capability.ELECTION}
    )
    #: the session setting that makes the server end a holder that stops renewing
    _expiry_setting: ClassVar[str] = "idle_session_timeout"

    def __init__(
        self, dsn: str, *, connect_timeout: float = 5.0, request_timeout: float = 5.0,
        max_connections: int = 50, pool_timeout: float | None = None, poll_interval: float = 0.5,
        url: str | None = None, **connect_options: Any,
    ) -> None:
        self._dsn = dsn
        self._connect_timeout = _number("connect_timeout", connect_timeout)
        self._request_timeout = _number("request_timeout", request_timeout)
        size = int(_number("max_connections", max_connections, integer=True))
        wait = self._connect_timeout if pool_timeout is None else _number("pool_timeout", pool_timeout)
        self._poll = _number("poll_interval", poll_interval)
        self._connect_options = connect_options
        self._url = url or _safe_url(dsn)
        self._pool = Pool(self._new_connection, size, wait, self._url, alive=lambda c: not c.is_closed(),
                           drop=lambda c: c.terminate(), close=_close)
        self._schema_ready = False
        self._schema_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        # semaphore release signals: LISTEN on one dedicated connection, by base key
        self._signals: dict[int, set[Waiter]] = {}
        self._listener: Any = None
        self._listener_lock = asyncio.Lock()
        self._relisten_task: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresBackend:
        """``postgresql://[user[:password]@]host[:port]/database[?option=value&...]``.

        Options (query or keyword): ``mode`` (``advisory``/``row``), ``connect_timeout``,
        ``request_timeout``, ``max_connections``, ``pool_timeout``, ``poll_interval``;
        other query parameters (e.g. ``sslmode``) go to ``asyncpg``.
        """
        parts = urlsplit(url)
        if parts.scheme.lower() not in cls.schemes:
            raise ValueError(f"expected postgresql://user@host:port/database, got {url!r}")
        if not parts.hostname and "host=" not in parts.query:
            raise ValueError(f"expected postgresql://user@host:port/database, got {url!r}")
        try:
            parts.port  # noqa: B018 -- validates the port
        except ValueError as exc:
            raise ValueError(f"bad port in {url!r}: {exc}") from None
        ours = {"mode", "connect_timeout", "request_timeout", "max_connections", "pool_timeout",
                "poll_interval"}
        query = parse_qsl(parts.query, keep_blank_values=True)
        _check_query(url, [k for k, _ in query if k not in ours], ours)
        _check_keywords(set(options) - ours, ours)
        opts: dict[str, Any] = {k: v for k, v in query if k in ours}
        opts.update(options)
        rest = [(k, v) for k, v in query if k not in ours]
        mode = str(opts.pop("mode", "advisory")).lower()
        if mode not in ("advisory", "row"):
            raise ValueError(f"mode must be 'advisory' or 'row', got {mode!r}")
        dsn = urlunsplit(parts._replace(scheme="postgresql", query=urlencode(rest)))
        backend_class = PostgresRowBackend if mode == "row" else PostgresBackend
        safe = urlunsplit(parts._replace(netloc=_without_password(parts.netloc)))
        if "connect_timeout" in opts:
            opts["connect_timeout"] = _number("connect_timeout", opts["connect_timeout"])
        for name in ("request_timeout", "pool_timeout", "poll_interval"):
            if name in opts and opts[name] is not None:
                opts[name] = _number(name, opts[name])
        if "max_connections" in opts:
            opts["max_connections"] = int(_number("max_connections", opts["max_connections"], integer=True))
        return backend_class(dsn, url=safe, **opts)

    @property
    def url(self) -> str:
        return self._url

    # -- connections ------------------------------------------------------------------------

    async def _new_connection(self) -> Any:
        apg = _asyncpg()
        options = dict(self._connect_options)
        settings = dict(options.pop("server_settings", {}) or {})
        settings.setdefault("application_name", "aiolock")
        try:
            async with asyncio.timeout(self._connect_timeout):
                conn = await apg.connect(
                    self._dsn, timeout=self._connect_timeout, server_settings=settings, **options
                )
        except Exception as exc:
            if isinstance(exc, (LockError, ValueError)):
                raise
            if _is_denied(exc):
                raise AccessDenied(
                    f"PostgreSQL at {self._url} refused the login ({exc}); check the user and "
                    "password in the URL, and that the user may CONNECT to the database"
                ) from exc
            raise BackendUnavailable(
                f"cannot reach PostgreSQL at {self._url} ({type(exc).__name__}: {exc})"
            ) from exc
        if not self._schema_ready:
            try:
                await self._ensure_schema(conn)
            except BaseException:
                conn.terminate()
                raise
        return conn

    async def _ensure_schema(self, conn: Any) -> None:
        async with self._schema_lock:
            if self._schema_ready:
                return
            async with self._guard():
                # tables made by an administrator need no CREATE privilege (least privilege)
                present = await conn.fetchrow(_TABLES_PRESENT)
            if not (present["tables"] and present["columns"]):
                try:
                    async with self._guard(), conn.transaction():
                        # serialize concurrent CREATE ... IF NOT EXISTS across processes
                        await conn.execute(
                            "SELECT pg_advisory_xact_lock($1::bigint)",
                            advisory_key("", _SCHEMA_KEY_TEXT),
                        )
                        if not present["tables"]:
                            await conn.execute(_SCHEMA)
                        await conn.execute(MIGRATE_SQL)
                except AccessDenied as exc:
                    if not present["tables"]:
                        raise
                    raise AccessDenied(
                        f"PostgreSQL at {self._url}: the table aiolock_holders was made by an "
                        "older aiolock and lacks the holder-record columns, and this user may not "
                        f"alter it; its owner (an administrator) must run once: {MIGRATE_SQL}"
                    ) from exc
            self._schema_ready = True

    @contextlib.asynccontextmanager
    async def _guard(self, timeout: float | None = -1.0) -> AsyncIterator[None]:
        """Bound a request by ``request_timeout`` and map asyncpg's errors to ours."""
        limit = self._request_timeout if timeout == -1.0 else timeout
        try:
            async with asyncio.timeout(limit):
                yield
        except (LockError, ValueError):
            raise
        except Exception as exc:
            if _is_connection_error(exc):
                raise BackendUnavailable(
                    f"PostgreSQL at {self._url} is unavailable ({type(exc).__name__}: {exc})"
                ) from exc
            if _is_denied(exc):
                raise AccessDenied(
                    f"PostgreSQL at {self._url} denied a permission aiolock needs ({exc}); the "
                    "user needs SELECT, INSERT, UPDATE, DELETE on aiolock_tokens, aiolock_holders "
                    "and aiolock_rows (or CREATE on the schema to make them)"
                ) from exc
            raise LockError(f"PostgreSQL at {self._url} refused the request: {exc}") from exc

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def connect(self) -> None:
        if self._closed:
            raise LockError(f"this backend for {self._url} is closed")
        conn = await self._pool.get()
        try:
            async with self._guard(self._connect_timeout):
                await conn.fetchval("SELECT 1")
        except BaseException:
            self._pool.discard(conn)
            raise
        self._pool.put(conn)

    # -- the claim's keys and state ------------------------------------------------------------

    def _state(self, claim: Claim) -> _State:
        st = claim.state.get("pg")
        if not isinstance(st, _State):
            if claim.kind is Kind.PERMIT:
                keys = [advisory_key("sem", claim.name, i) for i in range(claim.limit)]
            else:
                keys = [advisory_key(claim.kind.family, claim.name)]
            st = _State(keys)
            claim.state["pg"] = st
        return st

    def _args(self, claim: Claim, key: int | list[int]) -> tuple[Any, ...]:
        """The parameters of the grant statements (see :data:`_GRANT_CTES`)."""
        return (claim.kind.family, claim.name, claim.owner, claim.kind.value, claim.ttl_ms,
                self._expiry_setting, key, claim.info)

    # -- single-attempt primitives ----------------------------------------------------------

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        if self._closed:
            raise LockError(f"this backend for {self._url} is closed")
        st = self._state(claim)
        if st.abandoned:
            raise LockError(f"claim on {claim.name!r} was abandoned")
        if st.cleanup is not None and not st.cleanup.done():
            await asyncio.shield(st.cleanup)
        if st.conn is not None:  # granted already: confirm and give it again
            return await self._confirm(claim, st)
        if st.wait is not None:
            if not st.wait.done():
                return Busy(QUEUED_RECHECK)
            wait, st.wait = st.wait, None
            if not wait.cancelled() and wait.exception() is None:
                st.conn, st.key, st.token = wait.result()
                return await self._confirm(claim, st)
            # the wait failed (its error was logged): try afresh below
        if st.waiter is not None and claim.kind is not Kind.PERMIT:
            # a listening claim queues on the server: granted when the lock frees
            st.wait = self._spawn(self._blocking_wait(claim, st))
            return Busy(QUEUED_RECHECK)
        st.op = op = self._spawn(self._attempt(claim, st))
        granted = await asyncio.shield(op)  # a cancel lets it finish; abandon() cleans up
        if granted:
            return Granted(st.token, claim.ttl_ms)
        retry = claim.ttl_ms / 1000
        if claim.kind is Kind.PERMIT:
            retry = min(retry / 3, self._poll)
        return Busy(retry)

    async def _attempt(self, claim: Claim, st: _State) -> bool:
        """One non-blocking try on a pooled connection; it stays with the claim if granted."""
        for fresh in (False, True):
            conn = await self._pool.get()
            try:
                got = await self._try(conn, claim, st)
            except BackendUnavailable:
                self._pool.discard(conn)
                if fresh:
                    raise
                continue  # a pooled connection may have died idle (server restart): once more
            except BaseException:
                self._pool.discard(conn)
                raise
            if got:
                st.conn = conn
                if st.abandoned:  # abandoned while in flight: never grant late
                    await self._cleanup(claim, st)
                    return False
                return True
            self._pool.put(conn)
            return False
        return False  # pragma: no cover

    async def _try(self, conn: Any, claim: Claim, st: _State) -> bool:
        """Try to take the lock on ``conn``; record the grant. False if busy."""
        if claim.kind is Kind.PERMIT:
            sql, key = _TRY_SLOTS, st.keys
        else:
            sql = _TRY_SHARED if claim.kind is Kind.READ else _TRY_EXCLUSIVE
            key = st.keys[0]  # type: ignore[assignment]
        async with self._guard():
            row = await conn.fetchrow(sql, *self._args(claim, key))
        if not row["ok"]:
            return False
        st.key, st.token = int(row["k"]), int(row["token"])
        return True

    async def _blocking_wait(self, claim: Claim, st: _State) -> tuple[Any, int, int]:
        """Queue on the server for the lock; on grant record it and wake the waiter.

        The session's expiry is armed before it queues, so a grant nobody picks up (the
        client paused or gone) still ends ``ttl`` after it was made.
        """
        conn = None
        try:
            conn = await self._pool.get()
            key = st.keys[0]
            fn = "pg_advisory_lock_shared" if claim.kind is Kind.READ else "pg_advisory_lock"
            async with self._guard(None):
                await conn.execute(
                    f"SELECT set_config($2, $3::bigint::text, false), {fn}($1::bigint)",
                    key, self._expiry_setting, claim.ttl_ms,
                )
            async with self._guard():
                row = await conn.fetchrow(_GRANT_HELD, *self._args(claim, key))
            result = (conn, key, int(row["token"]))
        except BaseException as exc:
            await self._wait_failed(conn, claim, st, exc)
            raise
        self._wake(st)
        return result

    async def _wait_failed(self, conn: Any, claim: Claim, st: Any, exc: BaseException) -> None:
        """A blocking wait ended in an error: leave ``conn`` holding nothing and, unless
        it was a cancellation, let the next local waiter try instead."""
        if conn is not None:
            await self._scrub(conn)
        if not isinstance(exc, asyncio.CancelledError):
            log.warning("waiting for %r on %s failed: %s", claim.name, self._url, exc)
            self._wake(st)

    async def _scrub(self, conn: Any) -> None:
        """Make ``conn`` hold nothing (waiting out a cancelled statement) or drop it."""
        try:
            async with self._guard():
                if conn.is_in_transaction():
                    await conn.execute("ROLLBACK")
                await conn.execute(_UNLOCK_ALL)
        except BaseException:
            self._pool.discard(conn)
            raise
        self._pool.put(conn)

    @staticmethod
    def _wake(st: _State) -> None:
        if st.waiter is not None:
            st.waiter.wake()

    async def _confirm(self, claim: Claim, st: _State) -> Granted | Busy:
        """A claim granted earlier (e.g. by its wait): restart its expiry, give it out."""
        ms = await self._renew_one(claim, st)
        if ms == REVOKED:  # revoked before we could take it: give it back, ask again
            await self._cleanup(claim, st)
            ms = None
        if ms is None:
            return Busy(0.001)  # the grant died before we could take it: ask again
        return Granted(st.token, ms)

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        return list(await asyncio.gather(*(self._renew_one(c, self._state(c)) for c in claims)))

    async def _renew_one(self, claim: Claim, st: _State) -> int | None:
        async with st.mutex:
            conn = st.conn
            if conn is None or st.abandoned:
                return None
            if conn.is_closed():
                st.conn = None
                self._pool.discard(conn)
                return None
            try:
                kept = await self._renew_statement(conn, claim)
            except LockError:
                # dead, or too slow to trust: drop the connection, so the server frees it
                st.conn = None
                self._pool.discard(conn)
                return None
            # revoked: the connection stays with the claim until abandon() unlocks it
            return claim.ttl_ms if kept else REVOKED

    async def _renew_statement(self, conn: Any, claim: Claim) -> bool:
        """Extend on the claim's session; False if its holder row was revoked."""
        async with self._guard():
            row = await conn.fetchrow(_RENEW, claim.kind.family, claim.name, claim.owner,
                                      claim.ttl_ms, self._expiry_setting)
        return bool(row["kept"])

    async def release(self, claim: Claim) -> bool:
        st = self._state(claim)
        if st.release is None or (st.release.done() and (
            st.release.cancelled() or st.release.exception() is not None
        )):
            st.release = self._spawn(self._release(claim, st))
        return await asyncio.shield(st.release)

    async def _release(self, claim: Claim, st: _State) -> bool:
        if st.op is not None and not st.op.done():
            await asyncio.wait([st.op])
        async with st.mutex:
            conn, st.conn = st.conn, None
            if conn is None:
                return False
            if conn.is_closed():
                self._pool.discard(conn)
                return False
            try:
                await self._unlock(conn, claim)
            except LockError:
                self._pool.discard(conn)  # the server frees it as the session ends
                return False
            self._pool.put(conn)
            return True

    async def _unlock(self, conn: Any, claim: Claim) -> None:
        async with self._guard():
            await conn.execute(_UNLOCK_ALL)
            await conn.execute(_FORGET_HOLDER, claim.kind.family, claim.name, claim.owner)
            signal = _signal_key(claim.kind, claim.name)
            if signal is not None:
                await conn.execute("SELECT pg_notify($1, $2)", _CHANNEL, str(signal))

    async def abandon(self, claim: Claim) -> None:
        st = self._state(claim)
        st.abandoned = True
        if st.cleanup is None or st.cleanup.done():
            st.cleanup = self._spawn(self._abandon(claim, st))
        await asyncio.shield(st.cleanup)

    async def _abandon(self, claim: Claim, st: _State) -> None:
        wait, st.wait = st.wait, None
        if wait is not None:
            if not wait.done():
                wait.cancel()  # asyncpg cancels the queued statement on the server
            await asyncio.wait([wait])
            if not wait.cancelled() and wait.exception() is None and st.conn is None:
                st.conn, st.key, st.token = wait.result()
        if st.op is not None and not st.op.done():
            await asyncio.wait([st.op])
        if st.release is not None and not st.release.done():
            await asyncio.wait([st.release])
        await self._cleanup(claim, st)

    async def _cleanup(self, claim: Claim, st: _State) -> None:
        async with st.mutex:
            conn, st.conn = st.conn, None
            if conn is None:
                return
            if conn.is_closed():
                self._pool.discard(conn)
                return
            try:
                await self._unlock(conn, claim)
            except LockError as exc:
                log.warning("could not release %r on %s: %s", claim.name, self._url, exc)
                self._pool.discard(conn)
                return
            self._pool.put(conn)

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        """Locks and rwlocks wait in the server's lock queue (started by the next
        ``try_acquire``); semaphore waiters get ``NOTIFY`` on each release; an election's
        listeners (candidates and observers) on each grant, proclaim, release and
        revocation of its leadership. One ``LISTEN`` connection carries them all."""
        self._state(waiter.claim).waiter = waiter
        signal = _signal_key(kind, name)
        if signal is not None:
            self._signals.setdefault(signal, set()).add(waiter)
            try:
                await self._ensure_listener()
            except BaseException:
                self.unlisten(name, kind, waiter)
                raise

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        st = self._state(waiter.claim)
        if st.waiter is waiter:
            st.waiter = None
        key = _signal_key(kind, name)
        if key is not None:
            waiters = self._signals.get(key)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._signals[key]
        wait = st.wait
        if wait is not None and (st.cleanup is None or st.cleanup.done()):
            # a wait nobody will take any more: cancel it, free what it may have got
            st.cleanup = self._spawn(self._drop_wait(waiter.claim, st))

    async def _ensure_listener(self) -> None:
        async with self._listener_lock:
            if self._listener is not None and not self._listener.is_closed():
                return
            conn = await self._new_connection()
            try:
                async with self._guard():
                    await conn.add_listener(_CHANNEL, self._on_notify)
            except BaseException:
                conn.terminate()
                raise
            conn.add_termination_listener(self._on_listener_lost)
            self._listener = conn

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        try:
            key = int(payload)
        except ValueError:
            return
        for waiter in list(self._signals.get(key, ())):
            waiter.wake()

    def _on_listener_lost(self, conn: Any) -> None:
        # signals may have been missed: every listener looks again, and LISTEN is
        # re-opened for them (an election's observer never calls listen() again)
        if self._listener is conn:
            self._listener = None
        self._wake_all()
        if self._signals and not self._closed and (
            self._relisten_task is None or self._relisten_task.done()
        ):
            self._relisten_task = self._spawn(self._relisten())

    def _wake_all(self) -> None:
        for waiters in list(self._signals.values()):
            for waiter in list(waiters):
                waiter.wake()

    async def _relisten(self) -> None:
        """Re-open the LISTEN connection while anyone listens, retrying every
        ``poll_interval``; then wake everyone (signals sent meanwhile were missed)."""
        while self._signals and not self._closed:
            try:
                await self._ensure_listener()
            except LockError as exc:
                log.warning("cannot re-open LISTEN on %s: %s", self._url, exc)
                await asyncio.sleep(self._poll)
                continue
            self._wake_all()
            return

    async def _drop_wait(self, claim: Claim, st: _State) -> None:
        wait, st.wait = st.wait, None
        if wait is None:
            return
        if not wait.done():
            wait.cancel()
        await asyncio.wait([wait])
        if not wait.cancelled() and wait.exception() is None:
            conn, _key, _token = wait.result()
            tmp = _State(st.keys, conn=conn)
            await self._cleanup(claim, tmp)

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        if kind is Kind.PERMIT:
            return await self._inspect_sem(name)
        family = kind.family
        keys = [advisory_key(family, name)]
        conn = await self._pool.get()
        try:
            async with self._guard():
                locks = await conn.fetch(_INSPECT_LOCKS, keys)
                rows = await conn.fetch(_INSPECT_ROWS, family, name)
        except BaseException:
            self._pool.discard(conn)
            raise
        self._pool.put(conn)
        return _info(name, family, locks, rows)

    async def _inspect_sem(self, name: str) -> LockInfo:
        # the limit is not stored: count the holder rows whose sessions hold a slot lock
        conn = await self._pool.get()
        try:
            async with self._guard():
                rows = await conn.fetch(_INSPECT_ROWS, "sem", name)
                pids = [r["pid"] for r in rows if r["pid"] is not None]
                held = await conn.fetch(
                    "SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                    " AND pid = ANY($1::int[])", pids,
                ) if pids else []
        except BaseException:
            self._pool.discard(conn)
            raise
        self._pool.put(conn)
        alive = {r["pid"] for r in held}
        mine = [r for r in rows if r["pid"] in alive]
        last = rows[0]["last"] if rows else None
        lefts = [float(r["left_s"]) for r in mine]
        return LockInfo(name, bool(mine), holders=len(mine), last_token=last,
                        ttl_left=max(lefts) if lefts else None,
                        held_by=tuple(_holder(r) for r in mine), family="sem")

    async def _query(self, sql: str, *args: Any) -> list[Any]:
        """One statement on a pooled connection (a plain read, or a short write)."""
        conn = await self._pool.get()
        try:
            async with self._guard():
                rows = await conn.fetch(sql, *args)
        except BaseException:
            self._pool.discard(conn)
            raise
        self._pool.put(conn)
        return list(rows)

    async def set_info(self, claim: Claim) -> bool:
        """Replace the held claim's holder record and NOTIFY the name's listeners; on the
        claim's own session, so it also restarts that session's expiry timer."""
        st = self._state(claim)
        signal = _signal_key(claim.kind, claim.name)
        async with st.mutex:
            conn = st.conn
            if conn is None or st.abandoned or conn.is_closed():
                return False
            try:
                async with self._guard():
                    row = await conn.fetchrow(
                        _SET_INFO, claim.kind.family, claim.name, claim.owner, claim.info,
                        None if signal is None else str(signal),
                    )
            except LockError:
                st.conn = None
                self._pool.discard(conn)
                return False
            return bool(row["kept"])

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        """Revoke every holder of ``name`` in ``kind``'s family: their holder rows are
        deleted, so each holder's next renewal (within ``ttl/3``) answers "revoked" and it
        unlocks. Sessions are not terminated: a holder that does not renew (paused) keeps
        the advisory lock until its ``idle_session_timeout`` (``ttl``) ends the session."""
        signal = _signal_key(kind, name)
        rows = await self._query(_REVOKE, kind.family, name, None if signal is None else str(signal))
        return bool(rows and rows[0]["live"])

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every name held now (holder rows whose session holds the advisory lock), in
        name order; one plain SELECT over ``aiolock_holders`` and ``pg_locks``."""
        rows = await self._query(_SCAN, _escape_like(prefix))
        groups: dict[tuple[str, str], list[Any]] = {}
        for row in rows:
            groups.setdefault((row["name"], row["family"]), []).append(row)
        for (name, family), mine in groups.items():
            if family not in FAMILY_KIND:
                continue  # a family this aiolock does not know (a newer version's)
            exclusive = [r for r in mine if r["kind"] in _EXCLUSIVE_KINDS]
            lefts = [max(float(r["left_s"]), 0.0) for r in mine]
            yield LockInfo(
                name, True, holders=len(mine),
                token=exclusive[0]["token"] if exclusive else None, last_token=mine[0]["last"],
                ttl_left=max(lefts), waiters=max(int(r["waiting"]) for r in mine),
                held_by=tuple(_holder(r) for r in mine), family=family,
            )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self._request_timeout)
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(Exception):
                await _close(listener)
        await self._pool.aclose()


_EXCLUSIVE_KINDS = frozenset(k.value for k in Kind if k.exclusive)


def _holder(row: Any) -> Holder:
    """A holder row's record, ``since`` on the server's clock (unknown for older rows)."""
    since = row["since_s"]
    return decode_holder(row["info"], None if since is None else float(since))


def _info(name: str, family: str, locks: Sequence[Any], rows: Sequence[Any]) -> LockInfo:
    holding = {r["pid"]: r["mode"] for r in locks if r["granted"]}
    waiting = sum(1 for r in locks if not r["granted"])
    last = rows[0]["last"] if rows else None
    mine = [r for r in rows if r["pid"] is not None and r["pid"] in holding]
    if not holding:
        return LockInfo(name, False, last_token=last, waiters=waiting, family=family)
    exclusive = [r for r in mine if r["kind"] in _EXCLUSIVE_KINDS]
    lefts = [max(float(r["left_s"]), 0.0) for r in mine]
    return LockInfo(
        name, True, holders=len(holding), token=exclusive[0]["token"] if exclusive else None,
        last_token=last, ttl_left=max(lefts) if lefts else None, waiters=waiting,
        held_by=tuple(_holder(r) for r in mine), family=family,
    )


def _safe_url(dsn: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(netloc=_without_password(parts.netloc), query=""))


def _without_password(netloc: str) -> str:
    """``user:password@host:port`` -> ``user@host:port``: the user stays (an operator copies
    ``locks.url`` into ``aiolock ls --url``), the password never shows."""
    userinfo, at, hostport = netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return f"{user}@{hostport}" if at and user else hostport


class PostgresRowBackend(PostgresBackend):
    """``postgresql://...?mode=row``: the ``SELECT ... FOR UPDATE`` row lock.

    A held claim keeps a transaction open on its connection with the row
    ``aiolock_rows(family, name)`` locked; the server ends a holder that stops renewing
    after ``idle_in_transaction_session_timeout = ttl``. Mutex only: row locks have no
    writer preference and no "any of N" wait, so no rwlock or semaphore. Waiting queues on
    the row lock (first come, first served in practice, but PostgreSQL does not promise
    an order for tuple lock waiters: ``fair=True`` is not offered).
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.EVENTS, Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS}
    )
    _expiry_setting: ClassVar[str] = "idle_in_transaction_session_timeout"

    async def _lock_row(self, conn: Any, claim: Claim, *, nowait: bool) -> bool:
        family, name = claim.kind.family, claim.name
        await conn.execute(
            "INSERT INTO aiolock_rows (family, name) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            family, name,
        )
        await conn.execute("BEGIN")
        try:
            await conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', $1::bigint::text, true)",
                claim.ttl_ms,
            )
            suffix = " NOWAIT" if nowait else ""
            await conn.execute(
                f"SELECT 1 FROM aiolock_rows WHERE family = $1 AND name = $2 FOR UPDATE{suffix}",
                family, name,
            )
        except _asyncpg().exceptions.LockNotAvailableError:
            await conn.execute("ROLLBACK")
            return False
        return True

    async def _record(self, claim: Claim, st: _State) -> None:
        """Commit the token on another connection (the claim's transaction stays open)."""
        conn = await self._pool.get()
        try:
            async with self._guard():
                row = await conn.fetchrow(
                    _GRANT_HELD, claim.kind.family, claim.name, claim.owner, claim.kind.value,
                    claim.ttl_ms, "", st.keys[0], claim.info,
                )
        except BaseException:
            self._pool.discard(conn)
            raise
        self._pool.put(conn)
        st.key, st.token = st.keys[0], int(row["token"])

    async def _try(self, conn: Any, claim: Claim, st: _State) -> bool:
        self._check_kind(claim)
        async with self._guard():
            got = await self._lock_row(conn, claim, nowait=True)
        if got:
            try:
                await self._record(claim, st)
            except BaseException:
                with contextlib.suppress(Exception):
                    await conn.execute("ROLLBACK")
                raise
        return got

    async def _blocking_wait(self, claim: Claim, st: _State) -> tuple[Any, int, int]:
        conn = None
        try:
            self._check_kind(claim)
            conn = await self._pool.get()
            async with self._guard(None):
                await self._lock_row(conn, claim, nowait=False)
            await self._record(claim, st)
            result = (conn, st.key, st.token)
        except BaseException as exc:
            await self._wait_failed(conn, claim, st, exc)
            raise
        self._wake(st)
        return result

    async def _renew_statement(self, conn: Any, claim: Claim) -> bool:
        async with self._guard():
            if not conn.is_in_transaction():
                raise LockError("the row lock's transaction ended")
            await conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', $1::bigint::text, true)",
                claim.ttl_ms,
            )
        return True  # no revocation in row mode (REVOKE is not offered)

    async def _unlock(self, conn: Any, claim: Claim) -> None:
        async with self._guard():
            if conn.is_in_transaction():
                await conn.execute("ROLLBACK")
            await conn.execute(_UNLOCK_ALL)
            await conn.execute(_FORGET_HOLDER, claim.kind.family, claim.name, claim.owner)

    @staticmethod
    def _check_kind(claim: Claim) -> None:
        if claim.kind is not Kind.LOCK:
            raise LockError("the row-lock mode offers lock() only (no rwlock or semaphore)")

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        family = kind.family
        conn = await self._pool.get()
        try:
            async with self._guard():
                rows = await conn.fetch(_INSPECT_ROWS, family, name)
                async with conn.transaction():
                    free = await conn.fetchval(
                        "SELECT count(*) FROM (SELECT 1 FROM aiolock_rows WHERE family = $1"
                        " AND name = $2 FOR KEY SHARE SKIP LOCKED) AS free", family, name,
                    )
                    exists = await conn.fetchval(
                        "SELECT count(*) FROM aiolock_rows WHERE family = $1 AND name = $2",
                        family, name,
                    )
        except BaseException:
            self._pool.discard(conn)
            raise
        self._pool.put(conn)
        last = rows[0]["last"] if rows else None
        if not exists or free:
            return LockInfo(name, False, last_token=last)
        live = [r for r in rows if r["owner"] is not None and float(r["left_s"]) > 0]
        best = max(live, key=lambda r: r["token"]) if live else None
        # the holder is the latest grant (rows come by token; the row lock's renewals do
        # not commit, so its expiry column is not kept up to date)
        return LockInfo(
            name, True, holders=1, token=best["token"] if best else last, last_token=last,
            ttl_left=float(best["left_s"]) if best else None,
            held_by=tuple(_holder(r) for r in rows[-1:] if r["owner"] is not None),
        )
