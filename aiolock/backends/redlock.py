"""``redlock://h1:port,h2:port,h3:port``: Redlock over independent Redis masters.

Each node is a plain :class:`~aiolock.backends.redis.RedisBackend` (same keys, same
scripts); this class asks all of them at once and decides by majority (``n // 2 + 1``
of ``n`` nodes, n >= 3; an odd n is best). See ``docs/redlock.md`` for the full story.

* **Acquire**: ACQUIRE goes to every node at once; the attempt is decided as soon as a
  majority granted (or can no longer grant). It is granted only if a majority granted
  *and* the validity ``ttl - elapsed - drift`` is still positive, where ``elapsed`` runs
  on the monotonic clock from before the requests were sent and ``drift = ttl *
  drift_factor + 2 ms``. The lease then ends, on the core's clock, ``validity`` after
  the attempt finished (``Granted.ttl_ms = ttl - drift``, counted by the core from when
  it sent the attempt). A failed attempt releases its partial grants on every node
  before it returns, and after a split vote waits a random few ms (the one wait in this
  backend, as the Redlock algorithm prescribes) so two contenders woken by each other's
  clean-up do not retry in lockstep.
* **Renew** (the watchdog's batch) goes to every node; a claim is renewed if a majority
  confirmed, for ``ttl - drift`` from when the batch was sent, and gone if a majority
  denied it. A node that lost the lease (restarted empty) while a majority still holds
  it gets it back in the background (REPAIR), restoring the fault tolerance.
* **Release** and **abandon** go to every node; release is True if a majority confirmed
  that this claim held the lock there.
* **Waiting**: waiters subscribe on every node not found down by its last request (at
  least a majority, which a release always reaches); a release on any node wakes
  them, and a missed signal costs at most the holders' remaining lease.

Fencing tokens: every node INCRs its own counter; a grant's token is the highest of the
granting majority, and if those differ, a majority of the nodes where the claim holds
the lock are raised to it (RAISE) before the grant is returned. Since two majorities
intersect, the next grant sees a counter above it: tokens strictly increase in grant
order as long as no node loses its counter (keep AOF on) and Redlock's own timing
assumptions hold. They may repeat if a majority of the nodes lose their counters. See
``docs/redlock.md`` for the exact statement and Kleppmann's critique.

Not offered: ``fair=True``, read-write locks and semaphores. Each node's waiting queue
sees contenders in its own order, so per-node queues do not compose into one fair
order (heads can differ on every node and nobody gets a majority until places lapse);
a semaphore of ``limit`` permits per node admits more than ``limit`` holders with a
majority each (3 nodes, limit 2: three holders with two nodes each).

Errors: every node request is bounded by the connect and request timeouts. A minority
of nodes down (or slow) is tolerated; when a majority cannot answer, operations raise
:class:`aiolock.BackendUnavailable` (:class:`aiolock.AccessDenied` if a node refused the
credentials or a permission, a :class:`aiolock.LockError` if a node refused a script).
``abandon`` applies to every reachable node and raises only if fewer
than a majority confirmed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

from .._validate import format_hosts, parse_hosts
from ..abc import Backend, Busy, Capability, Claim, Granted, Kind, LockInfo, Waiter
from ..errors import AccessDenied, BackendUnavailable, LockError
from ._redis_scripts import INSPECT, Script
from ._redlock_scripts import RAISE, REPAIR
from .redis import RedisBackend

__all__ = ["DEFAULT_DRIFT_FACTOR", "RedlockBackend"]

log = logging.getLogger("aiolock")
T = TypeVar("T")

#: Clock drift allowance as a fraction of the ttl (plus :data:`DRIFT_MS`).
DEFAULT_DRIFT_FACTOR = 0.01
#: Constant part of the clock drift allowance, ms.
DRIFT_MS = 2.0
#: Upper bound of the random pause after a split vote, and of the jitter added to
#: ``Busy.retry_after``, seconds.
JITTER = 0.02


@dataclass(slots=True)
class _Replies(Generic[T]):
    """What the nodes answered so far, by node index."""

    ok: dict[int, T] = field(default_factory=dict)
    errors: dict[int, Exception] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)


class RedlockBackend(Backend):
    """Locks held by a majority of independent Redis masters (the Redlock algorithm).

    Build it with ``aiolock.connect("redlock://h1:6379,h2:6379,h3:6379")`` or from
    :class:`RedisBackend` nodes you made yourself: ``RedlockBackend([node, ...])``
    (they are closed with this backend).
    """

    schemes: ClassVar[tuple[str, ...]] = ("redlock",)
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.EVENTS, Capability.EXPIRY, Capability.DISTRIBUTED}
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
        parts = urlsplit(url)
        if parts.scheme != "redlock":
            raise ValueError(f"expected redlock://host:port,host:port,host:port, got {url!r}")
        own = ("drift_factor", "connect_timeout", "request_timeout", "prefix")
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        query: dict[str, str] = {k: v for k, v in pairs if k in own}
        # any other query option is a node's (RedisBackend checks it, and names it if bad)
        node_query = urlencode([(k, v) for k, v in pairs if k not in own and k != "ssl"])
        tls = node_options.pop("ssl", None)
        if tls is None:
            tls = dict(pairs).get("ssl", "false").lower() in ("1", "true", "yes", "on")

        def number(key: str, given: float | None, default: float) -> float:
            if given is not None:
                return given
            if key not in query:
                return default
            try:
                return float(query[key])
            except ValueError:
                raise ValueError(f"{key} in {url!r} must be a number, got {query[key]!r}") from None

        userinfo, _, hostlist = parts.netloc.rpartition("@")
        accepted = "redlock://host:port,host:port,host:port (at least 3 distinct nodes)"
        hosts = parse_hosts(url, hostlist, 6379, accepted)
        if len(hosts) < 3:
            raise ValueError(f"Redlock needs at least 3 nodes, got {len(hosts)} in {url!r}; "
                             f"expected {accepted}")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"the database in {url!r} must be a number, got {db!r}")
        options: dict[str, Any] = dict(
            connect_timeout=number("connect_timeout", connect_timeout, 5.0),
            request_timeout=number("request_timeout", request_timeout, 5.0),
            prefix=prefix if prefix is not None else query.get("prefix", "aiolock"),
        )
        auth = userinfo + "@" if userinfo else ""
        where = format_hosts(hosts)
        scheme = "rediss" if tls else "redis"
        tail = f"?{node_query}" if node_query else ""
        nodes = [RedisBackend.from_url(f"{scheme}://{auth}{node}/{db or 0}{tail}",
                                       **options, **node_options) for node in where]
        safe = "redlock://" + ",".join(where) + (f"/{db}" if db else "")
        return cls(nodes, drift_factor=number("drift_factor", drift_factor, DEFAULT_DRIFT_FACTOR),
                   url=safe)

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

    # -- asking every node ------------------------------------------------------------------

    async def _ask(
        self, call: Callable[[RedisBackend], Awaitable[T]],
        decided: Callable[[_Replies[T]], bool] | None = None, only: Sequence[int] | None = None,
    ) -> _Replies[T]:
        """Run ``call`` on every node (or those in ``only``) at once; return when all have
        answered or ``decided`` says the outcome is known. Requests still running then go
        on in the background (each node's requests keep their order on its connection)."""
        indexes = range(len(self._nodes)) if only is None else only
        tasks = {asyncio.ensure_future(call(self._nodes[i])): i for i in indexes}
        replies: _Replies[T] = _Replies(pending=set(tasks.values()))
        waiting = set(tasks)
        try:
            while waiting:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = tasks[task]
                    replies.pending.discard(i)
                    exc = BackendUnavailable("request cancelled") if task.cancelled() else task.exception()
                    if exc is None:
                        replies.ok[i] = task.result()
                        self._down.discard(i)
                    elif isinstance(exc, Exception):
                        replies.errors[i] = exc
                        if isinstance(exc, BackendUnavailable):
                            self._down.add(i)
                    else:
                        raise exc
                if decided is not None and decided(replies):
                    break
        finally:
            for task in waiting:
                self._keep(task)
        return replies

    def _keep(self, fut: asyncio.Future[Any]) -> None:
        self._background.add(fut)
        fut.add_done_callback(self._forget)

    def _forget(self, fut: asyncio.Future[Any]) -> None:
        self._background.discard(fut)
        if not fut.cancelled() and fut.exception() is not None:
            log.debug("redlock: background node request failed: %s", fut.exception())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._keep(asyncio.ensure_future(coro))

    def _failure(self, what: str, replies: _Replies[Any]) -> LockError:
        """The error for an operation that a majority could not answer."""
        n = len(self._nodes)
        detail = "; ".join(str(exc) for _, exc in sorted(replies.errors.items()))
        if replies.pending:
            detail += ("; " if detail else "") + f"{len(replies.pending)} still pending"
        message = (f"Redlock {self._url}: {what} needs {self.quorum} of {n} Redis nodes, "
                   f"only {len(replies.ok)} succeeded ({detail})")
        if any(isinstance(e, AccessDenied) for e in replies.errors.values()):
            return AccessDenied(message)  # credentials or ACL: retrying does not help
        refused = [e for e in replies.errors.values() if not isinstance(e, BackendUnavailable)]
        return LockError(message) if refused else BackendUnavailable(message)

    async def _script(self, node: RedisBackend, script: Script, claim: Claim, *args: Any) -> bool:
        keys = node._keys(claim.name, claim.owner)
        return int(await node._run(script, [keys[0], keys[1], keys[4]], claim.owner, *args)) == 1

    # -- primitives -------------------------------------------------------------------------

    async def connect(self) -> None:
        replies = await self._ask(lambda node: node.connect(), lambda r: len(r.ok) >= self.quorum)
        for i, exc in replies.errors.items():
            log.warning("redlock: node %s is unreachable (%s)", self._nodes[i].url, exc)
        if len(replies.ok) < self.quorum:
            raise self._failure("connecting", replies)

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        _check_kind(claim.kind)
        n, q = len(self._nodes), self.quorum

        def decided(r: _Replies[Granted | Busy]) -> bool:
            granted = sum(isinstance(v, Granted) for v in r.ok.values())
            return granted >= q or granted + len(r.pending) < q

        start = time.monotonic()
        replies = await self._ask(lambda node: node.try_acquire(claim), decided)
        grants = {i: v for i, v in replies.ok.items() if isinstance(v, Granted)}
        if len(grants) >= q:
            granted = await self._settle(claim, grants, replies, start)
            if granted is not None:
                return granted
        # Not granted: give back what we got (also on nodes still answering: their
        # release queues behind the acquire), so no partial grant lingers.
        if grants or replies.pending:
            await self._ask(
                lambda node: node.release(claim), lambda r: not (set(grants) & r.pending)
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
        self, claim: Claim, grants: dict[int, Granted], replies: _Replies[Granted | Busy],
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
                lambda node: self._script(node, RAISE, claim, token),
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
                self._spawn(self._script(self._nodes[i], RAISE, claim, token))
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

        def counts(r: _Replies[list[int | None]], k: int) -> tuple[int, int]:
            yes = sum(1 for v in r.ok.values() if v[k])
            return yes, len(r.ok) - yes

        def decided(r: _Replies[list[int | None]]) -> bool:
            for k in range(len(claims)):
                yes, no = counts(r, k)
                if yes < q and no <= n - q and yes + len(r.pending) >= q:
                    return False
            return True

        start = time.monotonic()
        replies = await self._ask(lambda node: node.renew(claims), decided)
        elapsed_ms = (time.monotonic() - start) * 1000
        out: list[int | None] = []
        unknown = False
        for k, claim in enumerate(claims):
            yes, no = counts(replies, k)
            if yes >= q:
                confirmed = sorted((v[k] or 0 for v in replies.ok.values()), reverse=True)
                ms = math.floor(confirmed[q - 1] - self.drift_ms(claim.ttl_ms))
                if ms > elapsed_ms:
                    out.append(ms)
                    self._repair(claim, [i for i, v in replies.ok.items() if not v[k]])
                else:
                    out.append(None)  # confirmed too late: the validity is over
            elif no > n - q:
                out.append(None)
            else:
                out.append(None)
                unknown = True
        if unknown:
            raise self._failure("renewing", replies)
        return out

    def _repair(self, claim: Claim, nodes: list[int]) -> None:
        """Put a lease a majority holds back on ``nodes``, which lost it, in the background."""
        token = claim.state.get("token")
        if not nodes or token is None or claim.state.get("released"):
            return
        for i in nodes:
            log.info("redlock: restoring the lease on %r at %s", claim.name, self._nodes[i].url)
            self._spawn(self._script(self._nodes[i], REPAIR, claim, token, claim.ttl_ms))

    async def release(self, claim: Claim) -> bool:
        claim.state["released"] = True  # no repair may put it back from now on
        replies = await self._ask(
            lambda node: node.release(claim), lambda r: sum(r.ok.values()) >= self.quorum
        )
        held = sum(replies.ok.values())
        if held >= self.quorum:
            return True
        if len(replies.ok) - held > len(self._nodes) - self.quorum:
            return False  # a majority says it did not hold it: it was lost
        raise self._failure("release", replies)

    async def abandon(self, claim: Claim) -> None:
        claim.state["released"] = True
        replies = await self._ask(lambda node: node.abandon(claim), lambda r: len(r.ok) >= self.quorum)
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
        q = self.quorum

        def owners(r: _Replies[list[Any]]) -> Counter[str]:
            return Counter(o for o in (_text(v[0]) for v in r.ok.values()) if o)

        def decided(r: _Replies[list[Any]]) -> bool:
            top = max(owners(r).values(), default=0)
            return top >= q or (len(r.ok) >= q and top + len(r.pending) < q)

        replies = await self._ask(lambda node: node._run(INSPECT, node._keys(name, "-")), decided)
        if len(replies.ok) < q:
            raise self._failure("inspect", replies)
        lasts = [int(v[3]) for v in replies.ok.values() if int(v[3]) >= 0]
        last = max(lasts) if lasts else None
        top = owners(replies).most_common(1)
        if not top or top[0][1] < q:
            return LockInfo(name, False, last_token=last)
        holder = [v for v in replies.ok.values() if _text(v[0]) == top[0][0]]
        left = sorted((int(v[2]) for v in holder), reverse=True)[q - 1]
        return LockInfo(
            name, True, holders=1, token=max(int(v[1]) for v in holder), last_token=last,
            ttl_left=max(left - self.drift_ms(left), 0) / 1000,
        )

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


def _check_kind(kind: Kind) -> None:
    if kind is not Kind.LOCK:
        raise LockError(f"the redlock:// backend offers plain locks only, not {kind.value}")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
