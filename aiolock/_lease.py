"""Leases: what a successful acquisition gives back.

A :class:`Lease` is the user's handle. The grant on the server is a :class:`_Hold`,
shared by a lease and its reentrant re-entries (counted; the server release happens at
the last one). The watchdog and the engine keep holds, never leases, so a lease that is
garbage collected unreleased is noticed (``__del__``): it is released best effort and a
:class:`ResourceWarning` says so.

A lease's life ends one of three ways: released (the server confirmed), lost (renewal
found it gone, or its last confirmed expiry passed on the monotonic clock), or its
connection closed. ``Lease.lost`` reads the clock itself, so it is exact even when the
event loop was stalled and the watchdog has not run yet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import _telemetry
from ._holder import Holder, decode_holder
from ._validate import check_ttl
from .abc import Claim, Kind
from .errors import LockError, LockLost

if TYPE_CHECKING:
    from ._engine import _Engine

__all__ = ["Lease"]

log = logging.getLogger("aiolock.lease")


class _Hold:
    """One grant on the server, shared by the reentrant leases of one task.

    Invariants:

    * ``lost_reason is not None`` implies ``done``: a loss ends the hold
      (:meth:`mark_lost` goes through ``engine.forget``, which sets ``done``).
    * ``done`` means untracked: in none of the engine's maps, not renewed by the watchdog,
      never again undone. A hold becomes ``done`` once: released (:meth:`finish`), lost,
      or its connection closed -- or dropped by a simulated crash (``abandon_for_demo``).
    * ``task`` is None for a semaphore permit (a permit belongs to no task); otherwise it
      is the acquiring task, and while the hold is live the engine's
      ``_owned[key][task]`` is this hold (reentrancy finds it there).
    * ``count`` is the number of unreleased leases sharing it (reentrant re-entries), at
      least 1 while any of them is held; the server release happens when it reaches 0.
    * ``expires_at`` (monotonic) never moves back: a renewal moves it to
      ``max(expires_at, sent + granted)``, counted from when the request was *sent*.
    * ``releasing`` is set once a release runs in the background (a cancelled release,
      or a collected lease); such a hold is never re-entered.
    * ``ending`` is True while a release of it is in flight: the release's answer says
      whether it was still held, not a renewal that reaches the server after it (which
      finds it gone: our own release, not a loss). False again if the release raised.
    """

    __slots__ = (
        "__weakref__",
        "callbacks",
        "claim",
        "count",
        "done",
        "ending",
        "engine",
        "expires_at",
        "key",
        "lost_reason",
        "releasing",
        "renew_at",
        "renewing",
        "sched",
        "since",
        "task",
        "token",
        "waiters",
        "watchdog",
    )

    def __init__(
        self, engine: _Engine, claim: Claim, token: int, expires_at: float,
        watchdog: bool, task: asyncio.Task[object] | None, granted_ms: int | None = None,
        key: tuple[str, str] | None = None,
    ) -> None:
        if granted_ms is None:
            granted_ms = claim.ttl_ms
        assert task is None or claim.kind is not Kind.PERMIT, "a permit belongs to no task"
        self.engine = engine
        self.claim = claim
        # the engine's key of its name (the lock's own, when it gives it)
        self.key = key if key is not None else (claim.kind.family, claim.name)
        self.token = token
        self.expires_at = expires_at
        # a third of the lease after the grant was asked for (the server may grant less
        # than the ttl: then a third of what it granted)
        granted = min(claim.ttl_ms, granted_ms) / 1000
        self.renew_at = expires_at - granted_ms / 1000 + granted / 3
        self.watchdog = watchdog
        self.task = task
        self.count = 1
        self.lost_reason: str | None = None
        self.done = False  # released or lost: no longer renewed or tracked
        self.ending = False  # a release in flight (see the class doc)
        self.renewing = False
        self.callbacks: list[Callable[[], object]] = []
        self.waiters: list[asyncio.Future[None]] = []
        self.releasing: asyncio.Task[bool] | None = None
        self.sched = math.nan  # when the watchdog's heap next looks at it
        self.since = time.monotonic()  # granted (about: when the reply came)
        _telemetry.hold_started(self)

    @property
    def ttl(self) -> float:
        return self.claim.ttl_ms / 1000

    def is_lost(self) -> bool:
        if self.lost_reason is None and not self.done and time.monotonic() >= self.expires_at:
            self.mark_lost("its last confirmed expiry passed without a renewal")
        return self.lost_reason is not None

    def mark_lost(self, reason: str) -> None:
        """The lease is gone: stop tracking it, tell everyone who asked, free it best effort."""
        if self.done:
            return
        self.lost_reason = reason
        log.warning("lease on %r lost: %s", self.claim.name, reason)
        _telemetry.hold_lost(self, reason)
        self.engine.forget(self, wake=False)
        assert self.done
        # The server may still keep it (e.g. a renewal reply that came too late, or a
        # revocation the backend only marked): give it back, then wake the next local
        # waiter, which waits for our release rather than asking the server.
        self.engine.spawn(self._give_back())
        self._notify()

    async def _give_back(self) -> None:
        await self.engine.abandon(self.claim)
        self.engine.wake_head(self)

    def finish(self, woken: object = None) -> None:
        """Released on the server: stop tracking it, wake the next local waiter (unless
        it is ``woken`` already) and anyone in wait_lost()."""
        if not self.done:
            _telemetry.hold_ended(self)
            self.engine.forget(self, wake=True, woken=woken)
            self._notify()

    def _notify(self) -> None:
        callbacks = self.callbacks
        if callbacks:  # (nothing to swap out, nor to allocate, on a plain release)
            self.callbacks = []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a user callback must not break the watchdog
                log.exception("on_lost callback for %r failed", self.claim.name)
        waiters = self.waiters
        if not waiters:
            return
        self.waiters = []
        # wait_lost() returns one loop turn after the callbacks ran: the body's
        # cancellation (scheduled by its callback) reaches the body first. Python 3.11's
        # wait_for() drops a cancellation that comes once the awaited task is done, so a
        # body in ``wait_for(lease.wait_lost(), t)`` would otherwise go on without the lock.
        try:
            asyncio.get_running_loop().call_soon(_wake, waiters)
        except RuntimeError:  # (no loop running: nothing can be cancelled either)
            _wake(waiters)


def _wake(waiters: list[asyncio.Future[None]]) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(None)


class Lease:
    """A held lock, read lock, write lock or semaphore permit.

    Attributes: ``name``; ``token``, the fencing token (an int strictly greater than that
    of every earlier acquisition of this name on this backend's data); ``lost``.
    Release it with :meth:`release` (a second release is a no-op) or by leaving the
    ``async with`` block that acquired it.
    """

    __slots__ = ("__weakref__", "_hold", "_released")

    def __init__(self, hold: _Hold) -> None:
        self._hold = hold
        self._released = False

    @property
    def name(self) -> str:
        """The lock's name."""
        return self._hold.claim.name

    @property
    def token(self) -> int:
        """The fencing token of this acquisition (reentrant re-entries share it)."""
        return self._hold.token

    @property
    def holder(self) -> Holder:
        """This lease's own record, as kept on the server beside the claim (host, pid,
        task, data; ``since`` counted on this process's clock)."""
        hold = self._hold
        # (not decode_holder's since: that is a server's time for the record, less what
        # the record says the claim queued, and this one counts from the grant already)
        return dataclasses.replace(decode_holder(hold.claim.info), since=time.monotonic() - hold.since)

    @property
    def lost(self) -> bool:
        """True once the lease is known lost or its last confirmed expiry has passed."""
        return self._hold.is_lost()

    @property
    def released(self) -> bool:
        """True once :meth:`release` completed (or the connection closed and released it)."""
        hold = self._hold
        return self._released or (hold.done and hold.lost_reason is None)

    @property
    def ttl(self) -> float:
        """The lease length in seconds that renewals ask for."""
        return self._hold.ttl

    @property
    def expires_in(self) -> float:
        """Seconds until the last expiry the server confirmed (<= 0: expired)."""
        return self._hold.expires_at - time.monotonic()

    async def wait_lost(self) -> None:
        """Return when the lease is lost, or when it is released (then ``lost`` is False)."""
        hold = self._hold
        if hold.done or self._released or hold.is_lost():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        hold.waiters.append(fut)
        try:
            await fut
        finally:
            if fut in hold.waiters:
                hold.waiters.remove(fut)

    async def extend(self, ttl: float | None = None) -> None:
        """Renew the lease now for ``ttl`` seconds (default: its current ttl).

        The new ttl also applies to later watchdog renewals. Raises :class:`LockLost`
        if the lease is gone, :class:`LockError` if it was released.
        """
        hold = self._hold
        ms = round(check_ttl(ttl) * 1000) if ttl is not None else hold.claim.ttl_ms
        if self._released:
            raise LockError(f"lease on {self.name!r} was released; acquire the lock again")
        if hold.is_lost():
            raise LockLost(f"lease on {self.name!r} is lost: {hold.lost_reason}")
        hold.claim.ttl_ms = ms
        await hold.engine.watchdog.renew_now(hold)
        if hold.lost_reason is not None:
            raise LockLost(f"lease on {self.name!r} is lost: {hold.lost_reason}")

    async def release(self) -> None:
        """Give the lock back. A second call is a no-op.

        The lease is forgotten only after the server confirmed, so a release that was
        cancelled or failed can be called again; a cancelled release also finishes in
        the background, so the lock is never left held by nobody.
        """
        await self._release()

    @_telemetry.release_span
    async def _release(self) -> bool:
        """Release; False if the server said the lease was no longer held."""
        if self._released:
            return True
        hold = self._hold
        if hold.count > 1:
            hold.count -= 1
            self._released = True
            return True
        if hold.done:  # lost (and given back best effort), or released by aclose()
            self._released = True
            hold.count = 0
            return hold.lost_reason is None
        pending = hold.releasing
        if pending is not None and not (
            pending.done() and (pending.cancelled() or pending.exception() is not None)
        ):
            held = await asyncio.shield(pending)  # an earlier, cancelled release still runs
        else:
            try:
                held = await hold.engine.release_hold(hold)
            except asyncio.CancelledError:
                # Finish in the background: the lock must not stay held by nobody.
                hold.releasing = hold.engine.spawn(hold.engine.release_hold(hold))
                raise
            except Exception as exc:
                # Stop renewing: the server lets it expire within its ttl (and a
                # best-effort release is retried in the background).
                hold.mark_lost(f"release failed ({exc}); it expires by its ttl")
                raise
        hold.count = 0
        self._released = True
        return held

    def __del__(self) -> None:
        hold = self._hold
        if self._released or hold.done or hold.releasing is not None:
            return  # released, lost, or a cancelled release finishing in the background
        hold.count -= 1
        if hold.count > 0:
            return
        try:
            warnings.warn(
                f"aiolock lease on {hold.claim.name!r} (token {hold.token}) was garbage "
                "collected while held; releasing it. Release leases explicitly or use "
                "'async with'.",
                ResourceWarning,
                stacklevel=1,
            )
            hold.engine.release_collected(hold)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __repr__(self) -> str:
        state = "released" if self._released else "lost" if self._hold.lost_reason else "held"
        return f"<Lease {self.name!r} token={self.token} {state}>"
