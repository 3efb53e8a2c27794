"""Leases: grants, spare leases, and the one keep-alive stream per connection.

etcd answers the keep-alives of one stream one after the other, and a keep-alive for a
lease that expired but is not yet revoked waits for that revocation (the server revokes
at most 1,000 expired leases a second, after a sweep every 0.5 s): one such keep-alive
holds up every keep-alive behind it on the stream. Under load that turned one late
renewal into thousands of lapses. So a keep-alive is sent only for a lease believed
alive with :data:`MARGIN` to spare (counted from when its last confirmation was *sent*;
the server counts from when it received it, later), and a batch waits for its replies
no longer than its leases are believed (then the stream is started afresh).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Any

from ...errors import BackendUnavailable, LockError
from ._claim import ClaimState
from ._connection import Connection
from ._recipe import lease_seconds
from ._wire import Stream, brief, pb

__all__ = ["MARGIN", "LeaseSession"]

log = logging.getLogger("aiolock.backends.etcd")

#: A keep-alive is sent only for a lease believed alive this long after the send (s).
MARGIN = 0.1
#: Spare leases are kept for at most this many lease lengths (seconds) at once...
SPARE_TTLS = 8
#: ... and at most this many of one length.
SPARES = 32


class LeaseSession:
    """The leases of one connection: grants, spares, and batched keep-alives."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.stream: Stream | None = None
        self._waiting: dict[int, collections.deque[_Batch]] = {}
        #: lease seconds -> leases with no key on them: (id, last confirmed, ttl); granted
        #: ahead, or given back by a release (which deletes the key, not the lease). An
        #: acquire takes one and needs one request, not two.
        self.spares: dict[int, list[tuple[int, float, int]]] = {}
        self._replenishing: set[int] = set()
        self._last_reply = 0.0  # (monotonic) when the stream last answered anything

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
            async with asyncio.timeout(wait):
                return await batch.done
        except TimeoutError:
            if self.stream is stream and self._last_reply < since:
                # stuck, not slow (a member cut off, or a keep-alive waiting for a
                # revocation): afresh; a slow stream keeps its other batches going
                self.stream = None
                stream.close()
            raise BackendUnavailable(
                f"etcd at {self._conn.url} did not answer a keep-alive within {wait:.2f} s"
            ) from None
        finally:
            batch.done.cancel()

    async def refresh(self, st: ClaimState) -> bool:
        """Keep one claim's lease alive now; False if it is gone or not surely alive (a
        keep-alive for a lease the server may have expired would hold up the stream)."""
        assert st.lease is not None
        sent = time.monotonic()
        if st.believed_until() - sent < MARGIN:
            return False
        (ttl,) = await self.keep_alive([st.lease], st.believed_until())
        if ttl <= 0:
            return False
        st.confirm(sent, ttl)
        return True

    # -- grants and spares ----------------------------------------------------------------

    async def grant(self, st: ClaimState, ttl_ms: int) -> int:
        """A new lease for a claim, recorded in ``st`` before it is asked for (an abandon
        can revoke it before the reply)."""
        lease = st.lease = secrets.randbelow(2**62) + 1
        sent = time.monotonic()
        request = pb.LeaseGrantRequest(TTL=lease_seconds(ttl_ms), ID=lease)
        reply = await self._conn.unary("Lease", "LeaseGrant", request, "a lease grant")
        if reply.error:
            raise LockError(f"etcd at {self._conn.url} refused a lease: {reply.error}")
        st.confirm(sent, int(reply.TTL))
        return lease

    async def take(self, st: ClaimState, ttl_ms: int) -> int:
        """A lease for a claim: a spare one if it is fresh (over half its ttl left), else
        granted now; either way another spare is asked for in the background."""
        ttl_s = lease_seconds(ttl_ms)
        spares = self.spares.get(ttl_s, [])
        lease = 0
        while spares:
            lease, sent, granted = spares.pop()
            if sent + granted - time.monotonic() > granted / 2:
                st.lease = lease
                st.confirm(sent, granted)
                break
            self._conn.spawn(self._conn.revoke_quietly(lease))
            lease = 0
        if not spares:
            self.spares.pop(ttl_s, None)
            self._replenish(ttl_s)
        return lease or await self.grant(st, ttl_ms)

    def give_back(self, st: ClaimState, ttl_ms: int) -> None:
        """After a release that deleted the key: keep its lease as a spare."""
        if st.lease is None or not st.lease_ttl:
            return
        ttl_s = lease_seconds(ttl_ms)
        spares = self.spares.get(ttl_s)
        if spares is None and len(self.spares) + len(self._replenishing) < SPARE_TTLS:
            spares = self.spares[ttl_s] = []
        if spares is not None and len(spares) < SPARES and not self._conn.closed:
            spares.append((st.lease, st.confirmed, st.lease_ttl))
        else:
            self._conn.spawn(self._conn.revoke_quietly(st.lease))

    def _replenish(self, ttl_s: int) -> None:
        if (self._conn.closed or ttl_s in self.spares or ttl_s in self._replenishing
                or len(self.spares) + len(self._replenishing) >= SPARE_TTLS):
            return
        self._replenishing.add(ttl_s)
        self._conn.spawn(self._grant_spare(ttl_s))

    async def _grant_spare(self, ttl_s: int) -> None:
        lease = secrets.randbelow(2**62) + 1
        sent = time.monotonic()
        try:
            async with self._conn.bounded("a lease grant"):
                reply = await self._conn.unary(
                    "Lease", "LeaseGrant", pb.LeaseGrantRequest(TTL=ttl_s, ID=lease), "a lease grant")
            if not reply.error and not self._conn.closed:
                self.spares.setdefault(ttl_s, []).append((lease, sent, int(reply.TTL)))
        except Exception as exc:  # the next acquire grants its own
            log.debug("granting a spare etcd lease failed: %s", exc)
        finally:
            self._replenishing.discard(ttl_s)

    async def aclose(self) -> None:
        """Close the stream; revoke the spares (unused, they would expire by their ttl)."""
        if self.stream is not None:
            await self.stream.aclose()
        spares = [lease for pool in self.spares.values() for lease, _, _ in pool]
        self.spares.clear()
        if spares and self._conn.channel is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(min(1.0, self._conn.request_timeout)):
                    await asyncio.gather(*(
                        self._conn.unary("Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), "a revoke")
                        for lease in spares), return_exceptions=True)


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
