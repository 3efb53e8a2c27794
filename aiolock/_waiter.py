"""A waiting acquisition: woken by a release signal, or by its retry timer."""

from __future__ import annotations

import asyncio

from .abc import Claim

__all__ = ["LocalWaiter"]


class LocalWaiter:
    """Implements :class:`aiolock.abc.Waiter` for the core's acquire loop.

    A wake that arrives while nobody waits is remembered, so a release between a failed
    attempt and the next :meth:`wait` is never missed.
    """

    __slots__ = ("_fut", "_pending", "claim")

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self._fut: asyncio.Future[None] | None = None
        self._pending = False

    def wake(self, hint: str | None = None) -> None:
        """A release happened; for a fair claim, only wake if ``hint`` names this claim."""
        if hint and self.claim.fair and hint != self.claim.owner:
            return
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)
        else:
            self._pending = True

    async def wait(self, timeout: float) -> None:
        """Wait for a wake, at most ``timeout`` seconds."""
        if self._pending:
            self._pending = False
            return
        loop = asyncio.get_running_loop()
        fut = self._fut = loop.create_future()
        timer = loop.call_later(max(timeout, 0.0), _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._fut = None
            self._pending = False


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
