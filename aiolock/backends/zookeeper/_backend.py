"""The ZooKeeper backend's adapter: the core's single-attempt primitives (see
:mod:`aiolock.abc`), on the layers below (:mod:`._acquire`, :mod:`._watches`,
:mod:`._io`) and the pure recipe (:mod:`._recipe`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

from aiozk import exc as zkexc
from aiozk.states import States

from ..._holder import decode_holder
from ...abc import FAMILY_KIND, REVOKED, Capability, Claim, Kind, LockInfo, Waiter
from ...errors import BackendUnavailable
from ._acquire import _Acquire
from ._claim import known, state_of
from ._options import parse_url
from ._recipe import KIND_PREFIX, Node, decode_data, families, family_nodes, holders, lock_name
from ._session import CountedDelete, pipelined
from ._wire import SetData

__all__ = ["ZooKeeperBackend"]

log = logging.getLogger("aiolock.backends.zookeeper")

#: How long an abandoned claim's owner id is remembered, to delete a late-created node.
ABANDONED_KEEP = 120.0
#: A renewal within ``1 - RENEW_FRESH`` of the granted time after the last confirmation
#: is answered from that confirmation (no request).
RENEW_FRESH = 0.9


class ZooKeeperBackend(_Acquire):
    """Locks on a ZooKeeper ensemble, over one ``aiozk`` session.

    Build it from a URL with :func:`aiolock.connect` (``zookeeper://h1:2181,h2:2181/chroot``,
    ``zookeeper://user:password@h1:2181/chroot`` for digest auth) or pass an
    ``aiozk.ZKClient`` you already have (``ZooKeeperBackend(client=...)``; it is started if
    needed, used as it is -- no credentials -- and not closed for you).

    ``username``/``password``: digest credentials, sent on every connection. ``acl``:
    ``"creator"`` (the default with credentials: only that identity may change or delete
    the nodes aiolock creates, anyone may read them) or ``"open"`` (the default without).
    ``session_timeout`` (s, default 20): a lease is believed for at most this long.
    """

    schemes: ClassVar[tuple[str, ...]] = ("zookeeper", "zk")
    waiting_counted: ClassVar[frozenset[Kind]] = frozenset(Kind)  # every waiter has its node
    held_since_queued: ClassVar[bool] = True  # since: from the claim's node/key
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.FAIR, Capability.RWLOCK, Capability.SEMAPHORE, Capability.EVENTS,
         Capability.EXPIRY, Capability.DISTRIBUTED, Capability.HOLDERS, Capability.SCAN,
         Capability.REVOKE, Capability.ELECTION}
    )

    @classmethod
    def from_url(
        cls, url: str, *, session_timeout: float = 20.0, connect_timeout: float = 5.0,
        request_timeout: float = 5.0, username: str | None = None, password: str | None = None,
        acl: str | None = None,
    ) -> ZooKeeperBackend:
        """``zookeeper://[user:password@]host:port[,host:port...][/chroot][?acl=...]`` or
        ``zk://...``; the chroot defaults to ``/aiolock``, the port to 2181. The user and
        password (percent-encoded in the URL, or given as ``username=``/``password=``)
        are digest credentials; ``acl`` (query or keyword) is ``creator`` or ``open``."""
        parts = parse_url(url, cls.schemes, username=username, password=password, acl=acl)
        return cls(parts.hosts, parts.chroot, session_timeout=session_timeout,
                   connect_timeout=connect_timeout, request_timeout=request_timeout,
                   username=parts.username, password=parts.password, acl=parts.acl)

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        if not claims:
            return []
        await self._ready()
        state = self._client.session.state.current_state
        if state == States.LOST:
            return [None] * len(claims)  # the session is gone: so is every node it made
        if state != States.CONNECTED:
            raise BackendUnavailable(f"ZooKeeper connection to {self.url} is {state}: leases at risk")
        out: list[int | None] = []
        ask: list[tuple[int, Claim, str]] = []
        for i, claim in enumerate(claims):
            st = state_of(claim)
            if st.path is None or st.sid != self._sid:
                out.append(None)
                continue
            out.append(self._renewed_lately(claim))
            if out[-1] is None:
                ask.append((i, claim, st.path))
        if ask:
            sid = self._sid
            async with self._bounded("a renewal"):
                stamps = await asyncio.gather(*(self._stamp(c, p) for _, c, p in ask))
            for (i, claim, _), stat in zip(ask, stamps, strict=True):
                out[i] = self._granted_ms(claim) if stat is not None else self._gone(claim, sid)
        return out

    def _gone(self, claim: Claim, sid: int | None) -> int | None:
        """A held node found gone: REVOKED if an operator deleted it (the session lives on
        and our lease had not run out, so no contender reaped it as stale); else None."""
        stamped = state_of(claim).stamped
        if (sid == self._sid == self._client.session.session_id and stamped is not None
                and time.monotonic() - stamped[0] < stamped[1] / 1000):
            return REVOKED
        return None

    def _renewed_lately(self, claim: Claim) -> int | None:
        """Confirmed a moment ago (the grant itself: the core renews at once when the
        session timeout cut the lease below its ttl): the ms left from that confirmation,
        counted from when it was sent, instead of another request; None: ask."""
        stamped = state_of(claim).stamped
        if stamped is None or stamped[1] != claim.ttl_ms:
            return None
        granted = self._granted_ms(claim)
        left = stamped[0] * 1000 + granted - time.monotonic() * 1000
        return int(left) if left >= granted * RENEW_FRESH else None

    async def release(self, claim: Claim) -> bool:
        self._unwatch(claim)
        st = state_of(claim)
        path, sid = st.path, st.sid
        if path is None:
            return False
        if sid != self._sid:
            st.forget_node()
            return False
        repeated = st.releasing == sid  # an earlier release sent its delete and was interrupted
        st.releasing = sid
        request = CountedDelete(path=path, version=-1)
        async with self._bounded("a release"):
            try:
                await self._send(request)
                deleted = True
            except zkexc.NoNode:
                # A retry after a dropped connection (aiozk resends a request whose reply
                # was lost) finds nothing if the first attempt deleted the node: that is
                # a release, not a loss -- unless the session changed (expired: the server
                # deleted the node). A real loss by expiry shows in the lease's own clock.
                deleted = ((request.sends > 1 or repeated)
                           and self._client.session.session_id == sid)
        st.forget_node()
        self._reaper.forget(path)
        return deleted

    async def abandon(self, claim: Claim) -> None:
        parent = self._parent(claim.name)
        prefix = f"{KIND_PREFIX[claim.kind]}-{claim.owner}-"
        # remembered first: a create still in flight is deleted whenever it shows up
        self._abandoned[claim.owner] = (parent, prefix, time.monotonic() + ABANDONED_KEEP)
        self._forget_abandoned()
        self._unwatch(claim)
        if len(self._client.session.watch_callbacks) > 2 * len(self._watching) + 64:
            self._prune_callbacks()
        waiter = self._waiters.get(claim.owner)
        if waiter is not None and waiter.claim is claim:
            del self._waiters[claim.owner]
        st = state_of(claim)
        if st.path is None and not st.creating:
            return
        async with self._bounded("an abandon"):
            if st.path is not None:
                await self._delete(st.path)
            # a create may have been sent whose reply never came: find it by our id
            # (requests on one session run in order, so this listing sees it)
            for child in await self._children(parent):
                if child.startswith(prefix):
                    await self._delete(f"{parent}/{child}")
        st.forget_node()

    def _after_reconnect(self, expired: bool) -> None:
        super()._after_reconnect(expired)
        self._forget_abandoned()
        parents = {parent for parent, _, _ in self._abandoned.values()}
        if parents:
            self._spawn(self._sweep(parents))

    async def _sweep(self, parents: set[str]) -> None:
        """Delete the nodes of claims abandoned here that landed after all."""
        try:
            async with asyncio.timeout(self._request_timeout):
                for parent in parents:
                    for child in await self._children(parent):
                        if self._owned_elsewhere(child):
                            await self._delete(f"{parent}/{child}")
        except Exception as exc:  # retried after the next reconnect
            log.debug("sweeping abandoned ZooKeeper nodes failed: %s", exc)

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        claim = waiter.claim
        if self._waiters.get(claim.owner) is waiter:
            del self._waiters[claim.owner]
        self._unlisten_observer(waiter)
        st = known(claim)
        if st is None:
            return
        self._unwatch(claim)
        if (st.path is not None or st.creating) and not st.granted:
            # The core stopped waiting without a grant (a timeout, a cancellation) and
            # abandons only fair claims and writers; but every claim here keeps a place
            # in the queue, which would block the lock: give it up.
            self._spawn(self._abandon_later(claim))

    async def _abandon_later(self, claim: Claim) -> None:
        if claim.owner in self._abandoned or self._closed:
            return  # the core abandoned it already
        try:
            await self.abandon(claim)
        except Exception as exc:  # the janitor of a reconnect (or session end) covers it
            log.debug("giving up a ZooKeeper claim on %r failed: %s", claim.name, exc)

    async def _holders_now(
        self, parent: str, kind: Kind,
    ) -> tuple[list[Node], list[tuple[Node, bytes, Any]], bool]:
        """One family's nodes (not ours being abandoned), each holder's data and stat,
        and whether that is the full listing (else the holders may not know it yet, and
        no lease clock may start on them: see ``Reaper.to_read``)."""
        listed = family_nodes(await self._children(parent), kind)
        nodes = [n for n in listed if n.owner not in self._abandoned]
        if not nodes:
            return [], [], True
        limit = 1
        if kind is Kind.PERMIT:  # the limit is in the nodes' data
            first = await self._get(f"{parent}/{nodes[0].name}", watch=False)
            limit = decode_data(first[0])[1] if first is not None else 1
        held = holders(nodes, limit)
        got = await pipelined([self._get(f"{parent}/{n.name}", False) for n in held])
        found = [(n, g[0], g[1]) for n, g in zip(held, got, strict=True) if g is not None]
        return nodes, found, len(nodes) == len(listed)

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        parent = self._parent(name)
        async with self._bounded("an inspect"):
            nodes, held, full = await self._holders_now(parent, kind)
        now_wall, now = time.time(), time.monotonic()
        self._reaper.prune(parent, nodes, kind.family)
        live: list[tuple[Node, int, float, str, float]] = []
        for node, data, stat in held:
            ttl_ms, _, info = decode_data(data)
            if full and self._reaper.stale(f"{parent}/{node.name}", int(stat.version), ttl_ms, now):
                continue  # its owner stopped renewing
            left = (int(stat.modified) + ttl_ms) / 1000 - now_wall  # server clock, roughly
            # since it queued (server clock); decode_holder takes off what the record
            # says it queued (a claim granted after a wait writes it: aiolock._holder)
            since = now_wall - int(stat.created) / 1000
            live.append((node, int(stat.created_zxid), min(max(left, 0.0), ttl_ms / 1000), info, since))
        waiters = len(nodes) - len(held)
        if not live:
            return LockInfo(name, False, waiters=waiters, family=kind.family)
        exclusive = [czxid for node, czxid, *_ in live if node.kind.exclusive]
        return LockInfo(
            name, True, holders=len(live), token=exclusive[0] if exclusive else None,
            last_token=max(czxid for _, czxid, *_ in live),
            ttl_left=max(left for _, _, left, *_ in live), waiters=waiters, family=kind.family,
            held_by=tuple(decode_holder(info, since) for *_, info, since in live),
        )

    async def set_info(self, claim: Claim) -> bool:
        """Rewrite the held node's data with the new record (a renewal too), and, for a
        proclaim, the name's container's data, which wakes the election's observers."""
        st = known(claim)
        if st is None or not st.granted or st.path is None or st.sid != self._sid:
            return False
        async with self._bounded("a proclaim"):
            if claim.kind is not Kind.LEADER:
                return await self._stamp(claim, st.path) is not None
            touch = SetData(path=self._parent(claim.name), data=b"", version=-1)
            stat, _ = await pipelined([self._stamp(claim, st.path), self._send(touch)])
        return stat is not None

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        """Delete every holder node of ``name`` in ``kind``'s family: each holder's next
        renewal finds its node gone in a live session (revoked); the waiters' watches
        fire. Tokens (czxids) keep increasing."""
        parent = self._parent(name)
        async with self._bounded("a revocation"):
            _, held, _ = await self._holders_now(parent, kind)
            done = await asyncio.gather(*(self._delete(f"{parent}/{n.name}") for n, _, _ in held))
        return any(done)

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every held name starting with ``prefix``: the chroot's children (one listing,
        which needs read on the chroot), each name's children, then an inspect per
        family found."""
        async with self._bounded("a scan"):
            escaped = await self._children(self._chroot)
        if self._chroot == "/":  # the server's own node is no lock
            escaped = [e for e in escaped if e != "zookeeper"]
        names = sorted(n for n in map(lock_name, escaped) if n.startswith(prefix))
        for name in names:
            parent = self._parent(name)
            async with self._bounded("a scan"):
                kinds = [FAMILY_KIND[f] for f in families(await self._children(parent))]
            held = [info for info in [await self.inspect(name, k) for k in kinds] if info.held]
            for info in held:
                yield info

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        starting = self._starting
        if starting is not None and not starting.done():  # closed while connecting
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
        monitor, self._monitor = self._monitor, None
        if monitor is not None:
            monitor.cancel()
            with contextlib.suppress(BaseException):
                await monitor
        for task in list(self._tasks):
            task.cancel()
        for path in list(self._watching):
            self._drop_watch(path)
        self._waiters.clear()
        if not self._owns_client:
            return
        if self._started and self._healthy():
            try:
                async with asyncio.timeout(self._request_timeout):
                    await self._client.close()  # ends the session: its nodes go at once
                return
            except Exception as exc:
                log.warning("closing the ZooKeeper session failed: %s", exc)
        await self._teardown()

