"""The MySQL / MariaDB ``Backend`` adapter: ``GET_LOCK`` named locks (see the package doc)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from ..._holder import Holder, decode_holder
from ...abc import FAMILY_KIND, Capability, Claim, Kind, LockInfo, Waiter
from ...errors import LockError
from .._sql import SQLBackend
from .._sql_claim import ClaimState, Renewal, forget_listener
from . import _statements as sql
from ._connection import asyncmy, map_connect_error, map_error, name_bytes, parse_url, run, seconds

__all__ = ["MySQLBackend"]

log = logging.getLogger("aiolock.backends.mysql")


class MySQLBackend(SQLBackend):
    """Locks on one MySQL or MariaDB database: ``GET_LOCK`` named locks (see the package doc).

    ``MySQLBackend.from_url("mysql://user:password@host:3306/db")``; ``?mode=row`` gives
    :class:`MySQLRowBackend`.
    """

    schemes: ClassVar[tuple[str, ...]] = ("mysql", "mariadb")
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.SEMAPHORE, Capability.EVENTS, Capability.EXPIRY, Capability.DISTRIBUTED,
         Capability.HOLDERS, Capability.SCAN, Capability.REVOKE, Capability.ELECTION}
    )
    _server: ClassVar[str] = "MySQL"
    _log: ClassVar[logging.Logger] = log

    def __init__(
        self, *, host: str = "127.0.0.1", port: int = 3306, user: str | None = None,
        password: str | None = None, database: str, connect_timeout: float = 5.0,
        request_timeout: float = 5.0, max_connections: int = 50, pool_timeout: float | None = None,
        poll_interval: float = 0.5, url: str | None = None,
    ) -> None:
        if not database:
            raise ValueError("a database is needed: mysql://user@host:port/DATABASE")
        asyncmy()  # a missing client is reported now, naming the extra to install
        self._params: dict[str, Any] = {
            "host": host, "port": port, "user": user, "password": password or "",
            "database": database,
        }
        super().__init__(
            url=url or f"mysql://{user + '@' if user else ''}{host}:{port}/{database}",
            connect_timeout=connect_timeout, request_timeout=request_timeout,
            max_connections=max_connections, pool_timeout=pool_timeout, poll_interval=poll_interval,
        )
        #: a session's idle time in ms from PROCESSLIST (MariaDB has TIME_MS; MySQL, TIME)
        self._idle_ms = "p.TIME * 1000"
        #: the server is MariaDB (MySQL: the defaults above)
        self._mariadb = False
        #: listeners of elections by name (observers, campaigners): woken when this
        #: backend grants, proclaims or gives back a leadership; others poll (ttl/2)
        self._elections: dict[str, set[Waiter]] = {}

    @classmethod
    def from_url(cls, url: str, **options: Any) -> MySQLBackend:
        """``mysql://[user[:password]@]host[:port]/database[?option=value&...]``.

        Options (query or keyword): ``mode`` (``lock``/``row``), ``connect_timeout``,
        ``request_timeout``, ``max_connections``, ``pool_timeout``, ``poll_interval``.
        """
        from ._row import MySQLRowBackend

        kwargs = parse_url(url, cls.schemes, options)
        mode = str(kwargs.pop("mode", "lock")).lower()
        if mode not in ("lock", "row"):
            raise ValueError(f"mode must be 'lock' or 'row', got {mode!r}")
        return (MySQLRowBackend if mode == "row" else MySQLBackend)(**kwargs)

    # -- connections ----------------------------------------------------------------------------

    @staticmethod
    def _alive(conn: Any) -> bool:
        return bool(conn.connected)

    @classmethod
    def _poolable(cls, conn: Any) -> bool:
        return bool(conn.connected) and not conn.get_transaction_status()

    @staticmethod
    def _drop(conn: Any) -> None:
        conn.close()

    @staticmethod
    async def _close(conn: Any) -> None:
        conn.close()

    async def _open(self) -> Any:
        flags = importlib.import_module("asyncmy.constants.CLIENT")
        conn = await asyncmy().connect(
            **self._params, autocommit=True, charset="utf8mb4",
            connect_timeout=max(1, math.ceil(self._connect_timeout)),
            client_flag=flags.MULTI_STATEMENTS, program_name="aiolock",
        )
        if "mariadb" in conn.get_server_info().lower():
            self._idle_ms, self._mariadb = "p.TIME_MS", True
        return conn

    def _error(self, exc: Exception) -> LockError:
        return map_error(exc, self._url)

    def _connect_error(self, exc: Exception) -> LockError:
        return map_connect_error(exc, self._url)

    async def _ping(self, conn: Any) -> None:
        await run(conn, "SELECT 1")

    async def _create_schema(self, conn: Any) -> None:
        """Make the tables that are missing. Tables made beforehand need no ``CREATE``
        privilege (least privilege): ``CREATE TABLE IF NOT EXISTS`` checks it even when
        the table exists, so only the missing ones are created."""
        async with self._guard():
            rows = await run(conn, sql.TABLES_PRESENT)
            present = {str(row[0]).lower() for row in rows}
            missing = [st for table, st in sql.SCHEMA.items() if table not in present]
            if not missing:
                return
            await run(conn, "SET @aiolock_notes = @@SESSION.sql_notes, SESSION sql_notes = 0")
            for statement in missing:
                await run(conn, statement)
            await run(conn, "SET SESSION sql_notes = @aiolock_notes")

    async def _kill(self, conn: Any) -> None:
        """End ``conn`` on the server (a statement may be waiting there) and close it.

        ``KILL CONNECTION`` from another connection ends the session and frees every lock
        it holds or waits for; then wait until the server has really let it go.
        """
        conn_id = conn.thread_id()
        self._pool.discard(conn)

        async def kill(other: Any) -> None:
            with contextlib.suppress(Exception):
                await run(other, "KILL CONNECTION %s", (conn_id,))
            for _ in range(200):
                rows = await run(other, "SELECT COUNT(*) FROM information_schema.PROCESSLIST"
                                 " WHERE ID = %s", (conn_id,))
                if not rows[0][0]:
                    break
                await asyncio.sleep(0.005)

        try:
            await self._pooled(kill)
        except Exception as exc:
            log.warning("could not end connection %s on %s: %s", conn_id, self._url, exc)

    # -- the claim's statements ---------------------------------------------------------------

    def _keys(self, claim: Claim) -> list[Any]:
        if claim.kind is Kind.PERMIT:
            return [sql.lock_key("sem", claim.name, i) for i in range(claim.limit)]
        return [sql.lock_key(claim.kind.family, claim.name)]

    def _try_sql(self, claim: Claim, st: ClaimState, timeout: int) -> tuple[str, list[Any]]:
        """``SET @aiolock_slot`` to the slot taken (NULL if none), then the grant tail."""
        family, name = claim.kind.family, name_bytes(claim.name)
        tail = [seconds(claim.ttl_ms), family, name, family, name, claim.owner, claim.kind.value,
                claim.ttl_ms, claim.info]
        if len(st.keys) == 1:
            head = "SET @aiolock_slot = IF(GET_LOCK(%s, %s) = 1, 0, NULL)"
            return head + sql.GRANT_TAIL, [st.keys[0], timeout, *tail]
        whens = " ".join(f"WHEN GET_LOCK(%s, 0) = 1 THEN {i}" for i in range(len(st.keys)))
        return f"SET @aiolock_slot = CASE {whens} END" + sql.GRANT_TAIL, [*st.keys, *tail]

    async def _try(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        """Try to take the lock on ``conn``; record the grant in the same request."""
        statement, args = self._try_sql(claim, st, 0)
        async with self._guard():
            rows = await run(conn, statement, args)
        slot, token = rows[0]
        if slot is None:
            return False
        st.slot, st.token = int(slot), int(token)
        return True

    async def _wait_on(self, conn: Any, claim: Claim, st: ClaimState) -> tuple[int, int] | None:
        """A blocking ``GET_LOCK`` with the token taken in the same request; the session's
        expiry is armed before it queues, so a grant nobody picks up still ends."""
        statement, args = self._try_sql(claim, st, sql.FOREVER)
        async with self._guard(None):
            rows = await run(conn, "SET SESSION wait_timeout = %s; " + statement,
                             [seconds(claim.ttl_ms), *args])
        slot, token = rows[0]
        return None if slot is None else (int(slot), int(token))

    async def _end_wait(self, conn: Any, claim: Claim) -> None:
        await self._kill(conn)  # so a cancelled wait can never be granted later

    def _holder_args(self, claim: Claim, st: ClaimState) -> tuple[Any, ...]:
        return (claim.kind.family, name_bytes(claim.name), st.slot, claim.owner)

    async def _renew_statement(self, conn: Any, claim: Claim, st: ClaimState) -> Renewal:
        async with self._guard():
            rows = await run(conn, sql.RENEW, (seconds(claim.ttl_ms), st.key,
                                               *self._holder_args(claim, st)))
        return Renewal(int(rows[0][0]))

    async def _unlock(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        async with self._guard(), conn.cursor() as cur:
            await cur.execute(sql.RELEASE, (st.key, *self._holder_args(claim, st)))
            released = bool((await cur.fetchone())[0] == 1)
            while await cur.nextset():
                pass
        return released

    async def _set_info_statement(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        holder = self._holder_args(claim, st)
        async with self._guard():
            rows = await run(conn, sql.SET_INFO, (claim.info, *holder, st.key, *holder))
        return bool(rows[0][0] == 1)

    async def _subscribe(self, name: str, kind: Kind, waiter: Waiter) -> None:
        """Election listeners are woken by this backend's own grants, proclaims and
        releases (there is no NOTIFY in MySQL); semaphore waiters poll."""
        if kind is Kind.LEADER:
            self._elections.setdefault(name, set()).add(waiter)

    def _unsubscribe(self, name: str, kind: Kind, waiter: Waiter) -> None:
        if kind is Kind.LEADER:
            forget_listener(self._elections, name, waiter)

    def _signal(self, claim: Claim) -> None:
        """Wake this backend's listeners of an election whose leadership changed."""
        if claim.kind is Kind.LEADER:
            for waiter in list(self._elections.get(claim.name, ())):
                if waiter.claim is not claim:
                    waiter.wake()

    # -- reading and revoking -------------------------------------------------------------------

    async def _query(self, statement: str, args: Sequence[Any]) -> list[Any]:
        """One request on a pooled connection (retried once on a fresh one)."""
        return await self._pooled(lambda conn: run(conn, statement, args))

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        await self._settle(kind.family, name)
        if kind is Kind.PERMIT:
            return await self._inspect_sem(name)
        family, raw = kind.family, name_bytes(name)
        rows = await self._query(sql.INSPECT.format(idle_ms=self._idle_ms),
                                 (sql.lock_key(family, name), family, raw, family, raw))
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
        raw = name_bytes(name)
        rows = await self._query(sql.INSPECT_SEM.format(idle_ms=self._idle_ms), (raw, raw))
        last = rows[0][7] if rows else None
        live = [r for r in rows if r[0] is not None]
        if live:
            used = await self._query("SELECT " + ", ".join("IS_USED_LOCK(%s)" for _ in live),
                                     [sql.lock_key("sem", name, int(r[0])) for r in live])
            live = [r for r, u in zip(live, used[0], strict=True) if u is not None and u == r[1]]
        lefts = [left for r in live if (left := _left(r[2], r[3], r[4])) is not None]
        return LockInfo(name, bool(live), holders=len(live), last_token=last,
                        ttl_left=max(lefts) if lefts else None, family="sem",
                        held_by=tuple(_holder(r[5], r[6]) for r in live))

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every name held now whose name starts with ``prefix``: the names of the holder
        rows (one indexed range read), each checked as :meth:`inspect` does."""
        rows = await self._query(sql.SCAN, (sql.like_prefix(prefix),))
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
        await self._query(sql.REVOKE, (kind.family, name_bytes(name)))
        return held


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
