"""What the etcd backend keeps per claim, typed (in ``claim.state["etcd"]``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ...abc import Claim

__all__ = ["ClaimState", "state"]


@dataclass(slots=True)
class ClaimState:
    """One claim's etcd lease, key revision, watches and answer cache.

    Invariants: ``confirmed``/``lease_ttl`` describe ``lease`` (0.0/0 when unknown: an
    adopted lease is not believed until a keep-alive confirms it); ``granted`` implies
    ``lease`` and ``rev``; ``watch`` is empty once ``granted``.
    """

    #: our key (made once: the name is escaped)
    key: bytes | None = None
    #: the etcd lease our key is attached to (ids are chosen here), None before a grant
    lease: int | None = None
    #: seconds the server granted the lease for, and when (monotonic) the request that
    #: last confirmed it was *sent*: the lease is believed until ``confirmed + lease_ttl``
    lease_ttl: int = 0
    confirmed: float = 0.0
    #: our key's create_revision (the fencing token once granted)
    rev: int | None = None
    granted: bool = False
    abandoned: bool = False
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
        """Monotonic time until which the lease surely lives on the server."""
        return self.confirmed + self.lease_ttl

    def left_ms(self, ttl_ms: int, since: float) -> int:
        """How long the lease surely lasts counted from ``since`` (ms, at most ``ttl_ms``)."""
        return int(min(ttl_ms, (self.believed_until() - since) * 1000))

    def confirm(self, sent: float, ttl: int) -> None:
        self.confirmed = sent
        self.lease_ttl = ttl

    def key_stamp(self) -> float:
        if self.stamp is None:
            self.stamp = time.time()
        return self.stamp

    def reset(self) -> None:
        """Forget the lease and the key (the watches are cancelled by the caller)."""
        self.lease = self.rev = self.revoking = self.stamp = None
        self.lease_ttl, self.confirmed = 0, 0.0
        self.granted = False
        self.busy = self.asked = None


def state(claim: Claim) -> ClaimState:
    """The claim's etcd state, made on first use."""
    st = claim.state.get("etcd")
    if not isinstance(st, ClaimState):
        st = claim.state["etcd"] = ClaimState()
    return st
