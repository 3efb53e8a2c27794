"""What the ZooKeeper backend remembers about one claim (kept in ``Claim.state``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from ...abc import Claim
from ._recipe import Node

_KEY = "zk"


@dataclass(slots=True, eq=False)
class ClaimState:
    """Per-claim state. Invariants: ``path`` set => ``sid`` is the session that made the
    node; ``granted`` => ``path`` set; ``creating`` => a create may be in flight (its node,
    if it landed, is found again by the claim's owner id)."""

    path: str | None = None  #: our znode, once its create was answered (or found again)
    sid: int | None = None  #: the session the node belongs to
    czxid: int = 0  #: the node's czxid (the fencing token); 0: unknown, read at the grant
    creating: bool = False  #: a create was sent; its reply may have been lost
    #: (when the last write of our node's data was sent, monotonic; the ttl it carried)
    stamped: tuple[float, int] | None = None
    releasing: int | None = None  #: the session of a release that was sent (and interrupted)
    #: the last Busy answer: (epoch it was given in, until when it holds, monotonic)
    busy: tuple[int, float] | None = None
    granted: bool = False
    #: when the last listing that showed the node waiting was sent (monotonic)
    waited: float | None = None
    #: the node paths whose deletion wakes this claim's waiter
    watch: set[str] = field(default_factory=set)
    #: while waiting: the nodes of the last listing up to ours (ours last), and the
    #: paths among them whose deletion a watch reported since (no node can join before
    #: ours later: sequence numbers only grow, so these tell whether we hold now)
    queue: list[Node] | None = None
    gone: set[str] = field(default_factory=set)
    #: a listing sent when a watch woke the waiter, for its next look: (when it was
    #: sent, monotonic; what ``_Io._list_now`` returned)
    prefetch: tuple[float, Any] | None = None

    def forget_node(self) -> None:
        """The node is gone (released, deleted, or its session expired)."""
        self.path = self.sid = self.stamped = self.releasing = self.busy = self.waited = None
        self.czxid = 0
        self.creating = self.granted = False
        self.queue = self.prefetch = None
        self.gone = set()


def state_of(claim: Claim) -> ClaimState:
    """The claim's ZooKeeper state, made on first use."""
    state = claim.state.get(_KEY)
    if state is None:
        state = claim.state[_KEY] = ClaimState()
    return cast(ClaimState, state)


def known(claim: Claim) -> ClaimState | None:
    """The claim's state if it has been tried here (observers never are)."""
    return cast("ClaimState | None", claim.state.get(_KEY))
