"""What Redlock asks of ONE of its Redis nodes: one script call per primitive.

A node is a :class:`~aiolock.backends.redis.RedisBackend` used as a connection: its
keys layout (``<prefix>:<family>:{<name>}``), its script runner (EVALSHA, loaded again
on NOSCRIPT, every error mapped by :func:`aiolock.backends._redis_errors.redis_error`)
and its pub/sub :class:`~aiolock.backends._redis_pubsub.Signals`; the scripts are
Redlock's own (:mod:`aiolock.backends._redlock_scripts`). Each function answers for
this node only; :mod:`aiolock.backends.redlock` decides by majority.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..abc import Busy, Claim, Granted, Kind
from ..errors import LockError
from . import _redlock_scripts as lua
from ._redis_errors import CONNECTING, redis_error
from .redis import RedisBackend, redis_key_part

__all__ = ["NodeView", "acquire", "inspect", "keys", "prepare", "raise_token", "release", "renew",
           "repair", "revoke", "scan", "set_info"]

#: How long an abandoned claim stays barred from a late grant (ms), at least.
TOMBSTONE_MS = 60_000
#: How long a release through a redis-py client stays recognisable to its resend (ms).
RELEASED_MARK_MS = 60_000
#: How long a revoked claim's renewal answers "revoked" (ms), at least (and at least
#: twice what was left of its lease).
REVOKED_MS = 60_000
#: Keys per SCAN step.
SCAN_COUNT = 200


@dataclass(slots=True, frozen=True)
class NodeView:
    """What one node says about one name (see ``lua.INSPECT``)."""

    owner: str
    token: int
    pttl: int
    last: int
    info: str
    since_ms: int


async def prepare(node: RedisBackend) -> None:
    """Connect and load Redlock's scripts now rather than at their first use, where a
    request whose script must be loaded first could be overtaken on the node's
    connection by one sent after it (an acquire by the release of its partial grant)."""
    await node.connect()
    try:
        await asyncio.gather(*(node._call("SCRIPT", "LOAD", s.source) for s in lua.SCRIPTS))
    except Exception as exc:
        raise redis_error(exc, node.url, CONNECTING) from exc


def keys(node: RedisBackend, name: str, kind: Kind, owner: str = "-") -> list[str]:
    """KEYS of Redlock's scripts for ``name`` in ``kind``'s family on ``node``."""
    base = node._base(name, kind)
    return [base, base + ":seq", base + ":x:" + owner]


def _claim_keys(node: RedisBackend, claim: Claim) -> list[str]:
    return keys(node, claim.name, claim.kind, claim.owner)


async def acquire(node: RedisBackend, claim: Claim) -> Granted | Busy:
    reply = await node._run(lua.ACQUIRE, _claim_keys(node, claim), claim.owner, claim.ttl_ms,
                            claim.info, "1" if claim.kind is Kind.LEADER else "0")
    if reply[0] == 1:
        return Granted(int(reply[1]), int(reply[2]))
    if reply[0] == -1:
        raise LockError(f"claim on {claim.name!r} was abandoned")
    return Busy(int(reply[1]) / 1000)


async def release(node: RedisBackend, claim: Claim, mode: str = "r") -> bool:
    """``mode``: 'r' release, 'd' drop a partial grant, 'a' abandon (see ``lua.RELEASE``)."""
    retried: list[bool] = []
    if mode == "a":
        mark = max(TOMBSTONE_MS, 2 * claim.ttl_ms)
    else:  # our own connection resends by itself, and tells us (on_retry): no marker
        mark = 0 if node.ordered or mode == "d" else RELEASED_MARK_MS
    held = await node._run(lua.RELEASE, _claim_keys(node, claim), claim.owner, mode, mark,
                           on_retry=lambda: retried.append(True))
    # a resend that finds nothing after the first copy released it: still a release
    return bool(int(held)) or (mode == "r" and bool(retried))


async def renew(node: RedisBackend, claims: list[Claim]) -> list[int]:
    """Per claim: ms granted, 0 if not held here, -1 if revoked."""
    flat_keys: list[str] = []
    args: list[Any] = []
    for claim in claims:
        flat_keys += _claim_keys(node, claim)[::2]
        args += (claim.owner, claim.ttl_ms)
    return [int(ms) for ms in await node._run(lua.RENEW, flat_keys, *args)]


async def inspect(node: RedisBackend, name: str, kind: Kind) -> NodeView:
    owner, token, pttl, last, info, since = await node._run(lua.INSPECT, keys(node, name, kind)[:2])
    return NodeView(_text(owner), int(token), int(pttl), int(last), _text(info), int(since))


async def set_info(node: RedisBackend, claim: Claim) -> bool:
    announce = "1" if claim.kind is Kind.LEADER else "0"
    return int(await node._run(lua.SET_INFO, _claim_keys(node, claim)[:1], claim.owner, claim.info,
                               announce)) == 1


async def revoke(node: RedisBackend, name: str, kind: Kind) -> bool:
    return int(await node._run(lua.REVOKE, keys(node, name, kind)[:1], REVOKED_MS)) == 1


async def raise_token(node: RedisBackend, claim: Claim, token: int) -> bool:
    return int(await node._run(lua.RAISE, _claim_keys(node, claim), claim.owner, token)) == 1


async def repair(node: RedisBackend, claim: Claim, token: int) -> bool:
    reply = await node._run(lua.REPAIR, _claim_keys(node, claim), claim.owner, token, claim.ttl_ms,
                            claim.info)
    return int(reply) == 1


async def scan(node: RedisBackend, prefix: str) -> AsyncIterator[tuple[str, str]]:
    """(family, name) of every name starting with ``prefix`` held on ``node`` now, one
    bounded SCAN step per request."""
    pattern = f"{node._prefix}:*:{{{_glob(redis_key_part(prefix))}*}}"
    head = len(node._prefix) + 1
    cursor = "0"
    while True:
        step = await node._run(lua.SCAN, [], cursor, pattern, SCAN_COUNT)
        cursor = _text(step[0])
        for key in map(_text, step[1:]):
            family, _, tagged = key[head:].partition(":")
            yield family, _unescape(tagged[1:-1])
        if cursor == "0":
            return


def _glob(text: str) -> str:
    """``text`` matched literally in a Redis glob pattern."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def _unescape(part: str) -> str:
    """The inverse of :func:`~aiolock.backends.redis.redis_key_part`."""
    return part.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
