"""``Locks``: a connection to one backend -- the public facade.

It makes locks (:meth:`Locks.lock`, :meth:`Locks.rwlock`, :meth:`Locks.semaphore`,
:meth:`Locks.election`), reports (:meth:`Locks.status`, :meth:`Locks.scan`) and closes
(:meth:`Locks.aclose`). What its locks share inside this process -- the watchdog, who
holds what, the local waiters, background tasks -- lives in its engine
(:mod:`aiolock._engine`), never in the facade.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any

from ._election import Election
from ._engine import _Engine
from ._lease import Lease
from ._lock import Lock
from ._validate import MAX_NAME_LENGTH, check_limit, check_name
from .abc import Backend, Capability, Kind, LockInfo

__all__ = ["Locks", "RWLock", "Semaphore"]


class Locks:
    """A connection to one lock backend; made by :func:`aiolock.connect`.

    Use it as ``async with aiolock.connect(url) as locks:`` or call :meth:`aclose` when
    done: closing releases every lease it still holds.
    """

    def __init__(self, backend: Backend, *, close_backend: bool = True) -> None:
        #: the backend driver (see :class:`aiolock.abc.Backend`)
        self.backend = backend
        self._close_backend = close_backend
        self._engine = _Engine(backend)

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
            self._engine, check_name(name), Kind.LOCK, ttl=ttl, timeout=timeout, watchdog=watchdog,
            reentrant=reentrant, fair=self._fair(fair), on_lost=on_lost, data=data,
        )

    def rwlock(
        self, name: str, *, ttl: float = 30.0, timeout: float | None = None,
        watchdog: bool = True, reentrant: bool = False, fair: bool = False,
        on_lost: str | Callable[[Lease], object] = "cancel", data: str = "",
    ) -> RWLock:
        """A read-write lock: ``rw.read()`` is shared, ``rw.write()`` exclusive; waiting
        writers are not starved by new readers. Options as for :meth:`lock`."""
        self._engine.need(Capability.RWLOCK, "rwlock()")
        opts: dict[str, Any] = dict(
            ttl=ttl, timeout=timeout, watchdog=watchdog, reentrant=reentrant,
            fair=self._fair(fair), on_lost=on_lost, data=data,
        )
        return RWLock(self._engine, check_name(name), opts)

    def semaphore(
        self, name: str, limit: int, *, ttl: float = 30.0, timeout: float | None = None,
        watchdog: bool = True, fair: bool = False,
        on_lost: str | Callable[[Lease], object] = "cancel", data: str = "",
    ) -> Semaphore:
        """At most ``limit`` holders at once; a dead holder's permit expires with its
        ``ttl``. Options as for :meth:`lock`."""
        self._engine.need(Capability.SEMAPHORE, "semaphore()")
        return Semaphore(
            self._engine, check_name(name), Kind.PERMIT, ttl=ttl, timeout=timeout, watchdog=watchdog,
            fair=self._fair(fair), on_lost=on_lost, limit=check_limit(limit), data=data,
        )

    def election(
        self, name: str, *, ttl: float = 10.0, watchdog: bool = True,
        on_lost: str | Callable[[Lease], object] = "cancel",
    ) -> Election:
        """A leader election named ``name`` (SPEC §8): ``campaign(data)`` waits to lead,
        ``leader()`` and ``observe()`` tell who leads. Options as for :meth:`lock`; the
        leadership is a lease of ``ttl`` seconds, renewed by the watchdog."""
        self._engine.need(Capability.ELECTION, "election()")
        return Election(self._engine, check_name(name), ttl=ttl, watchdog=watchdog, on_lost=on_lost)

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every name starting with ``prefix`` that is held now (locks, read-write locks,
        semaphores, elections), each as :meth:`status` reports it, with its holders. Needs
        ``Capability.SCAN``; it never blocks the server (Redis ``SCAN``, not ``KEYS``)."""
        if not isinstance(prefix, str) or len(prefix) > MAX_NAME_LENGTH:
            raise ValueError(f"prefix must be a str of at most {MAX_NAME_LENGTH} characters, "
                             f"got {prefix!r}")
        if prefix:
            check_name(prefix)  # encodable as UTF-8, like every name
        self._engine.need(Capability.SCAN, "scan()")
        self._engine.check_open()
        async for info in self.backend.scan(prefix):
            yield _counted(await self._engine.settle(info))

    async def status(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        """Who holds ``name`` now: held, holders, current token, seconds left, and
        (``Capability.HOLDERS``) each holder's record in ``held_by``."""
        return _counted(await self._engine.inspect(check_name(name), kind))

    def _fair(self, fair: bool) -> bool:
        if fair:
            self._engine.need(Capability.FAIR, "fair=True")
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
        return self._engine.closed

    async def aclose(self) -> None:
        """Release every lease still held, stop the watchdog, close connections."""
        if self._engine.closed:
            return
        await self._engine.aclose()
        if self._close_backend:
            await self.backend.aclose()


class RWLock:
    """A read-write lock: :meth:`read` gives shared leases, :meth:`write` exclusive ones."""

    def __init__(self, engine: _Engine, name: str, options: dict[str, Any]) -> None:
        self.name = name
        self._read = Lock(engine, name, Kind.READ, **options)
        self._write = Lock(engine, name, Kind.WRITE, **options)

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


def _counted(info: LockInfo) -> LockInfo:
    """``info`` with the waiters its holders' records count (tasks queued behind a
    holder in its own process: no server sees them) added to those the server sees."""
    local = sum(holder.waiting for holder in info.held_by)
    return dataclasses.replace(info, waiters=info.waiters + local) if local else info
