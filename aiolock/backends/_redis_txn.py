"""Redis without scripting: ``lock()`` and ``election()`` as ``WATCH``/``MULTI``/``EXEC`` transactions.

``redis://...?scripting=off`` builds :class:`RedisTxnBackend`; ``scripting=auto`` (the
default) builds :class:`AutoRedisBackend`, which becomes a plain
:class:`~aiolock.backends.redis.RedisBackend` at ``connect()`` (or its first request) if
the server loads the Lua scripts, and a :class:`RedisTxnBackend` if it refuses them
(``NOPERM``: an ACL user without ``@scripting``; ``unknown command``: scripting renamed
away); ``scripting=on`` never falls back.

The keys are the Lua path's (see :mod:`aiolock.backends._redis_scripts`), so a lock held
through one path is held for the other: the lock hash ``<prefix>:lock:{<name>}`` (an
election's: ``<prefix>:elect:{<name>}``, the same transactions on its own keys; fields
``owner``, ``token``, ``info``, ``since``; expires with the lease), the token counter
``...:seq`` (never expires), and the waiting queue ``...:q`` (entries
``<owner>|<registration>``) with the waiter keys ``...:x:<owner>``, which the waiters of
both paths share. Each primitive is one transaction on a connection of its own for its
round trips (see :mod:`aiolock.backends._redis_lend`; every option of the URL applies to
it), renewals and releases in slots of their own (:data:`URGENT`):

* acquire: ``WATCH`` the lock hash, the counter and the claim's waiter key, read them,
  ``TIME`` and (a claim that will wait) its place in the queue (``LPOS`` of its entry)
  (one round trip: all if the lock is held by another and the claim does not wait); if
  the lock is free, ``MULTI``, ``INCR`` the counter, ``HSET`` owner, holder record and
  the token (the counter's value + 1: it is watched, so that is what ``INCR`` returns),
  ``PEXPIRE``, (registered) ``LREM`` its entry and ``DEL`` its waiter key, ``EXEC`` (a
  second; an election's grant also publishes ``|`` on its channel, for its observers).
  The claim already the owner (a release handed it the lock) is granted with the lease
  left. Held by another, a claim that will wait registers as the Lua ``ACQUIRE`` does
  (``MULTI``: ``SET`` its waiter key to its registration ``<lease ttl ms>|<inbox
  length>|<inbox><holder record>`` for a waiter ttl of its lease ttl, ``RPUSH`` its
  entry unless the queue has it, ``PEXPIRE`` the queue, ``EXEC``) and is told to come
  back when the holder's lease ends (the first waiter) or within a third of its waiter
  ttl (each time it comes back it refreshes its registration). Its waiter listens on
  this process's inbox, where a release of either path hands it the lock (the message
  wakes it; it asks, and finds itself the owner), and on the lock's channel. An aborted
  ``EXEC`` (another client changed a watched key) is retried up to
  :data:`MAX_CONFLICTS` times, then answered :class:`~aiolock.abc.Busy`: the core's
  waiting retries; a registration aborted because the lock changed hands is made again
  watching only the waiter key (:meth:`RedisTxnBackend._tx_register_held`), so a waiter
  is queued even while a busy process takes the lock over and over;
* renew: ``WATCH`` every claim's hash, read their owners, ``PEXPIRE`` those still held in
  one ``MULTI``/``EXEC``; a claim no longer held whose waiter key carries the revocation
  mark ``v`` (``force_release`` on either path) is answered :data:`~aiolock.abc.REVOKED`;
* release: ``WATCH`` the hash, the counter and the queue; if this owner holds it, hand it
  to the first live registered waiter, of either path (as the Lua ``RELEASE`` does: new
  token, message on that waiter's inbox, its waiter key deleted; an election also
  publishes ``|`` on its channel; live: its waiter key has not lapsed and ``PUBSUB
  NUMSUB`` finds its inbox heard, asked before ``MULTI``; never the releaser itself; the
  queue is read page by page to its end), else ``DEL`` it and publish ``<owner>|`` on
  the lock's channel, where unregistered waiters of this path (and the Lua path's
  non-registering listeners, an election's observers) listen. No local hand-offs: every
  release goes through the server;
* abandon (a waiter that stops waiting: timeout, cancellation, an error): the Lua
  path's tombstone on the claim's waiter key first (an acquire in flight watches that
  key: it can neither grant nor register after; a release choosing it watches it too,
  and a Lua ``RELEASE`` skips an entry whose key is not a registration), then ``LREM``
  its queue entry, then a release (a hand-over that reached it while it gave up is
  passed on to the next waiter). If the abandon fails, the claim is kept as an orphan
  (see :class:`~aiolock.backends._redis_pubsub.Signals`): a hand-over to it still
  reaches this process, which abandons it again; a registration nobody abandons lapses
  with its waiter key (one lease ttl), and a release skips it at once if its process is
  gone (nobody hears its inbox);
* inspect, scan, force_release and set_info (an elected leader's ``proclaim``): see
  :mod:`aiolock.backends._redis_txn_ops`.

Trade-offs against the Lua path (docs/backends/redis-noscripting.md has figures): two
round trips per uncontended acquisition instead of one; a hand-over message is not
taken as the grant (the waiter asks: one round trip more); not fair in the sense of
``fair=True`` (a claim may take a free lock while others wait, as a non-fair Lua claim
may), but a waiter keeps its place in the queue, so a release by either path hands the
lock to the first live registered waiter of either path, and a Lua process's local
hand-offs (issue 10) are bounded while it waits. An ACL user that may not run ``LPOS``,
``RPUSH`` or ``LREM`` (the least-privilege line from before) waits unregistered, woken by
a release's message on the lock's channel (one INFO line says so). No read-write locks or
semaphores (the capabilities say so). Holder records are kept: the lock hash's ``info``
and ``since`` (server ms of the grant, from ``TIME``) fields, as the Lua path keeps them
(it may also leave ``gttl``, the lease's ms at a grant, which ``inspect`` reads too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from redis import exceptions as rexc

from ..abc import REVOKED, Busy, Capability, Claim, Granted, Kind, LockInfo, Waiter
from ..errors import BackendUnavailable, LockError
from . import _redis_txn_ops
from ._redis_errors import CONNECTING, error_code, redis_error
from ._redis_lend import ABORTED, Connections, Lent
from ._redis_txn_ops import HELD_IN_HASH
from ._redis_txn_ops import ms as _ms
from ._redis_txn_ops import text as _text
from ._resp import RespClient, ResponseError
from .redis import TOMBSTONE_MS, RedisBackend, warn_foreign_key

__all__ = ["MAX_CONFLICTS", "AutoRedisBackend", "RedisTxnBackend", "scripting_class"]

log = logging.getLogger("aiolock")

#: Aborted ``EXEC`` in a row before an acquire answers Busy (a renewal or release raises).
MAX_CONFLICTS = 5
#: Seconds to wait (at most, jittered) before trying again after MAX_CONFLICTS aborts.
CONFLICT_PAUSE = 0.005
#: Queue entries a release reads at a time to find a live registered waiter.
QUEUE_LOOK = 8
#: The least expiry of the queue a waiter registers in (the Lua WAITER's ``queue_ttl``:
#: the larger of this and 24 waiter ttls).
QUEUE_TTL_MS = 600_000
#: Transactions at once for renewals, releases and abandons: they never queue behind
#: acquisitions (at most MAX_IN_FLIGHT at once), which a burst of thousands would make
#: wait past the leases' expiry.
URGENT = 16

_ERRORS: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, OSError,
                                            rexc.RedisError, ResponseError)
#: An error reply, raised by Lent.run (aiolock's own connections, or redis-py's).
_REPLY_ERRORS: tuple[type[BaseException], ...] = (ResponseError, rexc.ResponseError)
#: A waiter's registration (its waiter key's value, on either path): ``<lease ttl ms>|<inbox length>|
#: <inbox><holder record>``, or (aiolock before holder records) ``<lease ttl ms>|<inbox>``.
_REGISTRATION = re.compile(r"^(\d+)\|(\d+)\|(.*)$", re.DOTALL)
_REGISTRATION_V1 = re.compile(r"^(\d+)\|(.+)$", re.DOTALL)


class RedisTxnBackend(RedisBackend):
    """Plain locks on one Redis server without Lua: ``WATCH``/``MULTI``/``EXEC``.

    ``aiolock.connect("redis://host:port/db?scripting=off")``, or automatically where the
    server refuses scripts (see the module doc). ``lock()`` and ``election()`` (with
    holders, ``scan`` and ``force_release``); waiters registered in the server's queue
    (no ``fair=True``); no read-write locks or semaphores.
    """

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.EVENTS, Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS,
         Capability.SCAN, Capability.REVOKE, Capability.ELECTION}
    )
    # waiters register on the server and listen on the inbox (and the lock's channel);
    # no local hand-offs: a release always goes through the server (see release). False
    # (set on an instance): waiters neither register nor listen on the inbox
    handoffs = True
    # plain locks and candidates keep a place in the queue that inspect() counts
    waiting_counted: ClassVar[frozenset[Kind]] = HELD_IN_HASH
    #: aborted ``EXEC`` (conflicts with another client) since this backend was made
    conflicts: int = 0

    def __init__(self, client: Any, **options: Any) -> None:
        lean = options.get("resp")
        options["resp"] = None  # one pipelined connection cannot carry WATCH transactions
        super().__init__(client, **options)
        self._as_transactions(lean)

    def _as_transactions(self, lean: RespClient | None) -> None:
        """Transactions from now on (also after a fallback), each on a connection of its
        own: like ``lean`` (its settings, not itself) if given, else of the client's pool."""
        self.ordered = False
        self._resp = None
        self._call = self._limited_call
        self._urgent = asyncio.Semaphore(URGENT)
        self._connections = Connections(self._client, lean)
        self._probed = False
        self._numsub = True  # PUBSUB NUMSUB allowed (until refused: see _subscribed)
        self._register = True  # waiters register (unless refused: see _probe, _no_register)

    async def aclose(self) -> None:
        await self._connections.aclose()
        await super().aclose()

    async def connect(self) -> None:
        try:
            async with asyncio.timeout(self._connect_timeout):
                await self._call("PING")
        except _ERRORS as exc:
            raise redis_error(exc, self._url, CONNECTING) from exc
        await self._probe()

    async def _probe(self) -> None:
        """An empty transaction, once, before the first acquire: a user who may not run
        ``MULTI``/``EXEC`` gets AccessDenied here, before any transaction of a lock (the
        commands after a refused ``MULTI`` would run unguarded); so does one who may not
        run ``MGET`` or ``UNWATCH``, which only a renewal that finds a lease gone (a
        revocation) or a busy acquire would use, too late to say so clearly."""
        base = self._base("-")
        async with self._tx_lent("WATCH/MULTI/EXEC", urgent=True) as conn:
            await conn.run(("WATCH", base), ("MGET", base), ("UNWATCH",),
                           ("WATCH", base), ("MULTI",), ("EXEC",))
            if self._register:
                try:  # a waiter's registration reads its place with LPOS (Redis 6.0.6+)
                    await conn.run(("LPOS", base + ":q", "-"))
                except _REPLY_ERRORS as exc:
                    if error_code(exc) != "NOPERM" and "unknown command" not in str(exc).lower():
                        raise
                    self._no_register(exc)
        self._probed = True

    @contextlib.asynccontextmanager
    async def _tx_lent(self, what: str, urgent: bool = False) -> AsyncIterator[Lent]:
        task = asyncio.current_task()
        asked = task.cancelling() if task is not None else 0
        async with self._urgent if urgent else self._in_flight:
            try:
                async with Lent(self._connections) as conn:
                    yield conn
            except _ERRORS as exc:
                raise redis_error(exc, self._url, what) from exc
        if task is not None and task.cancelling() > asked:
            raise asyncio.CancelledError  # swallowed by a write on Python 3.11 (gh-86296)

    # -- acquire --------------------------------------------------------------------------

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        if claim.kind not in HELD_IN_HASH:
            raise LockError(f"{claim.kind.value} claims need Lua scripts ({self._url} runs "
                            "without them: lock() and election() only)")
        if not self._probed:
            await self._probe()
        state = claim.state
        if state:
            state.pop("grant", None)  # a hand-over message: the transaction below sees it
        waits = claim.waits and self._register and self.handoffs
        claims = self.signals.claims
        if waits:  # before sending: a hand-over may come before the reply
            claims[claim.owner] = claim
            self.signals.hear(self.inbox)
        try:
            result = await self._try_acquire_tx(claim, waits)
        except BaseException:
            claims.pop(claim.owner, None)
            raise
        if isinstance(result, Granted):
            claims.pop(claim.owner, None)
        return result

    async def _try_acquire_tx(self, claim: Claim, waits: bool) -> Granted | Busy:
        """The acquire transaction (see the module doc); ``waits``: register when busy."""
        base = self._base(claim.name, claim.kind)
        announce = (("PUBLISH", base, "|"),) if claim.kind is Kind.LEADER else ()
        seq, mine, queue = base + ":seq", base + ":x:" + claim.owner, base + ":q"
        value = self._registration_of(claim)
        entry = f"{claim.owner}|{value}"
        lpos = (("LPOS", queue, entry),) if waits else ()
        async with self._tx_lent("WATCH/MULTI/EXEC acquire") as conn:
            for _ in range(MAX_CONFLICTS):
                _, (owner, token), pttl, last, mark, now, *at = await conn.run(
                    ("WATCH", base, seq, mine), ("HMGET", base, "owner", "token"),
                    ("PTTL", base), ("GET", seq), ("GET", mine), ("TIME",), *lpos,
                )
                mine_now = await _ours_already(conn, claim, owner, token, pttl, mark)
                if mine_now is not None:
                    return mine_now
                x = None if mark is None else _text(mark)
                place = at[0] if at and at[0] is not None else None  # in the queue (0: first)
                queued = place is not None
                if owner is not None:
                    if not waits:
                        await conn.unwatch()
                        return Busy(max(int(pttl), 1) / 1000)
                    busy: Granted | Busy | None
                    try:
                        busy = await self._tx_register(conn, claim, mine, queue, value,
                                                       entry, place, int(pttl))
                    except _REPLY_ERRORS as exc:  # refused inside MULTI: not registered
                        if error_code(exc) != "NOPERM":
                            raise
                        self._no_register(exc)
                        return Busy(CONFLICT_PAUSE)  # (the connection is closed after)
                    if busy is None:  # the lock changed hands meanwhile: register anyway
                        self.conflicts += 1
                        busy = await self._tx_register_held(conn, claim, base, mine, queue,
                                                            value, entry)
                    if busy is not None:
                        return busy
                    continue  # the lock looked free, or the claim's key changed: again
                token = int(last or 0) + 1
                # registered (or an entry left): leave the queue as it takes the lock
                leave = (*((("LREM", queue, 1, entry),) if queued or x is not None else ()),
                         *((("DEL", mine),) if x is not None else ()))
                *_, done = await conn.run(
                    ("MULTI",), ("INCR", seq),
                    ("HSET", base, "owner", claim.owner, "token", token, "info", claim.info,
                     "since", _ms(now)),
                    ("PEXPIRE", base, claim.ttl_ms), *leave, *announce, ("EXEC",),
                )
                if done is not ABORTED:
                    if int(done[0]) != token:
                        raise LockError(f"token counter of {claim.name!r} moved under WATCH")
                    return Granted(token, claim.ttl_ms)
                self.conflicts += 1
        return Busy(random.uniform(CONFLICT_PAUSE / 5, CONFLICT_PAUSE))

    async def _tx_register(
        self, conn: Lent, claim: Claim, mine: str, queue: str, value: str, entry: str,
        place: int | None, pttl: int,
    ) -> Busy | None:
        """Register (or refresh) ``claim`` as a waiter of the busy lock, as the Lua
        ACQUIRE does: its waiter key (for a waiter ttl of the claim's lease ttl), its
        entry at the end of the queue unless already there, the queue's expiry. Busy with
        the Lua path's retry time (the first waiter: when the holder's lease ends; every
        waiter within a third of its waiter ttl, to refresh); None if the EXEC aborted."""
        wttl = claim.ttl_ms
        push = () if place is not None else (("RPUSH", queue, entry),)
        *_, done = await conn.run(
            ("MULTI",), ("SET", mine, value, "PX", wttl), *push,
            ("PEXPIRE", queue, max(24 * wttl, QUEUE_TTL_MS)), ("EXEC",),
        )
        if done is ABORTED:
            return None
        first = int(done[1]) == 1 if push else int(place or 0) == 0
        refresh = wttl // 3
        retry = min(pttl, refresh) if first else refresh
        return Busy(max(retry, 1) / 1000)

    async def _tx_register_held(
        self, conn: Lent, claim: Claim, base: str, mine: str, queue: str, value: str, entry: str,
    ) -> Granted | Busy | None:
        """Register while the lock keeps changing hands (a busy process taking it over and
        over aborts every registration that watches the lock hash, and so was never
        queued, never handed the lock: starved). Watch only the claim's waiter key, then
        read the owner: a hand-over to this claim (which deletes that key) or a tombstone
        (which sets it) aborts the EXEC or shows in the reads; the lock's other changes
        do not matter to a registration. Granted if the lock is already this claim's;
        None if it looked free, or the EXEC aborted: the caller's loop tries again."""
        # (the aborted EXEC before this ended every WATCH)
        _, (owner, token), pttl, mark, at = await conn.run(
            ("WATCH", mine), ("HMGET", base, "owner", "token"), ("PTTL", base), ("GET", mine),
            ("LPOS", queue, entry),
        )
        mine_now = await _ours_already(conn, claim, owner, token, pttl, mark)
        if mine_now is not None:
            return mine_now
        if owner is None or int(pttl) <= 0:
            await conn.unwatch()
            return None
        busy = await self._tx_register(conn, claim, mine, queue, value, entry, at, int(pttl))
        if busy is None:
            self.conflicts += 1
        return busy

    def _registration_of(self, claim: Claim) -> str:
        """``claim``'s registration, as the Lua ACQUIRE writes it: ``<lease ttl ms>|
        <inbox length>|<inbox><holder record>`` (its waiter ttl is its lease ttl)."""
        return f"{claim.ttl_ms}|{len(self.inbox)}|{self.inbox}{claim.info}"

    def _no_register(self, exc: BaseException) -> None:
        """The user may not run the commands of a registration (an ACL line from before
        they were needed): wait unregistered from now on, as before, and say so once."""
        if self._register:
            self._register = False
            log.info("Redis at %s refuses the commands that register a waiter (%s): "
                     "waiters through transactions are not registered on the server, so a "
                     "release through the Lua path may hand the lock to its own waiters "
                     "first; grant +lpos +rpush +lrem", self._url, exc)

    # -- renew ----------------------------------------------------------------------------

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        keys = [self._base(c.name, c.kind) for c in claims]
        out: list[int | None] = [None] * len(claims)
        groups, aborts = [list(range(len(claims)))], 0
        async with self._tx_lent("WATCH/MULTI/EXEC renew", urgent=True) as conn:
            while groups:
                group = groups.pop()
                if await self._renew_group(conn, claims, keys, group, out):
                    continue
                # Aborted: a watched key changed -- most likely a lease of the batch that
                # expired. Halves are renewed apart, so one such key costs one lease only.
                self.conflicts += 1
                aborts += 1
                if aborts > MAX_CONFLICTS + 2 * len(claims):
                    raise BackendUnavailable(f"renewals on {self._url} kept conflicting "
                                             f"with other clients ({aborts} aborted EXEC)")
                half = len(group) // 2
                groups += [group[:half], group[half:]] if half else [group]
            gone = [i for i, ms in enumerate(out) if ms is None]
            if gone:  # revoked by an operator (the Lua path's mark), or just gone?
                marks, _ = await conn.run(("MGET", *(f"{keys[i]}:x:{claims[i].owner}"
                                                     for i in gone)), ("UNWATCH",))
                for i, mark in zip(gone, marks, strict=True):
                    out[i] = REVOKED if mark is not None and _text(mark) == "v" else None
        return out

    async def _renew_group(
        self, conn: Lent, claims: Sequence[Claim], keys: list[str], group: list[int],
        out: list[int | None],
    ) -> bool:
        """One transaction renewing the claims of ``group`` still held (their ttl into
        ``out``); False if its EXEC aborted. A key another client overwrote with another
        type (``HGET``: WRONGTYPE) fails its own claim only (not held, lost at once)."""
        try:
            _, *owners = await conn.run(("WATCH", *(keys[i] for i in group)),
                                        *(("HGET", keys[i], "owner") for i in group))
        except ResponseError as exc:
            if not str(exc).startswith("WRONGTYPE"):
                raise
            _, *kinds = await conn.run(("UNWATCH",), *(("TYPE", keys[i]) for i in group))
            foreign = [i for i, kind in zip(group, kinds, strict=True)
                       if _text(kind) not in ("hash", "none")]
            for i in foreign:
                warn_foreign_key(keys[i], claims[i].name)
            rest = [i for i in group if i not in foreign]
            if not foreign:  # changed again since (not seen in practice): retry the group
                return False
            return await self._renew_group(conn, claims, keys, rest, out) if rest else True
        held = [i for i, o in zip(group, owners, strict=True)
                if o is not None and _text(o) == claims[i].owner]
        if not held:
            await conn.unwatch()
            return True
        *_, done = await conn.run(
            ("MULTI",), *(("PEXPIRE", keys[i], claims[i].ttl_ms) for i in held), ("EXEC",))
        if done is ABORTED:
            return False
        for i, ok in zip(held, done, strict=True):
            out[i] = claims[i].ttl_ms if int(ok) else None
        return True

    # -- release --------------------------------------------------------------------------

    async def release(self, claim: Claim) -> bool:
        base = self._base(claim.name, claim.kind)
        # (an election's release wakes this process's observers too: no echo dropped)
        noted = claim.kind is Kind.LOCK and self.signals.note_local_release(base, claim.owner)
        released = freed = False
        try:
            released, freed = await self._tx_release(claim)
        finally:
            if noted and not freed:
                self.signals.forget_local_release(claim.owner)  # nothing on the lock's channel
        return released

    async def abandon(self, claim: Claim) -> None:
        self.signals.claims.pop(claim.owner, None)
        tomb = max(TOMBSTONE_MS, 2 * claim.ttl_ms)
        base = self._base(claim.name, claim.kind)
        # the tombstone first (an acquire in flight watches the waiter key: it can neither
        # grant nor register after it), then its queue entry (if it registered)
        first: tuple[tuple[Any, ...], ...] = (("SET", base + ":x:" + claim.owner, "a", "PX", tomb),)
        if claim.waits and self._register and self.handoffs:
            entry = f"{claim.owner}|{self._registration_of(claim)}"
            first += (("LREM", base + ":q", 1, entry),)
        try:
            await self._tx_release(claim, first=first)
        except BaseException:
            if claim.waits and self.handoffs:  # its entry may stay: a hand-over is passed on
                self.signals.orphan(claim, self.abandon)
            raise

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        channel = self._base(name, kind)
        # a hand-over to a registered waiter comes to this process's inbox; a release
        # that frees the lock (nobody registered and live) says so on the lock's channel
        if self.handoffs:
            await self.signals.listen(channel, waiter, self.inbox)
        await self.signals.listen(channel, waiter)

    async def _tx_release(
        self, claim: Claim, first: tuple[tuple[Any, ...], ...] = (),
    ) -> tuple[bool, bool]:
        """Release ``claim`` if it holds (after ``first``, commands sent before the
        WATCH): hand the lock to the first live registered waiter, or free it and say so
        on the lock's channel. (released, freed)."""
        base = self._base(claim.name, claim.kind)
        seq, queue = base + ":seq", base + ":q"
        result: tuple[bool, bool] | None = None
        async with self._tx_lent("WATCH/MULTI/EXEC release", urgent=True) as conn:
            for _ in range(2 * MAX_CONFLICTS):
                try:
                    *_, owner, waiting, last = await conn.run(
                        *first, ("WATCH", base, seq, queue), ("HGET", base, "owner"),
                        ("LRANGE", queue, 0, QUEUE_LOOK - 1), ("GET", seq),
                    )
                except ResponseError as exc:  # (an abandon's tombstone, first, is set)
                    if not str(exc).startswith("WRONGTYPE"):
                        raise
                    warn_foreign_key(base, claim.name)  # not held: nothing to release
                    return False, False
                first = ()
                if owner is None or _text(owner) != claim.owner:
                    await conn.unwatch()
                    return False, False
                plan, freed = await self._tx_plan(conn, base, claim.owner, waiting, last,
                                                  announce=claim.kind is Kind.LEADER,
                                                  passed=claim.owner)
                *_, done = await conn.run(("MULTI",), *plan, ("EXEC",))
                if done is not ABORTED:
                    result = True, freed
                    break
                self.conflicts += 1
        if result is None:
            raise BackendUnavailable(f"the release of {claim.name!r} on {self._url} kept "
                                     f"conflicting with other clients")
        return result

    async def _tx_plan(
        self, conn: Lent, base: str, me: str, waiting: list[Any], last: Any, *,
        announce: bool = False, passed: str = "",
    ) -> tuple[list[tuple[Any, ...]], bool]:
        """The commands of a release (or a revocation: ``me`` "") inside MULTI, and
        whether they free the lock: to the first live registered waiter if any (never
        ``passed``, the releasing or revoked owner; its waiter key now watched too, and
        deleted by the grant, as Lua's ``hand_over`` does; ``announce``: also ``|`` on the
        lock's channel, for an election's observers), else free. ``waiting`` is the
        queue's first page; the next pages are read (the queue is watched) until a live
        waiter is found or the queue ends, as Lua's RELEASE looks at the whole queue."""
        queue, start = base + ":q", 0
        while waiting:
            names = [_text(w).partition("|")[0] for w in waiting]  # <owner>|<registration>
            xkeys = [f"{base}:x:{w}" for w in names]
            _, values, now = await conn.run(("WATCH", *xkeys), ("MGET", *xkeys), ("TIME",))
            found = [_registration(value) for value in values]
            heard = await self._subscribed(conn, {f[1] for f in found if f is not None})
            for i, (name, registration) in enumerate(zip(names, found, strict=True)):
                if registration is None or name == passed:
                    continue
                ttl, inbox, info = registration
                if heard is not None and not heard.get(inbox):
                    continue  # nobody hears its inbox: its process is gone (or not yet there)
                token = int(last or 0) + 1
                return [
                    ("LTRIM", queue, start + i + 1, -1), ("DEL", xkeys[i]),
                    ("INCR", base + ":seq"),
                    ("HSET", base, "owner", name, "token", token, "info", info,
                     "since", _ms(now)),
                    ("PEXPIRE", base, ttl), ("PUBLISH", inbox, f"{base}|{name}|{token}"),
                    *((("PUBLISH", base, "|"),) if announce else ()),
                ], False
            start += len(names)
            if len(names) < QUEUE_LOOK:
                break
            [waiting] = await conn.run(("LRANGE", queue, start, start + QUEUE_LOOK - 1))
        trim = [("LTRIM", queue, start, -1)] if start else []  # none alive among them
        return [*trim, ("DEL", base), ("PUBLISH", base, f"{me}|")], True

    async def _subscribed(self, conn: Lent, inboxes: set[str]) -> dict[str, int] | None:
        """How many subscribers each of ``inboxes`` (registered waiters' processes) has now
        (``PUBSUB NUMSUB``), before a hand-over: a waiter nobody hears is skipped, as the
        Lua path's RELEASE skips one whose PUBLISH reached nobody. Asked before the
        transaction, never after: a hand-over found unheard after its EXEC cannot be taken
        back, as its waiter may have claimed it meanwhile (subscribed late, it asks, and
        its ACQUIRE finds it the owner). None (every registered waiter counts as live: a
        dead one costs its lease ttl) where PUBLISH counts are not trusted or the ACL user
        may not run ``PUBSUB NUMSUB``."""
        if not inboxes or not self.publish_counts or not self._numsub:
            return None
        try:
            [reply] = await conn.run(("PUBSUB", "NUMSUB", *inboxes))
        except _ERRORS as exc:
            if error_code(exc) != "NOPERM":
                raise
            self._numsub = False
            log.info("Redis at %s refuses PUBSUB NUMSUB to this user: a release through "
                     "transactions cannot skip a killed Lua-path waiter (it holds the "
                     "lock until its lease ttl lapses); grant +pubsub|numsub", self._url)
            return None
        return {_text(k): int(v) for k, v in _redis_txn_ops.pairs(reply)}

    # -- holders, listing, revocation, proclaim (see _redis_txn_ops) ----------------------

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        return await _redis_txn_ops.inspect(self, name, kind)

    async def set_info(self, claim: Claim) -> bool:
        return await _redis_txn_ops.set_info(self, claim)

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        return await _redis_txn_ops.force_release(self, name, kind)


class AutoRedisBackend(RedisBackend):
    """``scripting=auto``: at ``connect()`` (or its first request) this object becomes a
    :class:`RedisBackend` if the server loads the scripts, a :class:`RedisTxnBackend`
    if it refuses them."""

    def __init__(self, client: Any, **options: Any) -> None:
        super().__init__(client, **options)
        self._deciding = asyncio.Lock()

    async def connect(self) -> None:
        await self._decide()

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        await self._decide()
        return await self.try_acquire(claim)  # the class it became

    async def abandon(self, claim: Claim) -> None:
        await self._decide()
        await self.abandon(claim)

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        await self._decide()
        return await self.inspect(name, kind)

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        await self._decide()
        return await self.force_release(name, kind)

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        await self._decide()
        async for info in self.scan(prefix):  # the class it became
            yield info

    async def _decide(self) -> None:
        async with self._deciding:
            if type(self) is not AutoRedisBackend:
                return  # decided meanwhile
            try:
                await RedisBackend.connect(self)  # loads the scripts on the lean connection
                if not self.ordered:
                    try:
                        async with asyncio.timeout(self._connect_timeout):
                            await self._load_scripts()
                    except _ERRORS as exc:
                        raise redis_error(exc, self._url, "SCRIPT LOAD") from exc
            except LockError as exc:
                if not _refuses_scripts(exc):
                    raise
                await self._fall_back(exc)
                return
            _become(self, RedisBackend)

    async def _fall_back(self, refusal: LockError) -> None:
        """Become a RedisTxnBackend, if the server lets this user run transactions
        (else the refusal of the scripts is the error to show)."""
        resp = self._resp
        _become(self, RedisTxnBackend)
        assert isinstance(self, RedisTxnBackend)
        self._as_transactions(resp)
        if resp is not None:
            await resp.aclose()
        try:
            await self._probe()
        except LockError:
            _become(self, AutoRedisBackend)  # undecided: the next request asks again
            raise refusal from refusal.__cause__
        log.info("Redis at %s refuses Lua scripts (%s): lock() and election() run as "
                 "WATCH/MULTI/EXEC transactions (no fair=True, rwlock or semaphore)",
                 self._url, refusal.__cause__ or refusal)


def _refuses_scripts(exc: BaseException) -> bool:
    """True if ``exc`` (or its cause) is the server refusing EVALSHA or SCRIPT LOAD."""
    for error in (exc, exc.__cause__):
        text = str(error).lower()
        if (("noperm" in text or "no permissions" in text or "unknown command" in text)
                and ("script" in text or "eval" in text)):
            return True
    return False


def scripting_class(cls: type[RedisBackend], scripting: str) -> type[RedisBackend]:
    """The class ``RedisBackend.from_url`` builds for ``?scripting=`` (on, off, auto)."""
    if cls is not RedisBackend or scripting == "on":
        if scripting == "off":
            raise ValueError(f"scripting=off is for redis://, rediss:// and unix:// URLs "
                             f"({cls.__name__} needs its scripts)")
        return cls
    return RedisTxnBackend if scripting == "off" else AutoRedisBackend


def _become(backend: AutoRedisBackend, cls: type[RedisBackend]) -> None:
    """Decided: ``backend`` is a ``cls`` from now on (both share RedisBackend's state)."""
    backend.__class__ = cls  # type: ignore[assignment]


async def _ours_already(
    conn: Lent, claim: Claim, owner: Any, token: Any, pttl: Any, mark: Any,
) -> Granted | None:
    """What an acquire's reads (the lock hash's owner and token, its PTTL, the claim's
    waiter key) settle by themselves: the lock is this claim's already (a release handed
    it over, or a repeat): Granted with the lease left; its waiter key holds a tombstone
    or a release marker: LockError (abandoned). Either way the WATCH is dropped. Else
    None: the transaction goes on."""
    if owner is not None and _text(owner) == claim.owner and int(pttl) > 0:
        await conn.unwatch()  # (it may expire between reads)
        return Granted(int(token), int(pttl))
    x = None if mark is None else _text(mark)
    if x is not None and x != "v" and _registration(x) is None:
        await conn.unwatch()
        raise LockError(f"claim on {claim.name!r} was abandoned")
    return None


def _registration(value: Any) -> tuple[int, str, str] | None:
    """A waiter's registration -> (lease ttl ms, inbox, holder record); None for
    anything else (no waiter key, a tombstone, a release or revocation mark)."""
    if value is None:
        return None
    text = _text(value)
    found = _REGISTRATION.match(text)
    if found is not None and int(found[2]) <= len(found[3]):
        n = int(found[2])
        return int(found[1]), found[3][:n], found[3][n:]
    old = _REGISTRATION_V1.match(text)
    return (int(old[1]), old[2], "") if old is not None else None
