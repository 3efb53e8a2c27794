"""The ``?mode=row`` shape shared by the SQL backends: a ``SELECT ... FOR UPDATE`` row lock."""

from __future__ import annotations

import abc
import contextlib
from typing import Any

from ..abc import Capability, Claim, Kind
from ..errors import LockError
from ._sql import SQLBackend
from ._sql_claim import ClaimState

__all__ = ["RowMode"]


class RowMode(SQLBackend):
    """The ``?mode=row`` shape: the ``SELECT ... FOR UPDATE`` row lock of the design notes.

    The claim's connection keeps a transaction open with the row ``aiolock_rows(family,
    name)`` locked (``NOWAIT`` to try, a plain wait to queue); the token and the holder
    row are committed on another pooled connection, since the claim's transaction is
    never committed. Exclusive kinds only (a lock, an election's leadership).
    """

    @abc.abstractmethod
    async def _lock_row(self, conn: Any, claim: Claim, *, nowait: bool) -> bool:
        """Open the transaction and lock the row; False if ``nowait`` found it locked."""

    @abc.abstractmethod
    async def _record(self, conn: Any, claim: Claim) -> int:
        """Commit the token and the holder row of ``conn``'s grant; the token."""

    @abc.abstractmethod
    async def _rollback(self, conn: Any) -> None: ...

    def _check_kind(self, claim: Claim) -> None:
        if claim.kind is Kind.LOCK or (
            claim.kind is Kind.LEADER and Capability.ELECTION in self.capabilities
        ):
            return
        raise LockError("the row-lock mode offers lock() only (no rwlock or semaphore)"
                        if Capability.ELECTION not in self.capabilities else
                        "the row-lock mode offers lock() and elections only (no rwlock or semaphore)")

    async def _try(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        self._check_kind(claim)
        async with self._guard():
            got = await self._lock_row(conn, claim, nowait=True)
        if got:
            try:
                st.slot, st.token = 0, await self._record(conn, claim)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self._rollback(conn)
                raise
        return got

    async def _wait_on(self, conn: Any, claim: Claim, st: ClaimState) -> tuple[int, int] | None:
        self._check_kind(claim)
        async with self._guard(None):
            await self._lock_row(conn, claim, nowait=False)
        async with self._guard():
            return 0, await self._record(conn, claim)
