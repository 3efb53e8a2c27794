"""The engine: what the locks of one connection share inside this process.

:class:`aiolock.Locks` is the public facade (it makes locks and closes the connection);
behind it, one :class:`_Engine` per connection keeps the state the core needs to lock
correctly: the watchdog, which task holds what (reentrancy and same-task deadlock
detection), the local queue of waiters per name, the acquisitions in flight (abandoned
on the server when the connection closes), and the background tasks that finish
releases and clean-ups. Locks, leases and elections reach it as ``locks._engine``; no
user code does.

State, keyed by ``(kind.family, name)``:

* ``_locals[key]``: a :class:`_Local` -- this process's holds of the name and the queue
  of its local waiters; it exists while someone uses it (an ``acquire()`` runs, or a
  hold is live) and is dropped by :meth:`_Engine.tidy` after that.
* ``_owned[key][task]``: the hold ``task`` owns (exclusive kinds and readers; permits
  belong to no task), for reentrancy; always one of ``_locals[key].holds``.
* ``_acquiring[claim]``: every ``acquire()`` in flight, with its waiter once it waits;
  closing wakes them and waits for them to end, each abandoning its claim after its
  last attempt (an abandon made while an attempt is in flight may land before it).

Local waiters the server cannot see: a task queued behind another of this process
(``_Local.unseen``) asks nothing of the server until it heads the queue -- and while
the name is held here, not even then (a release here wakes it directly). So that
``status()`` and ``aiolock ls``/``top`` still count them, :meth:`_Engine.waiting_changed`
writes their number into the record of a hold of the name in this process
(``set_info``), at most once per :data:`WAITING_DELAY` per name, never on the hot path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from ._holder import with_waiting
from ._lease import _Hold
from ._settle import in_progress, settled
from ._waiter import LocalWaiter
from ._watchdog import Watchdog
from .abc import FAMILY_KIND, Backend, Capability, Claim, Kind, LockInfo
from .errors import BackendUnavailable, LockError

__all__ = ["CLOSE_TIMEOUT"]

log = logging.getLogger("aiolock.locks")
T = TypeVar("T")

#: How long closing a connection waits for the releases of the leases it still holds.
CLOSE_TIMEOUT = 5.0
#: a BackendUnavailable this soon is no slow server: an abandon is tried once more
QUICK_FAILURE = 0.25

#: Seconds after a change in a name's unseen local waiters before their number is
#: written to its holder record here (changes within it are written together).
WAITING_DELAY = 0.2

_Key = tuple[str, str]


class _Local:
    """Per name, inside this process: who holds it and who waits for it.

    Invariants (the first asserted in :meth:`_Engine.adopt`, the others by :meth:`check`
    at every :meth:`_Engine.tidy`):

    * every hold in ``holds`` is live (not ``done``): a hold enters the set live in
      :meth:`_Engine.adopt` and leaves it in :meth:`_Engine.forget`, which every
      release and loss goes through and which marks it done;
    * ``trying <= users``: a fast-path attempt is one of the ``acquire()`` calls using
      this state, and neither count goes below zero;
    * ``failures`` only grows, and ``failure`` is set once it is above zero.

    ``failures`` counts attempts of this name that found the server unreachable, and
    ``failure`` is the last such error: a waiter that queued on ``turn`` before a failure
    fails with it when its turn comes, instead of trying again -- so N waiters behind a
    dead server fail together within one connect + request timeout, not one after another.
    """

    __slots__ = ("_turn", "failure", "failures", "head", "holds", "trying", "unseen", "users")

    def __init__(self) -> None:
        # made on first use: an uncontended acquire never queues (and this state is made
        # and dropped once per cycle)
        self._turn: asyncio.Lock | None = None
        self.holds: set[_Hold] = set()
        # the waiter at the head of the local (non-fair) queue, the one asking the
        # server; a release in this process wakes it directly
        self.head: Any = None
        self.trying = 0  # fast-path attempts in flight
        self.users = 0  # acquire() calls using this state right now
        self.failures = 0
        self.failure: BackendUnavailable | None = None
        # the claims of local waiters that have not asked the server since they started
        # waiting (queued behind another local task): the server cannot count them
        self.unseen: set[Claim] | None = None

    @property
    def turn(self) -> asyncio.Lock:
        """FIFO: only the task holding it asks the server."""
        turn = self._turn
        if turn is None:
            turn = self._turn = asyncio.Lock()
        return turn

    @property
    def holders(self) -> int:
        return len(self.holds)

    def idle(self, kind: Kind) -> bool:
        """Nobody here waits (and, for an exclusive lock, nobody here holds it)."""
        turn = self._turn
        if (turn is not None and turn.locked()) or self.trying:
            return False
        return not self.holds if kind in (Kind.LOCK, Kind.WRITE) else True

    def retry_after(self) -> float:
        now = time.monotonic()
        return max((h.expires_at - now for h in self.holds), default=0.0) + 0.001

    def check(self) -> bool:
        """The invariants above (for ``assert``)."""
        return 0 <= self.trying <= self.users and (self.failures == 0 or self.failure is not None)


def _counts(info: str) -> bool:
    """Whether a record made here carries a count of waiters (``"w":`` cannot occur in
    a JSON string value: its quotes would be escaped)."""
    return '"w":' in info


class _Engine:
    """The core's state for one connection (see the module doc); made by ``Locks``."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        #: the URL scheme, for telemetry attributes (computed once: a backend's url may
        #: be built on each read)
        self.scheme = backend.url.partition("://")[0] or type(backend).__name__
        self.closed = False
        self.watchdog = Watchdog(backend, self.spawn)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._locals: dict[_Key, _Local] = {}
        self._owned: dict[_Key, dict[asyncio.Task[Any], _Hold]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        #: acquisitions in progress (claim -> its waiter, None before it waits): closing
        #: wakes each waiter to fail and waits for them all to end, each abandoning its
        #: claim on the server (fair-queue and writer places included) on its way out
        self._acquiring: dict[Claim, Any] = {}
        self._drain: asyncio.Event | None = None  # set once the acquisitions ended, closing
        #: names whose unseen local waiters' count is due to be written (see the module doc)
        self._waiting_due: set[_Key] = set()
        #: the waiters of ``Election.observe()`` iterations: closing wakes them, so each
        #: ends at once (its next read raises) whatever its backend does with listeners
        self.observers: set[LocalWaiter] = set()

    # -- checks ---------------------------------------------------------------------------

    def need(self, capability: Capability, what: str) -> None:
        """Refuse ``what`` with ValueError unless the backend offers ``capability``."""
        if capability not in self.backend.capabilities:
            raise ValueError(f"{what} is not supported by {self.backend.url} ({type(self.backend).__name__})")

    def check_open(self) -> None:
        """Raise LockError once the connection closed; remember the running loop."""
        if self.closed:
            raise LockError(f"this connection to {self.backend.url} is closed")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    # -- reading ----------------------------------------------------------------------------

    async def inspect(self, name: str, kind: Kind) -> LockInfo:
        """The backend's ``inspect``, made again while it shows a grant in progress (see
        ``_settle``)."""
        self.check_open()
        holders = Capability.HOLDERS in self.backend.capabilities
        return await settled(lambda: self.backend.inspect(name, kind),
                             lambda info: in_progress(info, holders))

    async def settle(self, info: LockInfo) -> LockInfo:
        """``info`` (from ``scan``), or, if it shows a grant in progress, a read made again."""
        if not in_progress(info, Capability.HOLDERS in self.backend.capabilities):
            return info
        return await self.inspect(info.name, FAMILY_KIND[info.family])

    # -- background work ------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` in the background; closing the connection waits for it."""
        task = asyncio.ensure_future(coro, loop=self._loop)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def uninterruptible(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to its end even if the caller is cancelled meanwhile; a
        cancellation is re-raised once it finished."""
        task = self.spawn(coro)
        cancelled = False
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if task.done() and task.cancelled():
                    raise
                cancelled = True
            except Exception:
                break
        if cancelled:
            raise asyncio.CancelledError
        return task.result()

    # -- acquisitions in flight -----------------------------------------------------------

    def acquiring(self, claim: Claim, waiter: Any = None) -> None:
        """``claim`` is being acquired (and waits with ``waiter``, if given)."""
        self._acquiring[claim] = waiter

    def drained(self) -> None:
        """The last acquire() in flight at the close ended (``aclose()`` waits for it)."""
        if self._drain is not None:
            self._drain.set()

    async def abandon(self, claim: Claim) -> None:
        """Best-effort: drop ``claim`` on the server (released, dequeued, barred); a
        quick failure (a connection being reopened) is tried once more, a moment later:
        a claim left behind holds its name for a whole ttl."""
        for last in (False, True):
            started = time.monotonic()
            try:
                await self.backend.abandon(claim)
                return
            except Exception as exc:
                quick = isinstance(exc, BackendUnavailable) and time.monotonic() - started <= QUICK_FAILURE
                if last or not quick:
                    log.warning("could not clean up claim on %r: %s (it expires by its ttl)",
                                claim.name, exc)
                    return
            await asyncio.sleep(0.05)

    # -- per-name state -------------------------------------------------------------------

    def local(self, key: _Key) -> _Local:
        """The name's local state, made on first use."""
        local = self._locals.get(key)
        if local is None:
            local = self._locals[key] = _Local()
        return local

    def tidy(self, key: _Key) -> None:
        """Drop the name's local state once nobody uses it."""
        local = self._locals.get(key)
        if local is None:
            return
        assert local.check(), "inconsistent local lock state"
        # Not turn.locked(): it reads False between a release and the next waiter's wake-up.
        if not local.holds and not local.users:
            del self._locals[key]

    def held_by(self, key: _Key, task: asyncio.Task[Any]) -> _Hold | None:
        """The live hold ``task`` owns on the name, if any (for reentrancy)."""
        owned = self._owned.get(key)
        if owned is None:
            return None
        hold = owned.get(task)
        if hold is None or hold.releasing is not None or hold.is_lost():
            return None  # a hold being released is not re-entered
        assert hold in self._locals[key].holds, "an owned hold is one of the name's holds"
        return hold

    def adopt(self, hold: _Hold, key: _Key) -> None:
        """A claim was granted: track it for renewal, reentrancy and local waiters."""
        assert not hold.done
        local = self.local(key)
        local.holds.add(hold)
        if hold.task is not None:
            self._owned.setdefault(key, {})[hold.task] = hold
        self.watchdog.track(hold)
        if local.unseen:
            self.waiting_changed(key)

    def forget(self, hold: _Hold, *, wake: bool, woken: object = None) -> None:
        """A hold ended (released or lost): stop tracking it; after a release, wake the
        next local waiter at once (the backend need not echo our own releases)."""
        hold.done = True
        self.watchdog.untrack(hold)
        assert hold.lost_reason is None or not wake, "a lost hold wakes nobody: its give-back does"
        key = hold.key
        owned = self._owned.get(key)
        if owned is not None and hold.task is not None and owned.get(hold.task) is hold:
            del owned[hold.task]
            if not owned:
                del self._owned[key]  # no empty maps: held_by() reads a missing key as free
        local = self._locals.get(key)
        if local is not None:
            local.holds.discard(hold)
            if wake:
                head = local.head
                if head is not None and head is not woken:  # as wake_head()
                    head.wake()
            self.tidy(key)

    # -- local waiters the server cannot see -----------------------------------------------

    def unseen(self, local: _Local, key: _Key, claim: Claim, waits: bool) -> None:
        """``claim`` starts (``waits``) or stops waiting unseen by the server."""
        unseen = local.unseen
        if waits:
            if unseen is None:
                unseen = local.unseen = set()
            unseen.add(claim)
        elif unseen is None or claim not in unseen:
            return
        else:
            unseen.discard(claim)
        self.waiting_changed(key)

    def waiting_changed(self, key: _Key) -> None:
        """The name's unseen local waiters changed, or it was granted here: write their
        number to its record here within :data:`WAITING_DELAY` (if it is held here)."""
        local = self._locals.get(key)
        if local is None or not local.holds or key in self._waiting_due or self.closed:
            return
        if not local.unseen and not any(_counts(h.claim.info) for h in local.holds):
            return  # nothing to count, nothing counted
        self._waiting_due.add(key)
        loop = self._loop or asyncio.get_running_loop()
        loop.call_later(WAITING_DELAY, lambda: self.spawn(self._write_waiting(key)))

    async def _write_waiting(self, key: _Key) -> None:
        self._waiting_due.discard(key)
        local = self._locals.get(key)
        if local is None or self.closed:
            return
        count = len(local.unseen or ())
        # one hold (the oldest grant here) carries the count, so readers or permits of
        # one process are not counted once each
        for hold in sorted(local.holds, key=lambda h: h.token):
            claim = hold.claim
            record = with_waiting(claim.info, count)
            count = 0
            if record == claim.info or hold.done or hold.releasing is not None:
                continue
            claim.info = record
            try:
                # False (released or lost meanwhile) is for the release or the watchdog to see
                await self.backend.set_info(claim)
            except Exception as exc:  # a count is advisory: never a loss
                log.debug("could not record the waiters of %r: %s", claim.name, exc)

    # -- releasing ------------------------------------------------------------------------

    async def release_hold(self, hold: _Hold) -> bool:
        """Release ``hold`` on the server, then forget it; True if the server had it."""
        # On an ordered backend our release is written before the woken waiter's acquire.
        woken = self.wake_head(hold) if self.backend.ordered else None
        hold.ending = True
        try:
            held = await self.backend.release(hold.claim)
        except BaseException:
            hold.ending = False
            raise
        hold.finish(woken)
        return held

    def wake_head(self, hold: _Hold, woken: object = None) -> object:
        """Wake the local waiter at the head of ``hold``'s queue, unless it is ``woken``."""
        local = self._locals.get(hold.key)
        head = local.head if local is not None else None
        if head is not None and head is not woken:
            head.wake()
        return head

    def release_collected(self, hold: _Hold) -> None:
        """A lease was garbage collected unreleased: give it back in the background.

        Called from ``Lease.__del__``, i.e. at any allocation: it only schedules work.
        """
        loop = self._loop
        if loop is None or loop.is_closed() or self.closed:
            return
        loop.call_soon(self._release_collected, hold)

    def _release_collected(self, hold: _Hold) -> None:
        if hold.done or hold.releasing is not None:
            return

        async def release() -> bool:
            try:
                return await self.release_hold(hold)
            except Exception as exc:
                log.warning("could not release collected lease on %r: %s", hold.claim.name, exc)
                hold.mark_lost(f"release failed ({exc})")
                return False

        hold.releasing = self.spawn(release())

    # -- closing --------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Abandon the acquisitions in flight, release every hold, stop the watchdog and
        wait (boundedly) for the background tasks; the backend stays open."""
        self.closed = True
        for observer in list(self.observers):
            observer.wake()
        acquiring = list(self._acquiring.values())
        if acquiring:
            # Each acquisition in flight ends (a waiter woken now, an attempt in flight
            # once answered -- bounded by the request timeout) and abandons its claim on
            # its way out (Lock._drop, Lock._grant), in a task the wait below covers:
            # after its last attempt, so a grant or a place in the server's queue that
            # this attempt made goes too. The backend is still open meanwhile.
            for waiter in acquiring:
                if waiter is not None:
                    waiter.wake()
            if self._acquiring:
                self._drain = asyncio.Event()
                try:
                    await asyncio.wait_for(self._drain.wait(), CLOSE_TIMEOUT)
                except TimeoutError:
                    log.warning("closing: %d acquisition(s) still running; their claims lapse "
                                "by their ttl", len(self._acquiring))
        holds = [h for local in self._locals.values() for h in local.holds]
        if holds:
            releases = [self.backend.release(h.claim) for h in holds]
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await asyncio.gather(*releases, return_exceptions=True)
            except TimeoutError:
                log.warning("closing: %d lease(s) not confirmed released; they expire by ttl", len(holds))
            for hold in holds:
                hold.finish()
        await self.watchdog.aclose()
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            _done, still = await asyncio.wait(pending, timeout=CLOSE_TIMEOUT)
            for task in still:
                task.cancel()

    def abandon_for_demo(self) -> None:
        """Simulate a crash: stop renewing without releasing (the demo and fault tests)."""
        for owned in list(self._owned.values()):
            for hold in list(owned.values()):
                hold.done = True
        self._owned.clear()
        self._locals.clear()
        self.watchdog.drop_all()
        self.closed = True
