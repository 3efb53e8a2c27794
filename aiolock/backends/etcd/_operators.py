"""Keys, and what operators read or do: ``inspect`` (``status``), ``scan``,
``force_release``. A mixin of :class:`._backend.EtcdBackend`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, unquote

from ..._holder import decode_holder
from ...abc import FAMILY_KIND, Claim, Kind, LockInfo
from . import _recipe as recipe
from ._claim import state
from ._connection import Connection
from ._recipe import KIND, range_end
from ._wire import ASCEND, CREATE, EQUAL, SORT_CREATE, pb

__all__ = ["SCAN_PAGE", "Operators"]

#: Keys per page of a scan.
SCAN_PAGE = 500


class Operators:
    """Key names and the operators' reads (see the package doc for the layout)."""

    _conn: Connection
    _prefix: str
    #: releases and abandons under way, by family prefix: an inspect waits for them
    #: (requests may take different members: this keeps them in order for the caller)
    _deleting: dict[bytes, set[asyncio.Future[None]]]

    def _family_prefix(self, name: str, kind: Kind) -> bytes:
        return f"{self._prefix}/{kind.family}/{quote(name, safe='')}/".encode()

    def _claim_key(self, claim: Claim) -> bytes:
        st = state(claim)
        if st.key is None:
            kind = f"{KIND[claim.kind]}-{claim.owner}".encode()
            st.key = self._family_prefix(claim.name, claim.kind) + kind
        return st.key

    def _token_key(self, name: str, kind: Kind) -> bytes:
        """A key without a lease, rewritten with every new claim key of the family: its
        mod_revision is the newest claim's create_revision, after every key is gone."""
        return f"{self._prefix}/token/{kind.family}/{quote(name, safe='')}".encode()

    def _listing(self, name: str, kind: Kind) -> Any:
        prefix = self._family_prefix(name, kind)
        return pb.RequestOp(request_range=pb.RangeRequest(
            key=prefix, range_end=range_end(prefix), sort_target=SORT_CREATE, sort_order=ASCEND))

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        """Holders, token and time left (the server's, in whole seconds) from one read;
        ``last_token`` from the family's token key once no claim key is left."""
        prefix = self._family_prefix(name, kind)
        read = pb.TxnRequest(success=[self._listing(name, kind), pb.RequestOp(
            request_range=pb.RangeRequest(key=self._token_key(name, kind)))])
        pending = self._deleting.get(prefix)
        if pending:  # our own releases first
            await asyncio.wait(list(pending), timeout=self._conn.request_timeout)
        async with self._conn.bounded("an inspect"):
            reply = await self._conn.unary("KV", "Txn", read, "an inspect")
            entries = recipe.entries(reply.responses[0].response_range.kvs, prefix)
            counter = reply.responses[1].response_range.kvs
            revs = [e.rev for e in entries] + [int(kv.mod_revision) for kv in counter]
            last = max(revs) if revs else None
            holders = recipe.holders(entries, entries[0].limit) if entries else []
            lives = await asyncio.gather(*(self._conn.unary(
                "Lease", "LeaseTimeToLive", pb.LeaseTimeToLiveRequest(ID=e.lease), "an inspect")
                for e in holders))
        # (the server truncates the time left to whole seconds, -1 once it expired)
        live = [(e, min(e.ttl_ms / 1000, r.TTL + 0.5)) for e, r in zip(holders, lives, strict=True)
                if r.TTL >= 0]
        waiters = len(entries) - len(holders)
        if not live:
            return LockInfo(name, False, last_token=last, waiters=waiters, family=kind.family)
        exclusive = [e.rev for e, _ in live if e.kind.exclusive]
        now = time.time()  # "since": from the stamp the writer put (etcd keeps no times)
        return LockInfo(
            name, True, holders=len(live), token=exclusive[0] if exclusive else None,
            last_token=last, ttl_left=max(left for _, left in live), waiters=waiters,
            family=kind.family,
            held_by=tuple(decode_holder(e.info, None if e.stamp is None else now - e.stamp)
                          for e, _ in live),
        )

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        """Delete every holder's key of ``name`` in ``kind``'s family: their next renewal
        finds the key gone under a live lease (revoked); the waiters' watches fire."""
        prefix = self._family_prefix(name, kind)
        request = pb.RangeRequest(key=prefix, range_end=range_end(prefix),
                                  sort_target=SORT_CREATE, sort_order=ASCEND)
        async with self._conn.bounded("a revocation"):
            reply = await self._conn.unary("KV", "Range", request, "a revocation")
            entries = recipe.entries(reply.kvs, prefix)
            holders = recipe.holders(entries, entries[0].limit) if entries else []
            if not holders:
                return False
            # each only if it is still the key we saw (not a later claim's)
            deletes = [pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=e.key)) for e in holders]
            compare = [pb.Compare(key=e.key, target=CREATE, result=EQUAL, create_revision=e.rev)
                       for e in holders]
            txn = pb.TxnRequest(compare=compare, success=deletes)
            done = await self._conn.unary("KV", "Txn", txn, "a revocation")
        return bool(done.succeeded)

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        """Every held name starting with ``prefix``: each family's keys under the escaped
        prefix, read in pages of :data:`SCAN_PAGE` keys (keys only), then inspected."""
        await self._conn.ready()
        for family in ("lock", "rw", "sem", "elect"):
            for name in await self._names(family, prefix):
                info = await self.inspect(name, FAMILY_KIND[family])
                if info.held:
                    yield info

    async def _names(self, family: str, prefix: str) -> list[str]:
        start = f"{self._prefix}/{family}/{quote(prefix, safe='')}".encode()
        base = len(f"{self._prefix}/{family}/")
        end = range_end(f"{self._prefix}/{family}/".encode()) if not prefix else range_end(start)
        names: list[str] = []
        key = start
        while True:
            request = pb.RangeRequest(key=key, range_end=end, keys_only=True, limit=SCAN_PAGE)
            async with self._conn.bounded("a scan"):
                reply = await self._conn.unary("KV", "Range", request, "a scan")
            for kv in reply.kvs:
                name = unquote(bytes(kv.key)[base:].split(b"/", 1)[0].decode(errors="replace"))
                if (not names or names[-1] != name) and name.startswith(prefix):
                    names.append(name)
            if not reply.more or not reply.kvs:
                return names
            key = bytes(reply.kvs[-1].key) + b"\0"

