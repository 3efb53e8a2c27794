"""Acquiring: the whole waiting, retrying, deadline and cancellation logic of every lock.

``Lock.acquire`` in short:

1. Same-task checks: a task that holds the lock re-enters it (``reentrant=True``) or
   gets :class:`LockError` at once instead of deadlocking.
2. Fast path: one ``try_acquire`` when no other local task is already waiting.
3. Slow path: local waiters of one name queue in-process (FIFO); only the head of the
   queue listens for release signals and asks the server, so a release wakes one local
   waiter, not all. With ``fair=True`` every waiter takes its own place in the server's
   queue instead and is woken by name. Each wait is bounded by the backend's
   ``retry_after`` (the holder's remaining lease), so a missed signal costs at most one
   lease length, and by the caller's deadline.
4. Cancellation safety: every claim has a unique owner id. If anything interrupts an
   attempt that may have reached the server (cancellation, a dropped connection), or a
   wait during which a release may have handed the claim the lock (a backend may
   register waiting claims on the server and grant them directly), the claim is
   abandoned on the server -- released if it was granted, removed from the queue, and
   barred from being granted late -- and for a cancellation this finishes before
   ``CancelledError`` propagates.

``async with lock as lease`` additionally ties the lease to the block: when the lease is
lost the body is cancelled (``on_lost="cancel"``), left running (``"raise"``) or a
callable is called, and the block raises :class:`LockLost` on exit.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, ParamSpec, TypeVar

from . import _telemetry
from ._holder import QUEUED_RECORDED, check_data, encode_holder, with_queued
from ._lease import Lease, _Hold
from ._validate import check_on_lost, check_seconds, check_ttl
from ._waiter import LocalWaiter
from .abc import Busy, Capability, Claim, Granted, Kind
from .errors import BackendUnavailable, LockError, LockLost, LockTimeout

log = logging.getLogger("aiolock.locks")

if TYPE_CHECKING:
    from ._engine import _Engine, _Local

__all__ = ["Lock"]


class _Default:
    def __repr__(self) -> str:
        return "<the lock's timeout>"


_DEFAULT: Final = _Default()
_EXCLUSIVE = tuple(kind for kind in Kind if kind.exclusive)
P = ParamSpec("P")
R = TypeVar("R")


class Lock:
    """A named distributed lock (or one side of a read-write lock, or a semaphore).

    Made by :meth:`aiolock.Locks.lock`; cheap to create and safe to share between tasks.
    ``async with lock as lease:`` acquires (waiting up to the lock's ``timeout``) and
    releases; :meth:`acquire` gives a :class:`Lease` to release yourself.
    """

    #: what a grant gives back (an election's campaign gives a Leadership)
    _lease_class: type[Lease] = Lease

    def __init__(
        self, engine: _Engine, name: str, kind: Kind = Kind.LOCK, *, ttl: float = 30.0,
        timeout: float | None = None, watchdog: bool = True, reentrant: bool = False,
        fair: bool = False, on_lost: str | Callable[[Lease], object] = "cancel", limit: int = 1,
        data: str = "",
    ) -> None:
        self._engine = engine
        self.name = name
        self.kind = kind
        self.ttl = check_ttl(ttl)
        self.timeout = check_seconds("timeout", timeout, allow_none=True, allow_zero=True)
        self.watchdog = bool(watchdog)
        self.reentrant = bool(reentrant)
        self.fair = bool(fair)
        self.on_lost = check_on_lost(on_lost)
        self.limit = limit
        self.data = check_data(data)
        self._key = (kind.family, name)
        self._guards: dict[asyncio.Task[Any], list[_Guard]] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} kind={self.kind.value} ttl={self.ttl}>"

    # -- public API ----------------------------------------------------------------------

    async def locked(self) -> bool:
        """Whether anyone (any process) holds it now."""
        self._engine.check_open()
        return (await self._engine.backend.inspect(self.name, self.kind)).held

    @_telemetry.acquire_span
    async def acquire(self, timeout: float | _Default | None = _DEFAULT) -> Lease:
        """Wait for the lock and return its :class:`Lease`.

        ``timeout``: seconds to wait (``None`` forever, ``0`` a single try); defaults to
        the lock's own ``timeout``. Raises :class:`LockTimeout` when it passes.
        """
        if isinstance(timeout, _Default):
            wait = self.timeout
        else:
            wait = check_seconds("timeout", timeout, allow_none=True, allow_zero=True)
        engine = self._engine
        engine.check_open()
        task = asyncio.current_task()
        if self.kind is not Kind.PERMIT and task is not None:
            mine = engine.held_by(self._key, task)
            if mine is not None:
                return self._reenter(mine)
        claim = Claim(
            # the owner id: 128 random bits in hex, as uuid4().hex without its costly UUID
            self.name, self.kind, os.urandom(16).hex(), round(self.ttl * 1000), self.fair, self.limit,
            encode_holder(self.data, None if task is None else task.get_name()),
            waits=wait != 0,
        )
        deadline = None if wait is None else time.monotonic() + wait
        local = engine.local(self._key)
        local.users += 1
        acquiring = engine._acquiring  # engine.acquiring(), inline (hot path)
        acquiring[claim] = None
        queued = False  # a busy attempt may have left the claim waiting on the server
        try:
            if not self.fair and local.idle(self.kind):
                local.trying += 1
                try:
                    if wait is None:  # _attempt() without a deadline, inline (hot path)
                        sent = time.monotonic()
                        try:
                            result = await engine.backend.try_acquire(claim)
                        except BaseException as exc:
                            await self._drop(claim, exc)
                            raise
                    else:
                        result, sent = await self._attempt(claim, deadline if wait else None, wait)
                finally:
                    local.trying -= 1
                if isinstance(result, Granted):
                    return self._grant(claim, result, sent, task)
                if wait == 0:
                    if self.kind is Kind.WRITE:  # its busy try took a place readers respect
                        await engine.uninterruptible(engine.abandon(claim))
                    raise self._timeout_error(wait)
                queued = True
            elif wait == 0 and self.kind in _EXCLUSIVE and local.holds:
                raise self._timeout_error(wait)  # held by another task here: no need to ask
            return await self._wait(claim, deadline, local, task, wait, sent if queued else None)
        finally:
            acquiring.pop(claim, None)
            if not acquiring and engine.closed:
                engine.drained()  # the close waits for the acquisitions in flight
            local.users -= 1
            engine.tidy(self._key)

    async def force_release(self) -> bool:
        """Revoke every holder of this primitive (for operators): each revoked holder
        finds its lease ``lost`` at its next renewal (within ``ttl/3``) and its ``async
        with`` body is cancelled as usual; tokens keep increasing. True if any was held."""
        self._engine.need(Capability.REVOKE, "force_release()")
        self._engine.check_open()
        return await self._engine.backend.force_release(self.name, self.kind)

    def __call__(self, func: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
        """Use the lock as a decorator: each call of the async function ``func`` runs
        inside ``async with lock:``."""
        if not inspect.iscoroutinefunction(func):
            raise ValueError(f"a lock decorates async functions, got {func!r}")

        @functools.wraps(func)
        async def locked_call(*args: P.args, **kwargs: P.kwargs) -> R:
            async with self:
                return await func(*args, **kwargs)

        return locked_call

    # -- steps ---------------------------------------------------------------------------

    def _reenter(self, hold: _Hold) -> Lease:
        if not self.reentrant or hold.claim.kind is not self.kind:
            what = "holds" if hold.claim.kind is self.kind else f"holds the {hold.claim.kind.value} side of"
            raise LockError(
                f"this task already {what} {self.name!r}; acquiring it again would deadlock "
                "(pass reentrant=True to re-enter a lock the task holds)"
            )
        if hold.is_lost():
            raise LockLost(f"lease on {self.name!r} is lost: {hold.lost_reason}")
        hold.count += 1
        return self._lease_class(hold)

    async def _attempt(
        self, claim: Claim, deadline: float | None = None, wait: float | None = None
    ) -> tuple[Granted | Busy, float]:
        """One ``try_acquire``, bounded by ``deadline``; abandons the claim if it is
        interrupted mid-flight (the request may have reached the server)."""
        engine = self._engine
        sent = time.monotonic()
        try:
            if deadline is None:
                return await engine.backend.try_acquire(claim), sent
            async with asyncio.timeout(max(deadline - sent, 0.0)) as scope:
                return await engine.backend.try_acquire(claim), sent
        except BaseException as exc:
            await self._drop(claim, exc)
            if isinstance(exc, TimeoutError) and deadline is not None and scope.expired():
                raise self._timeout_error(wait) from None
            raise

    def _grant(
        self, claim: Claim, granted: Granted, sent: float, task: asyncio.Task[Any] | None
    ) -> Lease:
        # granted.ttl_ms may be less than asked (a repeated request): it bounds this
        # expiry only; renewals keep asking for the claim's own ttl
        if self._engine.closed:  # granted as the close came: given back before it ends
            self._engine.spawn(self._engine.abandon(claim))
            raise LockError(f"this connection to {self._engine.backend.url} was closed")
        hold = _Hold(
            self._engine, claim, granted.token, sent + granted.ttl_ms / 1000, self.watchdog,
            task if self.kind is not Kind.PERMIT else None, granted.ttl_ms, self._key,
        )
        self._engine.adopt(hold, self._key)
        lease = self._lease_class(hold)
        if callable(self.on_lost):
            on_lost = self.on_lost
            ref = weakref.ref(lease)

            def call_on_lost() -> None:
                alive = ref()
                if alive is not None and hold.lost_reason is not None:
                    on_lost(alive)

            hold.callbacks.append(call_on_lost)
        return lease

    async def _record_queued(self, claim: Claim, queued: float, granted: Granted) -> None:
        """``claim`` was just granted after it queued ``queued`` seconds on a server whose
        time for its record counts from its first request (``Backend.held_since_queued``):
        write that into its record before the lease is given out, so that ``since`` counts
        from the grant (see ``aiolock._holder``). Advisory: bounded (a quarter of the
        lease), and a failure only leaves ``since`` counting from when it queued; a
        cancellation abandons the claim as any other in ``_contend``."""
        claim.info = with_queued(claim.info, queued)
        try:
            async with asyncio.timeout(granted.ttl_ms / 4000):
                await self._engine.backend.set_info(claim)
        except (LockError, TimeoutError) as exc:
            log.debug("could not record how long %r queued: %s", claim.name, exc)

    @_telemetry.waiting
    async def _wait(
        self, claim: Claim, deadline: float | None, local: _Local, task: asyncio.Task[Any] | None,
        wait: float | None, asked: float | None,
    ) -> Lease:
        # asked: when the fast path's busy attempt was sent (it may have left the claim
        # waiting on the server), else None
        queued = asked is not None
        if self.fair or (queued and local.turn.locked()):
            # A claim the fast path left waiting on the server (registered: the server may
            # hand it the lock) must listen at once, not queue behind a local head.
            return await self._contend(claim, deadline, local, task, wait, asked)
        # Queue behind the other local waiters of this name; only the head contends.
        # Until it asks the server, the server cannot count it (see _Engine.unseen).
        failures = local.failures
        engine = self._engine
        if not queued or self.kind not in engine.backend.waiting_counted:
            engine.unseen(local, self._key, claim, True)
        try:
            await self._within(local.turn.acquire(), deadline, wait)
        except BaseException as exc:
            engine.unseen(local, self._key, claim, False)
            if queued:  # the fast path's attempt left it waiting on the server
                await self._drop(claim, exc)
            raise
        try:
            if local.failures != failures:  # the server went away while we queued
                assert local.failure is not None
                if queued:  # best effort: the server may be back
                    self._engine.spawn(self._engine.abandon(claim))
                raise BackendUnavailable(str(local.failure)) from local.failure
            try:
                return await self._contend(claim, deadline, local, task, wait, asked)
            except BackendUnavailable as exc:  # tell those queued behind us (see _Local)
                local.failures += 1
                local.failure = exc
                raise
        finally:
            engine.unseen(local, self._key, claim, False)
            local.turn.release()

    async def _contend(
        self, claim: Claim, deadline: float | None, local: _Local, task: asyncio.Task[Any] | None,
        wait: float | None, asked: float | None,
    ) -> Lease:
        # asked: when the claim's first attempt was sent, if one was (see _record_queued)
        queued = asked is not None
        engine = self._engine
        backend = engine.backend
        waiter = LocalWaiter(claim)
        engine.acquiring(claim, waiter)
        head = not self.fair and local.head is None
        if head:
            local.head = waiter
        # queued: the claim may wait on the server (any busy attempt may register it, and
        # the server may then hand it the lock): abandon it on failure
        try:
            engine.check_open()  # (in the try: closed after the fast path queued it)
            if wait == 0:  # one try, nothing to wait for (a fair claim may reach here)
                queued = self.fair or self.kind is Kind.WRITE
                if self.kind in backend.waiting_counted:
                    engine.unseen(local, self._key, claim, False)
                result, sent = await self._attempt(claim, None, wait)
                if isinstance(result, Granted):
                    queued = False
                    return self._grant(claim, result, sent, task)
                raise self._timeout_error(wait)
            # Held by another task of this process: its release wakes us directly (or
            # hands us the lock), so the first attempt can wait for that -- unless the
            # fast path left this claim registered on the server. After any wake-up, ask.
            skip = self.kind in _EXCLUSIVE and head and not queued and local.holders > 0
            # once listening, a release in this process may hand it the lock directly
            queued = True
            await self._within(backend.listen(self.name, self.kind, waiter), deadline, wait)
            while True:
                engine.check_open()
                if skip:
                    skip = False
                    retry_after = local.retry_after()
                else:
                    if deadline is not None and time.monotonic() >= deadline:
                        # its wait ran out: a try now would only be cut off mid-flight
                        # (and then abandoned on the server)
                        raise self._timeout_error(wait)
                    if self.kind in backend.waiting_counted:  # the server counts it now
                        engine.unseen(local, self._key, claim, False)
                    result, sent = await self._attempt(claim, deadline, wait)
                    if isinstance(result, Granted):
                        waited = sent - asked if asked is not None else 0.0
                        if waited >= QUEUED_RECORDED and backend.held_since_queued:
                            await self._record_queued(claim, waited, result)
                        queued = False
                        return self._grant(claim, result, sent, task)
                    if asked is None:
                        asked = sent
                    retry_after = result.retry_after
                if deadline is None:
                    await waiter.wait(retry_after)
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._timeout_error(wait)
                    await waiter.wait(min(retry_after, left))
        except BaseException as exc:
            if queued:
                await self._drop(claim, exc)
            raise
        finally:
            if local.head is waiter:
                local.head = None
            backend.unlisten(self.name, self.kind, waiter)  # harmless if never listening

    async def _within(self, step: Awaitable[R], deadline: float | None, wait: float | None) -> R:
        """Await ``step`` until ``deadline`` (None: no limit); LockTimeout after it."""
        if deadline is None:
            return await step
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                return await step
        except TimeoutError:
            raise self._timeout_error(wait) from None

    async def _drop(self, claim: Claim, exc: BaseException) -> None:
        """Abandon ``claim``, which ``exc`` interrupted while the server may have it
        (granted, or waiting in the server's queue): for a cancellation, before it
        propagates; for a timeout or an error, in the background (nobody need wait)."""
        engine = self._engine
        if isinstance(exc, asyncio.CancelledError):
            await engine.uninterruptible(engine.abandon(claim))
        else:
            engine.spawn(engine.abandon(claim))

    def _timeout_error(self, wait: float | None) -> LockTimeout:
        return LockTimeout(f"could not acquire {self.name!r} within {wait} s")

    # -- async with ----------------------------------------------------------------------

    async def __aenter__(self) -> Lease:
        lease = await self.acquire()
        task = asyncio.current_task()
        assert task is not None
        guard = _Guard(lease, task, self.on_lost)
        self._guards.setdefault(task, []).append(guard)
        return lease

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        stack = self._guards[task]
        guard = stack.pop()
        if not stack:
            del self._guards[task]
        guard.armed = False
        lease = guard.lease
        try:
            held = await lease._release()
        except asyncio.CancelledError as cancel:
            if guard.cancelled and task.uncancel() == 0:
                raise guard.lost_error() from cancel
            raise
        if guard.cancelled:
            # We cancelled the body: undo our cancel. If nobody else cancelled the task,
            # the block ends in LockLost; if someone did, their CancelledError goes on.
            if task.uncancel() > 0 and exc_type is asyncio.CancelledError:
                return
            raise guard.lost_error() from exc
        if exc_type is asyncio.CancelledError:
            return  # cancelled from outside: that wins over a loss found at release
        if not held or lease._hold.lost_reason is not None:
            raise guard.lost_error() from exc


class _Guard:
    """Ties a lease to the ``async with`` block that holds it (like ``asyncio.timeout``)."""

    __slots__ = ("armed", "cancelled", "lease", "task")

    def __init__(self, lease: Lease, task: asyncio.Task[Any], on_lost: object) -> None:
        self.lease = lease
        self.task = task
        self.armed = True
        self.cancelled = False
        if on_lost == "cancel":
            lease._hold.callbacks.append(self._on_lost)
            if lease.lost:  # lost between acquire and here
                self._on_lost()

    def _on_lost(self) -> None:
        # Like asyncio.timeout: cancel from the loop, never from inside the task itself
        # (a loss found by ``lease.lost`` in the body), and only while still in the block.
        # A hold's callbacks also run when it is released: schedule nothing then (one
        # callback per release, for nothing, and a pile of them in a loop that never yields).
        if self.armed and self.lease._hold.lost_reason is not None:
            asyncio.get_running_loop().call_soon(self._cancel)

    def _cancel(self) -> None:
        if self.armed and not self.cancelled and self.lease._hold.lost_reason is not None:
            self.cancelled = True
            self.task.cancel(msg=f"aiolock: lease on {self.lease.name!r} was lost")

    def lost_error(self) -> LockLost:
        hold = self.lease._hold
        reason = hold.lost_reason or "the server no longer had it at release"
        return LockLost(f"lease on {hold.claim.name!r} (token {hold.token}) was lost: {reason}")
