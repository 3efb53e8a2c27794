"""Release and leadership signals over ``LISTEN``/``NOTIFY``: one dedicated connection per
backend carries every signal, by key (a semaphore's or an election's signal key)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any

from ...abc import Waiter
from ...errors import LockError
from .._sql_claim import forget_listener
from ._connection import close
from ._statements import CHANNEL

__all__ = ["Notifier"]

log = logging.getLogger("aiolock.backends.postgres")


class Notifier:
    """Wakes the waiters listening on a key when a ``NOTIFY`` names it.

    If the ``LISTEN`` connection drops, signals may have been missed: every listener is
    woken (it looks again), and the connection is re-opened by itself while anyone
    listens (an election's observer never calls ``listen()`` again).
    """

    def __init__(
        self, *, open_conn: Callable[[], Awaitable[Any]],
        guard: Callable[[], AbstractAsyncContextManager[None]],
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
        retry: float, url: str,
    ) -> None:
        self._open, self._guard, self._spawn = open_conn, guard, spawn
        self._retry = retry
        self._url = url
        self._signals: dict[int, set[Waiter]] = {}
        self._conn: Any = None
        self._lock = asyncio.Lock()
        self._relisten_task: asyncio.Task[None] | None = None
        self._closed = False

    async def add(self, key: int, waiter: Waiter) -> None:
        """Deliver signals of ``key`` to ``waiter``; returns once they flow."""
        self._signals.setdefault(key, set()).add(waiter)
        await self._ensure()

    def remove(self, key: int, waiter: Waiter) -> None:
        forget_listener(self._signals, key, waiter)

    async def _ensure(self) -> None:
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return
            conn = await self._open()
            try:
                async with self._guard():
                    await conn.add_listener(CHANNEL, self._on_notify)
            except BaseException:
                conn.terminate()
                raise
            conn.add_termination_listener(self._on_lost)
            self._conn = conn

    def _on_notify(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        try:
            key = int(payload)
        except ValueError:
            return
        for waiter in list(self._signals.get(key, ())):
            waiter.wake()

    def _on_lost(self, conn: Any) -> None:
        if self._conn is conn:
            self._conn = None
        self._wake_all()
        if self._signals and not self._closed and (
            self._relisten_task is None or self._relisten_task.done()
        ):
            self._relisten_task = self._spawn(self._relisten())

    def _wake_all(self) -> None:
        for waiters in list(self._signals.values()):
            for waiter in list(waiters):
                waiter.wake()

    async def _relisten(self) -> None:
        """Re-open the LISTEN connection while anyone listens, retrying every ``retry``
        seconds; then wake everyone (signals sent meanwhile were missed)."""
        while self._signals and not self._closed:
            try:
                await self._ensure()
            except LockError as exc:
                log.warning("cannot re-open LISTEN on %s: %s", self._url, exc)
                await asyncio.sleep(self._retry)
                continue
            self._wake_all()
            return

    async def aclose(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await close(conn)

