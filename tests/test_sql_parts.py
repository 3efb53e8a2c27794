"""The pure parts of the SQL backends, without a server: option checks, the server lock
names, ``LIKE`` escaping, the PostgreSQL holder-row reading, MySQL's time left, and the
claim state's invariants on a backend whose server answers from memory."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from aiolock.abc import REVOKED, Busy, Claim, Granted, Kind
from aiolock.backends._sql import SQLBackend
from aiolock.backends._sql_claim import ClaimState, Renewal, digest
from aiolock.backends._sql_options import number, numeric_options, without_password
from aiolock.errors import BackendUnavailable, LockError


def test_numbers_and_options() -> None:
    assert number("t", "2.5") == 2.5 and number("n", "3", integer=True) == 3
    for bad in ("0", "-1", "nan", "inf", "x", True, None):
        with pytest.raises(ValueError, match="must be a number"):
            number("t", bad)
    with pytest.raises(ValueError, match="whole number"):
        number("n", 1.5, integer=True)
    opts = numeric_options({"connect_timeout": "1", "max_connections": "7", "mode": "row",
                            "pool_timeout": None})
    assert opts == {"connect_timeout": 1.0, "max_connections": 7, "mode": "row", "pool_timeout": None}


def test_without_password_keeps_the_user() -> None:
    assert without_password("u:secret@h:1") == "u@h:1"
    assert without_password("u@h") == "u@h"
    assert without_password(":secret@h") == "h"
    assert without_password("h:5432") == "h:5432"
    assert without_password("u:p@ss@h") == "u@h"  # the last @ ends the credentials


def test_lock_names_keep_families_and_slots_apart() -> None:
    pg = pytest.importorskip("aiolock.backends.postgres")
    names = {digest(f, "n", s, 8) for f in ("lock", "rw", "sem") for s in (None, 0, 1)}
    assert len(names) == 9
    key = pg.advisory_key("lock", "orders:42")
    assert -2**63 <= key < 2**63 and key == pg.advisory_key("lock", "orders:42")
    assert pg.advisory_key("lock", "\udcff") != pg.advisory_key("lock", "?")  # surrogates kept


def test_mysql_names_and_like() -> None:
    pytest.importorskip("asyncmy")
    from aiolock.backends.mysql._statements import like_prefix, lock_key

    assert len(lock_key("lock", "x" * 512)) == 48 <= 64  # GET_LOCK's limit
    assert lock_key("lock", "A") != lock_key("lock", "a")  # GET_LOCK compares without case
    assert like_prefix("a%b_c\\") == b"a\\%b\\_c\\\\%"


def test_pg_escape_like_and_holder_rows() -> None:
    pytest.importorskip("asyncpg")
    from aiolock.backends.postgres._backend import _info
    from aiolock.backends.postgres._statements import escape_like

    assert escape_like("50%_off!") == "50!%!_off!!%"
    row = {"last": 9, "pid": 11, "kind": "lock", "token": 9, "left_s": -0.5, "since_s": 1.0,
           "info": None}
    free = _info("n", "lock", set(), [row])
    assert not free.held and free.last_token == 9 and free.held_by == ()
    held = _info("n", "lock", {11}, [row, {**row, "pid": 12, "token": 3}], waiters=2)
    assert held.held and held.token == 9 and held.ttl_left == 0.0 and len(held.held_by) == 1
    assert held.waiters == 2 and held.holders == 1


def test_mysql_time_left() -> None:
    pytest.importorskip("asyncmy")
    from aiolock.backends.mysql._backend import _left

    assert _left(None, None, None) is None
    assert _left(3000, 1000, "Sleep") == 2.0
    assert _left(3000, 5000, "Sleep") == 0.0
    assert _left(3000, 1000, "Query") == 3.0  # busy, or another account's session: whole ttl


class _Conn:
    """A connection of the in-memory server."""

    def __init__(self, ident: int) -> None:
        self.id = ident
        self.closed = False


class _Row:
    """One named lock held by at most one connection (the server, in memory)."""

    def __init__(self) -> None:
        self.holder: object = None
        self.revoked = False
        self.token = 0


class FakeSQL(SQLBackend):
    """The shared claim machine over an in-memory "server": every statement is a method."""

    _server = "Fake"
    _log = logging.getLogger("aiolock.backends.fake")

    def __init__(self) -> None:
        super().__init__(url="fake://", connect_timeout=1, request_timeout=1, max_connections=4,
                         pool_timeout=None, poll_interval=0.1)
        self.rows: dict[Any, _Row] = {}
        self.opened = 0

    @staticmethod
    def _alive(conn: Any) -> bool:
        return not conn.closed

    @staticmethod
    def _drop(conn: Any) -> None:
        conn.closed = True

    @staticmethod
    async def _close(conn: Any) -> None:
        conn.closed = True

    async def _open(self) -> Any:
        self.opened += 1
        return _Conn(self.opened)

    async def _create_schema(self, conn: Any) -> None:
        pass

    def _error(self, exc: Exception) -> LockError:
        return LockError(str(exc))

    async def _ping(self, conn: Any) -> None:
        pass

    def _keys(self, claim: Claim) -> list[Any]:
        return [claim.name]

    def _row(self, st: ClaimState) -> _Row:
        return self.rows.setdefault(st.key, _Row())

    async def _try(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        row = self._row(st)
        if row.holder is not None:
            return False
        row.holder, row.revoked, row.token = conn.id, False, row.token + 1
        st.token = row.token
        return True

    async def _wait_on(self, conn: Any, claim: Claim, st: ClaimState) -> tuple[int, int] | None:
        while self._row(st).holder is not None:
            await asyncio.sleep(0.001)
        await self._try(conn, claim, st)
        return 0, st.token

    async def _end_wait(self, conn: Any, claim: Claim) -> None:
        await self._unlock(conn, claim, ClaimState([claim.name]))
        self._pool.put(conn)

    async def _renew_statement(self, conn: Any, claim: Claim, st: ClaimState) -> Renewal:
        row = self._row(st)
        if row.holder != conn.id:
            return Renewal.GONE
        return Renewal.REVOKED if row.revoked else Renewal.HELD

    async def _unlock(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        row = self._row(ClaimState([claim.name]))
        if row.holder == conn.id:
            row.holder = None
            return True
        return False

    async def _set_info_statement(self, conn: Any, claim: Claim, st: ClaimState) -> bool:
        return bool(self._row(st).holder == conn.id)

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> Any:
        raise NotImplementedError


def _claim(name: str = "n") -> Claim:
    return Claim(name, Kind.LOCK, owner="o", ttl_ms=1000)


async def test_claim_state_machine() -> None:
    backend = FakeSQL()
    a, b = _claim(), _claim()
    got = await backend.try_acquire(a)
    assert isinstance(got, Granted) and got.token == 1
    assert isinstance(await backend.try_acquire(b), Busy)
    assert await backend.renew([a, b]) == [1000, None]
    backend.rows["n"].revoked = True
    assert await backend.renew([a]) == [REVOKED]  # the connection stays until abandon
    assert backend._state(a).conn is not None
    await backend.abandon(a)
    assert backend._state(a).conn is None and backend.rows["n"].holder is None
    with pytest.raises(LockError, match="abandoned"):
        await backend.try_acquire(a)
    got = await backend.try_acquire(b)
    assert isinstance(got, Granted) and got.token == 2
    assert await backend.release(b)
    assert await backend.release(b)  # the same give-back answers again: no second unlock
    assert backend.rows["n"].holder is None
    await backend.aclose()


async def test_cancelled_wait_gives_back_what_it_got() -> None:
    backend = FakeSQL()
    holder, waiter_claim = _claim(), _claim()
    assert isinstance(await backend.try_acquire(holder), Granted)

    class Waiter:
        claim = waiter_claim
        woken = 0

        def wake(self, hint: str | None = None) -> None:
            self.woken += 1

    waiter = Waiter()
    await backend.listen("n", Kind.LOCK, waiter)
    assert isinstance(await backend.try_acquire(waiter_claim), Busy)  # queued on the "server"
    await backend.release(holder)
    await asyncio.sleep(0.05)  # the wait is granted; nobody takes it
    assert waiter.woken and backend.rows["n"].holder is not None
    backend.unlisten("n", Kind.LOCK, waiter)  # the acquire gave up: the grant is given back
    await backend.abandon(waiter_claim)
    assert backend.rows["n"].holder is None
    assert isinstance(await backend.try_acquire(_claim()), Granted)
    await backend.aclose()


async def test_a_wait_that_absorbs_a_cancellation_is_still_given_up_at_once() -> None:
    """asyncmy was seen to absorb the cancellation of a read in flight (the wait read on,
    and aclose() took its 5 s bound): giving up a queued wait cancels it until it ends."""

    class Stubborn(FakeSQL):
        absorbed = 0

        async def _wait_on(self, conn: Any, claim: Claim, st: ClaimState) -> tuple[int, int] | None:
            while True:
                try:
                    return await super()._wait_on(conn, claim, st)
                except asyncio.CancelledError:
                    self.absorbed += 1
                    if self.absorbed > 2:
                        raise

    backend = Stubborn()
    holder, waiter_claim = _claim(), _claim()
    assert isinstance(await backend.try_acquire(holder), Granted)

    class Waiter:
        claim = waiter_claim

        def wake(self, hint: str | None = None) -> None:
            pass

    await backend.listen("n", Kind.LOCK, Waiter())
    assert isinstance(await backend.try_acquire(waiter_claim), Busy)  # queued
    await asyncio.sleep(0.01)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.wait_for(backend.abandon(waiter_claim), 2)
    assert backend.absorbed == 3 and loop.time() - t0 < 1.0
    assert backend.rows["n"].holder is not None  # the holder's, untouched
    t0 = loop.time()
    await backend.aclose()
    assert loop.time() - t0 < 1.0


async def test_give_back_cut_off_drops_its_connection() -> None:
    """A grant found revoked is given back inside ``try_acquire`` (the caller's task): a
    cancel landing in that unlock drops the connection (the server frees what it held),
    never leaves it out of the pool holding the lock for nobody."""
    backend = FakeSQL()
    claim = _claim()
    st = backend._state(claim)
    st.conn = conn = await backend._pool.get()  # as a granted wait hands it over
    row = backend._row(st)
    row.holder, row.revoked = conn.id, True
    unlocking = asyncio.Event()

    async def slow_unlock(conn: Any, claim: Claim, st: ClaimState) -> bool:
        unlocking.set()
        await asyncio.sleep(10)
        return True

    backend._unlock = slow_unlock  # type: ignore[method-assign]
    task = asyncio.create_task(backend.try_acquire(claim))
    await asyncio.wait_for(unlocking.wait(), 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert conn.closed and st.conn is None
    assert not backend._pool._out and backend._pool.free()  # its slot is back
    await backend.aclose()


@pytest.mark.parametrize("cause", [ConnectionResetError("reset"), TimeoutError()])
async def test_an_attempt_retries_a_dead_connection_never_a_timeout(cause: Exception) -> None:
    """A pooled connection that died idle (server restart) is retried once on a fresh
    one; a request that ran out of time is not (the server is slow or frozen: a second
    try would double the caller's wait: CI saw 3 s for a 1 s request_timeout)."""
    backend = FakeSQL()
    tries: list[int] = []
    real_try = backend._try

    async def failing_try(conn: Any, claim: Claim, st: ClaimState) -> bool:
        tries.append(conn.id)
        if len(tries) == 1:
            raise BackendUnavailable(f"first try failed: {cause!r}") from cause
        return await real_try(conn, claim, st)

    backend._try = failing_try  # type: ignore[method-assign]
    queried: list[int] = []

    async def query(conn: Any) -> int:
        queried.append(conn.id)
        if len(queried) == 1:
            raise BackendUnavailable(f"first query failed: {cause!r}") from cause
        return 7

    if isinstance(cause, TimeoutError):
        with pytest.raises(BackendUnavailable):
            await backend.try_acquire(_claim())
        with pytest.raises(BackendUnavailable):
            await backend._pooled(query)
        assert len(tries) == len(queried) == 1
    else:
        assert isinstance(await backend.try_acquire(_claim()), Granted)
        assert await backend._pooled(query) == 7
        assert len(tries) == len(queried) == 2
    await backend.aclose()
