"""The claim machinery the SQL backends share (PostgreSQL, MySQL / MariaDB).

Both servers tie a lock to a *connection*: a held claim keeps one pooled connection
(:mod:`._pool`) from its grant to its release, and a waiting claim queues on the server
with a blocking statement on a connection of its own, so it is granted the moment the
lock frees. What differs between the two is the SQL and the client library; a backend
supplies them as these methods:

* ``_try(conn, claim, st)``: one non-blocking attempt, recording the grant (token,
  holder row) in the same request; True if granted;
* ``_wait_on(conn, claim, st)``: a blocking wait queued on the server: ``(slot, token)``,
  or None if it ended without the lock;
* ``_end_wait(conn, claim)``: after a failed or cancelled wait, make ``conn`` hold
  nothing (and leave no holder row), or end it on the server;
* ``_renew_statement(conn, claim, st)``: a :class:`Renewal`; ``_unlock(conn, claim, st)``:
  give it back, True if it was held; ``_set_info_statement``: a proclaim;
* ``_error(exc)``: the backend's one exception map (every I/O call goes through
  :meth:`SQLBackend._guard`), ``_connect_error(exc)`` for a failed login;
* ``_open()``, ``_alive``, ``_drop``, ``_close`` (the connection), ``_create_schema``.

Beside it: :mod:`._sql_claim` (the per-claim state, with its invariants),
:mod:`._sql_options` (the options both take) and :mod:`._sql_row` (the ``?mode=row``
shape both offer).

A backend may *wait* on the server (a blocking lock statement, the server's own fair
queue) and resend a non-blocking try once on a fresh connection when a pooled one died
idle; it never loops otherwise (see :mod:`aiolock.abc`).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

from ..abc import REVOKED, Backend, Busy, Claim, Granted, Kind, Waiter
from ..errors import BackendUnavailable, LockError, timed_out
from ._own_task import cancel_until_done
from ._pool import Pool
from ._sql_claim import QUEUED_RECHECK, ClaimState, Renewal, result
from ._sql_options import number

__all__ = ["SQLBackend"]

T = TypeVar("T")


class SQLBackend(Backend):
    """A lock server whose locks belong to connections (see the module doc)."""

    #: "PostgreSQL" or "MySQL", for messages
    _server: ClassVar[str]
    _log: ClassVar[logging.Logger]

    def __init__(
        self, *, url: str, connect_timeout: float, request_timeout: float, max_connections: int,
        pool_timeout: float | None, poll_interval: float,
    ) -> None:
        self._url = url
        self._connect_timeout = number("connect_timeout", connect_timeout)
        self._request_timeout = number("request_timeout", request_timeout)
        size = int(number("max_connections", max_connections, integer=True))
        wait = self._connect_timeout if pool_timeout is None else number("pool_timeout", pool_timeout)
        self._poll = number("poll_interval", poll_interval)
        #: how long to wait for a pooled connection
        self._pool_wait = wait
        self._pool = Pool(self._new_connection, size, wait, url, alive=self._poolable,
                          drop=self._drop, close=self._close)
        self._schema_ready = False
        self._schema_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        #: clean-ups in flight by (family, name): inspect() waits for them, so that a
        #: status() read after a lost lease was given back does not see it still held
        self._pending: dict[tuple[str, str], set[asyncio.Task[Any]]] = {}
        self._closed = False

    @property
    def url(self) -> str:
        return self._url

    # -- the driver's part ----------------------------------------------------------------------

    @staticmethod
    @abc.abstractmethod
    def _alive(conn: Any) -> bool: ...

    @classmethod
    def _poolable(cls, conn: Any) -> bool:
        """May ``conn`` go back to the pool (or be lent from it): alive and idle. A
        backend refines it where its client knows more (no transaction left open)."""
        return cls._alive(conn)

    @staticmethod
    @abc.abstractmethod
    def _drop(conn: Any) -> None: ...

    @staticmethod
    @abc.abstractmethod
    async def _close(conn: Any) -> None: ...

    @abc.abstractmethod
    async def _open(self) -> Any:
        """A new connection (bounded by the caller)."""

    @abc.abstractmethod
    async def _create_schema(self, conn: Any) -> None:
        """Make the tables if missing (once per backend object)."""

    @abc.abstractmethod
    def _error(self, exc: Exception) -> LockError:
        """The backend's exception map: ``exc`` from the client library as ours."""

    def _connect_error(self, exc: Exception) -> LockError:
        return BackendUnavailable(f"cannot reach {self._server} at {self._url} "
                                  f"({type(exc).__name__}: {exc})")

    @abc.abstractmethod
    def _keys(self, claim: Claim) -> list[Any]:
        """The server lock names of ``claim`` (one per semaphore slot)."""

    @abc.abstractmethod
    async def _try(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        """One non-blocking attempt on ``conn``, recording the grant (``st.slot``,
        ``st.token``, the holder row) in the same request; True if granted."""

    @abc.abstractmethod
    async def _wait_on(self, conn: Any, claim: Claim, st: ClaimState) -> tuple[int, int] | None:
        """Queue on the server until granted: ``(slot, token)``, None if it ended without."""

    @abc.abstractmethod
    async def _end_wait(self, conn: Any, claim: Claim) -> None:
        """After a failed or cancelled wait: leave ``conn`` holding nothing and no holder
        row of ``claim`` behind, and give it back to the pool (or drop it); never raises
        an ``Exception``."""

    @abc.abstractmethod
    async def _renew_statement(self, conn: Any, claim: Claim, st: ClaimState) -> Renewal:
        """Restart the server-side expiry on the claim's session; what it found."""

    @abc.abstractmethod
    async def _unlock(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        """Give the lock back on ``conn`` and forget the holder row; True if it was held."""

    @abc.abstractmethod
    async def _set_info_statement(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        """Store ``claim.info`` as the holder row's record; False if no longer held."""

    async def _subscribe(self, name: str, kind: Kind, waiter: Waiter) -> None:
        """Start release signals for ``waiter`` (beyond the server's own lock queue)."""

    def _unsubscribe(self, name: str, kind: Kind, waiter: Waiter) -> None:
        """Stop what :meth:`_subscribe` started."""

    def _signal(self, claim: Claim) -> None:
        """``claim`` was granted, given back or proclaimed: wake local listeners."""

    async def _close_extra(self) -> None:
        """Close what the backend opened beside the pool."""

    # -- connections ----------------------------------------------------------------------------

    async def _new_connection(self) -> Any:
        try:
            async with asyncio.timeout(self._connect_timeout):
                conn = await self._open()
        except (LockError, ValueError):
            raise
        except Exception as exc:
            raise self._connect_error(exc) from exc
        if not self._schema_ready:
            try:
                async with self._schema_lock:
                    if not self._schema_ready:
                        await self._create_schema(conn)
                        self._schema_ready = True
            except BaseException:
                self._drop(conn)
                raise
        return conn

    @contextlib.asynccontextmanager
    async def _guard(self, timeout: float | None = -1.0) -> AsyncIterator[None]:
        """Bound a request (by ``request_timeout`` unless given) and map the client's
        errors to ours with the backend's one exception map, :meth:`_error`."""
        limit = self._request_timeout if timeout == -1.0 else timeout
        try:
            async with asyncio.timeout(limit):
                yield
        except (LockError, ValueError):
            raise
        except Exception as exc:
            raise self._error(exc) from exc

    async def _pooled(self, fn: Callable[[Any], Awaitable[T]], timeout: float = -1.0,
                      pool: Pool | None = None) -> T:
        """``fn(conn)`` on a pooled connection (of ``pool``, by default the backend's),
        guarded; once more on another connection if the first was dead (a pooled
        connection may have died idle: server restart), never after a timeout (the server
        is slow or gone: another try would double the time the caller waits)."""
        pool = self._pool if pool is None else pool
        for fresh in (False, True):
            conn = await pool.get()
            try:
                async with self._guard(timeout):
                    result = await fn(conn)
            except BackendUnavailable as exc:
                pool.discard(conn)
                if fresh or timed_out(exc):
                    raise
                continue
            except BaseException:
                pool.discard(conn)
                raise
            pool.put(conn)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _check_open(self) -> None:
        if self._closed:
            raise LockError(f"this backend for {self._url} is closed")

    async def connect(self) -> None:
        self._check_open()
        await self._pooled(self._ping, self._connect_timeout)

    @abc.abstractmethod
    async def _ping(self, conn: Any) -> None: ...

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        tasks = [t for t in self._tasks if not t.done()]
        if tasks:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._request_timeout):
                    await asyncio.gather(*(cancel_until_done(t) for t in tasks))
        await self._close_extra()
        await self._pool.aclose()

    # -- single-attempt primitives --------------------------------------------------------------

    def _state(self, claim: Claim) -> ClaimState:
        st = claim.state.get("sql")
        if not isinstance(st, ClaimState):
            st = ClaimState(self._keys(claim))
            claim.state["sql"] = st
        return st

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        self._check_open()
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
            got = result(wait)
            if got is not None:
                st.conn, st.slot, st.token = got
                return await self._confirm(claim, st)
            # the wait failed or ended without the lock: try afresh below
        assert st.op is None or st.op.done(), "one attempt at a time per claim"
        if st.waiter is not None and claim.kind is not Kind.PERMIT:
            # a listening claim queues on the server: granted when the lock frees
            st.wait_ending = False
            st.wait = self._spawn(self._blocking_wait(claim, st))
            return Busy(QUEUED_RECHECK)
        st.op = op = self._spawn(self._attempt(claim, st))
        if await asyncio.shield(op):  # a cancel lets it finish; abandon() cleans up
            self._signal(claim)
            return Granted(st.token, claim.ttl_ms)
        retry = claim.ttl_ms / 1000
        if claim.kind is Kind.PERMIT:  # no server queue for "any slot": poll
            retry = min(retry / 3, self._poll)
        return Busy(retry)

    async def _attempt(self, claim: Claim, st: ClaimState) -> bool:
        """One non-blocking try on a pooled connection; it stays with the claim if granted."""
        for fresh in (False, True):
            conn = await self._pool.get()
            try:
                got = await self._try(conn, claim, st)
            except BackendUnavailable as exc:
                self._pool.discard(conn)
                if fresh or timed_out(exc):
                    raise
                continue  # a pooled connection may have died idle (server restart): once more
            except BaseException:
                self._pool.discard(conn)
                raise
            if not got:
                self._pool.put(conn)
                return False
            assert st.conn is None, "a claim holds one connection at most"
            st.conn = conn
            if st.abandoned:  # abandoned while in flight: never grant late
                await self._give_back(claim, st, warn=True)
                return False
            return True
        raise AssertionError("unreachable")  # pragma: no cover

    async def _blocking_wait(self, claim: Claim, st: ClaimState) -> tuple[Any, int, int] | None:
        """Queue on the server for the lock; on grant (recorded by ``_wait_on``) hand the
        connection over and wake the waiter, which takes it with ``try_acquire``."""
        conn = None
        try:
            conn = await self._pool.get()
            got = await self._wait_on(conn, claim, st)
        except BaseException as exc:
            st.wait_ending = True  # (see _drop_wait)
            if conn is not None:
                await self._end_wait(conn, claim)
            if not isinstance(exc, asyncio.CancelledError):
                self._log.warning("waiting for %r on %s failed: %s", claim.name, self._url, exc)
                self._wake(st)
            raise
        self._wake(st)
        if got is None:  # the wait ended without the lock (killed, timed out)
            self._pool.discard(conn)
            return None
        return (conn, *got)

    @staticmethod
    def _wake(st: ClaimState) -> None:
        if st.waiter is not None:
            st.waiter.wake()

    async def _confirm(self, claim: Claim, st: ClaimState) -> Granted | Busy:
        """A claim granted earlier (e.g. by its wait): restart its expiry, give it out."""
        ms = await self._renew_one(claim, st)
        if ms == REVOKED:  # revoked before we could take it: give it back, ask again
            await self._give_back(claim, st)
            ms = None
        if ms is None:
            return Busy(0.001)  # the grant died before we could take it: ask again
        self._signal(claim)
        return Granted(st.token, ms)

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        return list(await asyncio.gather(*(self._renew_one(c, self._state(c)) for c in claims)))

    async def _renew_one(self, claim: Claim, st: ClaimState) -> int | None:
        async with st.mutex:
            conn = st.conn
            if conn is None or st.abandoned:
                return None
            found = Renewal.GONE
            if self._alive(conn):
                with contextlib.suppress(LockError):  # dead, or too slow to trust
                    found = await self._renew_statement(conn, claim, st)
            if found is Renewal.REVOKED:
                # the connection stays with the claim until abandon() unlocks it
                return REVOKED
            if found is Renewal.GONE:
                st.conn = None
                self._pool.discard(conn)  # so the server frees whatever it still holds
                return None
            return claim.ttl_ms

    async def release(self, claim: Claim) -> bool:
        st = self._state(claim)
        if st.release is None or (st.release.done() and (
            st.release.cancelled() or st.release.exception() is not None
        )):
            st.release = self._spawn(self._release(claim, st))
        return await asyncio.shield(st.release)

    async def _release(self, claim: Claim, st: ClaimState) -> bool:
        try:
            if st.op is not None and not st.op.done():
                await asyncio.wait([st.op])
            return await self._give_back(claim, st)
        finally:
            self._signal(claim)

    async def _give_back(self, claim: Claim, st: ClaimState, *, warn: bool = False) -> bool:
        """Unlock on the claim's connection and pool it; True if the server confirmed."""
        async with st.mutex:
            conn, st.conn = st.conn, None
            if conn is None:
                return False
            if not self._alive(conn):
                self._pool.discard(conn)
                return False
            try:
                released = await self._unlock(conn, claim, st)  # bounded (request_timeout)
            except BaseException as exc:
                # failed, timed out or cut off by a cancel: its state is unknown, so the
                # connection is dropped and the server frees what it held as the session
                # ends (never kept out of the pool, holding the lock for nobody)
                self._pool.discard(conn)
                if not isinstance(exc, LockError):
                    raise
                if warn:
                    self._log.warning("could not release %r on %s: %s", claim.name, self._url, exc)
                return False
            self._pool.put(conn)
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

    async def _abandon(self, claim: Claim, st: ClaimState) -> None:
        try:
            await self._drop_wait(claim, st)
            for task in (st.op, st.release):
                if task is not None and not task.done():
                    await asyncio.wait([task])
            await self._give_back(claim, st, warn=True)
        finally:
            self._signal(claim)
        assert st.conn is None, "an abandoned claim keeps no connection"

    async def _drop_wait(self, claim: Claim, st: ClaimState) -> None:
        """End the claim's queued wait; give back what it may have been granted."""
        wait, st.wait = st.wait, None
        if wait is None:
            return
        # its clean-up (``_end_wait``) leaves its connection holding nothing. Cancelled
        # until it starts that: asyncmy was seen to absorb a cancellation of a read in
        # flight (the task went on reading for seconds; 1 close in ~20 under CPU load)
        await cancel_until_done(wait, lambda: st.wait_ending)
        got = result(wait)
        if got is not None:
            conn, slot, _token = got
            await self._give_back(claim, ClaimState(st.keys, conn=conn, slot=slot), warn=True)

    async def _settle(self, family: str, name: str) -> None:
        """Wait (bounded) for this backend's own clean-ups of ``name`` in flight."""
        pending = self._pending.get((family, name))
        if pending:
            await asyncio.wait(list(pending), timeout=self._request_timeout)

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        """Locks wait in the server's queue (started by the next ``try_acquire``); the
        backend may add release signals (:meth:`_subscribe`)."""
        self._state(waiter.claim).waiter = waiter
        try:
            await self._subscribe(name, kind, waiter)
        except BaseException:
            self.unlisten(name, kind, waiter)
            raise

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        st = self._state(waiter.claim)
        if st.waiter is waiter:
            st.waiter = None
        self._unsubscribe(name, kind, waiter)
        if st.wait is not None and (st.cleanup is None or st.cleanup.done()):
            # a wait nobody will take any more: end it, free what it may have got
            st.cleanup = self._spawn(self._drop_wait(waiter.claim, st))

    async def set_info(self, claim: Claim) -> bool:
        """Replace the held claim's holder record (a proclaim) and wake the listeners;
        False if it is no longer held."""
        st = self._state(claim)
        async with st.mutex:
            conn = st.conn
            if conn is None or st.abandoned or not self._alive(conn):
                return False
            try:
                kept = await self._set_info_statement(conn, claim, st)
            except LockError:
                st.conn = None
                self._pool.discard(conn)
                return False
        if claim.kind is Kind.LEADER:  # a proclaim: the observers listen
            self._signal(claim)
        return kept

