"""Waiting on a plain Redis lock (or an election): registered on the server, handed over.

A plain lock's waiter is registered on the server by its busy ``ACQUIRE`` (see
:mod:`aiolock.backends._redis_scripts`): a release hands it the lock and one message on
this process's inbox says so (``Signals.granted`` leaves the token in
``claim.state["grant"]``). Its ``claim.state`` also keeps, from its last busy ACQUIRE:

* ``"sent"``: the monotonic time that request was sent: the lease it is handed later
  started after that (the busy reply proves the grant came later), so the lease is
  believed until sent + ttl, never longer;
* ``"seen"``: the token that reply saw: a grant with a token not above it is stale;
* ``"mark"``: ``Signals.mark()`` taken before that request, ``"due"`` its retry time,
  and ``"fresh"`` (the same mark) while the next call may answer busy without asking:
  registered and subscribed since, a grant cannot go unheard.

A local hand-off (a RELEASE naming a waiting claim of this process) sets ``"sent"`` to
the time that RELEASE was sent, and ``"handoff"`` to a future done when its reply is in.

Bounded local hand-offs (issue 10): while another process waits on the server (a waiter
registered in the lock's queue, through the Lua scripts or the transaction path), a
release hands the lock to a task of this process (a local hand-off, the fastest kind)
at most :data:`LOCAL_HANDOFFS` times in a row, and not after :data:`LOCAL_HANDOFF_S`
seconds from the first of them; the next release hands it to the first waiter on the
server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..abc import Busy, Claim, Granted, Kind
from ..errors import LockError
from ._redis_scripts import ACQUIRE, RELEASE

if TYPE_CHECKING:
    from .redis import RedisBackend

__all__ = ["LOCAL_HANDOFFS", "LOCAL_HANDOFF_S", "Streak", "heir", "release_lock", "try_lock"]

LOCAL_HANDOFFS = 4
LOCAL_HANDOFF_S = 0.010
#: Seconds before asking again when the server had not yet seen a hand-over we were told
#: of, and for how long after the message it is asked that way.
HEARD_RETRY = 0.005
HEARD_FOR = 0.5


class Streak:
    """Local hand-offs of one lock in a row while another process waits."""

    __slots__ = ("count", "since")

    def __init__(self) -> None:
        self.count = 0
        self.since = time.monotonic()


def _announce(claim: Claim) -> str:
    return "1" if claim.kind is _LEADER else "0"  # an election's observers


_LEADER = Kind.LEADER


async def try_lock(backend: RedisBackend, claim: Claim) -> Granted | Busy:
    """One attempt at a plain lock or a leadership: take a grant a release handed us,
    answer busy without asking while registered and subscribed, else run ACQUIRE."""
    state = claim.state
    signals = backend.signals
    heard: object = None  # the token of a hand-over message for this claim, if any
    if state:  # (a first attempt has nothing there yet)
        handoff = state.get("handoff")
        if isinstance(handoff, asyncio.Future):  # a release of ours may hand it to us
            await asyncio.shield(handoff)
        token = heard = state.pop("grant", None)
        if heard is None:
            heard = state.pop("heard", None)
        else:
            state.pop("heard_until", None)  # a new message: a new window
        if token is not None:
            if (backend.trust_handoffs and isinstance(token, int)
                    and token > state.get("seen", 0)):  # type: ignore[operator]
                sent = state["sent"]
                assert isinstance(sent, float)
                left = claim.ttl_ms - int((time.monotonic() - sent) * 1000)
                if left > claim.ttl_ms // 2:  # else ask the server for the exact time left
                    signals.claims.pop(claim.owner, None)
                    return Granted(token, left)
            # a grant message not taken as it is (stale, untrusted, or too little left):
            # ask the server now, never answer busy from the mark -- the message took the
            # claim out of Signals.claims, and only an ACQUIRE (below) puts it back
            state.pop("fresh", None)
        fresh = state.pop("fresh", None)
        if fresh is not None and signals.unbroken(backend.inbox, fresh):
            due = state["due"]
            assert isinstance(due, float)
            if due - time.monotonic() > 0.001:
                return Busy(due - time.monotonic())
    owner = claim.owner
    keys = backend._keys(claim.name, owner, claim.kind)
    waits = claim.waits and backend.handoffs
    claims = signals.claims
    inbox = backend.inbox
    if waits:  # before sending: a grant may come before the reply
        claims[owner] = claim
        signals.hear(inbox)
    mark = signals.mark(inbox)
    sent = time.monotonic()
    ttl_ms = claim.ttl_ms
    try:
        reply = await backend._run(
            ACQUIRE, keys, owner, ttl_ms, "1" if claim.fair else "0",
            ttl_ms if waits else 0, inbox, claim.info, _announce(claim),
        )
    except BaseException:
        claims.pop(owner, None)
        raise
    if reply[0] != 0:
        claims.pop(owner, None)
        if state:
            state.pop("grant", None)
        if reply[0] == -1:
            raise LockError(f"claim on {claim.name!r} was abandoned")
        return Granted(int(reply[1]), int(reply[2]))
    retry = max(int(reply[1]), 1) / 1000
    if isinstance(heard, int) and heard > int(reply[2]):
        # told of a hand-over with a token the server we asked has not seen yet (on
        # Sentinel, just after a failover, the message came before the grant showed):
        # ask again soon (for HEARD_FOR s at most), not at the timer -- no other
        # message will come for it
        until = state.setdefault("heard_until", time.monotonic() + HEARD_FOR)
        assert isinstance(until, float)
        if time.monotonic() < until:
            state["heard"] = heard
            retry, mark = min(retry, HEARD_RETRY), None
    if waits:
        state.update(sent=sent, seen=int(reply[2]), mark=mark, due=time.monotonic() + retry)
        if mark is not None:
            state["fresh"] = mark
    return Busy(retry)


def heir(
    backend: RedisBackend, claim: Claim, channel: str,
) -> tuple[Claim | None, Sequence[Claim]]:
    """Before a plain lock's release: the waiting claim of this process to hand it to
    (a local hand-off), if any and if the streak allows; and all local waiting claims."""
    if claim.fair:
        return None, []
    signals = backend.signals
    if not signals.listening(channel):  # no local waiter: no hand-off, no streak
        if backend._streaks:
            backend._streaks.pop(channel, None)
        return None, ()
    local = [w.claim for w in signals.waiting(channel)
             if not w.claim.fair and w.claim is not claim]
    streak = backend._streaks.get(channel)
    if local and (streak is None or (streak.count < LOCAL_HANDOFFS
                                     and time.monotonic() - streak.since < LOCAL_HANDOFF_S)):
        first = local[0]
        first.state.pop("fresh", None)  # woken to take it: must not answer busy itself
        return first, local
    backend._streaks.pop(channel, None)
    for each in local:  # woken, but the lock goes to the server's next waiter
        mark = each.state.get("mark")
        if "due" in each.state and signals.unbroken(backend.inbox, mark):
            each.state["fresh"] = mark  # registered: no need to ask again
    return None, local


async def release_lock(
    backend: RedisBackend, claim: Claim, keys: list[str], flag: str, tomb: int,
    heir: Claim | None, local: Sequence[Claim], on_retry: Callable[[], object] | None,
) -> int:
    """Run RELEASE for a plain lock or a leadership, handing it to ``heir`` (a local
    hand-off) or the server's first live waiter; 1 if ``claim`` held it."""
    sent = time.monotonic() if heir is not None else 0.0  # (only a local hand-off uses it)
    # an abandon also names its queue entry (its registration), in case its waiter key lapsed
    mine = (claim.ttl_ms, backend.inbox, claim.info) if flag == "1" and backend.handoffs else ()
    reply = await backend._run(
        RELEASE, keys, claim.owner, keys[0], flag, tomb,
        heir.owner if heir is not None else "", heir.ttl_ms if heir is not None else 0,
        heir.info if heir is not None else "", _announce(claim),
        "1" if backend.publish_counts else "0", *mine, on_retry=on_retry,
    )
    released, owner, token, queued = reply
    if not owner:  # released, handed to nobody (b"" or "")
        return int(released)
    owner = _text(owner)
    if heir is not None and owner == heir.owner:
        # a local hand-off: the lease began after this request was sent
        heir.state["sent"] = sent
        # others wait on the server (beyond our own registered waiters): count it
        if int(queued) > sum(1 for c in local if c is not heir and "due" in c.state):
            streak = backend._streaks.get(keys[0])
            if streak is None:
                streak = backend._streaks[keys[0]] = Streak()
            streak.count += 1
        else:
            backend._streaks.pop(keys[0], None)
    # handed over: if to a claim of ours, tell it now (not at the echo)
    backend.signals.granted(keys[0], owner, int(token), heir)
    return int(released)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
