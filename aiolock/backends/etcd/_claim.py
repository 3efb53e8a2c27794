"""What the etcd backend keeps per claim and per etcd lease, typed (a claim's state is in
``claim.state["etcd"]``)."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

from ...abc import Claim

__all__ = ["ClaimState", "EtcdLease", "state"]


@dataclass(slots=True, eq=False)
class EtcdLease:
    """One etcd lease of a connection, shared by its claims of one lease length.

    Invariants: ``confirmed``/``granted`` only move forward (the latest confirmation
    wins); ``claims`` are the claims whose key is (or may be) attached to it, ``orphans``
    keys of claims gone from it that must be deleted before it is kept alive again (a
    key nobody holds would otherwise live as long as the lease); once ``lost`` it is
    never kept alive nor given to a claim again; once ``retired`` it is given to no new
    claim, and is revoked when its last claim leaves.
    """

    #: the etcd lease id (chosen here)
    id: int
    #: the lease length asked for (whole seconds)
    ttl_s: int
    #: seconds the server granted it for, and when (monotonic) the request that last
    #: confirmed it was *sent*: it is believed until ``confirmed + granted``
    granted: int = 0
    confirmed: float = 0.0
    #: owner id -> state of the claims whose keys are on it
    claims: dict[str, ClaimState] = field(default_factory=dict)
    #: key -> tombstone key (None: a plain delete) of keys to delete before a keep-alive
    orphans: dict[bytes, bytes | None] = field(default_factory=dict)
    lost: bool = False
    retired: bool = False
    #: tombstones written on it (they go with the lease: it is retired after too many)
    tombstones: int = 0
    #: when (monotonic) its claims were last checked for lapsed ones
    swept: float = 0.0
    #: the call that revokes it once it stays idle (a current lease kept for reuse)
    idle_timer: asyncio.TimerHandle | None = None

    def believed_until(self) -> float:
        """Monotonic time until which the lease surely lives on the server."""
        return self.confirmed + self.granted

    def confirm(self, sent: float, ttl: int) -> None:
        if sent >= self.confirmed:
            self.confirmed, self.granted = sent, ttl


@dataclass(slots=True)
class ClaimState:
    """One claim's etcd lease, key revision, watches and answer cache.

    Invariants: ``lease`` is None before the claim is put on a lease; ``granted``
    implies ``lease`` and ``rev``; ``watch`` is empty once ``granted``; a claim on a lease
    is in that lease's ``claims``.
    """

    #: our key (made once: the name is escaped)
    key: bytes | None = None
    #: the (shared) etcd lease our key is attached to, None before one is taken
    lease: EtcdLease | None = None
    #: our key's create_revision (the fencing token once granted)
    rev: int | None = None
    granted: bool = False
    abandoned: bool = False
    #: a put of our key was sent and not answered (a cancelled or failed request): it
    #: may still be applied, so an abandon bars it with a tombstone
    uncertain: bool = False
    #: until when (monotonic) the core counts on this claim (its last confirmed expiry,
    #: or the next re-check of a waiting claim plus its ttl): a claim left past it is
    #: swept off its lease before the lease is kept alive again (inf: a request is under way)
    own_until: float = math.inf
    #: the lease a release is deleting (a repeated release after an interruption)
    revoking: int | None = None
    #: wall-clock time the key was first written (kept across rewrites)
    stamp: float | None = None
    #: key -> watch id of the keys whose deletion wakes this waiting claim
    watch: dict[bytes, int] = field(default_factory=dict)
    #: an election listener's watch on the whole family
    family_watch: int | None = None
    #: the last Busy answer: (watch-stream epoch, monotonic time it holds until)
    busy: tuple[int, float] | None = None
    #: set when answered Busy; the unattended check compares it
    asked: object | None = None

    def believed_until(self) -> float:
        """Monotonic time until which our lease surely lives on the server."""
        return self.lease.believed_until() if self.lease is not None else 0.0

    def left_ms(self, ttl_ms: int, since: float) -> int:
        """How long the lease surely lasts counted from ``since`` (ms, at most ``ttl_ms``)."""
        return int(min(ttl_ms, (self.believed_until() - since) * 1000))

    def key_stamp(self) -> float:
        if self.stamp is None:
            self.stamp = time.time()
        return self.stamp

    def reset(self) -> None:
        """Forget the lease and the key (the caller detached it from the lease and
        cancelled the watches)."""
        self.lease = None
        self.rev = self.revoking = self.stamp = None
        self.granted = self.uncertain = False
        self.own_until = math.inf
        self.busy = self.asked = None


def state(claim: Claim) -> ClaimState:
    """The claim's etcd state, made on first use."""
    st = claim.state.get("etcd")
    if not isinstance(st, ClaimState):
        st = claim.state["etcd"] = ClaimState()
    return st
