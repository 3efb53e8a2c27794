"""What a backend is: a few single-attempt primitives, and the capabilities it declares.

The core (:mod:`aiolock._lock`, :mod:`aiolock._watchdog`) owns waiting for a holder,
trying again after :class:`Busy`, deadlines, back-off and cancellation: it alone knows
the caller's deadline, the local queue of waiters and when a cancellation must finish
first. So a backend primitive never sleeps, never waits for a holder to go, and answers
one attempt -- with exactly the exceptions listed under "What a backend may do" below.
The primitives:

* :meth:`Backend.try_acquire` -- take the resource for one :class:`Claim`, or say it is
  busy and for how long the current holder's lease still runs;
* :meth:`Backend.renew` -- extend many held claims in one request (the watchdog batches,
  by :meth:`Backend.renewal_group` where the claims live on several servers);
* :meth:`Backend.release` -- give a claim back; true only if the server confirmed;
* :meth:`Backend.abandon` -- forget a claim that may or may not have been granted
  (used when an acquire is cancelled or fails mid-flight); idempotent, never raises
  for "not held";
* :meth:`Backend.listen` / :meth:`Backend.unlisten` -- deliver release signals for a
  name to a :class:`Waiter` (pub/sub, watches). A release made through this backend
  object has already woken the next local waiter (the core does that), so the backend
  may skip signalling its own releases to non-fair waiters;
* :meth:`Backend.inspect` -- who holds it, its token, time left, each holder's record;
* :meth:`Backend.set_info` -- replace a held claim's holder record (an elected leader's
  ``proclaim``), waking listeners of the name (observers);
* :meth:`Backend.force_release` -- an operator's revocation of every holder of a name;
* :meth:`Backend.scan` -- every name held now (``Capability.SCAN``).

Holder records: every claim carries ``info``, an opaque string the core made
(:mod:`aiolock._holder`); a backend that declares ``Capability.HOLDERS`` stores it beside
the claim in the same request that grants it, and reports it back in
:attr:`LockInfo.held_by` (through :func:`aiolock._holder.decode_holder`). A grant of a
``Kind.LEADER`` claim and a ``set_info`` wake the name's listeners, so that an election's
observers see a new leader or new data without polling.

Every claim carries an ``owner`` id unique to that acquisition, so every primitive is
safe to repeat: releasing or abandoning twice, or after the lease expired, does no harm.

What a backend may do within one primitive, and why
---------------------------------------------------
Three things, each bounded, none of them a wait for the resource:

1. **Keep a place in a server-side queue.** Where the server orders waiters itself
   (ZooKeeper's and etcd's sequence of holder nodes or keys, a blocking
   ``pg_advisory_lock`` or ``GET_LOCK`` in PostgreSQL's or MySQL's lock queue, the Redis
   fair queue), a busy ``try_acquire`` may leave the claim queued there and return
   :class:`Busy` at once: it must not block until the grant (PostgreSQL runs the
   blocking statement in a background task and answers ``Busy``). Why: that queue is
   what makes ``fair=True`` first come, first served across processes, lets a waiting
   writer hold off new readers, and grants the lock the moment it frees, with no missed
   signal. Rules: only when ``claim.waits`` (a single try registers nothing); the place
   is the claim's (its ``owner``), a later ``try_acquire`` of the same claim finds it
   again; ``abandon()`` removes it and bars a grant still on its way; the grant reaches
   the core through the next ``try_acquire`` after a :meth:`Waiter.wake`, and
   ``Busy.retry_after`` bounds how long the core waits for that wake.
2. **Send an idempotent request once more.** A request written on a connection that
   turned out dead may be sent once more on a fresh connection (the shared pipeline,
   ``_pipeline.py``, and redis-py's retry policy do this), because the first copy may or
   may not have reached the server and the primitives are safe to repeat (the claim's
   ``owner`` makes a repeated acquire re-grant and a repeated release a no-op). Once,
   and never after a *timeout*: a timed-out request may still be running on the server,
   and the request timeout is the bound the caller was promised. Where a repeat is not
   harmless by itself, the backend is told it is one (``on_retry``) and checks.
3. **Retry a bounded number of times on a conflict, without waiting.** An optimistic
   update (Memcached's ``cas``, a Redis ``WATCH``/``MULTI``/``EXEC`` transaction, an
   etcd transaction whose lease vanished) may lose a race against another client or
   against our own concurrent request, and a recipe may find its listing outdated by
   the time it acts (ZooKeeper: a predecessor gone before its watch was set, a parent
   node reaped, our own node reaped as stale). The backend re-reads and tries again at
   once, a small fixed number of times (a constant in the module), then answers
   ``Busy`` with a short ``retry_after`` (or raises, if the server keeps refusing).
   Why: such a conflict is not "the lock is held" -- the answer to this attempt is not
   known yet -- and handing it to the core would cost a round trip through the wait
   loop, or report a free lock as busy.

Anything else that repeats or waits -- polling for a release, sleeping between tries,
reconnect loops that outlast the connect timeout -- belongs to the core or to a
background task of the backend (a listener, a reaper, a session keeper), never to a
primitive the core awaits.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from ._holder import Holder

__all__ = [
    "REVOKED",
    "Backend",
    "Busy",
    "Capability",
    "Claim",
    "Granted",
    "Kind",
    "LockInfo",
    "Waiter",
]


class Capability(enum.Enum):
    """Features a backend may offer; the contract tests skip what a backend lacks."""

    #: ``fair=True``: first come, first served across processes.
    FAIR = "fair"
    #: ``rwlock()``: shared readers, exclusive writers that are not starved.
    RWLOCK = "rwlock"
    #: ``semaphore()``: up to ``limit`` holders, each with an expiring permit.
    SEMAPHORE = "semaphore"
    #: Waiters are woken by a release signal rather than by polling alone.
    EVENTS = "events"
    #: Leases expire on the server when their owner stops renewing (crash safety).
    EXPIRY = "expiry"
    #: Several processes (and hosts) share the lock.
    DISTRIBUTED = "distributed"
    #: Every lease's :class:`aiolock.Holder` record is kept on the server
    #: (:attr:`LockInfo.held_by`, ``Lease.holder``).
    HOLDERS = "holders"
    #: ``locks.scan(prefix)`` lists every name held now.
    SCAN = "scan"
    #: ``lock.force_release()``: an operator revokes every holder of a name.
    REVOKE = "revoke"
    #: ``locks.election(name)``: campaign, leader, observe, proclaim.
    ELECTION = "election"


class Kind(enum.Enum):
    """What a claim asks for."""

    LOCK = "lock"  #: exclusive mutex
    READ = "read"  #: shared side of a read-write lock
    WRITE = "write"  #: exclusive side of a read-write lock
    PERMIT = "permit"  #: one of ``limit`` semaphore permits
    LEADER = "leader"  #: the leadership of an election (exclusive)

    # Kinds are dict keys and set members on every lock cycle: hash by identity (C, no
    # Python frame) rather than Enum's ``hash(self._name_)``; members are singletons and
    # compare by identity, so equal members still hash equal.
    __hash__ = object.__hash__

    @property
    def family(self) -> str:
        """Claims of one family on one name contend with each other."""
        return _FAMILY[self]

    @property
    def exclusive(self) -> bool:
        """One holder at a time (a lock, a writer, a leader)."""
        return self in _EXCLUSIVE


_FAMILY = {
    Kind.LOCK: "lock", Kind.READ: "rw", Kind.WRITE: "rw", Kind.PERMIT: "sem", Kind.LEADER: "elect",
}
_EXCLUSIVE = frozenset({Kind.LOCK, Kind.WRITE, Kind.LEADER})
#: The kind :meth:`Backend.inspect` is asked for to report a whole family.
FAMILY_KIND = {"lock": Kind.LOCK, "rw": Kind.WRITE, "sem": Kind.PERMIT, "elect": Kind.LEADER}

#: What :meth:`Backend.renew` returns for a claim an operator revoked (``force_release``).
REVOKED = -1


@dataclass(slots=True, eq=False)
class Claim:
    """One acquisition of ``name``: what the core asks a backend for.

    ``owner`` is a fresh random id per acquisition, so it identifies this claim on the
    server (and any orphan a cancellation may leave). ``ttl_ms`` may change through
    :meth:`aiolock.Lease.extend`.
    """

    name: str
    kind: Kind
    owner: str
    ttl_ms: int
    fair: bool = False
    limit: int = 1
    #: the holder record to store beside the claim (see :mod:`aiolock._holder`)
    info: str = ""
    #: False for a single try (``timeout=0``): a backend that registers waiting claims
    #: on the server (to wake or hand the lock to one of them) must not register it
    waits: bool = True
    #: backend-private state (e.g. a ZooKeeper node path); the core never reads it
    state: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Granted:
    """The server granted the claim: fencing ``token`` and lease length ``ttl_ms``."""

    token: int
    ttl_ms: int


@dataclass(slots=True, frozen=True)
class Busy:
    """The claim was not granted now.

    ``retry_after`` (seconds) bounds how long to wait for a release signal before trying
    again: the current holder's remaining lease, or how soon a fair waiter must refresh
    its place in the queue.
    """

    retry_after: float


@dataclass(slots=True, frozen=True)
class LockInfo:
    """What :meth:`Backend.inspect` reports about a name."""

    name: str
    held: bool
    holders: int = 0
    token: int | None = None  #: the current holder's token (exclusive kinds)
    last_token: int | None = None  #: the highest token ever given for this name
    ttl_left: float | None = None  #: seconds until the current lease expires
    #: acquisitions waiting now: those the server sees, plus the tasks queued behind a
    #: holder in its own process (in its record: :attr:`aiolock.Holder.waiting`)
    waiters: int = 0
    #: every current holder (one for a lock, many for readers or permits); empty when
    #: free, or where the backend does not keep holder records
    held_by: tuple[Holder, ...] = ()
    #: the primitive: ``"lock"``, ``"rw"`` (read-write lock), ``"sem"`` or ``"elect"``
    family: str = "lock"


class Waiter(Protocol):
    """A waiting claim; a backend calls :meth:`wake` when its resource may be free."""

    claim: Claim

    def wake(self, hint: str | None = None) -> None:
        """Signal a (possible) release; ``hint`` is the owner id of the next fair waiter."""


class Backend(abc.ABC):
    """A lock server driver: single-attempt primitives, with the bounded exceptions the
    module doc lists (a server-side queue place, one resend, bounded conflict retries)."""

    #: URL schemes this backend serves, e.g. ``("redis", "rediss", "unix")``.
    schemes: ClassVar[tuple[str, ...]] = ()
    #: What this backend offers; see :class:`Capability`.
    capabilities: ClassVar[frozenset[Capability]] = frozenset()
    #: True if requests made through this object reach the server in the order they
    #: were made (one pipelined connection). The core then wakes the next local waiter
    #: as soon as a release is *sent*: its acquire queues right behind the release.
    ordered: bool = False
    #: The kinds whose claims :meth:`inspect` counts in ``waiters`` once they asked while
    #: the name was busy and still wait (the server keeps their place: a queue entry, a
    #: node, a blocked lock request). The core counts a local waiter of another kind in
    #: its holder's record as long as it waits (see ``_Engine.unseen``).
    waiting_counted: ClassVar[frozenset[Kind]] = frozenset()
    #: True if the server's time for a holder's record (what :meth:`inspect` gives as
    #: ``since``) is when its claim first asked (a node or key its first request made,
    #: kept while it queued), not when it was granted: the core then records how long a
    #: claim granted after a wait queued, which ``since`` leaves out (see ``aiolock._holder``).
    held_since_queued: ClassVar[bool] = False

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """A printable URL of the server (no password)."""

    async def connect(self) -> None:  # noqa: B027 -- optional hook
        """Open connections eagerly; raise :class:`BackendUnavailable` if unreachable."""

    @abc.abstractmethod
    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        """One attempt to take ``claim``. Repeating it for a granted claim re-grants it."""

    @abc.abstractmethod
    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        """Extend each claim by its ``ttl_ms``; per claim, the ms granted, None if gone,
        or :data:`REVOKED` if an operator revoked it (where the backend can tell)."""

    def renewal_group(self, claim: Claim) -> object:
        """The watchdog renews claims of one group in one batch (default: one group).
        A backend whose claims live on several servers names the server, so that a
        slow or unreachable one delays only the renewals of its own leases."""
        return None

    @abc.abstractmethod
    async def release(self, claim: Claim) -> bool:
        """Give ``claim`` back; True if it was held and is now released."""

    @abc.abstractmethod
    async def abandon(self, claim: Claim) -> None:
        """Drop ``claim`` whatever its state: release if held, leave any wait queue, and
        make sure a request for it still in flight cannot grant it later."""

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:  # noqa: B027
        """Start delivering release signals for ``name`` to ``waiter``.

        Returns once signals are flowing, so a release after this call is never missed.
        """

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:  # noqa: B027
        """Stop delivering signals to ``waiter``."""

    @abc.abstractmethod
    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        """Report who holds ``name`` now."""

    async def set_info(self, claim: Claim) -> bool:
        """Store ``claim.info`` as the record of the held ``claim`` and, for a
        ``Kind.LEADER`` claim (a proclaim), wake the name's listeners (an election's
        observers; the core also rewrites a lock's record to count the tasks queued behind
        it here, and that must not wake waiters); False if it is no longer held.
        (``Capability.ELECTION``)"""
        raise NotImplementedError(f"{type(self).__name__} does not keep holder records")

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        """Revoke every holder of ``name`` in ``kind``'s family (tokens keep increasing,
        waiters are woken); True if any was held. (``Capability.REVOKE``)"""
        raise NotImplementedError(f"{type(self).__name__} cannot revoke holders")

    def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every name starting with ``prefix`` held now, any family, each as
        :meth:`inspect` reports it; never blocks the server. (``Capability.SCAN``)"""
        raise NotImplementedError(f"{type(self).__name__} cannot list held names")

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close connections this backend opened (not a client the user passed in)."""
