"""``mysql://...?mode=row``: the ``SELECT ... FOR UPDATE`` row lock of the design notes."""

from __future__ import annotations

from typing import Any, ClassVar

from ...abc import Capability, Claim, Kind, LockInfo
from ...errors import LockError
from .._sql_claim import ClaimState, Renewal
from .._sql_row import RowMode
from . import _statements as sql
from ._backend import MySQLBackend, _holder, _left
from ._connection import asyncmy, code, name_bytes, run, seconds

__all__ = ["MySQLRowBackend"]

#: ``FOR UPDATE NOWAIT`` found the row locked (MariaDB 1205, MySQL 3572).
_LOCKED_ERRORS = frozenset({1205, 3572})


class MySQLRowBackend(RowMode, MySQLBackend):
    """``mysql://...?mode=row``: the ``SELECT ... FOR UPDATE`` row lock.

    A held claim keeps a READ COMMITTED transaction open on its connection with the row
    ``aiolock_rows(family, name)`` locked; the server ends a holder that stops renewing
    after ``wait_timeout = ceil(ttl)``. Locks and elections only: no rwlock or semaphore.
    Waiting queues on the row lock (InnoDB does not promise an order: no ``fair=True``).
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.EVENTS, Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS,
         Capability.SCAN, Capability.REVOKE, Capability.ELECTION}
    )

    async def _lock_row(self, conn: Any, claim: Claim, *, nowait: bool) -> bool:
        """Lock the row in a READ COMMITTED transaction (each renewal's plain read then
        sees a revocation committed since it began; REPEATABLE READ keeps its first
        snapshot). The row is made only when missing, outside that transaction: an
        ``INSERT`` of a row that exists waits for the row lock, and a try must not wait."""
        family, name = claim.kind.family, name_bytes(claim.name)
        # innodb_lock_wait_timeout bounds the INSERT of a row made concurrently (a try:
        # no wait; MySQL's floor is 1 s) and the wait of a queued claim (forever)
        wait = (0 if self._mariadb else 1) if nowait else sql.FOREVER
        lock = ("SET SESSION wait_timeout = %s, innodb_lock_wait_timeout = %s;"
                " SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION;"
                " SELECT 1 FROM aiolock_rows WHERE family = %s AND name = %s"
                f" FOR UPDATE{' NOWAIT' if nowait else ''}")
        args = (seconds(claim.ttl_ms), wait, family, name)
        try:
            if await run(conn, lock, args):
                return True
            await run(conn, "ROLLBACK; INSERT INTO aiolock_rows (family, name) VALUES (%s, %s)"
                      " ON DUPLICATE KEY UPDATE family = family", (family, name))
            if await run(conn, lock, args):
                return True
        except asyncmy().errors.MySQLError as exc:
            if code(exc) not in _LOCKED_ERRORS:
                raise
            await run(conn, sql.ROW_RESET)
            return False
        raise LockError(f"the row of {claim.name!r} in aiolock_rows vanished")  # never deleted

    async def _record(self, conn: Any, claim: Claim) -> int:
        family, name = claim.kind.family, name_bytes(claim.name)
        args = (family, name, family, name, claim.owner, claim.kind.value, conn.thread_id(),
                claim.ttl_ms, claim.info)
        rows = await self._aside(lambda other: run(other, sql.RECORD, args))
        return int(rows[0][0])

    async def _rollback(self, conn: Any) -> None:
        await run(conn, "ROLLBACK")

    async def _renew_statement(self, conn: Any, claim: Claim, st: ClaimState) -> Renewal:
        async with self._guard():
            rows = await run(conn, sql.ROW_RENEW, (seconds(claim.ttl_ms), claim.kind.family,
                                                   name_bytes(claim.name), claim.owner))
        # the server's status flag: our transaction (and so its row lock) is still open
        if not conn.get_transaction_status():
            return Renewal.GONE
        return Renewal.HELD if rows[0][0] else Renewal.REVOKED

    async def _unlock(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        held = bool(conn.get_transaction_status())
        async with self._guard():
            await run(conn, sql.ROW_RELEASE, (claim.kind.family, name_bytes(claim.name), claim.owner))
        return held

    async def _set_info_statement(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        """On another connection: an UPDATE in the held transaction would not be seen
        until it ends, and would lock the holder row against ``force_release``."""
        if not conn.get_transaction_status():
            return False
        args = (claim.info, *self._holder_args(claim, st), *self._holder_args(claim, st))
        rows = await self._aside(lambda other: run(other, sql.ROW_SET_INFO, args))
        return bool(rows[0][0])

    def _holder_args(self, claim: Claim, st: ClaimState) -> tuple[Any, ...]:
        """Row mode's holder row is its own (slot :data:`_statements.ROW_SLOT`): a
        named-lock holder of the same name keeps its record."""
        return (claim.kind.family, name_bytes(claim.name), sql.ROW_SLOT, claim.owner)

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        await self._settle(kind.family, name)
        family, raw = kind.family, name_bytes(name)
        rows = await self._query(sql.ROW_INSPECT.format(idle_ms=self._idle_ms),
                                 (family, raw, family, raw, family, raw, family, raw))
        exists, free, last, token, ttl_ms, idle_ms, command, info, since = rows[0]
        if not exists or free:
            return LockInfo(name, False, last_token=last, family=family)
        return LockInfo(name, True, holders=1, token=token if token is not None else last,
                        last_token=last, ttl_left=_left(ttl_ms, idle_ms, command), family=family,
                        held_by=(_holder(info, since),) if ttl_ms is not None else ())
