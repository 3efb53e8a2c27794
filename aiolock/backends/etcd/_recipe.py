"""The etcd recipe, pure: from a listing of one family's keys (oldest first), who holds
and which keys a waiter watches. No I/O here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...abc import Claim, Kind
from .. import _queue

KIND = {Kind.LOCK: "lock", Kind.READ: "read", Kind.WRITE: "write", Kind.PERMIT: "permit",
        Kind.LEADER: "leader"}
_BY_NAME = {v: k for k, v in KIND.items()}


@dataclass(slots=True, frozen=True)
class Entry:
    key: bytes
    kind: Kind
    owner: str
    rev: int  # create_revision: the fencing token when it holds
    lease: int
    ttl_ms: int
    limit: int
    stamp: float | None = None  #: wall-clock time the key was written (the writer's clock)
    info: str = ""  #: the holder record (aiolock._holder)


def value(claim: Claim, stamp: float) -> bytes:
    """A claim key's value: ``ttl_ms:limit:stamp:info``."""
    return f"{claim.ttl_ms}:{claim.limit}:{stamp:.3f}:{claim.info}".encode()


def entries(kvs: Sequence[Any], prefix: bytes) -> list[Entry]:
    """The claims of one family, oldest first (``kvs`` sorted by create_revision)."""
    out = []
    for kv in kvs:
        kind_name, sep, owner = kv.key[len(prefix):].decode(errors="replace").partition("-")
        kind = _BY_NAME.get(kind_name)
        if kind is None or not sep:
            continue
        stamp: float | None = None
        info = ""
        try:
            ttl, _, rest = kv.value.decode().partition(":")
            limit, _, rest = rest.partition(":")
            ttl_ms, lim = int(ttl), int(limit or 1)
            when, _, info = rest.partition(":")
            stamp = float(when) if when else None
        except (UnicodeDecodeError, ValueError):
            ttl_ms, lim = 30_000, 1
        out.append(Entry(kv.key, kind, owner, int(kv.create_revision), int(kv.lease), ttl_ms, lim,
                         stamp, info))
    return out


def holders(entries: list[Entry], limit: int) -> list[Entry]:
    """The entries in a granted position (:func:`aiolock.backends._queue.holders`)."""
    return _queue.holders(entries, limit)


def watch_targets(entries: list[Entry], index: int, claim: Claim) -> list[Entry]:
    """The entries whose deletion may grant the one at ``index`` (not granted now)."""
    return _queue.watch_targets(entries, index, claim.kind, claim.limit)


def range_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def lease_seconds(ttl_ms: int) -> int:
    return max(1, math.ceil(ttl_ms / 1000))
