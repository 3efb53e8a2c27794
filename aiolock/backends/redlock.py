"""``redlock://h1:port,h2:port,h3:port``: Redlock over independent Redis masters.

Each node is a :class:`~aiolock.backends.redis.RedisBackend` used as a connection, with
Redlock's own scripts (:mod:`aiolock.backends._redlock_node`); this class asks all nodes
at once and decides by majority (``n // 2 + 1`` of ``n >= 3`` nodes). The user's story,
the fencing-token guarantee and Kleppmann's critique are in ``docs/redlock.md``.

* **Acquire**: ACQUIRE goes to every node at once; the attempt is decided as soon as a
  majority granted (or can no longer grant). It is granted only if a majority granted
  *and* the validity ``ttl - elapsed - drift`` is still positive (``elapsed`` on the
  monotonic clock from before the requests were sent, ``drift = ttl * drift_factor + 2
  ms``); ``Granted.ttl_ms = ttl - drift``, counted by the core from when it sent the
  attempt. A failed attempt drops its partial grants on every node before it returns,
  and after a split vote waits a random few ms (the one wait in this backend, as the
  algorithm prescribes) so two contenders do not retry in lockstep.
* **Tokens**: a grant's token is the highest counter of the granting majority; if they
  differ, a majority of the nodes it holds are raised to it (RAISE) before it returns.
* **Renew** (the watchdog's batch) goes to every node: renewed if a majority confirmed,
  for ``ttl - drift`` from when the batch was sent; gone if a majority denied it
  (revoked if one said "revoked"). A node that lost a lease a majority still holds
  (restarted empty) gets it back in the background (REPAIR).
* **Release** and **abandon** go to every node; release is True if a majority confirmed.
* **Waiting**: waiters subscribe on every node not found down by its last request (at
  least a majority, which a release always reaches); any node's release wakes them.
* **Coordination**: holder records sit in each node's lock hash, written by the script
  that grants; ``inspect`` reports the owner, token and record a majority agrees on; ``scan``
  SCANs every node and lists a name where ``inspect`` finds it held; ``force_release``
  revokes on every node. Elections are locks of the ``elect`` family; a grant or a
  ``proclaim`` is published on the name's channel, so observers wake at once.

Not offered: ``fair=True``, read-write locks and semaphores: per-node queues do not
compose into one fair order, nor per-node permit counts into one limit.

Errors: every node request is bounded by the connect and request timeouts. A minority
of nodes down or slow is tolerated; when a majority cannot answer, operations raise
:class:`aiolock.BackendUnavailable` (:class:`aiolock.AccessDenied` if a node refused the
credentials or a permission, :class:`aiolock.LockError` if it refused a script).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from .._holder import decode_holder
from .._settle import settled
from ..abc import FAMILY_KIND, REVOKED, Backend, Busy, Capability, Claim, Granted, Kind, LockInfo, Waiter
from ..errors import LockError
from . import _redlock_node as one
from ._redlock_ask import Fanout, Replies
from ._redlock_url import DEFAULT_DRIFT_FACTOR, parse_url
from .redis import RedisBackend

__all__ = ["DEFAULT_DRIFT_FACTOR", "RedlockBackend"]

log = logging.getLogger(__name__)

#: Constant part of the clock drift allowance, ms.
DRIFT_MS = 2.0
#: How long a read waits, once a majority answered, for the other nodes (seconds).
GRACE = 0.005
#: Upper bound of the random pause after a split vote, and of the jitter added to
#: ``Busy.retry_after``, seconds.
JITTER = 0.02


class RedlockBackend(Fanout, Backend):
    """Locks held by a majority of independent Redis masters (the Redlock algorithm).

    Build it with ``aiolock.connect("redlock://h1:6379,h2:6379,h3:6379")`` or from
    :class:`RedisBackend` nodes you made yourself: ``RedlockBackend([node, ...])``
    (they are closed with this backend).
    """

    schemes: ClassVar[tuple[str, ...]] = ("redlock",)
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.EVENTS, Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS,
         Capability.SCAN, Capability.REVOKE, Capability.ELECTION}
    )
    ordered = False  # one connection per node: no order across them

    def __init__(
        self, nodes: Sequence[RedisBackend], *, drift_factor: float = DEFAULT_DRIFT_FACTOR,
        url: str | None = None,
    ) -> None:
        if len(nodes) < 3:
            raise ValueError(
                f"Redlock needs at least 3 independent Redis nodes (an odd count), got {len(nodes)}"
            )
        if (isinstance(drift_factor, bool) or not isinstance(drift_factor, (int, float))
                or not 0 <= drift_factor < 0.5):
            raise ValueError(f"drift_factor must be a number in [0, 0.5), got {drift_factor!r}")
        self._nodes = list(nodes)
        for node in self._nodes:
            node.handoffs = False  # a majority grants, never one node's release (see there)
        self.drift_factor = float(drift_factor)
        #: how many nodes make a majority
        self.quorum = len(self._nodes) // 2 + 1
        self._url = url or "redlock://" + ",".join(n.url.partition("://")[2] for n in self._nodes)
        self._background: set[asyncio.Future[Any]] = set()
        self._down: set[int] = set()  # nodes whose last request failed to reach them
        #: nodes still connecting and loading the scripts when ``connect()`` had a
        #: majority: requests to one wait for it (a request sent first would find no
        #: script, load it and retry, and one sent after it -- the RAISE that labels a late
        #: grant with its token -- could run before it)
        self._preparing: dict[int, asyncio.Future[None]] = {}

    @classmethod
    def from_url(
        cls, url: str, *, drift_factor: float | None = None, connect_timeout: float | None = None,
        request_timeout: float | None = None, prefix: str | None = None, **node_options: Any,
    ) -> RedlockBackend:
        """``redlock://[user:password@]host:port,host:port,host:port[/db]``.

        At least 3 distinct ``host:port`` pairs (port defaults to 6379; IPv6 as
        ``[::1]:6379``); user, password and db apply to every node. Options, as keywords
        or in the query string (keywords win): ``drift_factor`` (default 0.01),
        ``connect_timeout`` and ``request_timeout`` (s, default 5), ``prefix`` (key
        prefix, default ``"aiolock"``). Every other option is one of ``redis://``
        (TLS files, client name, credential provider...: see
        :class:`~aiolock.backends.redis.RedisBackend`) and applies to every node; ``ssl=true``
        makes every node ``rediss://``.
        """
        nodes, factor, safe = parse_url(
            url, drift_factor=drift_factor, connect_timeout=connect_timeout,
            request_timeout=request_timeout, prefix=prefix, **node_options,
        )
        return cls(nodes, drift_factor=factor, url=safe)

    @property
    def url(self) -> str:
        return self._url

    @property
    def nodes(self) -> list[RedisBackend]:
        """The Redis nodes, in URL order."""
        return list(self._nodes)

    def drift_ms(self, ttl_ms: float) -> float:
        """The clock drift allowance for a lease of ``ttl_ms``: ``ttl * factor + 2 ms``."""
        return ttl_ms * self.drift_factor + DRIFT_MS

    # -- primitives -------------------------------------------------------------------------

    async def connect(self) -> None:
        prepared = [asyncio.ensure_future(one.prepare(node)) for node in self._nodes]
        replies = await self._ask(lambda node: prepared[self._nodes.index(node)],
                                  lambda r: len(r.ok) >= self.quorum)
        self._preparing = {i: fut for i, fut in enumerate(prepared) if not fut.done()}
        if len(replies.ok) < self.quorum:  # (the error names every node's failure)
            raise self._failure("connecting", replies)
        for i, exc in replies.errors.items():  # connected without them: say so
            log.warning("redlock: node %s is unreachable (%s)", self._nodes[i].url, exc)

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        _check_kind(claim.kind)
        n, q = len(self._nodes), self.quorum

        def decided(r: Replies[Granted | Busy]) -> bool:
            granted = sum(isinstance(v, Granted) for v in r.ok.values())
            return granted >= q or granted + len(r.pending) < q

        start = time.monotonic()
        replies = await self._ask(lambda node: one.acquire(node, claim), decided)
        grants = {i: v for i, v in replies.ok.items() if isinstance(v, Granted)}
        if len(grants) >= q:
            granted = await self._settle(claim, grants, replies, start)
            if granted is not None:
                return granted
        # Not granted: give back what we got (also on nodes still answering: their
        # release queues behind the acquire), so no partial grant lingers.
        if grants or replies.pending:
            await self._ask(
                lambda node: one.release(node, claim, "d"), lambda r: not (set(grants) & r.pending)
            )
        if n - len(replies.errors) < q:
            raise self._failure("acquire", replies)
        busy = sorted(v.retry_after for v in replies.ok.values() if isinstance(v, Busy))
        if grants and busy and len(grants) < q:
            await asyncio.sleep(random.uniform(0, JITTER))  # split vote: desynchronise
        need = q - len(grants)  # nodes now held by others that must free up
        if need <= 0 or not busy:
            return Busy(random.uniform(0.001, JITTER))
        return Busy(busy[min(need, len(busy)) - 1] + random.uniform(0, JITTER))

    async def _settle(
        self, claim: Claim, grants: dict[int, Granted], replies: Replies[Granted | Busy],
        start: float,
    ) -> Granted | None:
        """A majority granted: agree on the token, check the validity; None if too late."""
        q = self.quorum
        token = max(g.token for g in grants.values())
        ttls = sorted((g.ttl_ms for g in grants.values()), reverse=True)
        ttl_ms = ttls[q - 1] - self.drift_ms(claim.ttl_ms)
        if any(g.token != token for g in grants.values()):
            # The counters differ: raise a majority of the nodes we hold to the token,
            # so the next grant anywhere (a majority, hence one of these) is above it.
            raised = await self._ask(
                lambda node: one.raise_token(node, claim, token),
                lambda r: sum(r.ok.values()) >= q or sum(r.ok.values()) + len(r.pending) < q,
                only=list(grants),
            )
            if sum(raised.ok.values()) < q:
                log.info("redlock: could not raise the token counters of %r on a majority", claim.name)
                return None
            synced = {i for i, ok in raised.ok.items() if ok}
        else:
            synced = set(grants)
        # Best effort, in the background: raise the other reachable nodes too (more
        # margin against a node that loses its counter) and label late grants.
        for i in range(len(self._nodes)):
            if i not in synced and i not in replies.errors:
                # once its acquire, if still running, answered: RAISE before it would lift
                # the counter that the acquire then increments past the token, and find no
                # grant to label
                self._spawn(self._after(replies.running.get(i),
                                        lambda node: one.raise_token(node, claim, token), self._nodes[i]))
        elapsed_ms = (time.monotonic() - start) * 1000
        if ttl_ms - elapsed_ms <= 0:
            log.info("redlock: acquiring %r took %.0f ms, beyond its validity", claim.name, elapsed_ms)
            return None
        claim.state["token"] = token
        claim.state.pop("released", None)
        return Granted(token, math.floor(ttl_ms))

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        n, q = len(self._nodes), self.quorum

        def counts(r: Replies[list[int]], k: int) -> tuple[int, int]:
            yes = sum(1 for v in r.ok.values() if v[k] > 0)
            return yes, len(r.ok) - yes  # "no": not held there, or revoked

        def decided(r: Replies[list[int]]) -> bool:
            for k in range(len(claims)):
                yes, no = counts(r, k)
                # neither renewed nor gone yet: wait for the nodes still answering (one
                # down, one "gone", one pending is "gone" or unknown: not the same thing)
                if yes < q and no <= n - q and r.pending:
                    return False
            return True

        start = time.monotonic()
        replies = await self._ask(lambda node: one.renew(node, list(claims)), decided)
        elapsed_ms = (time.monotonic() - start) * 1000
        out: list[int | None] = []
        unknown = False
        for k, claim in enumerate(claims):
            yes, no = counts(replies, k)
            if yes >= q:
                confirmed = sorted((max(v[k], 0) for v in replies.ok.values()), reverse=True)
                ms = math.floor(confirmed[q - 1] - self.drift_ms(claim.ttl_ms))
                if ms > elapsed_ms:
                    out.append(ms)
                    self._repair(claim, [i for i, v in replies.ok.items() if v[k] == 0])
                else:
                    out.append(None)  # confirmed too late: the validity is over
            elif no > n - q:  # gone from a majority: revoked if any node says so
                out.append(REVOKED if any(v[k] < 0 for v in replies.ok.values()) else None)
            else:
                out.append(None)
                unknown = True
        if unknown:
            raise self._failure("renewing", replies)
        # a node that answers after the majority decided and lost a lease renewed here:
        # put it back too (else a node always slower than the others never is)
        renewed = {k for k, ms in enumerate(out) if ms is not None and ms > 0}
        for i, fut in replies.running.items():
            fut.add_done_callback(functools.partial(self._repair_late, renewed, claims, i))
        return out

    def _repair_late(self, renewed: set[int], claims: Sequence[Claim], i: int,
                     fut: asyncio.Future[list[int]]) -> None:
        if renewed and not fut.cancelled() and fut.exception() is None:
            for k, ms in enumerate(fut.result()):
                if ms == 0 and k in renewed:
                    self._repair(claims[k], [i])

    def _repair(self, claim: Claim, nodes: list[int]) -> None:
        """Put a lease a majority holds back on ``nodes``, which lost it, in the background."""
        token = claim.state.get("token")
        if not nodes or not isinstance(token, int) or claim.state.get("released"):
            return
        for i in nodes:
            log.info("redlock: restoring the lease on %r at %s", claim.name, self._nodes[i].url)
            self._spawn(one.repair(self._nodes[i], claim, token))

    async def release(self, claim: Claim) -> bool:
        claim.state["released"] = True  # no repair may put it back from now on
        replies = await self._ask(lambda node: one.release(node, claim), self._yes_or_no)
        return self._majority_said("release", replies)

    def _yes_or_no(self, replies: Replies[bool]) -> bool:
        """Decided: a majority said yes, or so many said no that it cannot."""
        yes = sum(replies.ok.values())
        return yes >= self.quorum or len(replies.ok) - yes > len(self._nodes) - self.quorum

    def _majority_said(self, what: str, replies: Replies[bool]) -> bool:
        """True if a majority said yes, False if a majority said no (the claim is gone:
        lost, expired or revoked), else the failure."""
        if sum(replies.ok.values()) >= self.quorum:
            return True
        if self._yes_or_no(replies):
            return False
        raise self._failure(what, replies)

    async def abandon(self, claim: Claim) -> None:
        claim.state["released"] = True
        replies = await self._ask(lambda node: one.release(node, claim, "a"),
                                  lambda r: len(r.ok) >= self.quorum)
        if len(replies.ok) < self.quorum:
            raise self._failure("abandon", replies)

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        # A release is published on every node that held it (a majority): being
        # subscribed on a majority is enough not to miss it; the rest follow. Nodes
        # found down by the last request to them are skipped (each failed subscription
        # would try to connect and log); the next acquire attempt finds them back up.
        up = [i for i in range(len(self._nodes)) if i not in self._down]
        await self._ask(
            lambda node: node.listen(name, kind, waiter), lambda r: len(r.ok) >= self.quorum,
            only=up if len(up) >= self.quorum else None,
        )

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        for node in self._nodes:
            node.unlisten(name, kind, waiter)

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        _check_kind(kind)
        # A grant in progress shows as nodes that disagree: each counts its own token
        # until the acquirer, which alone knows which replies decided, raises them to one
        # (a node granting after the decision is relabelled once its grant is answered).
        # Read again until every node answering agrees, or the time to settle is over.
        info, _ = await settled(lambda: self._inspect_once(name, kind), lambda read: not read[1])
        return info

    async def _inspect_once(self, name: str, kind: Kind) -> tuple[LockInfo, bool]:
        """One read of every node: what a majority says, and whether every node that
        answered says the same (False: a grant may be in progress)."""
        q = self.quorum
        family = kind.family

        def owners(r: Replies[one.NodeView]) -> Counter[str]:
            return Counter(v.owner for v in r.ok.values() if v.owner)

        def agreed(r: Replies[one.NodeView]) -> int:
            """How many nodes agree on the most common (holder, token)."""
            held = Counter((v.owner, v.token) for v in r.ok.values() if v.owner)
            return max(held.values(), default=0)

        def decided(r: Replies[one.NodeView]) -> bool:
            # a majority holds and a majority agrees on its token, or no majority can
            # hold it (a node slow to answer is not waited for)
            top = max(owners(r).values(), default=0)
            return agreed(r) >= q or (len(r.ok) >= q and top + len(r.pending) < q)

        # a node a moment slower than the majority may show a grant in progress: a few ms
        # for it (not the request timeout of one that is down or stopped)
        replies = await self._ask(lambda node: one.inspect(node, name, kind), decided, grace=GRACE)
        if len(replies.ok) < q:
            raise self._failure("inspect", replies)
        last = max((v.last for v in replies.ok.values() if v.last >= 0), default=None)
        top = owners(replies).most_common(1)
        if not top or top[0][1] < q:
            return LockInfo(name, False, last_token=last, family=family), True
        holder = [v for v in replies.ok.values() if v.owner == top[0][0]]
        left = sorted((v.pttl for v in holder), reverse=True)[q - 1]
        # the record most of its nodes keep (a proclaim may not have reached them all)
        info = Counter(v.info for v in holder).most_common(1)[0][0]
        since = max(v.since_ms for v in holder)
        # the token a majority of its nodes keep: the lease's once it is granted
        token, count = Counter(v.token for v in holder).most_common(1)[0]
        if count < q:  # still being raised to one token: the highest is the lease's
            token = max(v.token for v in holder)
        same = all(v.owner == top[0][0] and v.token == token for v in replies.ok.values())
        return LockInfo(
            name, True, holders=1, token=token, last_token=last,
            ttl_left=max(left - self.drift_ms(left), 0) / 1000,
            held_by=(decode_holder(info, since / 1000 if since >= 0 else None),), family=family,
        ), same

    async def set_info(self, claim: Claim) -> bool:
        replies = await self._ask(lambda node: one.set_info(node, claim), self._yes_or_no)
        return self._majority_said("proclaim", replies)

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        """Revoke the holder on every node; True if a node answering had one."""
        _check_kind(kind)

        def decided(r: Replies[bool]) -> bool:
            return len(r.ok) >= self.quorum and (any(r.ok.values()) or not r.pending)

        replies = await self._ask(lambda node: one.revoke(node, name, kind), decided)
        if len(replies.ok) < self.quorum:
            raise self._failure("force_release", replies)
        return any(replies.ok.values())

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """SCAN on every node; a name is listed where a majority holds it (see
        :meth:`inspect`), so a minority's leftover never shows."""

        async def names(node: RedisBackend) -> set[tuple[str, str]]:
            return {found async for found in one.scan(node, prefix)}

        # any majority of nodes meets every name a majority holds: no need to wait for more
        replies = await self._ask(names, lambda r: len(r.ok) >= self.quorum)
        if len(replies.ok) < self.quorum:
            raise self._failure("scan", replies)
        seen = set().union(*replies.ok.values())
        for name, family in sorted((n, f) for f, n in seen if f in _FAMILIES):
            info = await self.inspect(name, FAMILY_KIND[family])
            if info.held:
                yield info

    async def aclose(self) -> None:
        """Let requests still running on slow nodes (the last releases, mostly) finish,
        for at most one request timeout, then close every node."""
        if self._background:
            grace = max(node._request_timeout for node in self._nodes)
            _, late = await asyncio.wait(set(self._background), timeout=grace)
            for fut in late:
                fut.cancel()
        results = await asyncio.gather(*(node.aclose() for node in self._nodes), return_exceptions=True)
        for node, result in zip(self._nodes, results, strict=True):
            if isinstance(result, Exception):
                log.debug("redlock: closing %s failed: %s", node.url, result)


#: The families Redlock offers: plain locks and elections.
_FAMILIES = ("lock", "elect")


def _check_kind(kind: Kind) -> None:
    if kind.family not in _FAMILIES:
        raise LockError(f"the redlock:// backend offers plain locks and elections only, "
                        f"not {kind.value}")
