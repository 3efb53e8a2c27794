"""``Locks``: a connection to one backend, and the state the core keeps for it.

It makes locks (:meth:`Locks.lock`, :meth:`Locks.rwlock`, :meth:`Locks.semaphore`) and
owns what they share inside this process: the watchdog, which task holds what (for
reentrancy and same-task deadlock detection), the local queue of waiters per name, and
the background tasks that finish releases and clean-ups.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

from ._election import Election
from ._lease import Lease, _Hold
from ._lock import Lock
from ._validate import MAX_NAME_LENGTH, check_limit, check_name
from ._watchdog import Watchdog
from .abc import Backend, Capability, Claim, Kind, LockInfo
from .errors import BackendUnavailable, LockError

__all__ = ["Locks", "RWLock", "Semaphore"]

log = logging.getLogger("aiolock.locks")
T = TypeVar("T")

#: How long closing a session waits for the releases of the leases it still holds.
CLOSE_TIMEOUT = 5.0


class _Local:
    """Per name, inside this process: who holds it and who waits for it.

    ``failures`` counts attempts of this name that found the server unreachable, and
    ``failure`` is the last such error: a waiter that queued on ``turn`` before a failure
    fails with it when its turn comes, instead of trying again -- so N waiters behind a
    dead server fail together within one connect + request timeout, not one after another.
    """

    __slots__ = ("failure", "failures", "head", "holds", "trying", "turn", "users")

    def __init__(self) -> None:
        self.turn = asyncio.Lock()  # FIFO: only the task holding it asks the server
        self.holds: set[_Hold] = set()
        self.head: Any = None  # the waiter currently asking the server
        self.trying = 0  # fast-path attempts in flight
        self.users = 0  # acquire() calls using this state right now
        self.failures = 0
        self.failure: BackendUnavailable | None = None

    @property
    def holders(self) -> int:
        return len(self.holds)

    def idle(self, kind: Kind) -> bool:
        """Nobody here waits (and, for an exclusive lock, nobody here holds it)."""
        if self.turn.locked() or self.trying:
            return False
        return not self.holds if kind in (Kind.LOCK, Kind.WRITE) else True

    def retry_after(self) -> float:
        now = time.monotonic()
        return max((h.expires_at - now for h in self.holds), default=0.0) + 0.001


class Locks:
    """A connection to one lock backend; made by :func:`aiolock.connect`.

    Use it as ``async with aiolock.connect(url) as locks:`` or call :meth:`aclose` when
    done: closing releases every lease it still holds.
    """

    def __init__(self, backend: Backend, *, close_backend: bool = True) -> None:
        self.backend = backend
        self._close_backend = close_backend
        self._tasks: set[asyncio.Task[Any]] = set()
        self.watchdog = Watchdog(backend, self.spawn)
        self._locals: dict[tuple[str, str], _Local] = {}
        self._owned: dict[tuple[str, str], dict[asyncio.Task[Any], _Hold]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        #: acquisitions in progress (claim -> its waiter, None before it waits): closing
        #: abandons each claim on the server (fair-queue and writer places included)
        #: before the backend closes, then wakes the waiter to fail
        self._acquiring: dict[Claim, Any] = {}
        self._abandoned_at_close: set[Claim] = set()

    def __repr__(self) -> str:
        return f"<aiolock.Locks {self.backend.url}>"

    @property
    def url(self) -> str:
        """The backend's URL (without a password)."""
        return self.backend.url

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What the backend offers (see :class:`aiolock.Capability`)."""
        return self.backend.capabilities

    # -- making locks ---------------------------------------------------------------------

    def lock(
        self, name: str, *, ttl: float = 30.0, timeout: float | None = None,
        watchdog: bool = True, reentrant: bool = False, fair: bool = False,
        on_lost: str | Callable[[Lease], object] = "cancel", data: str = "",
    ) -> Lock:
        """A mutex named ``name`` (see the options in the README and SPEC §2).

        ``ttl``: lease length on the server in seconds, renewed every ``ttl/3`` while
        held when ``watchdog`` is on. ``timeout``: default wait for ``async with`` and
        :meth:`Lock.acquire` (``None`` forever, ``0`` one try). ``reentrant``: the holding
        task may acquire it again. ``fair``: first come, first served across processes.
        ``on_lost``: ``"cancel"`` the ``async with`` body, ``"raise"`` only at its end, or
        a callable given the lost lease. ``data``: a string of yours (<= 1024 chars) kept
        on the server in each lease's :class:`aiolock.Holder` record.
        """
        return Lock(
            self, self._name(name), Kind.LOCK, ttl=ttl, timeout=timeout, watchdog=watchdog,
            reentrant=reentrant, fair=self._fair(fair), on_lost=on_lost, data=data,
        )

    def rwlock(
        self, name: str, *, ttl: float = 30.0, timeout: float | None = None,
        watchdog: bool = True, reentrant: bool = False, fair: bool = False,
        on_lost: str | Callable[[Lease], object] = "cancel", data: str = "",
    ) -> RWLock:
        """A read-write lock: ``rw.read()`` is shared, ``rw.write()`` exclusive; waiting
        writers are not starved by new readers. Options as for :meth:`lock`."""
        self._need(Capability.RWLOCK, "rwlock()")
        opts: dict[str, Any] = dict(
            ttl=ttl, timeout=timeout, watchdog=watchdog, reentrant=reentrant,
            fair=self._fair(fair), on_lost=on_lost, data=data,
        )
        return RWLock(self, self._name(name), opts)

    def semaphore(
        self, name: str, limit: int, *, ttl: float = 30.0, timeout: float | None = None,
        watchdog: bool = True, fair: bool = False,
        on_lost: str | Callable[[Lease], object] = "cancel", data: str = "",
    ) -> Semaphore:
        """At most ``limit`` holders at once; a dead holder's permit expires with its
        ``ttl``. Options as for :meth:`lock`."""
        self._need(Capability.SEMAPHORE, "semaphore()")
        return Semaphore(
            self, self._name(name), Kind.PERMIT, ttl=ttl, timeout=timeout, watchdog=watchdog,
            fair=self._fair(fair), on_lost=on_lost, limit=check_limit(limit), data=data,
        )

    def election(
        self, name: str, *, ttl: float = 10.0, watchdog: bool = True,
        on_lost: str | Callable[[Lease], object] = "cancel",
    ) -> Election:
        """A leader election named ``name`` (SPEC §8): ``campaign(data)`` waits to lead,
        ``leader()`` and ``observe()`` tell who leads. Options as for :meth:`lock`; the
        leadership is a lease of ``ttl`` seconds, renewed by the watchdog."""
        self._need(Capability.ELECTION, "election()")
        return Election(self, self._name(name), ttl=ttl, watchdog=watchdog, on_lost=on_lost)

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every name starting with ``prefix`` that is held now (locks, read-write locks,
        semaphores, elections), each as :meth:`status` reports it, with its holders. Needs
        ``Capability.SCAN``; it never blocks the server (Redis ``SCAN``, not ``KEYS``)."""
        if not isinstance(prefix, str) or len(prefix) > MAX_NAME_LENGTH:
            raise ValueError(f"prefix must be a str of at most {MAX_NAME_LENGTH} characters, "
                             f"got {prefix!r}")
        self._need(Capability.SCAN, "scan()")
        self.check_open()
        async for info in self.backend.scan(prefix):
            yield info

    async def status(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        """Who holds ``name`` now: held, holders, current token, seconds left, and
        (``Capability.HOLDERS``) each holder's record in ``held_by``."""
        return await self.backend.inspect(check_name(name), kind)

    def _name(self, name: str) -> str:
        return check_name(name)

    def _need(self, capability: Capability, what: str) -> None:
        if capability not in self.backend.capabilities:
            raise ValueError(f"{what} is not supported by {self.backend.url} ({type(self.backend).__name__})")

    def _fair(self, fair: bool) -> bool:
        if fair:
            self._need(Capability.FAIR, "fair=True")
        return bool(fair)

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Locks:
        await self.backend.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` started."""
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise LockError(f"this connection to {self.backend.url} is closed")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    async def aclose(self) -> None:
        """Release every lease still held, stop the watchdog, close connections."""
        if self._closed:
            return
        self._closed = True
        acquiring = list(self._acquiring.items())
        if acquiring:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await asyncio.gather(
                        *(self.abandon(claim) for claim, _ in acquiring), return_exceptions=True
                    )
            except TimeoutError:
                log.warning("closing: %d waiting claim(s) not confirmed abandoned; they lapse "
                            "by their ttl", len(acquiring))
            self._abandoned_at_close.update(claim for claim, _ in acquiring)
            for _, waiter in acquiring:
                if waiter is not None:
                    waiter.wake()
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
        if self._close_backend:
            await self.backend.aclose()

    def _abandon_for_demo(self) -> None:
        """Simulate a crash: stop renewing without releasing (the demo and fault tests)."""
        for owned in list(self._owned.values()):
            for hold in list(owned.values()):
                hold.done = True
        self._owned.clear()
        self._locals.clear()
        self.watchdog._holds.clear()
        self._closed = True

    # -- core state shared by locks and leases ----------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` in the background; closing the session waits for it."""
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

    def acquiring(self, claim: Claim, waiter: Any = None) -> None:
        """``claim`` is being acquired (and waits with ``waiter``, if given)."""
        self._acquiring[claim] = waiter

    def acquired(self, claim: Claim) -> None:
        """``claim``'s acquire() ended, granted or not."""
        self._acquiring.pop(claim, None)

    async def abandon(self, claim: Claim) -> None:
        """Best-effort: drop ``claim`` on the server (released, dequeued, barred)."""
        if claim in self._abandoned_at_close:
            return  # closing abandoned it already (the backend may be gone now)
        try:
            await self.backend.abandon(claim)
        except Exception as exc:
            log.warning("could not clean up claim on %r: %s (it expires by its ttl)", claim.name, exc)

    def local(self, key: tuple[str, str]) -> _Local:
        local = self._locals.get(key)
        if local is None:
            local = self._locals[key] = _Local()
        return local

    def tidy(self, key: tuple[str, str]) -> None:
        local = self._locals.get(key)
        # Not turn.locked(): it reads False between a release and the next waiter's wake-up.
        if local is not None and not local.holds and not local.users:
            del self._locals[key]

    def held_by(self, key: tuple[str, str], task: asyncio.Task[Any]) -> _Hold | None:
        owned = self._owned.get(key)
        if owned is None:
            return None
        hold = owned.get(task)
        if hold is None or hold.releasing is not None or hold.is_lost():
            return None  # a hold being released is not re-entered
        return hold

    def adopt(self, hold: _Hold, key: tuple[str, str]) -> None:
        """A claim was granted: track it for renewal, reentrancy and local waiters."""
        self.local(key).holds.add(hold)
        if hold.task is not None:
            self._owned.setdefault(key, {})[hold.task] = hold
        self.watchdog.track(hold)

    def forget(self, hold: _Hold, *, wake: bool, woken: object = None) -> None:
        """A hold ended (released or lost): stop tracking it; after a release, wake the
        next local waiter at once (the backend need not echo our own releases)."""
        hold.done = True
        self.watchdog.untrack(hold)
        key = (hold.claim.kind.family, hold.claim.name)
        owned = self._owned.get(key)
        if owned is not None and hold.task is not None and owned.get(hold.task) is hold:
            del owned[hold.task]
            if not owned:
                del self._owned[key]
        local = self._locals.get(key)
        if local is not None:
            local.holds.discard(hold)
            if wake:
                self._wake_head(hold, woken)
            self.tidy(key)

    async def release_hold(self, hold: _Hold) -> bool:
        # On an ordered backend our release is written before the woken waiter's acquire.
        woken = self._wake_head(hold) if self.backend.ordered else None
        held = await self.backend.release(hold.claim)
        hold.finish(woken)
        return held

    def _wake_head(self, hold: _Hold, woken: object = None) -> object:
        """Wake the local waiter at the head of ``hold``'s queue, unless it is ``woken``."""
        local = self._locals.get((hold.claim.kind.family, hold.claim.name))
        head = local.head if local is not None else None
        if head is not None and head is not woken:
            head.wake()
        return head

    def release_collected(self, hold: _Hold) -> None:
        """A lease was garbage collected unreleased: give it back in the background.

        Called from ``Lease.__del__``, i.e. at any allocation: it only schedules work.
        """
        loop = self._loop
        if loop is None or loop.is_closed() or self._closed:
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


class RWLock:
    """A read-write lock: :meth:`read` gives shared leases, :meth:`write` exclusive ones."""

    def __init__(self, locks: Locks, name: str, options: dict[str, Any]) -> None:
        self.name = name
        self._read = Lock(locks, name, Kind.READ, **options)
        self._write = Lock(locks, name, Kind.WRITE, **options)

    def read(self) -> Lock:
        """The shared side: many readers at once, none while a writer holds or waits."""
        return self._read

    def write(self) -> Lock:
        """The exclusive side: one writer, no readers."""
        return self._write

    async def force_release(self) -> bool:
        """Revoke every reader and the writer (see :meth:`aiolock.Lock.force_release`)."""
        return await self._write.force_release()

    def __repr__(self) -> str:
        return f"<RWLock {self.name!r}>"


class Semaphore(Lock):
    """At most ``limit`` holders at once, each with an expiring, renewed permit."""
