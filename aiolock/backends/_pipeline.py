"""One pipelined connection shared by many callers: the transport of the Redis and
Memcached backends (their parsers live in ``_resp.py`` and ``_mc_proto.py``).

A request is written at once and its replies are matched in order (both servers answer
one connection in order), so concurrent acquires, releases and renewals pipeline
without a pool, and commands written earlier on a connection are processed before
commands written later (the core's early wake-up relies on it, see
``Backend.ordered``). A caller that is cancelled simply stops waiting: its replies are
still read and dropped in turn, so a cancellation never makes another caller read the
wrong reply.

At most ``MAX_IN_FLIGHT`` requests are written and unanswered at once; later ones wait
in the client, in order, and are written as replies come in (backpressure). Every
written request is bounded: if the oldest unanswered request was written longer than
the request timeout ago, the connection is aborted and every pending request fails with
:class:`TimeoutError`; a dropped connection fails them with :class:`ConnectionError`.
The next call reconnects within the connect timeout. A request written on a connection
that turns out dead is sent once more on a fresh one (callers make their requests safe
to repeat, and may ask to be told, see ``on_retry``); a timed-out one is never retried.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ._own_task import cancelled_by_close

__all__ = ["PipelinedClient", "PipelinedProtocol"]

_generations = itertools.count(1)
P = TypeVar("P", bound="PipelinedProtocol")


#: Requests written and not yet answered, at most, per connection; later ones wait in
#: the client, in order, and are written as replies come back (backpressure: the
#: request timeout then measures the server, not time queued behind a burst).
MAX_IN_FLIGHT = 512


@dataclass(slots=True, eq=False)
class _Request:
    expected: int  # replies to collect
    fut: asyncio.Future[list[Any]]
    sent: float  # when written (monotonic)
    replies: list[Any] | None = None  # of several commands, those collected so far
    data: bytes = b""  # while queued, not yet written


class PipelinedProtocol(asyncio.Protocol):
    """Requests out, replies back in order. A subclass parses ``data_received`` and
    hands each reply to :meth:`deliver` (an exception instance fails its request)."""

    #: the server's name in error messages
    peer = "the server"

    def __init__(self, timeout: float) -> None:
        self.generation = next(_generations)
        self._timeout = timeout
        self._transport: asyncio.Transport | None = None
        self._pending: collections.deque[_Request] = collections.deque()
        self._queued: collections.deque[_Request] = collections.deque()  # not written yet
        self.max_in_flight = MAX_IN_FLIGHT
        self._timer: asyncio.TimerHandle | None = None
        self.closed: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def deliver(self, reply: Any) -> None:
        """The next reply in order; raises ValueError if nobody asked for one."""
        if not self._pending:
            raise ValueError(f"{self.peer} sent a reply nobody asked for")
        req = self._pending[0]
        if req.expected == 1:
            self._pending.popleft()
            fut = req.fut
            if not fut.done():  # its caller was cancelled: drop the reply, stay in step
                if isinstance(reply, BaseException):
                    fut.set_exception(reply)
                else:
                    fut.set_result([reply])
        else:
            # in a request of several commands an error reply is one of its replies (its
            # caller looks at each): the replies after it still belong to this request
            replies = req.replies
            if replies is None:
                replies = req.replies = []
            replies.append(reply)
            if len(replies) < req.expected:
                return
            self._pending.popleft()
            if not req.fut.done():  # its caller was cancelled: drop the replies, stay in step
                req.fut.set_result(replies)
        if self._queued:
            self._write_queued()

    def _write_queued(self) -> None:
        """Write queued requests, in order, while fewer than max_in_flight are out."""
        assert self._transport is not None
        now = time.monotonic()
        while self._queued and len(self._pending) < self.max_in_flight:
            req = self._queued.popleft()
            # written even if its caller was cancelled meanwhile: callers count a request
            # as sent (ordered after earlier ones) once send() returned
            self._transport.write(req.data)
            req.data, req.sent = b"", now
            self._pending.append(req)
        if self._timer is None and self._pending:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._timeout, self._check, loop)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError(f"connection to {self.peer} closed"))

    def _fail(self, exc: BaseException) -> None:
        if self.closed is None:
            self.closed = exc if isinstance(exc, ConnectionError) else ConnectionError(str(exc))
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        timed_out = isinstance(exc, TimeoutError)
        # queued ones were never written: they fail with the connection (a dropped one is
        # retried by PipelinedClient.send on a fresh connection, a timed-out one is not)
        self._pending.extend(self._queued)
        self._queued.clear()
        while self._pending:
            req = self._pending.popleft()
            if not req.fut.done():  # a timeout is not retried (see PipelinedClient.send)
                req.fut.set_exception(
                    TimeoutError(str(exc)) if timed_out
                    else ConnectionError(f"connection to {self.peer} lost: {exc}")
                )

    def abort(self, exc: BaseException) -> None:
        self._fail(exc)
        if self._transport is not None:
            self._transport.abort()

    def send(
        self, data: bytes, loop: asyncio.AbstractEventLoop, expected: int = 1
    ) -> asyncio.Future[list[Any]]:
        """Write ``data`` (holding ``expected`` commands) now; the future gets the replies."""
        if self.closed is not None or self._transport is None:
            raise ConnectionError(f"connection to {self.peer} is closed")
        fut: asyncio.Future[list[Any]] = loop.create_future()
        if self._queued or len(self._pending) >= self.max_in_flight:
            self._queued.append(_Request(expected, fut, 0.0, data=data))
            return fut
        self._transport.write(data)
        self._pending.append(_Request(expected, fut, time.monotonic()))
        if self._timer is None:
            self._timer = loop.call_later(self._timeout, self._check, loop)
        return fut

    def _check(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if not self._pending:
            return
        late = time.monotonic() - self._pending[0].sent
        if late >= self._timeout:
            self.abort(TimeoutError(f"{self.peer} did not answer within {self._timeout} s"))
        else:
            self._timer = loop.call_later(self._timeout - late, self._check, loop)


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a finished connect task's exception as retrieved (the callers see it)."""
    if not task.cancelled():
        task.exception()


class PipelinedClient(abc.ABC, Generic[P]):
    """Connects lazily (and again after a loss) and sends requests, pipelined."""

    def __init__(self, *, connect_timeout: float = 5.0, request_timeout: float = 5.0) -> None:
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._proto: P | None = None
        self._connecting: asyncio.Task[P] | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` ran."""
        return self._closed

    @abc.abstractmethod
    async def _open(self, loop: asyncio.AbstractEventLoop) -> P:
        """Open one connection and run its handshake (bounded by the caller)."""

    @property
    def generation(self) -> int | None:
        """An id of the live connection (None if there is none). Commands sent on one
        generation are processed in the order they were sent; a command sent on an older
        generation may still be processed at any time relative to newer ones."""
        proto = self._proto
        return proto.generation if proto is not None and proto.closed is None else None

    async def _connect(self) -> P:
        try:
            async with asyncio.timeout(self._connect_timeout):
                return await self._open(asyncio.get_running_loop())
        except TimeoutError as exc:
            raise ConnectionError(
                f"no connection within {self._connect_timeout} s"
            ) from exc

    async def _connection(self) -> P:
        if self._closed:
            raise ConnectionError("this connection was closed")
        proto = self._proto
        if proto is not None and proto.closed is None:
            return proto
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
            # whoever awaited it may be gone (cancelled) when it fails: retrieve the
            # exception here so asyncio never logs "Task exception was never retrieved"
            self._connecting.add_done_callback(_retrieve)
        connecting = self._connecting
        try:
            self._proto = await asyncio.shield(connecting)
        except asyncio.CancelledError:
            if cancelled_by_close(connecting, self._closed):
                raise ConnectionError("this connection was closed") from None
            raise
        finally:
            if self._connecting is not None and self._connecting.done():
                if not self._connecting.cancelled():
                    self._connecting.exception()  # retrieved: no "never retrieved" warning
                self._connecting = None
        return self._proto

    async def send(
        self, data: bytes, expected: int = 1, *, retry: bool = True,
        on_retry: Callable[[], object] | None = None, mark: dict[str, object] | None = None,
    ) -> list[Any]:
        """Send ``data`` (``expected`` commands) and return their replies in order.

        With one command an error reply raises; with several, an error reply is returned
        in its place (as the protocol's exception) and the caller checks each reply.

        A request written on a connection that turns out dead is sent once more on a
        fresh one if ``retry``, calling ``on_retry`` first (the first try may or may not
        have run). ``mark["gen"]`` gets the generation it was written on.
        """
        proto = self._proto
        if proto is None or proto.closed is not None:
            proto = await self._connection()
        loop = asyncio.get_running_loop()
        if mark is not None:
            mark["gen"] = proto.generation
        try:
            return await proto.send(data, loop, expected)
        except ConnectionError:
            if self._proto is proto:
                self._proto = None
            if not retry:
                raise
            if on_retry is not None:
                on_retry()
            proto = await self._connection()
            if mark is not None:
                mark["gen"] = proto.generation
            return await proto.send(data, loop, expected)

    async def aclose(self) -> None:
        self._closed = True
        proto, self._proto = self._proto, None
        if proto is not None:
            proto.abort(ConnectionError("closed by aiolock"))
        connecting, self._connecting = self._connecting, None
        if connecting is not None and not connecting.done():
            connecting.cancel()
