"""Awaiting a client library's request in a task of its own, so that a cancellation of the
caller reaches the caller as the CancelledError its canceller made, whatever the library
does with the one it receives (grpc.aio re-raises a new one without the message, by which
anyio's cancel scopes know theirs; asyncpg cancelled mid-handshake leaves a future failing
unseen); cancelling a task until it ends."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["cancel_until_done", "cancelled_by_close", "in_own_task"]

#: Seconds between the cancellations of :func:`cancel_until_done`.
RECANCEL_S = 0.05

T = TypeVar("T")


async def in_own_task(request: Awaitable[T], orphan: Callable[[asyncio.Future[T]], object]) -> T:
    """``await request`` in a task of its own; if the caller is cancelled meanwhile,
    ``orphan(task)`` decides what becomes of the request (cancel it, or let it finish and
    clean up after it) and the caller's own CancelledError goes on."""
    inner = asyncio.ensure_future(request)
    try:
        await asyncio.wait((inner,))
    except asyncio.CancelledError:
        orphan(inner)
        raise
    return inner.result()


def cancelled_by_close(request: asyncio.Future[Any], closed: bool) -> bool:
    """Whether the CancelledError that awaiting ``request`` raised came from a close that
    cancelled ``request`` (``closed``), not from a cancellation of the caller: then the
    caller gets a LockError ("closed"), else its CancelledError goes on."""
    caller = asyncio.current_task()
    return closed and request.cancelled() and not (caller is not None and caller.cancelling())


async def cancel_until_done(task: asyncio.Future[Any], heard: Callable[[], bool] = lambda: False) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling it again every
    :data:`RECANCEL_S` while it runs on and ``heard()`` is false: a client library may absorb
    a cancellation (asyncmy was seen reading on for seconds after one), as anyio's cancel
    scopes assume too. ``heard``: the task says it is cleaning up after the cancellation
    (which another one would cut short). The caller bounds the wait."""
    task.cancel()
    while not task.done():
        await asyncio.wait((task,), timeout=RECANCEL_S)
        if not task.done() and not heard():
            task.cancel()
