"""The PostgreSQL ``Backend`` adapter: session advisory locks (see the package doc)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlsplit

from ..._holder import Holder, decode_holder
from ...abc import FAMILY_KIND, Capability, Claim, Kind, LockInfo, Waiter
from ...errors import AccessDenied, LockError
from .._own_task import in_own_task
from .._sql import SQLBackend
from .._sql_claim import ClaimState, Renewal
from .._sql_options import refuse_contradictions
from . import _statements as sql
from ._connection import asyncpg, close, map_connect_error, map_error, parse_url, safe_url
from ._notify import Notifier

__all__ = ["PostgresBackend"]

log = logging.getLogger("aiolock.backends.postgres")

_EXCLUSIVE_KINDS = frozenset(k.value for k in Kind if k.exclusive)


class PostgresBackend(SQLBackend):
    """Locks on one PostgreSQL database: session advisory locks (see the package doc).

    ``PostgresBackend.from_url("postgresql://user@host:5432/db")``; ``?mode=row`` gives
    :class:`PostgresRowBackend`.
    """

    schemes: ClassVar[tuple[str, ...]] = ("postgresql", "postgres")
    # a blocked lock request (semaphores poll)
    waiting_counted: ClassVar[frozenset[Kind]] = frozenset({Kind.LOCK, Kind.WRITE, Kind.READ, Kind.LEADER})
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.FAIR, Capability.RWLOCK, Capability.SEMAPHORE, Capability.EVENTS,
         Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS, Capability.SCAN,
         Capability.REVOKE, Capability.ELECTION}
    )
    _server: ClassVar[str] = "PostgreSQL"
    _log: ClassVar[logging.Logger] = log
    #: the session setting that makes the server end a holder that stops renewing
    _expiry_setting: ClassVar[str] = "idle_session_timeout"
    #: "session ``{pid}`` holds ``{key}``" in SQL (see :data:`_statements.HOLDS`)
    _holds: ClassVar[str] = sql.HOLDS
    #: a claim's connection may be inside a transaction (row mode): see :meth:`_unlock`
    _transactions: ClassVar[bool] = False

    def __init__(
        self, dsn: str, *, connect_timeout: float = 5.0, request_timeout: float = 5.0,
        max_connections: int = 50, pool_timeout: float | None = None, poll_interval: float = 0.5,
        url: str | None = None, **connect_options: Any,
    ) -> None:
        self._dsn = dsn
        self._connect_options = connect_options
        super().__init__(url=url or safe_url(dsn), connect_timeout=connect_timeout,
                         request_timeout=request_timeout, max_connections=max_connections,
                         pool_timeout=pool_timeout, poll_interval=poll_interval)
        self._notifier = Notifier(open_conn=self._new_connection, guard=self._guard,
                                  spawn=self._spawn, retry=self._poll, url=self._url)
        #: connections being opened: the close lets them finish (never cancelled
        #: mid-handshake, see _open), and a connection opened for nobody is closed
        self._openings: set[asyncio.Future[Any]] = set()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresBackend:
        """``postgresql://[user[:password]@]host[:port]/database[?option=value&...]``.

        Options (query or keyword): ``mode`` (``advisory``/``row``), ``connect_timeout``,
        ``request_timeout``, ``max_connections``, ``pool_timeout``, ``poll_interval``;
        other query parameters (e.g. ``sslmode``) go to ``asyncpg``.
        """
        from ._row import PostgresRowBackend

        refuse_contradictions(dict(parse_qsl(urlsplit(url).query, keep_blank_values=True)),
                              options)
        dsn, safe, opts = parse_url(url, cls.schemes, options)
        mode = str(opts.pop("mode", "advisory")).lower()
        if mode not in ("advisory", "row"):
            raise ValueError(f"mode must be 'advisory' or 'row', got {mode!r}")
        backend_class = PostgresRowBackend if mode == "row" else PostgresBackend
        return backend_class(dsn, url=safe, **opts)

    # -- connections ----------------------------------------------------------------------------

    @staticmethod
    def _alive(conn: Any) -> bool:
        return not conn.is_closed()

    @classmethod
    def _poolable(cls, conn: Any) -> bool:
        # asyncpg's transaction status is the server's, as of the last completed statement
        return not conn.is_closed() and not conn.is_in_transaction()

    @staticmethod
    def _drop(conn: Any) -> None:
        conn.terminate()

    @staticmethod
    async def _close(conn: Any) -> None:
        await close(conn)

    async def _open(self) -> Any:
        options = dict(self._connect_options)
        settings = dict(options.pop("server_settings", {}) or {})
        settings.setdefault("application_name", "aiolock")
        # not cut short by a cancelled caller: asyncpg cancelled mid-handshake leaves its
        # TLS probe's future failing unseen ("Future exception was never retrieved"); a
        # connection made for nobody is closed
        opening = asyncio.ensure_future(
            asyncpg().connect(self._dsn, timeout=self._connect_timeout, server_settings=settings,
                              **options))
        self._openings.add(opening)
        opening.add_done_callback(self._openings.discard)
        return await in_own_task(opening, lambda opening: opening.add_done_callback(_close_unused))

    def _error(self, exc: Exception) -> LockError:
        return map_error(exc, self._url)

    def _connect_error(self, exc: Exception) -> LockError:
        return map_connect_error(exc, self._url)

    async def _ping(self, conn: Any) -> None:
        await conn.fetchval("SELECT 1")

    async def _create_schema(self, conn: Any) -> None:
        async with self._guard():
            # tables made by an administrator need no CREATE privilege (least privilege)
            present = await conn.fetchrow(sql.TABLES_PRESENT)
        if present["tables"] and present["columns"]:
            return
        try:
            async with self._guard(), conn.transaction():
                # serialize concurrent CREATE ... IF NOT EXISTS across processes
                await conn.execute("SELECT pg_advisory_xact_lock($1::bigint)",
                                   sql.advisory_key("", sql.SCHEMA_KEY_TEXT))
                if not present["tables"]:
                    await conn.execute(sql.SCHEMA)
                await conn.execute(sql.MIGRATE_SQL)
        except AccessDenied as exc:
            if not present["tables"]:
                raise
            raise AccessDenied(
                f"PostgreSQL at {self._url}: the table aiolock_holders was made by an older "
                "aiolock and lacks the holder-record columns, and this user may not alter it; "
                f"its owner (an administrator) must run once: {sql.MIGRATE_SQL}"
            ) from exc

    async def _close_extra(self) -> None:
        await self._notifier.aclose()
        if self._openings:  # (else the event loop's end would cancel them mid-handshake)
            await asyncio.wait(list(self._openings), timeout=self._connect_timeout)

    # -- the claim's statements ---------------------------------------------------------------

    def _keys(self, claim: Claim) -> list[Any]:
        if claim.kind is Kind.PERMIT:
            return [sql.advisory_key("sem", claim.name, i) for i in range(claim.limit)]
        return [sql.advisory_key(claim.kind.family, claim.name)]

    def _args(self, claim: Claim, key: int | list[int], *, arm: bool = True,
              pid: int | None = None) -> tuple[Any, ...]:
        """The parameters of the grant statements (see :data:`_statements.GRANT_CTES`)."""
        return (claim.kind.family, claim.name, claim.owner, claim.kind.value, claim.ttl_ms,
                self._expiry_setting if arm else "", key, claim.info, pid)

    async def _try(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        """Try to take the lock on ``conn``, recording the grant in the same statement."""
        if claim.kind is Kind.PERMIT:
            statement, key = sql.TRY_SLOTS, st.keys
        else:
            statement = sql.TRY_SHARED if claim.kind is Kind.READ else sql.TRY_EXCLUSIVE
            key = st.keys[0]
        async with self._guard():
            row = await conn.fetchrow(statement, *self._args(claim, key))
        if not row["ok"]:
            return False
        st.slot, st.token = st.keys.index(int(row["k"])), int(row["token"])
        return True

    async def _wait_on(self, conn: Any, claim: Claim, st: ClaimState) -> tuple[int, int] | None:
        """Queue on the server; the session's expiry is armed before it queues, so a grant
        nobody picks up (the client paused or gone) still ends ``ttl`` after it was made."""
        key = st.keys[0]
        fn = "pg_advisory_lock_shared" if claim.kind is Kind.READ else "pg_advisory_lock"
        async with self._guard(None):
            await conn.execute(f"SELECT set_config($2, $3::bigint::text, false), {fn}($1::bigint)",
                               key, self._expiry_setting, claim.ttl_ms)
        async with self._guard():
            row = await conn.fetchrow(sql.GRANT_HELD, *self._args(claim, key))
        return 0, int(row["token"])

    async def _end_wait(self, conn: Any, claim: Claim) -> None:
        """Make ``conn`` hold nothing and leave no holder row (waiting out a cancelled
        statement), then pool it; drop it if that fails."""
        try:
            await self._unlock(conn, claim, None)
        except BaseException as exc:
            self._pool.discard(conn)
            if not isinstance(exc, Exception):
                raise
            return
        self._pool.put(conn)

    async def _renew_statement(self, conn: Any, claim: Claim, st: ClaimState) -> Renewal:
        """Extend on the claim's session; REVOKED if its holder row was deleted."""
        async with self._guard():
            row = await conn.fetchrow(sql.RENEW, claim.kind.family, claim.name, claim.owner,
                                      claim.ttl_ms, self._expiry_setting)
        return Renewal.HELD if row["kept"] else Renewal.REVOKED

    async def _unlock(self, conn: Any, claim: Claim, st: ClaimState | None) -> bool:
        signal = sql.signal_key(claim.kind, claim.name)
        async with self._guard():
            # asyncpg's is_in_transaction() is the status after the last statement that
            # *completed*: a BEGIN whose execute was cancelled (a wait cut off) still runs
            # on the server, and only then opens the transaction. So where transactions
            # are opened at all (row mode), ROLLBACK always: asyncpg first waits out the
            # cancelled statement, and a ROLLBACK outside a transaction is only a warning.
            # Else UNLOCK would run in that transaction, never committed, and the
            # connection go back to the pool inside it.
            if self._transactions or conn.is_in_transaction():
                await conn.execute("ROLLBACK")
            await conn.fetchrow(sql.UNLOCK, claim.kind.family, claim.name, claim.owner,
                                None if signal is None else str(signal))
        return True

    async def _set_info_statement(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        """On the claim's own session: also restarts that session's expiry timer."""
        async with self._guard():
            row = await conn.fetchrow(sql.SET_INFO, *self._set_info_args(claim))
        return bool(row["kept"])

    @staticmethod
    def _set_info_args(claim: Claim) -> tuple[Any, ...]:
        signal = sql.signal_key(claim.kind, claim.name)
        return (claim.kind.family, claim.name, claim.owner, claim.info,
                None if signal is None else str(signal))

    async def _subscribe(self, name: str, kind: Kind, waiter: Waiter) -> None:
        """Semaphore waiters get ``NOTIFY`` on each release; an election's listeners
        (candidates and observers) on each grant, proclaim, release and revocation of its
        leadership. Locks and rwlocks need none: they queue on the server."""
        signal = sql.signal_key(kind, name)
        if signal is not None:
            await self._notifier.add(signal, waiter)

    def _unsubscribe(self, name: str, kind: Kind, waiter: Waiter) -> None:
        signal = sql.signal_key(kind, name)
        if signal is not None:
            self._notifier.remove(signal, waiter)

    # -- reading and revoking -------------------------------------------------------------------

    async def _query(self, statement: str, *args: Any) -> list[Any]:
        """One statement on a pooled connection (a plain read, or a short write)."""
        return list(await self._pooled(lambda conn: conn.fetch(statement, *args)))

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        family = kind.family
        await self._settle(family, name)
        if kind is Kind.PERMIT:
            return await self._inspect_sem(name)

        async def read(conn: Any) -> tuple[Any, Any]:
            locks = await conn.fetch(sql.INSPECT_LOCKS, [sql.advisory_key(family, name)])
            return locks, await conn.fetch(sql.INSPECT_ROWS, family, name)

        locks, rows = await self._pooled(read)
        holding = {r["pid"] for r in locks if r["granted"]}
        waiting = sum(1 for r in locks if not r["granted"])
        return _info(name, family, holding, rows, waiters=waiting)

    async def _inspect_sem(self, name: str) -> LockInfo:
        # the limit is not stored: count the holder rows whose sessions hold a slot lock
        async def read(conn: Any) -> tuple[Any, Any]:
            rows = await conn.fetch(sql.INSPECT_ROWS, "sem", name)
            pids = [r["pid"] for r in rows if r["pid"] is not None]
            held = await conn.fetch(
                "SELECT DISTINCT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND pid = ANY($1::int[])", pids,
            ) if pids else []
            return rows, held

        rows, held = await self._pooled(read)
        return _info(name, "sem", {r["pid"] for r in held}, rows)

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        """Revoke every holder of ``name`` in ``kind``'s family: their holder rows are
        deleted, so each holder's next renewal (within ``ttl/3``) answers "revoked" and it
        unlocks. Sessions are not terminated: a holder that does not renew (paused) keeps
        its lock until the server's idle timeout (``ttl``) ends the session."""
        signal = sql.signal_key(kind, name)
        rows = await self._query(sql.revoke_sql(self._holds), kind.family, name,
                                 None if signal is None else str(signal))
        return bool(rows and rows[0]["live"])

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every name held now (holder rows whose session holds the lock), in name order;
        one plain SELECT over ``aiolock_holders`` and ``pg_locks``."""
        rows = await self._query(self._scan_sql(), sql.escape_like(prefix))
        groups: dict[tuple[str, str], list[Any]] = {}
        for row in rows:
            groups.setdefault((row["name"], row["family"]), []).append(row)
        for (name, family), mine in groups.items():
            if family not in FAMILY_KIND:
                continue  # a family this aiolock does not know (a newer version's)
            yield _info(name, family, {r["pid"] for r in mine}, mine,
                        waiters=max(int(r["waiting"]) for r in mine))

    def _scan_sql(self) -> str:
        return sql.scan_sql(self._holds)


def _holder(row: Any) -> Holder:
    """A holder row's record, ``since`` on the server's clock (unknown for older rows)."""
    since = row["since_s"]
    return decode_holder(row["info"], None if since is None else float(since))


def _info(name: str, family: str, holding: set[int], rows: Sequence[Any], *,
          waiters: int = 0) -> LockInfo:
    """What :meth:`Backend.inspect` reports from the holder ``rows`` (by token, each with the
    name's last token) whose session ``pid`` is among ``holding`` (holding the lock now)."""
    last = rows[0]["last"] if rows else None
    if not holding:
        return LockInfo(name, False, last_token=last, waiters=waiters, family=family)
    mine = [r for r in rows if r["pid"] is not None and r["pid"] in holding]
    exclusive = [r for r in mine if r["kind"] in _EXCLUSIVE_KINDS]
    lefts = [max(float(r["left_s"]), 0.0) for r in mine]
    return LockInfo(
        name, True, holders=len(holding), token=exclusive[0]["token"] if exclusive else None,
        last_token=last, ttl_left=max(lefts) if lefts else None, waiters=waiters,
        held_by=tuple(_holder(r) for r in mine), family=family,
    )


def _close_unused(opening: asyncio.Future[Any]) -> None:
    """A connection opened for a caller cancelled meanwhile: closed (its error, if it
    failed, is retrieved: nobody waits for it)."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().terminate()
