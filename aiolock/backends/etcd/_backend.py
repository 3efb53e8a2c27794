"""The etcd backend's adapter: the core's single-attempt primitives on the recipe
(:mod:`._recipe`), the leases (:mod:`._leases`), the watches (:mod:`._watches`) and the
connection (:mod:`._connection`). See the package doc for the layout and the recipe."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from ...abc import REVOKED, Backend, Busy, Capability, Claim, Granted, Kind, Waiter
from ...errors import LockError
from . import _recipe as recipe
from ._claim import ClaimState, state
from ._connection import Connection, LeaseGone, options_from_url
from ._leases import MARGIN, TOMBSTONES, TXN_OPS, LeaseSession
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


class EtcdBackend(Operators, Backend):
    """Locks on an etcd v3 cluster (or one member). See the package doc."""

    schemes: ClassVar[tuple[str, ...]] = ("etcd",)
    waiting_counted: ClassVar[frozenset[Kind]] = frozenset(Kind)  # every waiter has its key
    held_since_queued: ClassVar[bool] = True  # since: from the claim's node/key
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
        self._leases.on_swept = self._watches.unwatch
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
        """Our key is gone (or its lease is): off the lease, the watches cancelled."""
        st = state(claim)
        self._watches.unwatch(st)
        self._leases.detach(st, claim.owner)
        st.reset()

    # -- acquire --------------------------------------------------------------------------

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        st = state(claim)
        _check_not_abandoned(claim, st)
        st.asked = None  # being asked: not unattended
        busy = self._same_answer(claim, st)
        if busy is not None:
            return busy
        st.own_until = math.inf  # (not swept off its lease meanwhile)
        try:
            async with self._conn.bounded("an acquire"):
                await self._conn.check_token()
                started = time.monotonic()
                for _ in range(4):
                    answer = await self._attempt(claim, st, started)
                    if answer is not None:
                        return answer
            return Busy(0.05)
        finally:
            if st.own_until == math.inf:  # (failed: the core abandons it; else it is swept)
                st.own_until = time.monotonic() + claim.ttl_ms / 1000

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
        st.own_until = busy[1] + claim.ttl_ms / 1000
        self._answered_busy(claim, st)
        return Busy(left)

    async def _attempt(self, claim: Claim, st: ClaimState, started: float) -> Granted | Busy | None:
        """Put our key if it is not there (and the family's token key with it), list the
        family; None: start again (our lease was gone or not surely alive)."""
        _check_not_abandoned(claim, st)
        prefix = self._family_prefix(claim.name, claim.kind)
        key = self._claim_key(claim)
        if st.lease is not None and st.lease.lost:  # (its key is gone, or going)
            self._forget(claim)
        lease = st.lease if st.lease is not None else await self._leases.take(st, claim.owner, claim.ttl_ms)
        listing = self._listing(claim.name, claim.kind)
        # (a tombstone: this claim was abandoned while this put was in flight)
        barred = pb.Compare(key=self._leases.tombstone(claim.owner), target=CREATE, result=EQUAL,
                            create_revision=0)
        txn = pb.TxnRequest(
            compare=[pb.Compare(key=key, target=CREATE, result=EQUAL, create_revision=0), barred],
            success=[pb.RequestOp(request_put=pb.PutRequest(
                         key=key, value=recipe.value(claim, st.key_stamp()), lease=lease.id)),
                     pb.RequestOp(request_put=pb.PutRequest(key=self._token_key(claim.name, claim.kind))),
                     listing],
            failure=[listing],
        )
        st.uncertain = True  # until answered
        try:
            reply = await self._conn.unary("KV", "Txn", txn, "an acquire")
        except LeaseGone:  # the lease expired (every claim on it is lost): start again
            st.uncertain = False
            self._leases.lose(lease)
            self._forget(claim)
            return None
        st.uncertain = False
        _check_not_abandoned(claim, st)  # (the close abandons claims in flight)
        entries = recipe.entries(reply.responses[-1].response_range.kvs, prefix)
        index = next((i for i, e in enumerate(entries) if e.owner == claim.owner), None)
        if index is None:  # cannot be (one transaction), but never grant on it
            self._forget(claim)
            return None
        me = entries[index]
        if me.lease != lease.id and not await self._adopt(claim, st, me):
            return None
        st.rev = me.rev
        if any(e.owner == claim.owner for e in recipe.holders(entries, claim.limit)):
            return await self._granted(claim, st, started)
        targets = {e.key for e in recipe.watch_targets(entries, index, claim)}
        self._watches.watch(claim, targets)
        return await self._queued(claim, st)

    async def _adopt(self, claim: Claim, st: ClaimState, me: Entry) -> bool:
        """Our key is on another lease (an earlier one of this claim, lost since): keep
        it if that lease is ours and surely lives on, else delete the key (only it: the
        lease may carry other claims) and try again."""
        known = self._leases.leases.get(me.lease)
        if known is not None and not known.lost and known.believed_until() - time.monotonic() > MARGIN:
            self._leases.attach(known, claim.owner, st)
            return True
        txn = pb.TxnRequest(
            compare=[pb.Compare(key=me.key, target=CREATE, result=EQUAL, create_revision=me.rev)],
            success=[pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=me.key))])
        await self._conn.unary("KV", "Txn", txn, "an acquire")
        return False

    async def _drop_lease(self, claim: Claim, st: ClaimState) -> None:
        """Our lease is gone or not surely alive: it is lost, with every claim on it;
        revoke it (deleting its keys, so that no keep-alive is ever sent for a lease the
        server may have expired) and forget it."""
        lease = st.lease
        self._forget(claim)
        if lease is not None:
            self._leases.lose(lease, revoke=False)
            with contextlib.suppress(LeaseGone):
                revoke = pb.LeaseRevokeRequest(ID=lease.id)
                await self._conn.unary("Lease", "LeaseRevoke", revoke, "an acquire")

    async def _granted(self, claim: Claim, st: ClaimState, started: float) -> Granted | None:
        if st.left_ms(claim.ttl_ms, started) < claim.ttl_ms / 2 and not await self._leases.refresh(st):
            await self._drop_lease(claim, st)
            return None
        self._watches.unwatch(st)
        st.granted = True
        assert st.rev is not None
        left = st.left_ms(claim.ttl_ms, started)
        st.own_until = started + left / 1000  # (what the core counts on, at least)
        return Granted(st.rev, left)

    async def _queued(self, claim: Claim, st: ClaimState) -> Busy | None:
        """Waiting: keep our own lease (our place in the queue) alive, and say when to
        look again."""
        assert st.lease is not None  # (abandoned meanwhile: _attempt raised already)
        lease = st.lease
        due = st.left_ms(claim.ttl_ms, time.monotonic()) < lease.granted * 1000 * 2 / 3
        if due and not await self._leases.refresh(st):
            await self._drop_lease(claim, st)
            return None
        now = time.monotonic()
        wait = max(0.001, min(MAX_RECHECK, lease.confirmed + lease.granted / 3 - now))
        st.busy = (self._watches.epoch, now + wait)
        st.own_until = now + wait + claim.ttl_ms / 1000
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
            self._watches.unwatch(st)  # asked again later, it takes a new place
            lease = self._leases.orphan(st, claim.owner, self._claim_key(claim), st.uncertain)
            st.reset()
            if lease is not None:
                self._conn.spawn(self._leases.clear_quietly(lease))

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
            lease = st.lease
            if lease is None or not st.granted or lease.lost or lease.believed_until() - now < MARGIN:
                continue  # (not surely alive: lost, and no keep-alive to hold up the stream)
            if claim.ttl_ms > lease.granted * 1000:
                moves.append((i, claim))  # extended past its etcd lease: a longer one
            else:
                ask.append((i, claim, st))
        async with self._conn.bounded("a renewal"):
            if ask:
                # one keep-alive per lease (its orphans deleted first; the claims the core
                # no longer counts on swept off it), and (one transaction per TXN_OPS
                # claims) whether each key is still there: a key gone under a live lease
                # was revoked by an operator
                leases = list({id(st.lease): st.lease for _, _, st in ask if st.lease is not None}.values())
                ttls, present = await asyncio.gather(
                    self._leases.extend(leases), self._present([claim for _, claim, _ in ask]))
                answers = {lease.id: ttl for lease, ttl in zip(leases, ttls, strict=True)}
            else:
                answers, present = {}, []
            for (i, claim, st), there in zip(ask, present, strict=True):
                lease = st.lease  # (None if it was swept meanwhile)
                ttl = answers.get(lease.id, 0) if lease is not None and st.granted else 0
                if lease is None or ttl <= 0:
                    continue
                if not there:
                    out[i] = REVOKED
                else:
                    ms = out[i] = min(claim.ttl_ms, ttl * 1000)
                    st.own_until = lease.confirmed + ms / 1000
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
        """Attach the claim's key to the (shared) lease of its longer ttl; same key, same
        create_revision, so the same token. The ms granted, or None if the key is gone."""
        st = state(claim)
        assert st.rev is not None
        sent = time.monotonic()
        lease = await self._leases.current_lease(recipe.lease_seconds(claim.ttl_ms))
        lease.claims[claim.owner] = st  # on both while the rewrite is in flight
        try:
            reply = await self._conn.unary("KV", "Txn", self._rewrite(claim, st, lease.id), "a renewal")
        except LeaseGone:
            self._leases.lose(lease)
            raise
        except BaseException:
            lease.claims.pop(claim.owner, None)
            self._leases.check_idle(lease)
            raise
        if not reply.succeeded:
            lease.claims.pop(claim.owner, None)
            self._leases.check_idle(lease)
            return None
        self._leases.attach(lease, claim.owner, st)  # (and off the old one)
        return st.left_ms(claim.ttl_ms, sent)

    async def set_info(self, claim: Claim) -> bool:
        """Rewrite the held claim's value with its new record (same lease, same key, so
        the same token); the election's listeners see the put."""
        st = state(claim)
        if not st.granted or st.rev is None or st.lease is None:
            return False
        async with self._conn.bounded("a proclaim"):
            try:
                rewrite = self._rewrite(claim, st, st.lease.id)
                reply = await self._conn.unary("KV", "Txn", rewrite, "a proclaim")
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
        repeated = st.revoking == st.lease.id  # an earlier release was interrupted
        st.revoking = st.lease.id
        with self._deletion(claim):
            async with self._conn.bounded("a release"):
                request = pb.DeleteRangeRequest(key=self._claim_key(claim))
                reply = await self._conn.unary("KV", "DeleteRange", request, "a release")
        self._forget(claim)  # (its last claim gone, the lease is kept for reuse while fresh)
        return reply.deleted > 0 or repeated

    async def abandon(self, claim: Claim) -> None:
        st = state(claim)
        st.abandoned = True
        self._watches.unwatch(st)
        waiter = self._watches.waiters.get(claim.owner)
        if waiter is not None and waiter.claim is claim:
            del self._watches.waiters[claim.owner]
        lease = st.lease
        if lease is None:
            return
        # The key is deleted by its name (our owner id), whatever lease it is on. A put
        # of it may still be in flight (the acquire was cancelled mid-request): the lease
        # is shared, so revoking it is no way to make that put fail; a tombstone is, on
        # the put's lease (so it goes with the lease), which the put's transaction checks.
        key = self._claim_key(claim)
        tombstone = st.uncertain
        delete = pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key))
        ops = [delete]
        if tombstone:
            ops.insert(0, pb.RequestOp(request_put=pb.PutRequest(
                key=self._leases.tombstone(claim.owner), lease=lease.id)))
        try:
            with self._deletion(claim):
                async with self._conn.bounded("an abandon"):
                    try:
                        await self._conn.unary("KV", "Txn", pb.TxnRequest(success=ops), "an abandon")
                    except LeaseGone:  # then no put on it can land either
                        self._leases.lose(lease)
                        await self._conn.unary("KV", "Txn", pb.TxnRequest(success=[delete]), "an abandon")
                        tombstone = False
        except BaseException:
            # deleted before its lease is kept alive again (or with the lease)
            self._watches.unwatch(st)
            self._leases.orphan(st, claim.owner, key, tombstone)
            st.reset()
            raise
        if tombstone:
            lease.tombstones += 1
            if lease.tombstones >= TOMBSTONES:
                self._leases.retire(lease)
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


def _check_not_abandoned(claim: Claim, st: ClaimState) -> None:
    """Raise LockError once ``claim`` was abandoned (by a cancellation, or by the close
    while its request was in flight: its key is deleted, or barred by a tombstone)."""
    if st.abandoned:
        raise LockError(f"claim on {claim.name!r} was abandoned")
