"""Redis without scripting, the operator's side (SPEC §7) and a leader's ``proclaim`` (§8):
``inspect``, ``force_release`` and ``set_info`` as ``WATCH``/``MULTI``/``EXEC`` transactions.

What :mod:`aiolock.backends._redis_admin` does with Lua scripts, done by
:class:`~aiolock.backends._redis_txn.RedisTxnBackend` on the same keys (see
:mod:`aiolock.backends._redis_scripts`), so that what one path writes the other reads,
revokes or proclaims over. Each transaction runs on a connection of its own
(:mod:`aiolock.backends._redis_lend`); an aborted ``EXEC`` (another client changed a
watched key: a renewal's ``PEXPIRE`` is enough) is retried at once, at most
:data:`RETRIES` times, then :class:`~aiolock.BackendUnavailable` is raised.

* inspect: one ``MULTI``/``EXEC`` of reads, nothing watched: the lock hash (``owner``,
  ``token``, ``info``, ``since``, ``gttl``), its ``PTTL``, the counter ``...:seq``, the
  queue's length (``LLEN ...:q``) and ``TIME``; for a read-write lock or a semaphore
  (held through the Lua path) also its shared holders (``ZRANGE ...:h 0 -1 WITHSCORES``:
  the live ones score after now) and their records (``HGETALL ...:ht``). The values are
  put in the shape of the Lua path's ``INSPECT`` / ``INSPECT_SHARED`` reply and read by
  :func:`~aiolock.backends._redis_admin.lock_info`, so both paths report the same data
  alike. ``scan`` is the Lua path's own (:func:`~aiolock.backends._redis_admin.scan`:
  ``SCAN ... MATCH``, never ``KEYS``), reading each name found with this inspect.
* force_release (a plain lock or an election): ``WATCH`` the lock hash, the counter and
  the queue; read the owner, ``PTTL``, the first queue entries and the counter. Free:
  ``UNWATCH``, False. Held: ``MULTI``; ``SET <hash>:x:<owner> v PX <ms>`` (the Lua
  path's revocation mark, for a minute and at least twice the lease left: the holder's
  next renewal on either path answers :data:`~aiolock.abc.REVOKED`); ``DEL`` the hash;
  then as a release: hand it to the first live registered waiter, of either path (a new
  token, a message on that waiter's inbox; an election also publishes ``|`` on its
  channel), or publish ``|`` on the lock's channel, which wakes every waiter and
  observer of the name on either path; ``EXEC``: True. The counter is left alone (only a
  hand-over ``INCR``'s it): tokens keep increasing across a revocation.
* set_info (``Leadership.proclaim``): ``WATCH`` the lock hash; ``HGET`` its owner. Not
  this claim's: ``UNWATCH``, False. Else ``MULTI``, ``HSET`` its ``info``, ``PUBLISH |``
  on the name's channel (observers read it again), ``EXEC``: True.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..abc import FAMILY_KIND, Claim, Kind, LockInfo
from ..errors import BackendUnavailable, LockError
from ._redis_admin import REVOKED_KEEP_MS, lock_info
from ._redis_lend import ABORTED

if TYPE_CHECKING:
    from ._redis_txn import RedisTxnBackend

__all__ = ["HELD_IN_HASH", "RETRIES", "force_release", "inspect", "ms", "pairs", "set_info",
           "text"]

#: Aborted ``EXEC`` in a row before a revocation or a proclaim raises.
RETRIES = 10
#: The kinds this path holds: a plain lock and an election, in the lock hash alone.
HELD_IN_HASH = frozenset({Kind.LOCK, Kind.LEADER})
#: A shared holder's record in ``...:ht``: ``<token>|<since>|<info>``.
_RECORD = re.compile(r"^\d+\|(\d+)\|(.*)$", re.DOTALL)


async def inspect(backend: RedisTxnBackend, name: str, kind: Kind) -> LockInfo:
    """Who holds ``name`` in ``kind``'s family now, as the Lua path's inspect says it."""
    base = backend._base(name, kind)
    shared = kind not in HELD_IN_HASH
    more = (("ZRANGE", base + ":h", 0, -1, "WITHSCORES"), ("HGETALL", base + ":ht"))
    async with backend._tx_lent("MULTI/EXEC inspect") as conn:
        *_, done = await conn.run(
            ("MULTI",), ("HMGET", base, "owner", "token", "info", "since", "gttl"),
            ("PTTL", base), ("GET", base + ":seq"), ("LLEN", base + ":q"), ("TIME",),
            *(more if shared else ()), ("EXEC",),
        )
    (owner, token, info, since, gttl), pttl, last, queued, now, *rest = done
    now, pttl = ms(now), int(pttl)
    head = [owner or "", -1 if token is None else int(token), pttl,
            -1 if last is None else int(last), int(queued)]
    held = _held_ms(since, gttl, pttl, now)
    if not shared:
        return lock_info(name, kind, [*head, info or "", held])
    holders, records = (pairs(r) for r in rest)
    live = [(m, int(float(score))) for m, score in holders if float(score) > now]
    record = dict(records)
    found: list[Any] = []
    for member, _ in live:
        parts = _RECORD.match(text(record.get(member) or ""))
        found += [parts[2], now - int(parts[1])] if parts else ["", -1]
    left = max(end for _, end in live) - now if live else -1
    return lock_info(name, kind, [*head, len(live), left, info or "", held, found])


async def force_release(backend: RedisTxnBackend, name: str, kind: Kind) -> bool:
    """Revoke the holder of ``name`` in ``kind``'s family (a plain lock or an election);
    True if it was held."""
    kind = FAMILY_KIND[kind.family]
    if kind not in HELD_IN_HASH:
        raise ValueError(f"{backend.url} runs without Lua scripts: only lock() and election "
                         f"names can be revoked, got kind {kind.value!r}")
    from ._redis_txn import QUEUE_LOOK  # (that module imports this one)

    base = backend._base(name, kind)
    seq, queue = base + ":seq", base + ":q"
    async with backend._tx_lent("WATCH/MULTI/EXEC force_release") as conn:
        for _ in range(RETRIES):
            _, owner, pttl, waiting, last = await conn.run(
                ("WATCH", base, seq, queue), ("HGET", base, "owner"), ("PTTL", base),
                ("LRANGE", queue, 0, QUEUE_LOOK - 1), ("GET", seq),
            )
            if owner is None:
                await conn.unwatch()
                return False
            keep = max(REVOKED_KEEP_MS, 2 * int(pttl))
            plan, _ = await backend._tx_plan(conn, base, "", waiting, last,
                                             announce=kind is Kind.LEADER, passed=text(owner))
            *_, done = await conn.run(
                ("MULTI",), ("SET", f"{base}:x:{text(owner)}", "v", "PX", keep), ("DEL", base),
                *plan, ("EXEC",),
            )
            if done is not ABORTED:
                break
            backend.conflicts += 1
        else:
            raise BackendUnavailable(f"the revocation of {name!r} on {backend.url} kept "
                                     f"conflicting with other clients")
    return True


async def set_info(backend: RedisTxnBackend, claim: Claim) -> bool:
    """Store ``claim.info`` as the held claim's record and wake the name's listeners;
    False if it no longer holds."""
    if claim.kind not in HELD_IN_HASH:
        raise LockError(f"{claim.kind.value} claims need Lua scripts ({backend.url} runs "
                        "without them)")
    base = backend._base(claim.name, claim.kind)
    async with backend._tx_lent("WATCH/MULTI/EXEC set_info") as conn:
        for _ in range(RETRIES):
            _, owner = await conn.run(("WATCH", base), ("HGET", base, "owner"))
            if owner is None or text(owner) != claim.owner:
                await conn.unwatch()
                return False
            announce = [("PUBLISH", base, "|")] if claim.kind is Kind.LEADER else []
            *_, done = await conn.run(("MULTI",), ("HSET", base, "info", claim.info),
                                      *announce, ("EXEC",))
            if done is not ABORTED:
                return True
            backend.conflicts += 1
    raise BackendUnavailable(f"the holder record of {claim.name!r} on {backend.url} kept "
                             f"conflicting with other clients")


def _held_ms(since: Any, gttl: Any, pttl: int, now: int) -> int:
    """Ms a lock hash's holder has held it: from ``since`` (server ms of the grant), or,
    where the Lua path granted it without reading the clock, from ``gttl`` (the lease's
    ms at the grant) and the ms left; -1 if neither is known (the Lua ``held_ms``)."""
    if since:  # None, or '' (the Lua path's grant: unknown until its first renewal)
        return max(now - int(since), 0)
    if gttl is not None and pttl >= 0:
        return max(int(gttl) - pttl, 0)
    return -1


def pairs(reply: Any) -> list[tuple[Any, Any]]:
    """``(field, value)`` pairs of a ``WITHSCORES`` or ``HGETALL`` reply, as RESP2 (a flat
    list) or RESP3 (pairs, a map) gives it."""
    if isinstance(reply, dict):
        return list(reply.items())
    if reply and isinstance(reply[0], list | tuple):
        return [(pair[0], pair[1]) for pair in reply]
    return list(zip(reply[::2], reply[1::2], strict=True))


def ms(time_reply: Any) -> int:
    """A ``TIME`` reply (seconds, microseconds) in milliseconds."""
    return int(time_reply[0]) * 1000 + int(time_reply[1]) // 1000


def text(value: Any) -> str:
    """A reply as ``str`` (aiolock's own connections give bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)
