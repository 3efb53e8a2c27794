"""The etcd backend's adapter: the core's single-attempt primitives on the recipe
(:mod:`._recipe`), the leases (:mod:`._leases`), the watches (:mod:`._watches`) and the
connection (:mod:`._connection`). See the package doc for the layout and the recipe."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from ...abc import REVOKED, Backend, Busy, Capability, Claim, Granted, Kind, Waiter
from ...errors import LockError
from . import _recipe as recipe
from ._claim import ClaimState, state
from ._connection import Connection, LeaseGone, options_from_url
from ._leases import MARGIN, LeaseSession
from ._operators import Operators
from ._recipe import Entry
from ._watches import Watches
from ._wire import CREATE, EQUAL, pb

__all__ = ["EtcdBackend"]

log = logging.getLogger("aiolock.backends.etcd")

#: At most this long between re-checks of a waiting claim (a missed watch costs this).
MAX_RECHECK = 5.0
#: A claim answered Busy and then neither asked again nor listening for this long (the
#: core gave up after one try) loses its key.
UNATTENDED = 0.5
#: Operations per transaction (etcd's --max-txn-ops defaults to 128).
TXN_OPS = 100


class EtcdBackend(Operators, Backend):
    """Locks on an etcd v3 cluster (or one member). See the package doc."""

    schemes: ClassVar[tuple[str, ...]] = ("etcd",)
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.FAIR, Capability.RWLOCK, Capability.SEMAPHORE, Capability.EVENTS,
         Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS, Capability.SCAN,
         Capability.REVOKE, Capability.ELECTION}
    )

    def __init__(
        self, hosts: str, *, username: str | None = None, password: str | None = None,
        ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
        tls: bool | None = None, server_name: str | None = None, connect_timeout: float = 5.0,
        request_timeout: float = 5.0, prefix: str = "aiolock",
    ) -> None:
        self._conn = Connection(
            hosts, username=username, password=password, ca_file=ca_file, cert_file=cert_file,
            key_file=key_file, tls=tls, server_name=server_name, connect_timeout=connect_timeout,
            request_timeout=request_timeout, prefix=prefix)
        self._prefix = prefix
        self._leases = LeaseSession(self._conn)
        self._watches = Watches(self._conn)
        self._deleting = {}
        self._unary, self._bounded = self._conn.unary, self._conn.bounded  # (tests/faults' names)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> EtcdBackend:
        """``etcd://[user:password@]host:port[,host:port...][?option=value...]``; the port
        defaults to 2379. Options (query or keyword): ``username``, ``password``,
        ``ca_file``, ``cert_file``, ``key_file``, ``tls`` (``true`` to use TLS with the
        system's CAs), ``server_name`` (the name the server certificate is checked for),
        ``connect_timeout``, ``request_timeout`` (seconds, default 5), ``prefix`` (key
        prefix, default ``aiolock``)."""
        hosts, given = options_from_url(url, cls.schemes, options)
        return cls(hosts, **given)

    @property
    def url(self) -> str:
        return self._conn.url

    async def connect(self) -> None:
        await self._conn.ready()

    # -- keys -----------------------------------------------------------------------------

    def _forget(self, claim: Claim) -> None:
        st = state(claim)
        self._watches.unwatch(st)
        st.reset()

    # -- acquire --------------------------------------------------------------------------

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        st = state(claim)
        if st.abandoned:
            raise LockError(f"claim on {claim.name!r} was abandoned")
        st.asked = None  # being asked: not unattended
        busy = self._same_answer(claim, st)
        if busy is not None:
            return busy
        async with self._conn.bounded("an acquire"):
            await self._conn.check_token()
            started = time.monotonic()
            for _ in range(4):
                answer = await self._attempt(claim, st, started)
                if answer is not None:
                    return answer
        return Busy(0.05)

    def _same_answer(self, claim: Claim, st: ClaimState) -> Busy | None:
        """Asked again with nothing changed (no watch fired, no stream restart, no re-check
        or keep-alive due): the same answer, without a request."""
        busy, st.busy = st.busy, None
        if busy is None or busy[0] != self._watches.epoch or self._conn.closed:
            return None
        left = busy[1] - time.monotonic()
        if left <= 0 or not self._watches.watching(st):
            return None
        st.busy = busy
        self._answered_busy(claim, st)
        return Busy(left)

    async def _attempt(self, claim: Claim, st: ClaimState, started: float) -> Granted | Busy | None:
        """Put our key if it is not there (and the family's token key with it), list the
        family; None: start again (our lease was gone or not surely alive)."""
        prefix = self._family_prefix(claim.name, claim.kind)
        key = self._claim_key(claim)
        lease = st.lease if st.lease is not None else await self._leases.take(st, claim.ttl_ms)
        listing = self._listing(claim.name, claim.kind)
        txn = pb.TxnRequest(
            compare=[pb.Compare(key=key, target=CREATE, result=EQUAL, create_revision=0)],
            success=[pb.RequestOp(request_put=pb.PutRequest(
                         key=key, value=recipe.value(claim, st.key_stamp()), lease=lease)),
                     pb.RequestOp(request_put=pb.PutRequest(key=self._token_key(claim.name, claim.kind))),
                     listing],
            failure=[listing],
        )
        try:
            reply = await self._conn.unary("KV", "Txn", txn, "an acquire")
        except LeaseGone:  # our lease expired while we waited: start again
            self._forget(claim)
            return None
        entries = recipe.entries(reply.responses[-1].response_range.kvs, prefix)
        index = next((i for i, e in enumerate(entries) if e.owner == claim.owner), None)
        if index is None:  # cannot be (one transaction), but never grant on it
            self._forget(claim)
            return None
        me = entries[index]
        if me.lease != lease and not await self._adopt(st, me):
            return None
        st.rev = me.rev
        if any(e.owner == claim.owner for e in recipe.holders(entries, claim.limit)):
            return await self._granted(claim, st, started)
        targets = {e.key for e in recipe.watch_targets(entries, index, claim)}
        self._watches.watch(claim, targets, int(reply.header.revision) + 1)
        return await self._queued(claim, st)

    async def _adopt(self, st: ClaimState, me: Entry) -> bool:
        """Our key is on another lease (an earlier one of this claim, whose reply was
        lost or which was being revoked): keep it if that lease surely lives on, else
        revoke it (which deletes the key) and try again."""
        sent = time.monotonic()
        ours = st.lease
        reply = await self._conn.unary(
            "Lease", "LeaseTimeToLive", pb.LeaseTimeToLiveRequest(ID=me.lease), "an acquire")
        if reply.TTL >= 1:  # (whole seconds left, truncated: a lower bound)
            st.lease = me.lease
            st.confirm(sent, int(reply.TTL))
            if ours is not None:
                self._conn.spawn(self._conn.revoke_quietly(ours))
            return True
        with contextlib.suppress(LeaseGone):
            await self._conn.unary("Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=me.lease), "an acquire")
        return False

    async def _drop_lease(self, claim: Claim, st: ClaimState) -> None:
        """Our lease is gone or not surely alive: revoke it (deleting our key, so that no
        keep-alive is ever sent for a lease the server may have expired) and forget it."""
        lease = st.lease
        self._forget(claim)
        if lease is not None:
            with contextlib.suppress(LeaseGone):
                await self._conn.unary("Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), "an acquire")

    async def _granted(self, claim: Claim, st: ClaimState, started: float) -> Granted | None:
        if st.left_ms(claim.ttl_ms, started) < claim.ttl_ms / 2 and not await self._leases.refresh(st):
            await self._drop_lease(claim, st)
            return None
        self._watches.unwatch(st)
        st.granted = True
        assert st.rev is not None
        return Granted(st.rev, st.left_ms(claim.ttl_ms, started))

    async def _queued(self, claim: Claim, st: ClaimState) -> Busy | None:
        """Waiting: keep our own lease (our place in the queue) alive, and say when to
        look again."""
        ttl = st.lease_ttl
        due = st.left_ms(claim.ttl_ms, time.monotonic()) < ttl * 1000 * 2 / 3
        if due and not await self._leases.refresh(st):
            await self._drop_lease(claim, st)
            return None
        now = time.monotonic()
        wait = max(0.001, min(MAX_RECHECK, st.confirmed + ttl / 3 - now))
        st.busy = (self._watches.epoch, now + wait)
        self._answered_busy(claim, st)
        return Busy(wait)

    def _answered_busy(self, claim: Claim, st: ClaimState) -> None:
        """After a Busy answer: a claim not asked again nor listening soon (the core gave
        up after one try) loses its key, so it cannot block the lock."""
        if claim.owner in self._watches.waiters:
            return
        token = st.asked = object()
        asyncio.get_running_loop().call_later(UNATTENDED, self._check_unattended, claim, token)

    def _check_unattended(self, claim: Claim, token: object) -> None:
        st = state(claim)
        if (st.asked is token and claim.owner not in self._watches.waiters and st.lease is not None
                and not self._conn.closed and not st.granted and not st.abandoned):
            lease = st.lease
            self._forget(claim)  # asked again later, it takes a new place
            self._conn.spawn(self._conn.revoke_quietly(lease))

    # -- renew ----------------------------------------------------------------------------

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        out: list[int | None] = [None] * len(claims)
        ask: list[tuple[int, Claim, ClaimState]] = []
        moves: list[tuple[int, Claim]] = []
        now = time.monotonic()
        for i, claim in enumerate(claims):
            st = state(claim)
            if st.lease is None or not st.granted or st.believed_until() - now < MARGIN:
                continue  # (not surely alive: lost, and no keep-alive to hold up the stream)
            if claim.ttl_ms > st.lease_ttl * 1000:
                moves.append((i, claim))  # extended past its etcd lease: a longer one
            else:
                ask.append((i, claim, st))
        async with self._conn.bounded("a renewal"):
            sent = time.monotonic()
            if ask:
                # the keep-alives, and (one transaction per TXN_OPS claims) whether each key
                # is still there: a key gone under a live lease was revoked by an operator
                until = max(st.believed_until() for _, _, st in ask)
                ttls, present = await asyncio.gather(
                    self._leases.keep_alive([st.lease for _, _, st in ask if st.lease is not None], until),
                    self._present([claim for _, claim, _ in ask]))
            else:
                ttls, present = [], []
            for (i, claim, st), ttl, there in zip(ask, ttls, present, strict=True):
                if ttl > 0 and not there:
                    out[i] = REVOKED
                elif ttl > 0:
                    st.confirm(sent, ttl)
                    out[i] = min(claim.ttl_ms, ttl * 1000)
            for i, claim in moves:
                out[i] = await self._move_lease(claim)
        return out

    async def _present(self, claims: Sequence[Claim]) -> list[bool]:
        """Whether each claim's key exists (one read-only transaction per TXN_OPS keys)."""
        async def chunk(part: Sequence[Claim]) -> list[bool]:
            ops = [pb.RequestOp(request_range=pb.RangeRequest(key=self._claim_key(c), count_only=True))
                   for c in part]
            reply = await self._conn.unary("KV", "Txn", pb.TxnRequest(success=ops), "a renewal")
            return [r.response_range.count > 0 for r in reply.responses]

        parts = await asyncio.gather(*(chunk(claims[i : i + TXN_OPS])
                                       for i in range(0, len(claims), TXN_OPS)))
        return [there for part in parts for there in part]

    def _rewrite(self, claim: Claim, st: ClaimState, lease: int) -> Any:
        """A transaction that rewrites our key's value on ``lease`` if it is still ours."""
        key = self._claim_key(claim)
        return pb.TxnRequest(
            compare=[pb.Compare(key=key, target=CREATE, result=EQUAL, create_revision=st.rev)],
            success=[pb.RequestOp(request_put=pb.PutRequest(
                key=key, value=recipe.value(claim, st.key_stamp()), lease=lease))])

    async def _move_lease(self, claim: Claim) -> int | None:
        """Attach the claim's key to a new lease of its (longer) ttl; same key, same
        create_revision, so the same token. The ms granted, or None if the key is gone."""
        st = state(claim)
        old = st.lease
        assert st.rev is not None
        sent = time.monotonic()
        lease = await self._leases.grant(st, claim.ttl_ms)
        reply = await self._conn.unary("KV", "Txn", self._rewrite(claim, st, lease), "a renewal")
        stale = lease if not reply.succeeded else old
        if stale is not None:
            self._conn.spawn(self._conn.revoke_quietly(stale))
        if not reply.succeeded:
            return None
        return st.left_ms(claim.ttl_ms, sent)

    async def set_info(self, claim: Claim) -> bool:
        """Rewrite the held claim's value with its new record (same lease, same key, so
        the same token); the election's listeners see the put."""
        st = state(claim)
        if not st.granted or st.rev is None or st.lease is None:
            return False
        async with self._conn.bounded("a proclaim"):
            try:
                reply = await self._conn.unary("KV", "Txn", self._rewrite(claim, st, st.lease), "a proclaim")
            except LeaseGone:
                return False
        return bool(reply.succeeded)

    # -- release --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _deletion(self, claim: Claim) -> Iterator[None]:
        prefix = self._family_prefix(claim.name, claim.kind)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._deleting.setdefault(prefix, set()).add(done)
        try:
            yield
        finally:
            done.set_result(None)
            pending = self._deleting[prefix]
            pending.discard(done)
            if not pending:
                del self._deleting[prefix]

    async def release(self, claim: Claim) -> bool:
        st = state(claim)
        self._watches.unwatch(st)
        if st.lease is None:
            return False
        repeated = st.revoking == st.lease  # an earlier release was interrupted
        st.revoking = st.lease
        with self._deletion(claim):
            async with self._conn.bounded("a release"):
                request = pb.DeleteRangeRequest(key=self._claim_key(claim))
                reply = await self._conn.unary("KV", "DeleteRange", request, "a release")
        if reply.deleted > 0:
            self._leases.give_back(st, claim.ttl_ms)  # the lease lives on, keyless: the next acquire's
        self._forget(claim)
        return reply.deleted > 0 or repeated

    async def abandon(self, claim: Claim) -> None:
        st = state(claim)
        st.abandoned = True
        self._watches.unwatch(st)
        waiter = self._watches.waiters.get(claim.owner)
        if waiter is not None and waiter.claim is claim:
            del self._watches.waiters[claim.owner]
        if st.lease is None:
            return
        # Revoking deletes our key; a put still in flight finds no lease and fails; a
        # grant still in flight makes a lease without keys, which expires by its ttl.
        # Then the key is deleted by its name (our owner id) too, whatever lease it has
        # (one attached to an earlier lease of this claim, say).
        with self._deletion(claim):
            async with self._conn.bounded("an abandon"):
                with contextlib.suppress(LeaseGone):
                    await self._conn.unary(
                        "Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=st.lease), "an abandon")
                await self._conn.unary(
                    "KV", "DeleteRange", pb.DeleteRangeRequest(key=self._claim_key(claim)), "an abandon")
        self._forget(claim)

    # -- listeners ------------------------------------------------------------------------

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        self._watches.waiters[waiter.claim.owner] = waiter
        if kind is Kind.LEADER:  # observers and candidates: every change of the election
            await self._conn.ready()
            await self._watches.listen_family(waiter, self._family_prefix(name, kind))

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        self._watches.unlisten(waiter)
        st = state(waiter.claim)
        if st.lease is not None and not st.granted and not st.abandoned:
            # the core stopped waiting without a grant; our key keeps a place in the
            # queue, which would block the lock: give it up
            self._conn.spawn(self._give_up(waiter.claim))

    async def _give_up(self, claim: Claim) -> None:
        if self._conn.closed or state(claim).abandoned:
            return
        try:
            await self.abandon(claim)
        except Exception as exc:  # its lease expires by its ttl
            log.debug("giving up an etcd claim on %r failed: %s", claim.name, exc)

    async def aclose(self) -> None:
        if self._conn.closed:
            return
        self._conn.closed = True
        self._conn.cancel_tasks()
        await self._watches.aclose()
        await self._leases.aclose()
        await self._conn.aclose()
