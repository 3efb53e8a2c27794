"""Asking every Redlock node at once: the requests, the replies as they come in, and a
request to a node ordered after an earlier one (:class:`Fanout`, a part of
:class:`~aiolock.backends.redlock.RedlockBackend`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..errors import AccessDenied, BackendUnavailable, LockError
from .redis import RedisBackend

__all__ = ["Fanout", "Replies"]

log = logging.getLogger("aiolock.backends.redlock")
T = TypeVar("T")


@dataclass(slots=True)
class Replies(Generic[T]):
    """What the nodes answered so far, by node index."""

    ok: dict[int, T] = field(default_factory=dict)
    errors: dict[int, Exception] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    #: the requests of the nodes still answering when the outcome was decided (they go
    #: on in the background): what must follow one of them waits for it
    running: dict[int, asyncio.Future[T]] = field(default_factory=dict)


class Fanout:
    """The requests to every node of a Redlock backend, which sets these attributes."""

    _nodes: list[RedisBackend]
    _url: str
    quorum: int
    _background: set[asyncio.Future[Any]]
    _down: set[int]  # nodes whose last request failed to reach them
    _preparing: dict[int, asyncio.Future[None]]  # see RedlockBackend.__init__

    async def _ask(
        self, call: Callable[[RedisBackend], Awaitable[T]],
        decided: Callable[[Replies[T]], bool] | None = None, only: Sequence[int] | None = None,
        grace: float = 0.0,
    ) -> Replies[T]:
        """Run ``call`` on every node (or those in ``only``) at once; return when all have
        answered or ``decided`` says the outcome is known (and ``grace`` seconds more have
        passed for the others to answer too). Requests still running then go on in the
        background (``running``)."""
        indexes = range(len(self._nodes)) if only is None else only
        tasks = {self._start(call, i): i for i in indexes}
        replies: Replies[T] = Replies(pending=set(tasks.values()))
        waiting = set(tasks)
        try:
            while waiting:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                self._fold(done, tasks, replies)
                if decided is not None and decided(replies):
                    if grace and waiting:
                        late, waiting = await asyncio.wait(waiting, timeout=grace)
                        self._fold(late, tasks, replies)
                    break
        finally:
            for task in waiting:
                self._keep(task)
                replies.running[tasks[task]] = task
        return replies

    def _fold(self, done: set[asyncio.Future[T]], tasks: dict[asyncio.Future[T], int],
              replies: Replies[T]) -> None:
        """Add the answers of ``done`` to ``replies``."""
        for task in done:
            i = tasks[task]
            replies.pending.discard(i)
            exc = BackendUnavailable("request cancelled") if task.cancelled() else task.exception()
            if exc is None:
                replies.ok[i] = task.result()
                self._down.discard(i)
            elif isinstance(exc, Exception):
                replies.errors[i] = exc
                if isinstance(exc, BackendUnavailable):
                    self._down.add(i)
            else:
                raise exc

    def _start(self, call: Callable[[RedisBackend], Awaitable[T]], i: int) -> asyncio.Future[T]:
        preparing = self._preparing.get(i)
        if preparing is not None and preparing.done():
            del self._preparing[i]
            preparing = None
        if preparing is None:
            return asyncio.ensure_future(call(self._nodes[i]))
        return asyncio.ensure_future(self._after(preparing, call, self._nodes[i]))

    @staticmethod
    async def _after(
        first: asyncio.Future[Any] | None, call: Callable[[RedisBackend], Awaitable[T]], node: RedisBackend,
    ) -> T:
        """``call(node)`` once ``first``, an earlier request to that node, has ended
        (however: a failure of it is the request's own to report)."""
        if first is not None:
            await asyncio.wait([first])
        return await call(node)

    def _keep(self, fut: asyncio.Future[Any]) -> None:
        self._background.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut: asyncio.Future[Any]) -> None:
        self._background.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("redlock: background node request failed: %s", fut.exception())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._keep(asyncio.ensure_future(coro))

    def _failure(self, what: str, replies: Replies[Any]) -> LockError:
        """The error for an operation that a majority could not answer."""
        n = len(self._nodes)
        detail = "; ".join(str(exc) for _, exc in sorted(replies.errors.items()))
        if replies.pending:
            detail += ("; " if detail else "") + f"{len(replies.pending)} still pending"
        message = (f"Redlock {self._url}: {what} needs {self.quorum} of {n} Redis nodes, "
                   f"only {len(replies.ok)} succeeded ({detail})")
        if any(isinstance(e, AccessDenied) for e in replies.errors.values()):
            return AccessDenied(message)  # credentials or ACL: retrying does not help
        refused = [e for e in replies.errors.values() if not isinstance(e, BackendUnavailable)]
        return LockError(message) if refused else BackendUnavailable(message)
