"""``mysql://user@host:port/db`` (also ``mariadb://``): MySQL / MariaDB with ``asyncmy``.

How it works
------------
* **Named-lock mode** (default): a lock is a ``GET_LOCK`` named lock. Its name is
  ``aiolock:`` + the first 20 bytes of ``blake2b(family NUL name)`` in hex (48 characters):
  ``GET_LOCK`` names are limited to 64 characters and MySQL compares them without case,
  so every name is hashed, and the family keeps ``lock()`` and ``semaphore()`` of one name
  apart. A semaphore of ``limit`` has ``limit`` slot locks; a permit is the first free
  slot (one ``CASE WHEN GET_LOCK(slot 0) ... WHEN GET_LOCK(slot 1) ...`` statement).
* A named lock belongs to a connection, so **every held claim keeps its own connection**
  from a bounded pool (``max_connections``, default 50) for the whole lease.
* **Fencing tokens** come from the InnoDB table ``aiolock_tokens(family, name, token)``:
  ``INSERT ... ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1)``, an autocommit
  statement (its own committed transaction) run after the lock is taken and before the
  grant is reported, so tokens strictly increase in grant order and survive restarts.
  ``aiolock_holders`` records who holds what for ``inspect()``.
* **Expiry on the server**: when a claim is granted its session gets
  ``wait_timeout = ceil(ttl)`` (in the same request as the ``GET_LOCK``, so no pause of
  the client can come between them); each renewal is a statement on that session and so
  restarts the idle timer. A holder that stops renewing (paused, partitioned) is
  disconnected by the server ``ceil(ttl)`` seconds after its last renewal, which frees the
  lock; a holder whose process dies frees it at once (its socket closes).
* **Waiting** happens on the server: the head of the local queue issues a blocking
  ``GET_LOCK(name, <a year>)`` on a pooled connection (its ``wait_timeout`` armed first),
  and the token is taken in the same request, so it is granted the moment the lock frees
  -- released, or its holder's connection gone. Cancelling a waiting claim ends that
  connection on the server with ``KILL CONNECTION`` (and waits until it is gone), so a
  cancelled wait can never be granted later. Semaphore waiters cannot wait for "any slot":
  they retry every ``poll_interval`` (default 0.5 s), or at once on a local release.
* **Holders, scan, revoke, elections**: ``aiolock_holders`` keeps each held claim's
  holder record (``info``), its session id and its grant time (server clock). ``scan``
  reads the names of the holder rows with a ``LIKE`` prefix and checks each one live;
  ``force_release`` deletes the holder rows, and each revoked holder's next renewal
  (within ``ttl/3``) finds its row gone, answers ``REVOKED`` and gives the lock back (no
  ``KILL`` of another session: that would need its account or ``CONNECTION ADMIN``). An
  election is a ``GET_LOCK`` of the family ``elect``; ``proclaim`` updates the holder row
  on the holding connection. Observers are woken by this backend's own grants, proclaims
  and releases and otherwise poll every ``ttl/2`` (there is no ``NOTIFY`` in MySQL).
* **Row mode** (``?mode=row``, :class:`MySQLRowBackend`): the ``SELECT ... FOR UPDATE``
  row lock of the design notes. The claim's connection keeps a transaction open on one
  row of ``aiolock_rows`` (``FOR UPDATE NOWAIT`` to try, plain ``FOR UPDATE`` to wait);
  the token is committed on another connection. ``lock()`` only (with holders, scan and
  revoke; no elections).

Guarantees and limits
---------------------
* A lease is lost when its connection drops (server restart, network failure, idle
  timeout, ``KILL``): the server frees the lock at once, and this holder learns it at its
  next renewal (at most ``ttl/3`` later), when ``SELECT IS_USED_LOCK(..) = CONNECTION_ID()``
  fails or says no. Between the two it still believes it holds the lock: **fencing tokens
  are what protect a resource**.
* The server's timeout is in whole seconds: a paused holder keeps its lock up to
  ``ceil(ttl)`` seconds after its last renewal (with ``ttl=0.5``, one second).
* Not fair (``GET_LOCK`` waiters are served in arrival order in practice, but neither
  server promises it), no ``rwlock()`` (named locks have no shared mode).
* Tokens survive server restarts (InnoDB); a restart loses every lease.
* Each held lease and each waiting head costs one server connection. Named locks need a
  direct session: a proxy that multiplexes statements over shared connections breaks them.
* Cancelling a waiting claim issues ``KILL CONNECTION`` on the waiter's own connection:
  allowed for the same account without extra privileges. Privileges needed: ``CREATE``
  (first use, or create the three tables beforehand), ``SELECT``, ``INSERT``, ``UPDATE``,
  ``DELETE`` on the database.
* Tested on MariaDB 10.11; MySQL 8 differences handled (``PROCESSLIST.TIME`` instead of
  ``TIME_MS``, ``NOWAIT`` error 3572) but not tested here. Row mode's ``inspect`` uses
  ``LOCK IN SHARE MODE SKIP LOCKED`` (MariaDB 10.6+).

Options (URL query or keyword): ``connect_timeout`` (s, 5), ``request_timeout`` (s, 5),
``max_connections`` (50), ``pool_timeout`` (s, defaults to ``connect_timeout``),
``poll_interval`` (s, 0.5), ``mode`` (``lock`` or ``row``). Unreachable server:
:class:`aiolock.BackendUnavailable`; refused credentials: :class:`aiolock.AccessDenied`;
other server errors :class:`aiolock.LockError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
import math
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

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

__all__ = ["MySQLBackend", "MySQLRowBackend", "lock_key"]

log = logging.getLogger("aiolock")

#: A ``Busy.retry_after`` while a blocking wait is queued on the server: the wait itself
#: wakes the waiter; this only bounds an in-memory re-check.
QUEUED_RECHECK = 5.0
#: A blocking ``GET_LOCK``'s timeout (s): "forever" (MariaDB refuses negative values).
_FOREVER = 365 * 86400

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS aiolock_tokens ("
    " family VARCHAR(8) NOT NULL, name VARBINARY(2048) NOT NULL, token BIGINT NOT NULL,"
    " PRIMARY KEY (family, name)) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS aiolock_holders ("
    " family VARCHAR(8) NOT NULL, name VARBINARY(2048) NOT NULL, slot INT NOT NULL,"
    " owner CHAR(32) NOT NULL, kind VARCHAR(8) NOT NULL, token BIGINT NOT NULL,"
    " conn BIGINT NOT NULL, ttl_ms BIGINT NOT NULL, since DATETIME(6) NOT NULL,"
    " info TEXT CHARACTER SET utf8mb4 NOT NULL,"
    " PRIMARY KEY (family, name, slot)) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS aiolock_rows ("
    " family VARCHAR(8) NOT NULL, name VARBINARY(2048) NOT NULL,"
    " PRIMARY KEY (family, name)) ENGINE=InnoDB",
)

#: After ``@aiolock_slot`` is set (the slot taken, or NULL): arm the session's expiry,
#: bump the token (autocommit: its own transaction), record the holder, report.
#: Parameters: ttl s, family, name, family, name, owner, kind, ttl ms, holder record.
_GRANT_TAIL = """;
SET SESSION wait_timeout = IF(@aiolock_slot IS NULL, @@GLOBAL.wait_timeout, %s);
INSERT INTO aiolock_tokens (family, name, token)
    SELECT %s, %s, LAST_INSERT_ID(1) FROM DUAL WHERE @aiolock_slot IS NOT NULL
    ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1);
REPLACE INTO aiolock_holders (family, name, slot, owner, kind, token, conn, ttl_ms, since, info)
    SELECT %s, %s, @aiolock_slot, %s, %s, LAST_INSERT_ID(), CONNECTION_ID(), %s, NOW(6), %s
    FROM DUAL WHERE @aiolock_slot IS NOT NULL;
SELECT @aiolock_slot, LAST_INSERT_ID()"""

#: 1: held; 0: gone; 2: held, but its holder row was deleted (revoked by an operator)
_RENEW = (
    "SET SESSION wait_timeout = %s; SELECT CASE WHEN NOT IS_USED_LOCK(%s) <=> CONNECTION_ID()"
    " THEN 0 WHEN EXISTS (SELECT 1 FROM aiolock_holders WHERE family = %s AND name = %s"
    " AND slot = %s AND owner = %s) THEN 1 ELSE 2 END"
)

_RELEASE = (
    "SELECT RELEASE_LOCK(%s);"
    " DELETE FROM aiolock_holders WHERE family = %s AND name = %s AND slot = %s AND owner = %s;"
    " SET SESSION wait_timeout = @@GLOBAL.wait_timeout"
)

_INSPECT = """
SELECT IS_USED_LOCK(%s), t.token, h.token, h.conn, h.ttl_ms, {idle_ms}, p.COMMAND, h.info,
       TIMESTAMPDIFF(MICROSECOND, h.since, NOW(6)) / 1e6
FROM (SELECT 1) AS one
LEFT JOIN aiolock_tokens t ON t.family = %s AND t.name = %s
LEFT JOIN aiolock_holders h ON h.family = %s AND h.name = %s AND h.slot = 0
LEFT JOIN information_schema.PROCESSLIST p ON p.ID = h.conn
"""

#: MySQL client/server error codes: the connection is gone or cannot be made.
_CONNECTION_ERRORS = frozenset({
    1040,  # too many connections
    1053,  # server shutdown in progress
    1077, 1079, 1080,  # normal shutdown, shutdown complete, forcing close
    1152, 1153, 1154, 1155, 1156, 1157, 1158, 1159, 1160, 1161,  # aborted / net errors
    1927,  # MariaDB: connection was killed
    2002, 2003, 2005, 2006, 2013, 2055,  # cannot connect, gone away, lost during query
    4031,  # MySQL: disconnected by the server for inactivity
})
#: Refused credentials or permissions.
_ACCESS_ERRORS = frozenset({1044, 1045, 1142, 1143, 1227, 1370, 1698})
#: ``FOR UPDATE NOWAIT`` found the row locked (MariaDB 1205, MySQL 3572).
_LOCKED_ERRORS = frozenset({1205, 3572})


def lock_key(family: str, name: str, slot: int | None = None) -> str:
    """The ``GET_LOCK`` name of ``name`` in ``family`` (and a semaphore slot): 48 chars."""
    text = f"{family}\0{name}" if slot is None else f"{family}\0{name}\0{slot}"
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20).hexdigest()
    return f"aiolock:{digest}"


def _asyncmy() -> Any:
    """Import ``asyncmy`` on first use; say which extra installs it if it is missing."""
    try:
        return importlib.import_module("asyncmy")
    except ImportError as exc:
        raise ImportError(
            "the mysql:// backend needs the asyncmy client; install it with: "
            "pip install 'aiolock[mysql]'", name="asyncmy",
        ) from exc


def _code(exc: BaseException) -> int | None:
    args = getattr(exc, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def _is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, (OSError, TimeoutError, ConnectionError, EOFError)):
        return True
    errors = _asyncmy().errors
    if isinstance(exc, errors.InterfaceError):
        return True
    return isinstance(exc, errors.MySQLError) and _code(exc) in _CONNECTION_ERRORS


def _seconds(ttl_ms: int) -> int:
    """The session's ``wait_timeout`` for a lease of ``ttl_ms``: whole seconds, >= 1."""
    return max(1, math.ceil(ttl_ms / 1000))


def _name(claim_name: str) -> bytes:
    return claim_name.encode("utf-8", "surrogatepass")


async def _run(conn: Any, sql: str, args: Sequence[Any] = ()) -> list[Any]:
    """Run ``sql`` (one or more statements); the rows of the last result set."""
    async with conn.cursor() as cur:
        await cur.execute(sql, tuple(args) if args else None)
        rows = list(await cur.fetchall() or ())
        while await cur.nextset():
            rows = list(await cur.fetchall() or ())
    return rows


async def _close(conn: Any) -> None:
    conn.close()


def _alive(conn: Any) -> bool:
    return bool(conn.connected)


@dataclass(slots=True, eq=False)
class _State:
    """What this backend keeps on a :class:`Claim` (in ``claim.state["mysql"]``)."""

    keys: list[str]
    conn: Any = None  #: the connection holding the lock once granted
    slot: int = 0  #: the slot held (a semaphore permit), else 0
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


_OPTIONS = ("mode", "connect_timeout", "request_timeout", "max_connections", "pool_timeout",
            "poll_interval")


class MySQLBackend(Backend):
    """Locks on one MySQL or MariaDB database: ``GET_LOCK`` named locks (see the module doc).

    ``MySQLBackend.from_url("mysql://user:password@host:3306/db")``; ``?mode=row`` gives
    :class:`MySQLRowBackend`.
    """

    schemes: ClassVar[tuple[str, ...]] = ("mysql", "mariadb")
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.SEMAPHORE, Capability.EVENTS, Capability.EXPIRY, Capability.DISTRIBUTED,
         Capability.HOLDERS, Capability.SCAN, Capability.REVOKE, Capability.ELECTION}
    )

    def __init__(
        self, *, host: str = "127.0.0.1", port: int = 3306, user: str | None = None,
        password: str | None = None, database: str, connect_timeout: float = 5.0,
        request_timeout: float = 5.0, max_connections: int = 50, pool_timeout: float | None = None,
        poll_interval: float = 0.5, url: str | None = None,
    ) -> None:
        if not database:
            raise ValueError("a database is needed: mysql://user@host:port/DATABASE")
        _asyncmy()  # a missing client is reported now, naming the extra to install
        self._params: dict[str, Any] = {
            "host": host, "port": port, "user": user, "password": password or "",
            "database": database,
        }
        self._connect_timeout = _number("connect_timeout", connect_timeout)
        self._request_timeout = _number("request_timeout", request_timeout)
        size = int(_number("max_connections", max_connections, integer=True))
        wait = self._connect_timeout if pool_timeout is None else _number("pool_timeout", pool_timeout)
        self._poll = _number("poll_interval", poll_interval)
        self._url = url or f"mysql://{user + '@' if user else ''}{host}:{port}/{database}"
        self._pool = Pool(self._new_connection, size, wait, self._url, alive=_alive,
                           drop=lambda c: c.close(), close=_close)
        self._schema_ready = False
        self._schema_lock = asyncio.Lock()
        #: a session's idle time in ms from PROCESSLIST (MariaDB has TIME_MS; MySQL, TIME)
        self._idle_ms = "p.TIME * 1000"
        self._tasks: set[asyncio.Task[Any]] = set()
        #: clean-ups in flight by (family, name): inspect() waits for them, so that a
        #: status() read after a lost lease was given back does not see it still held
        self._pending: dict[tuple[str, str], set[asyncio.Task[Any]]] = {}
        #: listeners of elections by name (observers, campaigners): woken when this
        #: backend grants, proclaims or gives back a leadership; others poll (ttl/2)
        self._elections: dict[str, set[Waiter]] = {}
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MySQLBackend:
        """``mysql://[user[:password]@]host[:port]/database[?option=value&...]``.

        Options (query or keyword): ``mode`` (``lock``/``row``), ``connect_timeout``,
        ``request_timeout``, ``max_connections``, ``pool_timeout``, ``poll_interval``.
        """
        parts = urlsplit(url)
        expected = f"expected mysql://user@host:port/database, got {_safe(url)!r}"
        if parts.scheme.lower() not in cls.schemes or not parts.hostname:
            raise ValueError(expected)
        try:
            port = parts.port or 3306
        except ValueError as exc:
            raise ValueError(f"bad port in {_safe(url)!r}: {exc}") from None
        database = unquote(parts.path.lstrip("/"))
        if not database or "/" in database:
            raise ValueError(expected)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        opts: dict[str, Any] = {**query, **options}
        unknown = sorted(set(opts) - set(_OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)} for {parts.scheme}://; accepted: "
                + ", ".join(_OPTIONS)
            )
        mode = str(opts.pop("mode", "lock")).lower()
        if mode not in ("lock", "row"):
            raise ValueError(f"mode must be 'lock' or 'row', got {mode!r}")
        for name in ("connect_timeout", "request_timeout", "pool_timeout", "poll_interval"):
            if name in opts and opts[name] is not None:
                opts[name] = _number(name, opts[name])
        if "max_connections" in opts:
            opts["max_connections"] = int(_number("max_connections", opts["max_connections"], integer=True))
        backend_class = MySQLRowBackend if mode == "row" else MySQLBackend
        user = unquote(parts.username) if parts.username is not None else None
        password = unquote(parts.password) if parts.password is not None else None
        safe = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        if user:
            safe = urlunsplit(parts._replace(netloc=f"{parts.username}@{parts.netloc.rpartition('@')[2]}"))
        return backend_class(host=parts.hostname, port=port, user=user, password=password,
                             database=database, url=safe, **opts)

    @property
    def url(self) -> str:
        return self._url

    # -- connections ------------------------------------------------------------------------

    async def _new_connection(self) -> Any:
        mod = _asyncmy()
        flags = importlib.import_module("asyncmy.constants.CLIENT")
        try:
            async with asyncio.timeout(self._connect_timeout):
                conn = await mod.connect(
                    **self._params, autocommit=True, charset="utf8mb4",
                    connect_timeout=max(1, math.ceil(self._connect_timeout)),
                    client_flag=flags.MULTI_STATEMENTS, program_name="aiolock",
                )
        except Exception as exc:
            if isinstance(exc, (LockError, ValueError)):
                raise
            if isinstance(exc, mod.errors.MySQLError) and _code(exc) in _ACCESS_ERRORS:
                raise AccessDenied(f"MySQL at {self._url} refused the login: {exc}") from exc
            raise BackendUnavailable(
                f"cannot reach MySQL at {self._url} ({type(exc).__name__}: {exc})"
            ) from exc
        if "mariadb" in conn.get_server_info().lower():
            self._idle_ms = "p.TIME_MS"
        if not self._schema_ready:
            try:
                await self._ensure_schema(conn)
            except BaseException:
                conn.close()
                raise
        return conn

    async def _ensure_schema(self, conn: Any) -> None:
        async with self._schema_lock:
            if self._schema_ready:
                return
            async with self._guard():
                await _run(conn, "SET @aiolock_notes = @@SESSION.sql_notes, SESSION sql_notes = 0")
                for statement in _SCHEMA:
                    await _run(conn, statement)
                await _run(conn, "SET SESSION sql_notes = @aiolock_notes")
            self._schema_ready = True

    @contextlib.asynccontextmanager
    async def _guard(self, timeout: float | None = -1.0) -> AsyncIterator[None]:
        """Bound a request by ``request_timeout`` and map asyncmy's errors to ours."""
        limit = self._request_timeout if timeout == -1.0 else timeout
        try:
            async with asyncio.timeout(limit):
                yield
        except (LockError, ValueError):
            raise
        except Exception as exc:
            if _is_connection_error(exc):
                raise BackendUnavailable(
                    f"MySQL at {self._url} is unavailable ({type(exc).__name__}: {exc})"
                ) from exc
            if _code(exc) in _ACCESS_ERRORS:
                raise AccessDenied(f"MySQL at {self._url} refused the request: {exc}") from exc
            raise LockError(f"MySQL at {self._url} refused the request: {exc}") from exc

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
                await _run(conn, "SELECT 1")
        except BaseException:
            self._pool.discard(conn)
            raise
        self._pool.put(conn)

    async def _kill(self, conn: Any, conn_id: int | None) -> None:
        """End ``conn`` on the server (a statement may be waiting there) and close it.

        ``KILL CONNECTION`` from another connection ends the session and frees every lock
        it holds or waits for; then wait until the server has really let it go.
        """
        self._pool.discard(conn)
        if conn_id is None:
            return
        other = None
        try:
            other = await self._pool.get()
            async with self._guard():
                with contextlib.suppress(Exception):
                    await _run(other, "KILL CONNECTION %s", (conn_id,))
                for _ in range(200):
                    rows = await _run(
                        other, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s",
                        (conn_id,),
                    )
                    if not rows[0][0]:
                        break
                    await asyncio.sleep(0.005)
        except Exception as exc:
            log.warning("could not end connection %s on %s: %s", conn_id, self._url, exc)
            if other is not None:
                self._pool.discard(other)
            return
        self._pool.put(other)

    # -- the claim's keys and state ------------------------------------------------------------

    def _state(self, claim: Claim) -> _State:
        st = claim.state.get("mysql")
        if not isinstance(st, _State):
            if claim.kind is Kind.PERMIT:
                keys = [lock_key("sem", claim.name, i) for i in range(claim.limit)]
            else:
                keys = [lock_key(claim.kind.family, claim.name)]
            st = _State(keys)
            claim.state["mysql"] = st
        return st

    def _grant_args(self, claim: Claim) -> tuple[Any, ...]:
        family, name = claim.kind.family, _name(claim.name)
        return (_seconds(claim.ttl_ms), family, name, family, name, claim.owner,
                claim.kind.value, claim.ttl_ms, claim.info)

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
            if not wait.cancelled() and wait.exception() is None and wait.result() is not None:
                st.conn, st.slot, st.token = wait.result()
                return await self._confirm(claim, st)
            # the wait failed (its error was logged): try afresh below
        if st.waiter is not None and claim.kind is not Kind.PERMIT:
            # a listening claim queues on the server: granted when the lock frees
            st.wait = self._spawn(self._blocking_wait(claim, st))
            return Busy(QUEUED_RECHECK)
        st.op = op = self._spawn(self._attempt(claim, st))
        granted = await asyncio.shield(op)  # a cancel lets it finish; abandon() cleans up
        if granted:
            self._signal(claim)
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

    def _try_sql(self, st: _State, timeout: int) -> tuple[str, list[Any]]:
        """``SET @aiolock_slot`` to the slot taken (NULL if none), then the grant tail."""
        if len(st.keys) == 1:
            head = "SET @aiolock_slot = IF(GET_LOCK(%s, %s) = 1, 0, NULL)"
            return head + _GRANT_TAIL, [st.keys[0], timeout]
        whens = " ".join(f"WHEN GET_LOCK(%s, 0) = 1 THEN {i}" for i in range(len(st.keys)))
        return f"SET @aiolock_slot = CASE {whens} END" + _GRANT_TAIL, list(st.keys)

    async def _try(self, conn: Any, claim: Claim, st: _State) -> bool:
        """Try to take the lock on ``conn``; record the grant. False if busy."""
        sql, args = self._try_sql(st, 0)
        async with self._guard():
            rows = await _run(conn, sql, [*args, *self._grant_args(claim)])
        slot, token = rows[0]
        if slot is None:
            return False
        st.slot, st.token = int(slot), int(token)
        return True

    async def _blocking_wait(self, claim: Claim, st: _State) -> tuple[Any, int, int] | None:
        """Queue on the server for the lock; on grant record it and wake the waiter.

        The session's expiry is armed before it queues, so a grant nobody picks up (the
        client paused or gone) still ends ``ttl`` after it was made.
        """
        conn = conn_id = None
        try:
            conn = await self._pool.get()
            conn_id = conn.thread_id()
            sql, args = self._try_sql(st, _FOREVER)
            sql = "SET SESSION wait_timeout = %s; " + sql
            async with self._guard(None):
                rows = await _run(conn, sql, [_seconds(claim.ttl_ms), *args, *self._grant_args(claim)])
            slot, token = rows[0]
            if slot is None:  # the wait ended without the lock (killed, timed out)
                self._pool.discard(conn)
                self._wake(st)
                return None
            result = (conn, int(slot), int(token))
        except BaseException as exc:
            if conn is not None:
                await self._kill(conn, conn_id)
            if not isinstance(exc, asyncio.CancelledError):
                log.warning("waiting for %r on %s failed: %s", claim.name, self._url, exc)
                self._wake(st)
            raise
        self._wake(st)
        return result

    @staticmethod
    def _wake(st: _State) -> None:
        if st.waiter is not None:
            st.waiter.wake()

    async def _confirm(self, claim: Claim, st: _State) -> Granted | Busy:
        """A claim granted earlier (e.g. by its wait): restart its expiry, give it out."""
        ms = await self._renew_one(claim, st)
        if ms is None or ms == REVOKED:
            return Busy(0.001)  # the grant died before we could take it: ask again
        self._signal(claim)
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
            if not _alive(conn):
                st.conn = None
                self._pool.discard(conn)
                return None
            try:
                held = await self._renew_statement(conn, claim, st)
            except LockError:
                held = 0
            if held == 2:  # revoked: give it back now (the core reports the loss)
                return REVOKED
            if held != 1:
                # gone, or too slow to trust: drop the connection, so the server frees it
                st.conn = None
                self._pool.discard(conn)
                return None
            return claim.ttl_ms

    async def _renew_statement(self, conn: Any, claim: Claim, st: _State) -> int:
        """1 held, 0 gone, 2 revoked."""
        async with self._guard():
            rows = await _run(conn, _RENEW, (_seconds(claim.ttl_ms), st.keys[st.slot],
                                             claim.kind.family, _name(claim.name), st.slot,
                                             claim.owner))
        return int(rows[0][0])

    async def release(self, claim: Claim) -> bool:
        st = self._state(claim)
        if st.release is None or (st.release.done() and (
            st.release.cancelled() or st.release.exception() is not None
        )):
            st.release = self._spawn(self._release(claim, st))
        return await asyncio.shield(st.release)

    async def _release(self, claim: Claim, st: _State) -> bool:
        try:
            return await self._release_now(claim, st)
        finally:
            self._signal(claim)

    async def _release_now(self, claim: Claim, st: _State) -> bool:
        if st.op is not None and not st.op.done():
            await asyncio.wait([st.op])
        async with st.mutex:
            conn, st.conn = st.conn, None
            if conn is None:
                return False
            if not _alive(conn):
                self._pool.discard(conn)
                return False
            try:
                released = await self._unlock(conn, claim, st)
            except LockError:
                self._pool.discard(conn)  # the server frees it as the session ends
                return False
            self._pool.put(conn)
            return released

    async def _unlock(self, conn: Any, claim: Claim, st: _State) -> bool:
        async with self._guard(), conn.cursor() as cur:
            await cur.execute(_RELEASE, (st.keys[st.slot], claim.kind.family, _name(claim.name),
                                         st.slot, claim.owner))
            released = bool((await cur.fetchone())[0] == 1)
            while await cur.nextset():
                pass
        return released

    async def abandon(self, claim: Claim) -> None:
        st = self._state(claim)
        st.abandoned = True
        if st.cleanup is None or st.cleanup.done():
            st.cleanup = self._spawn(self._abandon(claim, st))
            key = (claim.kind.family, claim.name)
            pending = self._pending.setdefault(key, set())
            pending.add(st.cleanup)

            def done(task: asyncio.Task[Any]) -> None:
                pending.discard(task)
                if not pending and self._pending.get(key) is pending:
                    del self._pending[key]

            st.cleanup.add_done_callback(done)
        await asyncio.shield(st.cleanup)

    async def _abandon(self, claim: Claim, st: _State) -> None:
        try:
            await self._abandon_now(claim, st)
        finally:
            self._signal(claim)

    async def _abandon_now(self, claim: Claim, st: _State) -> None:
        await self._drop_wait(claim, st)
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
            if not _alive(conn):
                self._pool.discard(conn)
                return
            try:
                await self._unlock(conn, claim, st)
            except LockError as exc:
                log.warning("could not release %r on %s: %s", claim.name, self._url, exc)
                self._pool.discard(conn)
                return
            self._pool.put(conn)

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        """Locks wait in the server's queue (started by the next ``try_acquire``);
        semaphore waiters poll (and are woken by local releases); election listeners
        are woken by this backend's own grants, proclaims and releases."""
        self._state(waiter.claim).waiter = waiter
        if kind is Kind.LEADER:
            self._elections.setdefault(name, set()).add(waiter)

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        st = self._state(waiter.claim)
        if st.waiter is waiter:
            st.waiter = None
        if kind is Kind.LEADER:
            waiters = self._elections.get(name)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._elections[name]
        if st.wait is not None and (st.cleanup is None or st.cleanup.done()):
            # a wait nobody will take any more: end it, free what it may have got
            st.cleanup = self._spawn(self._drop_wait(waiter.claim, st))

    async def _drop_wait(self, claim: Claim, st: _State) -> None:
        wait, st.wait = st.wait, None
        if wait is None:
            return
        if not wait.done():
            wait.cancel()  # its clean-up kills its connection on the server
        await asyncio.wait([wait])
        if not wait.cancelled() and wait.exception() is None and wait.result() is not None:
            conn, slot, _token = wait.result()
            await self._cleanup(claim, _State(st.keys, conn=conn, slot=slot))

    def _signal(self, claim: Claim) -> None:
        """Wake this backend's listeners of an election whose leadership changed."""
        if claim.kind is Kind.LEADER:
            for waiter in list(self._elections.get(claim.name, ())):
                if waiter.claim is not claim:
                    waiter.wake()

    async def set_info(self, claim: Claim) -> bool:
        """Store the held ``claim``'s new holder record (a proclaim); False if not held."""
        st = self._state(claim)
        async with st.mutex:
            conn = st.conn
            if conn is None or st.abandoned or not _alive(conn):
                return False
            async with self._guard():
                rows = await _run(
                    conn,
                    "UPDATE aiolock_holders SET info = %s WHERE family = %s AND name = %s"
                    " AND slot = %s AND owner = %s; SELECT IS_USED_LOCK(%s) <=> CONNECTION_ID()"
                    " AND EXISTS (SELECT 1 FROM aiolock_holders WHERE family = %s AND name = %s"
                    " AND slot = %s AND owner = %s)",
                    (claim.info, claim.kind.family, _name(claim.name), st.slot, claim.owner,
                     st.keys[st.slot], claim.kind.family, _name(claim.name), st.slot, claim.owner),
                )
        self._signal(claim)
        return bool(rows[0][0] == 1)

    async def _settle(self, family: str, name: str) -> None:
        """Wait (bounded) for this backend's own clean-ups of ``name`` in flight."""
        pending = self._pending.get((family, name))
        if pending:
            await asyncio.wait(list(pending), timeout=self._request_timeout)

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        await self._settle(kind.family, name)
        if kind is Kind.PERMIT:
            return await self._inspect_sem(name)
        family = kind.family
        raw = _name(name)
        rows = await self._query(_INSPECT.format(idle_ms=self._idle_ms),
                                 (lock_key(family, name), family, raw, family, raw))
        used, last, token, holder, ttl_ms, idle_ms, command, info, since = rows[0]
        if used is None:
            return LockInfo(name, False, last_token=last, family=family)
        if holder != used:  # held by a session that has not recorded itself (yet)
            return LockInfo(name, True, holders=1, last_token=last, family=family)
        return LockInfo(name, True, holders=1, token=token, last_token=last,
                        ttl_left=_left(ttl_ms, idle_ms, command), family=family,
                        held_by=(_holder(info, since),))

    async def _inspect_sem(self, name: str) -> LockInfo:
        # the limit is not stored: count the holder rows whose sessions hold their slot
        rows = await self._query(
            "SELECT h.slot, h.conn, h.ttl_ms, " + self._idle_ms + ", p.COMMAND,"
            " (SELECT token FROM aiolock_tokens WHERE family = 'sem' AND name = %s), h.info,"
            " TIMESTAMPDIFF(MICROSECOND, h.since, NOW(6)) / 1e6"
            " FROM (SELECT 1) AS one LEFT JOIN aiolock_holders h ON h.family = 'sem' AND h.name = %s"
            " LEFT JOIN information_schema.PROCESSLIST p ON p.ID = h.conn",
            (_name(name), _name(name)),
        )
        last = rows[0][5] if rows else None
        live = [r for r in rows if r[0] is not None]
        if live:
            used = await self._query(
                "SELECT " + ", ".join("IS_USED_LOCK(%s)" for _ in live),
                [lock_key("sem", name, int(r[0])) for r in live],
            )
            live = [r for r, u in zip(live, used[0], strict=True) if u is not None and u == r[1]]
        lefts = [left for r in live if (left := _left(r[2], r[3], r[4])) is not None]
        return LockInfo(name, bool(live), holders=len(live), last_token=last,
                        ttl_left=max(lefts) if lefts else None, family="sem",
                        held_by=tuple(_holder(r[6], r[7]) for r in live))

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every name held now whose name starts with ``prefix``: the names of the holder
        rows (one indexed range read), each checked as :meth:`inspect` does."""
        rows = await self._query(
            "SELECT DISTINCT family, name FROM aiolock_holders WHERE name LIKE %s"
            " ORDER BY name, family", (_like_prefix(prefix),),
        )
        for family, raw in rows:
            if family not in FAMILY_KIND:
                continue  # a family this aiolock does not know
            info = await self.inspect(bytes(raw).decode("utf-8", "surrogatepass"), FAMILY_KIND[family])
            if info.held:
                yield info

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        """Delete the holder rows of ``name``: each holder learns at its next renewal
        (within ``ttl/3``) that it was revoked, and gives the lock back."""
        held = (await self.inspect(name, kind)).held
        await self._query(
            "DELETE FROM aiolock_holders WHERE family = %s AND name = %s; SELECT ROW_COUNT()",
            (kind.family, _name(name)),
        )
        return held

    async def _query(self, sql: str, args: Sequence[Any]) -> list[Any]:
        """One read on a pooled connection (retried once on a fresh one)."""
        for fresh in (False, True):
            conn = await self._pool.get()
            try:
                async with self._guard():
                    rows = await _run(conn, sql, args)
            except BackendUnavailable:
                self._pool.discard(conn)
                if fresh:
                    raise
                continue
            except BaseException:
                self._pool.discard(conn)
                raise
            self._pool.put(conn)
            return rows
        return []  # pragma: no cover

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self._request_timeout)
        await self._pool.aclose()


def _left(ttl_ms: Any, idle_ms: Any, command: Any) -> float | None:
    """Seconds left of a holder's lease: its ttl less the time its session has been idle
    (the server's own count, ``PROCESSLIST.TIME_MS``; unknown for another account's
    session, then the whole ttl)."""
    if ttl_ms is None:
        return None
    ttl = int(ttl_ms) / 1000
    if command == "Sleep" and idle_ms is not None:
        return max(ttl - float(idle_ms) / 1000, 0.0)
    return ttl


def _holder(info: Any, since: Any) -> Holder:
    return decode_holder(info, None if since is None else float(since))


def _like_prefix(prefix: str) -> bytes:
    """A ``LIKE`` pattern matching names that start with ``prefix`` (``\\`` escapes)."""
    raw = prefix.encode("utf-8", "surrogatepass")
    for char in (b"\\", b"%", b"_"):
        raw = raw.replace(char, b"\\" + char)
    return raw + b"%"


def _safe(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class MySQLRowBackend(MySQLBackend):
    """``mysql://...?mode=row``: the ``SELECT ... FOR UPDATE`` row lock.

    A held claim keeps a transaction open on its connection with the row
    ``aiolock_rows(family, name)`` locked; the server ends a holder that stops renewing
    after ``wait_timeout = ceil(ttl)``. Mutex only: no rwlock or semaphore. Waiting queues
    on the row lock (InnoDB does not promise an order: no ``fair=True``).
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.EVENTS, Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS,
         Capability.SCAN, Capability.REVOKE}
    )

    async def _lock_row(self, conn: Any, claim: Claim, *, nowait: bool) -> bool:
        family, name = claim.kind.family, _name(claim.name)
        await _run(conn, "INSERT INTO aiolock_rows (family, name) VALUES (%s, %s)"
                   " ON DUPLICATE KEY UPDATE family = family", (family, name))
        if not nowait:  # the wait is bounded by innodb_lock_wait_timeout: make it long
            await _run(conn, "SET SESSION innodb_lock_wait_timeout = %s", (_FOREVER,))
        suffix = " NOWAIT" if nowait else ""
        try:
            await _run(
                conn,
                "SET SESSION wait_timeout = %s; START TRANSACTION;"
                f" SELECT 1 FROM aiolock_rows WHERE family = %s AND name = %s FOR UPDATE{suffix}",
                (_seconds(claim.ttl_ms), family, name),
            )
        except _asyncmy().errors.MySQLError as exc:
            if _code(exc) not in _LOCKED_ERRORS:
                raise
            await _run(conn, "ROLLBACK; SET SESSION wait_timeout = @@GLOBAL.wait_timeout")
            return False
        return True

    async def _record(self, claim: Claim, st: _State, holder_id: int) -> None:
        """Commit the token on another connection (the claim's transaction stays open)."""
        family, name = claim.kind.family, _name(claim.name)
        rows = await self._query(
            "INSERT INTO aiolock_tokens (family, name, token) VALUES (%s, %s, LAST_INSERT_ID(1))"
            " ON DUPLICATE KEY UPDATE token = LAST_INSERT_ID(token + 1);"
            " REPLACE INTO aiolock_holders (family, name, slot, owner, kind, token, conn, ttl_ms,"
            " since, info) VALUES (%s, %s, 0, %s, %s, LAST_INSERT_ID(), %s, %s, NOW(6), %s);"
            " SELECT LAST_INSERT_ID()",
            (family, name, family, name, claim.owner, claim.kind.value, holder_id, claim.ttl_ms,
             claim.info),
        )
        st.slot, st.token = 0, int(rows[0][0])

    async def _try(self, conn: Any, claim: Claim, st: _State) -> bool:
        self._check_kind(claim)
        async with self._guard():
            got = await self._lock_row(conn, claim, nowait=True)
        if got:
            try:
                await self._record(claim, st, conn.thread_id())
            except BaseException:
                with contextlib.suppress(Exception):
                    await _run(conn, "ROLLBACK")
                raise
        return got

    async def _blocking_wait(self, claim: Claim, st: _State) -> tuple[Any, int, int] | None:
        conn = conn_id = None
        try:
            self._check_kind(claim)
            conn = await self._pool.get()
            conn_id = conn.thread_id()
            async with self._guard(None):
                await self._lock_row(conn, claim, nowait=False)
            async with self._guard():
                await self._record(claim, st, conn_id)
            result = (conn, 0, st.token)
        except BaseException as exc:
            if conn is not None:
                await self._kill(conn, conn_id)
            if not isinstance(exc, asyncio.CancelledError):
                log.warning("waiting for %r on %s failed: %s", claim.name, self._url, exc)
                self._wake(st)
            raise
        self._wake(st)
        return result

    async def _renew_statement(self, conn: Any, claim: Claim, st: _State) -> int:
        """1 held, 0 gone, 2 revoked."""
        async with self._guard():
            rows = await _run(
                conn,
                "SET SESSION wait_timeout = %s; SELECT EXISTS (SELECT 1 FROM aiolock_holders"
                " WHERE family = %s AND name = %s AND slot = 0 AND owner = %s)",
                (_seconds(claim.ttl_ms), claim.kind.family, _name(claim.name), claim.owner),
            )
        # the server's status flag: our transaction (and so its row lock) is still open
        if not conn.get_transaction_status():
            return 0
        return 1 if rows[0][0] else 2

    async def _unlock(self, conn: Any, claim: Claim, st: _State) -> bool:
        held = bool(conn.get_transaction_status())
        async with self._guard():
            await _run(
                conn,
                "ROLLBACK; SET SESSION wait_timeout = @@GLOBAL.wait_timeout,"
                " innodb_lock_wait_timeout = @@GLOBAL.innodb_lock_wait_timeout;"
                " DELETE FROM aiolock_holders WHERE family = %s AND name = %s AND slot = 0"
                " AND owner = %s",
                (claim.kind.family, _name(claim.name), claim.owner),
            )
        return held

    @staticmethod
    def _check_kind(claim: Claim) -> None:
        if claim.kind is not Kind.LOCK:
            raise LockError("the row-lock mode offers lock() only (no rwlock or semaphore)")

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        await self._settle(kind.family, name)
        family, raw = kind.family, _name(name)
        rows = await self._query(
            "START TRANSACTION;"
            " SELECT (SELECT COUNT(*) FROM aiolock_rows WHERE family = %s AND name = %s),"
            " (SELECT COUNT(*) FROM (SELECT 1 FROM aiolock_rows WHERE family = %s AND name = %s"
            "  LOCK IN SHARE MODE SKIP LOCKED) AS f) INTO @aiolock_exists, @aiolock_free;"
            " ROLLBACK;"
            " SELECT @aiolock_exists, @aiolock_free, t.token, h.token, h.ttl_ms, " + self._idle_ms
            + ", p.COMMAND, h.info, TIMESTAMPDIFF(MICROSECOND, h.since, NOW(6)) / 1e6"
            " FROM (SELECT 1) AS one"
            " LEFT JOIN aiolock_tokens t ON t.family = %s AND t.name = %s"
            " LEFT JOIN aiolock_holders h ON h.family = %s AND h.name = %s AND h.slot = 0"
            " LEFT JOIN information_schema.PROCESSLIST p ON p.ID = h.conn",
            (family, raw, family, raw, family, raw, family, raw),
        )
        exists, free, last, token, ttl_ms, idle_ms, command, info, since = rows[0]
        if not exists or free:
            return LockInfo(name, False, last_token=last, family=family)
        return LockInfo(name, True, holders=1, token=token if token is not None else last,
                        last_token=last, ttl_left=_left(ttl_ms, idle_ms, command), family=family,
                        held_by=(_holder(info, since),) if ttl_ms is not None else ())
