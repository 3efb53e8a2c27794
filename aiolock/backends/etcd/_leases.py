"""Leases: one shared etcd lease per connection and lease length, and the one keep-alive
stream per connection.

Every claim of a connection with the same lease length (whole seconds) is put on one etcd
lease (etcd's own ``concurrency.Session``): a renewal round costs one keep-alive per lease,
not one per claim. The lease is granted when the first claim needs it; kept while claims
are on it; when the last one leaves, kept for reuse while over half its ttl is left (no
keep-alive is sent for an idle lease), then revoked. A lease found gone (a keep-alive
answered TTL 0, a put refused for lack of it) or not confirmed in time is *lost*: every
claim on it is lost, it is revoked (in case the server still has it), and the next claim
gets a new one.

Sharing has a price: a key nobody holds any more would live as long as the lease. So a
key whose delete failed (a release or an abandon that did not get through) is an
*orphan* of its lease, and the orphans are deleted before the lease is kept alive again;
and a claim the core stopped counting on (past its own expiry, say a release that was
cancelled) is swept off the lease the same way.

etcd answers the keep-alives of one stream one after the other, and a keep-alive for a
lease that expired but is not yet revoked waits for that revocation (the server revokes
at most 1,000 expired leases a second, after a sweep every 0.5 s): one such keep-alive
holds up every keep-alive behind it on the stream. So a keep-alive is sent only for a
lease believed alive with :data:`MARGIN` to spare (counted from when its last
confirmation was *sent*; the server counts from when it received it, later), and a batch
waits for its replies no longer than its leases are believed (then the stream is started
afresh).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...errors import BackendUnavailable, LockError
from .._own_task import cancelled_by_close
from ._claim import ClaimState, EtcdLease
from ._connection import Connection, LeaseGone
from ._recipe import lease_seconds
from ._wire import Stream, brief, pb

__all__ = ["MARGIN", "TOMBSTONES", "TXN_OPS", "LeaseSession"]

log = logging.getLogger("aiolock.backends.etcd")

#: A keep-alive is sent only for a lease believed alive this long after the send (s).
MARGIN = 0.1
#: A keep-alive batch's timer that fired this late (s) says the event loop was blocked or
#: starved: its replies then get up to STALL_GRACE more to be read (else LATE more).
LATE = 0.02
STALL_GRACE = 0.5
#: A lease that carries this many tombstones (see ``abandon``) is retired: later claims
#: get a new one, and the tombstones go when it is revoked.
TOMBSTONES = 1000
#: Operations per transaction (etcd's --max-txn-ops defaults to 128).
TXN_OPS = 100


class LeaseSession:
    """The leases of one connection: the shared leases, their claims and orphans, and the
    batched keep-alives."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.stream: Stream | None = None
        self._waiting: dict[int, collections.deque[_Batch]] = {}
        #: lease seconds -> the lease new claims of that length go on
        self.current: dict[int, EtcdLease] = {}
        #: lease id -> every lease of ours not yet revoked (nor forgotten as lost)
        self.leases: dict[int, EtcdLease] = {}
        self._granting: dict[int, asyncio.Task[EtcdLease]] = {}
        self._last_reply = 0.0  # (monotonic) when the stream last answered anything
        #: called for a claim swept off its lease (the backend cancels its watches)
        self.on_swept: Callable[[ClaimState], None] = lambda st: None

    def tombstone(self, owner: str) -> bytes:
        """The key that bars a late put of ``owner``'s claim key (see ``abandon``)."""
        return f"{self._conn.prefix}/gone/{owner}".encode()

    # -- keep-alive stream ----------------------------------------------------------------

    def _stream(self) -> Stream:
        stream = self.stream
        if stream is None or not stream.alive:
            stub = self._conn.stubs["Lease"]
            stream = self.stream = Stream(
                lambda it: stub.LeaseKeepAlive(it, metadata=self._conn.metadata),
                self._on_reply, self._ended)
        return stream

    def _on_reply(self, response: Any) -> None:
        self._last_reply = time.monotonic()
        batches = self._waiting.get(int(response.ID))
        if batches:
            batch = batches.popleft()  # replies for one lease come in request order
            if not batches:
                del self._waiting[int(response.ID)]
            batch.answer(int(response.ID), int(response.TTL))

    def _ended(self, stream: Stream, error: BaseException | None) -> None:
        self._conn.note_stream_end(error)
        if self.stream is stream:
            self.stream = None
        waiting, self._waiting = self._waiting, {}
        failure = BackendUnavailable(f"the etcd keep-alive stream to {self._conn.url} ended ({brief(error)})")
        for batches in waiting.values():
            for batch in batches:
                batch.fail(failure)
        if error is not None and not self._conn.closed:
            log.debug("etcd keep-alive stream ended: %s", brief(error))

    async def keep_alive(self, leases: Sequence[int], until: float) -> list[int]:
        """One keep-alive per lease over the stream: each one's TTL (0: gone). Waits no
        later than ``until`` (monotonic), nor longer than the request timeout."""
        await self._conn.check_token()
        stream = self._stream()
        batch = _Batch(leases)
        for lease in leases:
            self._waiting.setdefault(lease, collections.deque()).append(batch)
        stream.send(*(pb.LeaseKeepAliveRequest(ID=lease) for lease in leases))
        since = time.monotonic()
        wait = max(0.0, min(self._conn.request_timeout, until - since))
        try:
            await asyncio.wait((batch.done,), timeout=wait)
            if not batch.done.done():
                # A reply may be in already, its callbacks queued behind this timer: the
                # loop was blocked (or starved of CPU) past the deadline. Let them run
                # before deciding: a late reply is as good (a lease is believed from when
                # its keep-alive was sent, never from when the reply is read).
                late = time.monotonic() - (since + wait)
                grace = min(STALL_GRACE, self._conn.request_timeout) if late > LATE else LATE
                await asyncio.wait((batch.done,), timeout=grace)
            if batch.done.done():
                return batch.done.result()
            if self.stream is stream and self._last_reply < since:
                # stuck, not slow (a member cut off, or a keep-alive waiting for a
                # revocation): afresh; a slow stream keeps its other batches going
                self.stream = None
                stream.close()
            raise BackendUnavailable(
                f"etcd at {self._conn.url} did not answer a keep-alive within {wait:.2f} s"
            )
        finally:
            batch.done.cancel()

    async def extend(self, leases: Sequence[EtcdLease]) -> list[int]:
        """Keep ``leases`` alive now (their orphans deleted first): each one's TTL, 0 for
        one gone or not surely alive (then it is lost). The leases confirmed are
        believed from when the keep-alives were sent."""
        now = time.monotonic()
        alive = []
        for lease in leases:
            if lease.lost or lease.believed_until() - now < MARGIN:
                self.lose(lease)  # (a keep-alive for it could hold up the stream)
            elif lease not in alive:
                alive.append(lease)
        for lease in alive:
            self._sweep(lease, now)
        # (a lease left without claims is revoked now: it takes its orphans with it)
        alive = [lease for lease in alive if lease.id in self.leases]
        dirty = [lease for lease in alive if lease.orphans]
        if dirty:
            await asyncio.gather(*(self.clear_orphans(lease) for lease in dirty))
            alive = [lease for lease in alive if not lease.lost and lease.id in self.leases]
        ttls: dict[int, int] = {}
        if alive:
            sent = time.monotonic()
            until = max(lease.believed_until() for lease in alive)
            answers = await self.keep_alive([lease.id for lease in alive], until)
            for lease, ttl in zip(alive, answers, strict=True):
                if ttl > 0 and not lease.lost:
                    lease.confirm(sent, ttl)
                    ttls[lease.id] = ttl
                else:
                    self.lose(lease)
        return [ttls.get(lease.id, 0) for lease in leases]

    def _sweep(self, lease: EtcdLease, now: float) -> None:
        """Claims the core no longer counts on (past their own expiry) leave the lease,
        their keys orphans (at most every sixth of the lease's ttl)."""
        if now - lease.swept < lease.granted / 6:
            return
        lease.swept = now
        for owner, st in list(lease.claims.items()):
            if st.lease is not lease:  # (stale: a move that failed)
                del lease.claims[owner]
            elif st.own_until < now:
                del lease.claims[owner]
                if st.key is not None:
                    lease.orphans[st.key] = self.tombstone(owner) if st.uncertain else None
                if st.uncertain:
                    st.abandoned = True  # (its tombstone bars it for good)
                self.on_swept(st)
                st.reset()
        self.check_idle(lease)

    async def refresh(self, st: ClaimState) -> bool:
        """Keep one claim's lease alive now; False if it is gone or not surely alive (a
        keep-alive for a lease the server may have expired would hold up the stream)."""
        assert st.lease is not None
        (ttl,) = await self.extend([st.lease])
        return ttl > 0

    # -- the shared leases ----------------------------------------------------------------

    async def take(self, st: ClaimState, owner: str, ttl_ms: int) -> EtcdLease:
        """Put a claim on the current lease of its length (granted now if there is none,
        or none fresh enough): the lease, believed as the claim's."""
        lease = await self.current_lease(lease_seconds(ttl_ms))
        self.attach(lease, owner, st)
        return lease

    async def current_lease(self, ttl_s: int) -> EtcdLease:
        """The lease new claims of ``ttl_s`` seconds go on (one grant at a time)."""
        for _ in range(3):
            lease = self.current.get(ttl_s)
            if lease is not None:
                left = lease.believed_until() - time.monotonic()
                if lease.lost or left < 2 * MARGIN:
                    self.lose(lease)
                elif lease.claims or left > lease.granted / 2:
                    # (in use: the claims' renewals keep it; else fresh enough to reuse)
                    return lease
                else:
                    self.retire(lease)  # idle and stale: a new one (no tombstones either)
            task = self._granting.get(ttl_s)
            if task is None:
                task = self._granting[ttl_s] = asyncio.get_running_loop().create_task(self._grant(ttl_s))
                task.add_done_callback(self._granted)
            try:
                lease = await asyncio.shield(task)
            except asyncio.CancelledError:
                if cancelled_by_close(task, self._conn.closed):  # the grant, by aclose()
                    raise self._conn.closed_error() from None
                raise
            if not lease.lost:
                return lease
        raise BackendUnavailable(f"etcd at {self._conn.url}: a new lease was lost at once")

    def _granted(self, task: asyncio.Task[EtcdLease]) -> None:
        for ttl_s, granting in list(self._granting.items()):
            if granting is task:
                del self._granting[ttl_s]
        if not task.cancelled():
            task.exception()  # (retrieved: the acquires that asked raise it themselves)

    async def _grant(self, ttl_s: int) -> EtcdLease:
        lease = EtcdLease(secrets.randbelow(2**62) + 1, ttl_s)
        sent = time.monotonic()
        async with self._conn.bounded("a lease grant"):
            reply = await self._conn.unary(
                "Lease", "LeaseGrant", pb.LeaseGrantRequest(TTL=ttl_s, ID=lease.id), "a lease grant")
        if reply.error:
            raise LockError(f"etcd at {self._conn.url} refused a lease: {reply.error}")
        lease.confirm(sent, int(reply.TTL))
        self.leases[lease.id] = lease
        if self._conn.closed:
            self.retire(lease)
        else:
            old = self.current.get(ttl_s)
            if old is not None:
                self.retire(old)
            self.current[ttl_s] = lease
            self.check_idle(lease)  # (none of the claims that asked for it may come)
        return lease

    def attach(self, lease: EtcdLease, owner: str, st: ClaimState) -> None:
        """Put a claim on ``lease`` (its key is about to be written with it)."""
        if st.lease is not None and st.lease is not lease:
            self.detach(st, owner)
        st.lease = lease
        lease.claims[owner] = st
        if lease.idle_timer is not None:
            lease.idle_timer.cancel()
            lease.idle_timer = None

    def detach(self, st: ClaimState, owner: str) -> None:
        """Take a claim off its lease (its key is gone, or the lease is)."""
        lease = st.lease
        st.lease = None
        if lease is not None:
            if lease.claims.get(owner) is st:
                del lease.claims[owner]
            self.check_idle(lease)

    def orphan(self, st: ClaimState, owner: str, key: bytes, tombstone: bool) -> EtcdLease | None:
        """Take a claim off its lease, its key still to be deleted (with a tombstone if a
        put of it may still be in flight): before the lease is kept alive again, or by its
        revocation. The lease, for :meth:`clear_orphans`."""
        lease = st.lease
        if lease is None:
            return None
        if not lease.lost:
            lease.orphans[key] = self.tombstone(owner) if tombstone else None
        self.detach(st, owner)
        return lease

    async def clear_orphans(self, lease: EtcdLease) -> None:
        """Delete the lease's orphan keys (a tombstone put on the lease first where a put
        may be in flight); a lease found gone is lost (its keys went with it)."""
        orphans = dict(lease.orphans)
        keys = list(orphans)
        try:
            for i in range(0, len(keys), TXN_OPS // 2):
                ops = []
                for key in keys[i : i + TXN_OPS // 2]:
                    tomb = orphans[key]
                    if tomb is not None:
                        ops.append(pb.RequestOp(request_put=pb.PutRequest(key=tomb, lease=lease.id)))
                    ops.append(pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key)))
                await self._conn.unary("KV", "Txn", pb.TxnRequest(success=ops), "a cleanup")
                lease.tombstones += sum(orphans[key] is not None for key in keys[i : i + TXN_OPS // 2])
        except LeaseGone:
            lease.orphans.clear()
            self.lose(lease)
            return
        for key in keys:
            if lease.orphans.get(key, False) == orphans[key]:
                del lease.orphans[key]
        if lease.tombstones >= TOMBSTONES:
            self.retire(lease)
        self.check_idle(lease)

    async def clear_quietly(self, lease: EtcdLease) -> None:
        """:meth:`clear_orphans` in the background (else before the next keep-alive)."""
        try:
            async with self._conn.bounded("a cleanup"):
                await self.clear_orphans(lease)
        except Exception as exc:
            log.debug("deleting orphan etcd keys failed (retried before the next keep-alive): %s", exc)

    def lose(self, lease: EtcdLease, revoke: bool = True) -> None:
        """The lease is gone or not surely alive: every claim on it is lost (each finds
        out at its next renewal or re-check); revoked in case the server still has it
        (unless the caller does that itself: ``revoke=False``)."""
        if lease.lost:
            return
        lease.lost = True
        lease.orphans.clear()  # (they go with it)
        self._revoke(lease, spawn=revoke)

    def retire(self, lease: EtcdLease) -> None:
        """Give the lease to no new claim; revoke it once no claim is left on it."""
        lease.retired = True
        if self.current.get(lease.ttl_s) is lease:
            del self.current[lease.ttl_s]
        self.check_idle(lease)

    def check_idle(self, lease: EtcdLease) -> None:
        """A lease whose claims may all be gone: revoked if retired (or lost), else kept
        for reuse while fresh (no keep-alives for it), then revoked."""
        if lease.claims or lease.id not in self.leases:
            return
        if lease.orphans or lease.retired or lease.lost or self._conn.closed:  # (it takes its orphans)
            self._revoke(lease)
            return
        if lease.idle_timer is None:
            delay = max(0.0, lease.believed_until() - lease.granted / 2 - time.monotonic())
            lease.idle_timer = asyncio.get_running_loop().call_later(delay, self._stale, lease)

    def _stale(self, lease: EtcdLease) -> None:
        lease.idle_timer = None
        if not lease.claims and lease.id in self.leases:
            self.retire(lease)

    def _revoke(self, lease: EtcdLease, spawn: bool = True) -> None:
        if lease.idle_timer is not None:
            lease.idle_timer.cancel()
            lease.idle_timer = None
        lease.retired = True
        if self.current.get(lease.ttl_s) is lease:
            del self.current[lease.ttl_s]
        if self.leases.pop(lease.id, None) is not None and spawn and not self._conn.closed:
            self._conn.spawn(self._conn.revoke_quietly(lease.id))

    async def aclose(self) -> None:
        """Close the stream; revoke every lease left (their keys go with them)."""
        for task in self._granting.values():
            task.cancel()
        if self.stream is not None:
            await self.stream.aclose()
        leases = list(self.leases.values())
        self.leases.clear()
        self.current.clear()
        for lease in leases:
            if lease.idle_timer is not None:
                lease.idle_timer.cancel()
        if leases and self._conn.channel is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(min(1.0, self._conn.request_timeout)):
                    await asyncio.gather(*(self._conn.unary(
                        "Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease.id), "a revoke")
                        for lease in leases), return_exceptions=True)


class _Batch:
    """The keep-alives sent together: done once each lease's reply came (a lease sent
    twice in one batch counts twice)."""

    __slots__ = ("_left", "_order", "_ttls", "done")

    def __init__(self, leases: Sequence[int]) -> None:
        self.done: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._order = list(leases)
        self._ttls: dict[int, int] = {}
        self._left = len(self._order)
        if not self._left:
            self.done.set_result([])

    def answer(self, lease: int, ttl: int) -> None:
        self._ttls[lease] = ttl
        self._left -= 1
        if self._left == 0 and not self.done.done():
            self.done.set_result([self._ttls[lease] for lease in self._order])

    def fail(self, error: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(error)
