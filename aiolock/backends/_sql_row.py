"""The ``?mode=row`` shape shared by the SQL backends: a ``SELECT ... FOR UPDATE`` row lock."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..abc import Capability, Claim, Kind
from ..errors import LockError
from ._pool import Pool
from ._sql import SQLBackend
from ._sql_claim import ClaimState

T = TypeVar("T")

__all__ = ["RowMode"]


class RowMode(SQLBackend):
    """The ``?mode=row`` shape: the ``SELECT ... FOR UPDATE`` row lock of the design notes.

    The claim's connection keeps a transaction open with the row ``aiolock_rows(family,
    name)`` locked (``NOWAIT`` to try, a plain wait to queue); the token and the holder
    row are committed on another connection (:meth:`_aside`), since the claim's
    transaction is never committed. Exclusive kinds only (a lock, an election's
    leadership).
    """

    #: the bookkeeping connection beside the pool (see :meth:`_aside`), made on first need
    _books: Pool | None = None

    async def _aside(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        """``fn(conn)`` on a connection other than any claim's, for a short autocommit
        request (a grant's token and holder row, a proclaim): a pooled one if one is free
        now, else the backend's one bookkeeping connection beside the pool. So a grant
        never needs a second *pooled* connection: ``max_connections`` connections hold as
        many leases (the server sees at most one connection more)."""
        if self._pool.free():
            return await self._pooled(fn)
        if self._books is None:
            self._books = Pool(self._new_connection, 1, self._pool_wait, self._url,
                               alive=self._poolable, drop=self._drop, close=self._close)
        return await self._pooled(fn, pool=self._books)

    async def _close_extra(self) -> None:
        await super()._close_extra()
        if self._books is not None:
            await self._books.aclose()

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
                with contextlib.suppress(Exception):  # bounded; the caller drops conn anyway
                    async with self._guard():
                        await self._rollback(conn)
                raise
        return got

    async def _wait_on(self, conn: Any, claim: Claim, st: ClaimState) -> tuple[int, int] | None:
        self._check_kind(claim)
        async with self._guard(None):
            await self._lock_row(conn, claim, nowait=False)
        async with self._guard():
            return 0, await self._record(conn, claim)
