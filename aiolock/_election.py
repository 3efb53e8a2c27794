"""Leader election on a backend's exclusive, fair lease (SPEC §8).

An election is a lock of its own kind (:attr:`aiolock.Kind.LEADER`) whose holder is the
leader: ``campaign(data)`` waits for the leadership like ``acquire()`` waits for a lock,
and gives a :class:`Leadership` -- a :class:`aiolock.Lease` (fencing token = the term,
watchdog, loss cancels the body) that can also ``proclaim(data)``. Resigning is releasing.
The leader's ``data`` is its holder record's ``data`` (:mod:`aiolock._holder`), kept on
the server beside the claim; ``leader()`` reads it with ``inspect``; ``observe()`` reads
it again whenever the backend signals the name (a grant, a proclaim, a release) and at
least every ``ttl / 2``, so it can skip states under churn but never ends on a stale one.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._holder import Holder, check_data, with_data
from ._lease import Lease
from ._lock import _DEFAULT, Lock, _Default
from ._waiter import LocalWaiter
from .abc import Capability, Claim, Kind
from .errors import LockError, LockLost

if TYPE_CHECKING:
    from ._engine import _Engine

__all__ = ["Campaign", "Election", "Leader", "Leadership"]


@dataclass(frozen=True, slots=True)
class Leader:
    """The current leader of an election: its ``data``, its term (``token``, a fencing
    token strictly increasing per election name) and its :class:`aiolock.Holder` record."""

    data: str
    token: int
    holder: Holder


class Leadership(Lease):
    """A won campaign: a :class:`aiolock.Lease` whose token is the term, plus
    :meth:`proclaim`. Resign by releasing it (or leaving the ``async with`` block)."""

    __slots__ = ()

    async def proclaim(self, data: str) -> None:
        """Replace the leader's ``data`` (seen by ``leader()`` and ``observe()``), keeping
        the leadership. Raises :class:`LockLost` if it was lost meanwhile."""
        data = check_data(data)
        hold = self._hold
        if hold.is_lost():  # before "resigned": a lost term's block also released it
            raise LockLost(f"leadership of {self.name!r} is lost: {hold.lost_reason}")
        if self._released:
            raise LockError(f"leadership of {self.name!r} was resigned; campaign again")
        hold.claim.info = with_data(hold.claim.info, data)  # (keeps how long it queued)
        if not await hold.engine.backend.set_info(hold.claim):
            hold.mark_lost("the server no longer has it (expired or taken over)")
            raise LockLost(f"leadership of {self.name!r} is lost: {hold.lost_reason}")


class Campaign(Lock):
    """A candidacy, used like a :class:`aiolock.Lock`: ``async with campaign as term:``
    or ``await campaign.acquire(timeout)``; either gives a :class:`Leadership`."""

    _lease_class = Leadership

    async def acquire(self, timeout: float | _Default | None = _DEFAULT) -> Leadership:
        """Wait until this candidate leads (see :meth:`aiolock.Lock.acquire`)."""
        lease = await super().acquire(timeout)
        assert isinstance(lease, Leadership)
        return lease

    async def __aenter__(self) -> Leadership:
        lease = await super().__aenter__()
        assert isinstance(lease, Leadership)
        return lease


class Election:
    """A named election; made by :meth:`aiolock.Locks.election`."""

    def __init__(
        self, engine: _Engine, name: str, *, ttl: float, watchdog: bool,
        on_lost: str | Callable[[Lease], object],
    ) -> None:
        self._engine = engine
        self.name = name
        self._options: dict[str, Any] = dict(
            ttl=ttl, watchdog=watchdog, on_lost=on_lost,
            fair=Capability.FAIR in engine.backend.capabilities,
        )
        self.ttl = Campaign(engine, name, Kind.LEADER, **self._options).ttl  # validates

    def __repr__(self) -> str:
        return f"<Election {self.name!r} ttl={self.ttl}>"

    def campaign(self, data: str = "", timeout: float | None = None) -> Campaign:
        """A candidacy with ``data`` (the leader's data once it leads, <= 1024 chars)."""
        return Campaign(self._engine, self.name, Kind.LEADER, timeout=timeout, data=data,
                        **self._options)

    async def leader(self) -> Leader | None:
        """The current leader, or None while nobody leads."""
        self._engine.check_open()
        info = await self._engine.inspect(self.name, Kind.LEADER)
        if not info.held or info.token is None:
            return None
        holder = info.held_by[0] if info.held_by else Holder("", 0, None, "")
        return Leader(holder.data, info.token, holder)

    async def observe(self) -> AsyncIterator[Leader | None]:
        """The current leader (or None) first, then every change: a new leader, new
        data, or None when the leadership falls vacant. Under churn it may skip states,
        but after changes stop its last value is the current state within one ``ttl``."""
        engine = self._engine
        engine.check_open()
        backend = engine.backend
        waiter = LocalWaiter(Claim(self.name, Kind.LEADER, f"observer-{uuid.uuid4().hex}", 0))
        engine.observers.add(waiter)  # aclose() wakes it: its next leader() raises
        try:
            await backend.listen(self.name, Kind.LEADER, waiter)
        except BaseException:
            engine.observers.discard(waiter)
            raise
        try:
            seen: object = object()
            while True:
                current = await self.leader()
                state = None if current is None else (current.token, current.data)
                if state != seen:
                    seen = state
                    yield current
                await waiter.wait(self.ttl / 2)
        finally:
            engine.observers.discard(waiter)
            backend.unlisten(self.name, Kind.LEADER, waiter)
