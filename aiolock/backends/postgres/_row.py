"""``postgresql://...?mode=row``: the ``SELECT ... FOR UPDATE`` row lock of the design notes."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ...abc import Capability, Claim, Kind, LockInfo
from .._sql_claim import ClaimState, Renewal
from .._sql_row import RowMode
from . import _statements as sql
from ._backend import PostgresBackend, _info
from ._connection import asyncpg

__all__ = ["PostgresRowBackend"]


class PostgresRowBackend(RowMode, PostgresBackend):
    """``postgresql://...?mode=row``: the ``SELECT ... FOR UPDATE`` row lock.

    A held claim keeps a READ COMMITTED transaction open on its connection with the row
    ``aiolock_rows(family, name)`` locked; the server ends a holder that stops renewing
    after ``idle_in_transaction_session_timeout = ttl``. Locks and elections only: row
    locks have no writer preference and no "any of N" wait. Waiting queues on the row
    lock (first come, first served in practice, but PostgreSQL does not promise an order
    for tuple lock waiters: ``fair=True`` is not offered).

    Who holds a row is read without locking it: the row's ``xmax`` names the transaction
    that locked it, and ``pg_locks`` the session running that transaction
    (:data:`_statements.ROW_HOLDS`), so ``inspect``, ``scan`` and ``force_release`` never
    disturb a concurrent ``NOWAIT`` try.
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.EVENTS, Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS,
         Capability.SCAN, Capability.REVOKE, Capability.ELECTION}
    )
    _expiry_setting: ClassVar[str] = "idle_in_transaction_session_timeout"
    _transactions: ClassVar[bool] = True
    _holds: ClassVar[str] = sql.ROW_HOLDS

    async def _lock_row(self, conn: Any, claim: Claim, *, nowait: bool) -> bool:
        family, name = claim.kind.family, claim.name
        await conn.execute(
            "INSERT INTO aiolock_rows (family, name) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            family, name,
        )
        # READ COMMITTED whatever the database's default: each renewal must see a
        # revocation committed since the transaction began
        await conn.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
        try:
            # the expiry is armed (local to the transaction) before a wait queues, so a
            # grant nobody picks up still ends ``ttl`` after it was made
            await conn.execute(
                "SELECT set_config('idle_in_transaction_session_timeout', $3::bigint::text, true)"
                " FROM aiolock_rows WHERE family = $1 AND name = $2"
                f" FOR UPDATE{' NOWAIT' if nowait else ''}",
                family, name, claim.ttl_ms,
            )
        except asyncpg().exceptions.LockNotAvailableError:
            await conn.execute("ROLLBACK")
            return False
        return True

    async def _record(self, conn: Any, claim: Claim) -> int:
        """Commit the token and the holder row (with the holding session's pid) on another
        connection: the claim's transaction stays open."""
        args = self._args(claim, self._keys(claim)[0], arm=False, pid=conn.get_server_pid())
        row = await self._aside(lambda other: other.fetchrow(sql.GRANT_HELD, *args))
        return int(row["token"])

    async def _rollback(self, conn: Any) -> None:
        await conn.execute("ROLLBACK")

    async def _renew_statement(self, conn: Any, claim: Claim, st: ClaimState) -> Renewal:
        if not conn.is_in_transaction():
            return Renewal.GONE  # the row lock's transaction ended
        async with self._guard():
            row = await conn.fetchrow(sql.ROW_RENEW, claim.kind.family, claim.name, claim.owner,
                                      claim.ttl_ms)
        return Renewal.HELD if row["kept"] else Renewal.REVOKED

    async def _set_info_statement(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        """On another connection: an UPDATE in the held transaction would not be seen
        until it ends, and would lock the holder row against ``force_release``."""
        if not conn.is_in_transaction():
            return False
        args = self._set_info_args(claim)
        row = await self._aside(lambda other: other.fetchrow(sql.SET_INFO, *args))
        return bool(row["kept"])

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        family = kind.family
        await self._settle(family, name)

        async def read(conn: Any) -> tuple[Any, Any]:
            lockers = await conn.fetch(sql.ROW_LOCKER, family, name)
            return lockers, await conn.fetch(sql.INSPECT_ROWS, family, name)

        lockers, rows = await self._pooled(read)
        info = _info(name, family, {r["pid"] for r in lockers}, rows,
                     waiters=max((int(r["waiting"]) for r in lockers), default=0))
        # renewals do not commit (the transaction stays open), so the recorded expiry is
        # the grant's: once it passed, how long the lease still runs is not known here
        return dataclasses.replace(info, ttl_left=info.ttl_left or None)

    def _scan_sql(self) -> str:
        return sql.scan_sql(self._holds, waiting=sql.ROW_WAITING)
