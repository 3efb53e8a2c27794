"""``memory://[name]``: an in-process lock server -- the embedded default.

Every :func:`aiolock.connect` to the same ``memory://name`` in one process shares one
store, so separate connections behave like separate clients of one server: leases
expire on the monotonic clock unless renewed, tokens come from a per-name counter that
never resets, and releases wake waiters directly. It offers every primitive (mutex,
fair, read-write, semaphore, election), holder records, listing and revocation; it is
not shared between processes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar
from urllib.parse import urlsplit

from .._holder import decode_holder
from ..abc import FAMILY_KIND, REVOKED, Backend, Busy, Capability, Claim, Granted, Kind, LockInfo, Waiter

__all__ = ["MemoryBackend"]


#: How long a revoked claim's renewal still answers "revoked" (s), at least its ttl.
REVOKED_KEEP = 60.0


@dataclass(slots=True)
class _Holder:
    kind: Kind
    token: int
    expires_at: float
    info: str = ""
    since: float = 0.0  # when it was granted (monotonic)


@dataclass(slots=True)
class _Resource:
    """One name of one family (lock, rw or semaphore)."""

    holders: dict[str, _Holder] = field(default_factory=dict)
    #: waiters that keep a place: fair claims, and writers (who block new readers)
    queue: dict[str, tuple[float, Kind]] = field(default_factory=dict)
    listeners: set[Waiter] = field(default_factory=set)
    #: owners revoked by force_release -> until when their renewal says so
    revoked: dict[str, float] = field(default_factory=dict)

    def prune(self, now: float) -> None:
        for owner in [o for o, h in self.holders.items() if h.expires_at <= now]:
            del self.holders[owner]
        for owner in [o for o, (dl, _) in self.queue.items() if dl <= now]:
            del self.queue[owner]
        for owner in [o for o, until in self.revoked.items() if until <= now]:
            del self.revoked[owner]

    def wake(self) -> None:
        hint = next(iter(self.queue), None)
        for waiter in list(self.listeners):
            waiter.wake(hint)


class _Store:
    def __init__(self) -> None:
        self.resources: dict[tuple[str, str], _Resource] = {}
        self.tokens: dict[tuple[str, str], int] = {}

    def get(self, claim_or_key: tuple[str, str]) -> _Resource:
        res = self.resources.get(claim_or_key)
        if res is None:
            res = self.resources[claim_or_key] = _Resource()
        return res

    def tidy(self, key: tuple[str, str]) -> None:
        res = self.resources.get(key)
        if res is not None and not (res.holders or res.queue or res.listeners or res.revoked):
            del self.resources[key]


_STORES: dict[str, _Store] = {}


def _key(claim: Claim) -> tuple[str, str]:
    return (claim.kind.family, claim.name)


class MemoryBackend(Backend):
    """In-process backend; ``MemoryBackend("name")`` shares the store ``memory://name``."""

    schemes: ClassVar[tuple[str, ...]] = ("memory",)
    # writers and candidates keep a place in the queue (readers behind a writer, locks
    # and permits only listen)
    waiting_counted: ClassVar[frozenset[Kind]] = frozenset({Kind.WRITE, Kind.LEADER})
    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.FAIR, Capability.RWLOCK, Capability.SEMAPHORE, Capability.EVENTS,
         Capability.EXPIRY, Capability.HOLDERS, Capability.SCAN, Capability.REVOKE,
         Capability.ELECTION}
    )

    def __init__(self, name: str = "") -> None:
        self._name = name
        self._store = _STORES.setdefault(name, _Store())

    @classmethod
    def from_url(cls, url: str, **options: object) -> MemoryBackend:
        if options:
            raise ValueError(f"memory:// takes no options, got {sorted(options)}")
        parts = urlsplit(url)
        if parts.query or parts.fragment:
            raise ValueError(f"memory:// takes no options or query, got {url!r}; "
                             "expected memory:// or memory://name")
        return cls((parts.netloc + parts.path).strip("/"))

    @property
    def url(self) -> str:
        return f"memory://{self._name}"

    async def try_acquire(self, claim: Claim) -> Granted | Busy:
        now = time.monotonic()
        key = _key(claim)
        res = self._store.get(key)
        res.prune(now)
        mine = res.holders.get(claim.owner)
        if mine is not None:
            return Granted(mine.token, round((mine.expires_at - now) * 1000))
        blocked_by = self._blocking(res, claim)
        if blocked_by is None:
            res.queue.pop(claim.owner, None)
            token = self._store.tokens.get(key, 0) + 1
            self._store.tokens[key] = token
            res.holders[claim.owner] = _Holder(
                claim.kind, token, now + claim.ttl_ms / 1000, claim.info, now
            )
            if claim.kind is Kind.LEADER:
                res.wake()  # observers: a new leader
            return Granted(token, claim.ttl_ms)
        if claim.fair or claim.kind is Kind.WRITE:
            deadline = now + claim.ttl_ms / 1000
            res.queue[claim.owner] = (deadline, claim.kind)  # keeps its place if present
            blocked_by = min(blocked_by, claim.ttl_ms / 3000)  # come back to keep the place
        return Busy(max(blocked_by, 0.001))

    def _blocking(self, res: _Resource, claim: Claim) -> float | None:
        """None if ``claim`` can be granted now, else seconds until that may change."""
        now = time.monotonic()
        refresh = claim.ttl_ms / 3000
        if claim.fair:
            for owner, (deadline, _) in res.queue.items():
                if owner == claim.owner:
                    break
                return min(deadline - now, refresh)  # someone is ahead of us
        holders = res.holders.values()
        kind = claim.kind
        if kind.exclusive:
            conflict = list(holders)
        elif kind is Kind.READ:
            conflict = [h for h in holders if h.kind is Kind.WRITE]
            if not conflict:
                writers = [dl for o, (dl, k) in res.queue.items() if k is Kind.WRITE]
                if writers:  # writer preference: a waiting writer goes before new readers
                    return min(min(writers) - now, refresh)
        else:
            conflict = list(holders) if len(res.holders) >= claim.limit else []
        if not conflict:
            return None
        return min(h.expires_at for h in conflict) - now

    async def renew(self, claims: Sequence[Claim]) -> list[int | None]:
        now = time.monotonic()
        out: list[int | None] = []
        for claim in claims:
            res = self._store.resources.get(_key(claim))
            holder = res.holders.get(claim.owner) if res is not None else None
            if res is not None and claim.owner in res.revoked:
                out.append(REVOKED)
            elif holder is None or holder.expires_at <= now:
                out.append(None)
            else:
                holder.expires_at = now + claim.ttl_ms / 1000
                out.append(claim.ttl_ms)
        return out

    async def release(self, claim: Claim) -> bool:
        key = _key(claim)
        res = self._store.resources.get(key)
        if res is None:
            return False
        holder = res.holders.pop(claim.owner, None)
        held = holder is not None and holder.expires_at > time.monotonic()
        if holder is not None:
            res.wake()
        self._store.tidy(key)
        return held

    async def abandon(self, claim: Claim) -> None:
        key = _key(claim)
        res = self._store.resources.get(key)
        if res is None:
            return
        was_first = next(iter(res.queue), None) == claim.owner
        queued = res.queue.pop(claim.owner, None) is not None
        held = res.holders.pop(claim.owner, None) is not None
        if held or (queued and (was_first or claim.kind is Kind.WRITE)):
            res.wake()
        self._store.tidy(key)

    async def listen(self, name: str, kind: Kind, waiter: Waiter) -> None:
        self._store.get((kind.family, name)).listeners.add(waiter)

    def unlisten(self, name: str, kind: Kind, waiter: Waiter) -> None:
        key = (kind.family, name)
        res = self._store.resources.get(key)
        if res is not None:
            res.listeners.discard(waiter)
            self._store.tidy(key)

    async def inspect(self, name: str, kind: Kind = Kind.LOCK) -> LockInfo:
        family = kind.family
        key = (family, name)
        now = time.monotonic()
        res = self._store.resources.get(key)
        last = self._store.tokens.get(key)
        if res is None:
            return LockInfo(name, False, last_token=last, family=family)
        res.prune(now)
        holders = sorted(res.holders.values(), key=lambda h: h.token)
        if not holders:
            return LockInfo(name, False, last_token=last, waiters=len(res.queue), family=family)
        exclusive = [h for h in holders if h.kind.exclusive]
        return LockInfo(
            name, True, holders=len(holders),
            token=exclusive[0].token if exclusive else None, last_token=last,
            ttl_left=max(h.expires_at for h in holders) - now, waiters=len(res.queue),
            held_by=tuple(decode_holder(h.info, now - h.since) for h in holders), family=family,
        )

    async def set_info(self, claim: Claim) -> bool:
        res = self._store.resources.get(_key(claim))
        holder = res.holders.get(claim.owner) if res is not None else None
        if res is None or holder is None or holder.expires_at <= time.monotonic():
            return False
        holder.info = claim.info
        if claim.kind is Kind.LEADER:  # a proclaim: the observers listen
            res.wake()
        return True

    async def force_release(self, name: str, kind: Kind = Kind.LOCK) -> bool:
        key = (kind.family, name)
        res = self._store.resources.get(key)
        if res is None:
            return False
        now = time.monotonic()
        res.prune(now)
        revoked = list(res.holders.items())
        for owner, holder in revoked:
            keep = max(REVOKED_KEEP, holder.expires_at - holder.since)
            res.revoked[owner] = now + keep
        res.holders.clear()
        if revoked:
            res.wake()
        self._store.tidy(key)
        return bool(revoked)

    async def scan(self, prefix: str = "") -> AsyncIterator[LockInfo]:
        now = time.monotonic()
        for family, name in sorted(self._store.resources):
            res = self._store.resources.get((family, name))
            if res is None or not name.startswith(prefix):
                continue
            res.prune(now)
            if res.holders:
                yield await self.inspect(name, FAMILY_KIND[family])

    async def aclose(self) -> None:
        return None
