"""The bounded connection pool of the SQL backends (PostgreSQL, MySQL): a held claim keeps
one connection until it is released, because the server ties the lock to it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import BackendUnavailable, LockError

__all__ = ["Pool"]


class Pool:
    """A bounded set of connections; a held claim keeps one until it is released.

    The driver's part comes in as three callables: ``alive(conn)`` (still usable, and
    idle: no transaction left open on it?), ``drop(conn)`` (close it now, without waiting)
    and ``close(conn)`` (close it politely, awaited at :meth:`aclose`).

    Invariants: every connection lent out (in ``_out``) holds one of the ``size`` slots,
    taken in :meth:`get` and given back exactly once, by :meth:`put` or :meth:`discard`;
    an idle connection is never also lent out; a connection is kept idle only while
    ``alive`` says so: one put back inside a transaction is dropped (its session's locks
    and uncommitted writes end with it), never lent to the next request.
    """

    def __init__(
        self, connect: Callable[[], Awaitable[Any]], size: int, wait: float, url: str, *,
        alive: Callable[[Any], bool], drop: Callable[[Any], None],
        close: Callable[[Any], Awaitable[None]],
    ) -> None:
        self._connect = connect
        self._size = size
        self._wait = wait
        self._url = url
        self._alive, self._drop, self._close = alive, drop, close
        self._slots = asyncio.Semaphore(size)
        self._idle: list[Any] = []
        self._out: set[Any] = set()
        self.closed = False

    async def get(self) -> Any:
        if self.closed:
            raise LockError(f"the connection pool to {self._url} is closed")
        try:
            async with asyncio.timeout(self._wait):
                await self._slots.acquire()
        except TimeoutError:
            raise BackendUnavailable(
                f"all {self._size} connections to {self._url} are in use (each held lease and each "
                f"waiting claim keeps one) for {self._wait} s; raise max_connections"
            ) from None
        try:
            while self._idle:
                conn = self._idle.pop()
                if self._alive(conn):
                    self._out.add(conn)
                    return conn
            conn = await self._connect()
            if self.closed:  # closed while it opened: nobody would close it
                self._drop(conn)
                raise LockError(f"the connection pool to {self._url} is closed")
            self._out.add(conn)
            assert len(self._out) <= self._size, "each lent connection holds a slot"
            return conn
        except BaseException:
            self._slots.release()
            raise

    def free(self) -> bool:
        """Would :meth:`get` lend a connection now, without waiting for a slot?"""
        return not self.closed and not self._slots.locked()

    def put(self, conn: Any) -> None:
        """Return a clean connection (no lock held, no timeout armed)."""
        if conn not in self._out:
            return
        assert conn not in self._idle, "a lent connection is not idle"
        self._out.discard(conn)
        if self.closed or not self._alive(conn) or len(self._idle) >= 10:
            self._drop(conn)
        else:
            self._idle.append(conn)
        self._slots.release()

    def discard(self, conn: Any) -> None:
        """Drop a connection whose state is unknown: the server frees what it held."""
        self._drop(conn)
        if conn in self._out:
            self._out.discard(conn)
            self._slots.release()

    async def aclose(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        conns = idle + list(self._out)
        self._out.clear()
        await asyncio.gather(*(self._close(c) for c in conns), return_exceptions=True)
