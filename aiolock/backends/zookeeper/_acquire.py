"""One acquire attempt on ZooKeeper (:meth:`_Acquire.try_acquire`).

A claim takes a place in the queue (creates its node, listing the children in the same
round trip), asks the recipe (:func:`aiolock.backends._queue.verdict`) whether it holds
and, if not, watches what can grant it and answers Busy. Asked again with nothing
changed (no watch fired, no reconnect), it answers the same without a request. A
handoff costs one listing after the watch fires: no write (the watchdog's first renewal
restamps the node).

A grant is believed for ``min(ttl, session timeout)`` from a moment no contender can
have started its reap clock before: the sending of the create, or, for a waiter that
became the holder, our last listing that still showed it waiting.

A claim keeps a place only while someone waits on it (its waiter listens, or the core
says it will: ``Claim.waits``). A try nobody waits on deletes its node before answering
Busy, so a try-lock loop leaves nothing to block the lock; such tries on a name found
busy in the last :data:`CONTENDED_HINT` seconds only list the nodes (no write), and the
next one after that takes a place again and reads the holders' lease clocks, so a
try-lock loop also reaps a holder that stopped renewing.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Sequence
from typing import Any

from ...abc import Busy, Claim, Granted
from ...errors import LockError
from .._queue import verdict
from ._claim import ClaimState, state_of
from ._recipe import KIND_PREFIX, Node, encode_data, family_nodes, holders, parse
from ._session import pipelined, retrieved
from ._watches import _Watches
from ._wire import Children

log = logging.getLogger("aiolock.backends.zookeeper")

_OWNER = operator.attrgetter("owner")
_NAME = operator.attrgetter("name")

#: At most this long between re-checks of a waiting claim (a missed watch costs this).
MAX_RECHECK = 5.0
#: After a try found a name busy, the next tries nobody listens for only look (a listing,
#: no node) for this long; then one takes a place again (and reads the holders' lease
#: clocks, so a holder that stopped renewing is still reaped).
CONTENDED_HINT = 2.0
#: How often one attempt may look again (its node reaped, a holder reaped, a watched
#: node gone before the watch was set) before it answers Busy for the core to retry.
LOOKS = 8


class _Acquire(_Watches):
    """``try_acquire`` on top of the watches; see the module doc."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._abandoned: dict[str, tuple[str, str, float]] = {}  # owner -> (parent, prefix, until)
        #: lock node path -> until when a try nobody listens for only looks (see _peek)
        self._contended: dict[str, float] = {}

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        if claim.owner in self._abandoned:
            raise LockError(f"claim on {claim.name!r} was abandoned")
        state = state_of(claim)
        busy = self._same_answer(claim, state)
        if busy is not None:
            return busy
        async with self._bounded("an acquire"):
            return await self._try_acquire(claim, state)

    def _same_answer(self, claim: Claim, state: ClaimState) -> Busy | None:
        """Asked again with nothing changed since the last answer (the core asks once more
        after listen(), and a local release wakes the local head): none of the watches
        fired, no reconnect, the re-check time not reached. Only the deletion of a node
        we watch can grant us, so the answer is the same, without a request."""
        busy, state.busy = state.busy, None
        if busy is None or busy[0] != self._epoch or self._closed:
            return None
        left = busy[1] - time.monotonic()
        if (left <= 0 or not state.watch or state.sid != self._sid or not self._healthy()
                or not all(claim.owner in self._watching.get(p, ()) for p in state.watch)):
            return None
        state.busy = busy
        return Busy(left)

    async def _try_acquire(self, claim: Claim, state: ClaimState) -> Granted | Busy:
        parent = self._parent(claim.name)
        if state.sid not in (None, self._sid):
            state.forget_node()  # made in an expired session: the server deleted it
        attended = self._attended(claim)
        if (not attended and state.path is None and not state.creating
                and self._contended.get(parent, 0.0) > time.monotonic()):
            peeked = await self._peek(claim, parent)
            if peeked is not None:
                return peeked
        started = time.monotonic()
        for _ in range(LOOKS):
            answer = await self._look(claim, state, parent, attended, started)
            if answer is not None:
                return answer
        return Busy(0.05)

    async def _look(
        self, claim: Claim, state: ClaimState, parent: str, attended: bool, started: float,
    ) -> Granted | Busy | None:
        """Take a place if we have none, list, and decide; None: look again."""
        path, children, listed, created = await self._place(claim, state, parent)
        if children is None and self._freed(claim, state, parent):
            return await self._grant(claim, state, path, False, started)
        state.queue = None
        if children is None:
            prefetch, state.prefetch = state.prefetch, None
            if prefetch is None:
                listed = time.monotonic()
                children = await self._children(parent)
            else:
                listed = prefetch[0]
                children = await self._children(parent, prefetch[1])
        nodes = family_nodes(children, claim.kind)
        me = path.rpartition("/")[2]
        live = nodes
        if self._abandoned or list(map(_OWNER, nodes)).count(claim.owner) > 1:
            await self._delete_strays(claim, parent, path, nodes)
            live = [n for n in nodes if n.owner not in self._abandoned or n.name == me]
        names = list(map(_NAME, live))
        index = names.index(me) if me in names else None
        if index is None:  # our node is gone (reaped as stale, or session expired)
            state.forget_node()
            return None
        found = verdict(live, index, claim.limit)
        if found.holds:
            return await self._grant(claim, state, path, created, started)
        self._note_contended(parent)
        held = holders(live, claim.limit)
        if not attended:  # nobody will wait on this place (one try, or a core that cannot say)
            return await self._give_way(claim, parent, path, nodes, held)
        # not holding at `listed`: no contender can see us holding before that moment
        state.waited = listed
        state.queue, state.gone = live[: index + 1], set()
        return await self._wait_on(claim, state, parent, nodes, held, found.watch, created)

    def _woken(self, claim: Claim, state: ClaimState) -> None:
        """A deletion woke the claim's waiter: unless that grants it outright (``_freed``),
        send the listing its next look needs now, not after the turns of the event
        loop it takes the waiter to run (the wake-up is on the handoff's critical path).
        It is a listing sent after the deletion all the same; its sending time is what
        ``_look`` counts from."""
        path = state.path
        if state.prefetch is not None or path is None or state.sid != self._sid:
            return
        parent = path.rpartition("/")[0]
        if self._freed(claim, state, parent):
            return
        listed = time.monotonic()  # (before the request: the listing shows it later)
        sent = self._list_now(parent)
        if sent is not None:
            state.prefetch = (listed, sent)

    def _freed(self, claim: Claim, state: ClaimState, parent: str) -> bool:
        """The watches told of deletions that grant us, without a listing: no node can
        join the queue before ours (sequence numbers only grow), so the last listing
        without the nodes deleted since is all that can stand before us now."""
        queue = state.queue
        if not queue or not state.gone or state.sid != self._sid:
            return False
        gone = {p.rpartition("/")[2] for p in state.gone}
        rest = [n for n in queue if n.name not in gone]
        return verdict(rest, len(rest) - 1, claim.limit).holds

    async def _grant(
        self, claim: Claim, state: ClaimState, path: str, created: bool, started: float,
    ) -> Granted | None:
        """Our node holds: the grant (stamping the node first if need be); None if the
        node turned out to be gone (reaped as stale, or the session expired)."""
        granted = self._granted(claim, state, created, started)
        if granted is None:
            granted = await self._granted_stamped(claim, state, path)
        if granted is None:
            state.forget_node()
            return None
        self._unwatch(claim)
        state.creating, state.granted, state.queue, state.prefetch = False, True, None, None
        return granted

    async def _place(
        self, claim: Claim, state: ClaimState, parent: str,
    ) -> tuple[str, list[str] | None, float, bool]:
        """Our node's path, the children if listed on the way (else None), when that
        listing was sent, and whether the node was created now."""
        listed = time.monotonic()
        if state.path is not None:
            return state.path, None, listed, False
        children: list[str] | None = None
        prefix = f"{KIND_PREFIX[claim.kind]}-{claim.owner}-"
        if state.creating:  # an earlier create may have happened with its reply lost
            children = await self._children(parent)
            path = self._adopt_orphan(state, parent, prefix, children)
            if path is not None:
                return path, children, listed, False
        state.creating = True
        sid = self._sid
        # The listing goes right behind the create, in the same round trip (and the same
        # write): the server answers a session's requests in order, so the listing sees
        # our node (unless the create made the parent first: checked below). If the
        # session is not connected, the listing's task starts when this one first
        # waits, after the create was sent.
        create = self._create_request(
            parent, prefix, encode_data(claim.ttl_ms, claim.limit, claim.info))
        sent = self._send_both_now(create, Children(path=parent, watch=False))
        listing: Any
        if sent is None:
            listing = asyncio.ensure_future(self._children(parent))
            creating = self._create(create)
        else:
            listing = self._children(parent, sent[1])
            creating = self._create(create, sent[0])
        try:
            path, czxid = await creating
        except BaseException:
            if isinstance(listing, asyncio.Future):
                listing.cancel()
                listing.add_done_callback(retrieved)
            else:
                listing.close()
            raise
        state.path, state.sid, state.czxid, state.stamped = path, sid, czxid, (listed, claim.ttl_ms)
        try:
            children = await listing
        except Exception:  # listed again by the caller, where a real failure raises
            children = None
        if children is not None and path.rpartition("/")[2] not in children:
            children = None  # the create made the parent first: list again
        return path, children, listed, True

    def _attended(self, claim: Claim) -> bool:
        """Someone will wait on this claim's place: its waiter listens, or the core says
        the claim waits if busy (``Claim.waits``: it listens right after this answer).
        Such a first try keeps its node and watches, and the next one is answered
        without a request: create, list, watch on the way in, one listing per wake-up,
        one delete on the way out."""
        return claim.waits or claim.owner in self._waiters

    def _granted(
        self, claim: Claim, state: ClaimState, fresh: bool, started: float,
    ) -> Granted | None:
        """Grant without another request, if the lease is safe; None: stamp first.

        A node created by this attempt is fine as it is (the create was sent after the
        attempt started). A node that waited became a holder only after our last listing
        that showed it waiting (sent at ``waited``), so no contender can reap it before
        ``waited + ttl``, nor can the session expire before ``waited + session
        timeout``: the grant counts from there. After a long wait (less than half the
        lease would be left), or for an adopted orphan whose token is unknown, the node
        is stamped first (None).
        """
        ms = self._granted_ms(claim)
        if not state.czxid:
            return None
        if fresh:
            return Granted(state.czxid, ms)
        waited = state.waited
        if waited is None or state.sid != self._sid:
            return None
        left = int((waited - started) * 1000 + ms)
        if left < ms / 2:
            return None
        stamped = state.stamped
        if stamped is None or stamped[0] < waited or stamped[1] != claim.ttl_ms:
            state.stamped = (waited, claim.ttl_ms)  # what a renewal may count from
        return Granted(state.czxid, left)

    async def _granted_stamped(self, claim: Claim, state: ClaimState, path: str) -> Granted | None:
        stat = await self._stamp(claim, path)
        if stat is None:
            return None
        state.czxid = int(stat.created_zxid)
        return Granted(state.czxid, self._granted_ms(claim))

    def _adopt_orphan(
        self, state: ClaimState, parent: str, prefix: str, children: list[str],
    ) -> str | None:
        mine = sorted(c for c in children if c.startswith(prefix))
        if not mine:
            return None
        state.path, state.sid = f"{parent}/{mine[0]}", self._sid
        state.czxid = 0  # looked up again when granted (the stamp returns it)
        return state.path

    async def _delete_strays(self, claim: Claim, parent: str, path: str, nodes: list[Node]) -> None:
        """Delete duplicates of our own node (a create retried by aiozk after a dropped
        connection) and nodes of claims abandoned here whose create landed late."""
        strays = [n for n in nodes if (n.owner == claim.owner and f"{parent}/{n.name}" != path)
                  or n.owner in self._abandoned]
        for node in strays:
            await self._delete(f"{parent}/{node.name}")

    async def _wait_on(
        self, claim: Claim, state: ClaimState, parent: str, nodes: list[Node],
        held: list[Node], targets: list[Node], first: bool,
    ) -> Busy | None:
        """Not granted: watch what can grant us, reap stale holders. None: look again.

        The holders' data (lease ttl and version) is read to reap a holder that stopped
        renewing; on the first look after creating our node only for a holder we watch
        anyway (the next look, on the bounded timer, reads the others: a stale holder is
        found later, never early).
        """
        watched = sorted({f"{parent}/{n.name}" for n in targets})
        holder_paths = self._reaper.to_read(parent, nodes, held, claim.limit)
        read = sorted(holder_paths.intersection(watched) if first else holder_paths)
        self._watch(claim, set(watched))
        requests = [*(self._watch_node(p) for p in watched), *(self._get(p, watch=False) for p in read)]
        results: list[Any] = ([await requests[0]] if len(requests) == 1
                              else await pipelined(requests))
        if not all(results[: len(watched)]):
            return None  # something we wait for went meanwhile (and set no watch): look again
        wait = await self._reap_stale(claim, read, results[len(watched):])
        if wait is None:
            return None
        state.busy = (self._epoch, time.monotonic() + wait)
        return Busy(wait)

    async def _peek(self, claim: Claim, parent: str) -> Busy | None:
        """A try nobody listens for, on a name found busy a moment ago: list the nodes
        and answer Busy without taking a place if a new node would not be granted (no
        write at all: a try-lock loop costs the server one read). None: it looks free,
        take a place."""
        nodes = [n for n in family_nodes(await self._children(parent), claim.kind)
                 if n.owner not in self._abandoned]
        newcomer = Node(1 << 62, claim.kind, claim.owner, "")
        if verdict([*nodes, newcomer], len(nodes), claim.limit).holds:
            self._contended.pop(parent, None)
            return None
        return Busy(self._recheck(claim))

    def _recheck(self, claim: Claim) -> float:
        return min(MAX_RECHECK, claim.ttl_ms / 3000, self.session_timeout / 3)

    def _note_contended(self, parent: str) -> None:
        now = time.monotonic()
        if parent not in self._contended and len(self._contended) >= 1024:
            for key in [k for k, until in self._contended.items() if until <= now]:
                del self._contended[key]
        self._contended[parent] = now + CONTENDED_HINT

    async def _give_way(
        self, claim: Claim, parent: str, path: str, nodes: list[Node], held: list[Node],
    ) -> Busy | None:
        """Not granted, and nobody listens for ``claim``: delete its node before answering
        Busy, so that it blocks nobody. The holders' data is read in the same round trip,
        so that a try-lock loop still reaps a holder that stopped renewing. None: one was
        reaped, look again (with a new node)."""
        read = sorted(self._reaper.to_read(parent, nodes, held, claim.limit))
        self._unwatch(claim)
        results = await pipelined([self._delete(path), *(self._get(p, watch=False) for p in read)])
        state_of(claim).forget_node()
        wait = await self._reap_stale(claim, read, results[1:])
        return None if wait is None else Busy(wait)

    async def _reap_stale(
        self, claim: Claim, paths: Sequence[str], got: Sequence[tuple[bytes, Any] | None]
    ) -> float | None:
        """Delete a holder at ``paths`` unchanged for its whole ttl: None then (look
        again); else how long to wait before looking again."""
        due = self._reaper.due(paths, got, self._recheck(claim))
        if isinstance(due, float):
            return due
        path, version = due
        if await self._delete(path, version):
            log.info("reaped stale ZooKeeper lease node %s", path)
        return None

    def _forget_abandoned(self) -> None:
        now = time.monotonic()
        for owner in [o for o, (_, _, until) in self._abandoned.items() if until <= now]:
            del self._abandoned[owner]

    def _owned_elsewhere(self, child: str) -> bool:
        """A child node of a claim abandoned here."""
        node = parse(child)
        return node is not None and node.owner in self._abandoned
