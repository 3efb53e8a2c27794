"""The operator's view of the Redis backends (SPEC §7): who holds a name, every name
held (``SCAN``), revocation, and an elected leader's ``proclaim``.

Holder records are written by the acquire scripts themselves (no extra round trip): a
plain lock's, a writer's and a leader's beside ``owner`` and ``token`` in the lock hash
(fields ``info`` and ``since``, the grant's server time in ms), a reader's or a permit's
in the holder records hash (``<token>|<since>|<info>``); see
:mod:`aiolock.backends._redis_scripts`. :func:`inspect` reads them back with the
server's own clock, so ``Holder.since`` does not depend on the client's.

:func:`scan` walks the keyspace with ``SCAN ... MATCH`` (never ``KEYS``: it does not
block the server), on every master of a Cluster, and reports each name that has a lock
hash or a live shared holder, as the backend's own ``inspect`` reads it: the transaction
path (:mod:`aiolock.backends._redis_txn_ops`) scans with this code too, and reads its
values into the replies :func:`lock_info` takes, so both paths list the same data
alike. :func:`force_release` runs ``REVOKE``: every holder is removed and marked revoked
(their next renewal answers :data:`aiolock.abc.REVOKED`), the token counter is left
alone, and the waiters are woken -- a plain lock or an election is handed to its first
registered waiter, as a release would.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from .._holder import decode_holder
from ..abc import FAMILY_KIND, Claim, Kind, LockInfo
from ._redis_scripts import INSPECT, LIB, WAITER, Script
from ._redis_scripts_shared import INSPECT_SHARED

if TYPE_CHECKING:
    from .redis import RedisBackend

__all__ = ["REVOKED_KEEP_MS", "REVOKE", "SET_INFO", "force_release", "inspect", "lock_info",
           "scan", "set_info"]

#: How long a revoked holder's renewal still answers "revoked" (ms), at least.
REVOKED_KEEP_MS = 60_000
#: Keys asked for per ``SCAN`` step.
SCAN_COUNT = 1000

#: REVOKE -- an operator removes every holder of one name in one family.
#: KEYS     all seven (see ``_redis_scripts``)
#: ARGV[1]  'x': an exclusive lock or election (hand it to the first registered waiter);
#:          'rw': the writer and every reader; 'sem': every permit
#: ARGV[2]  "1" to announce on KEYS[1] (an election)   ARGV[3]  ms a mark lives, at least
#: ARGV[4]  "1" to trust PUBLISH counts to tell live waiters (RELEASE's ARGV[9])
#: marks    each holder's waiter key ``v`` (its renewal then answers -1) for at least
#:          twice its remaining lease; the token counter is left alone
#: returns  how many holders were revoked
REVOKE = Script("revoke", LIB + WAITER + """
local now = server_now()
local revoked = 0
local function mark(owner, left)
  redis.call('set', KEYS[1] .. ':x:' .. owner, 'v', 'PX', math.max(tonumber(ARGV[3]), 2 * left))
  revoked = revoked + 1
end
local holder = redis.call('hget', KEYS[1], 'owner')
if holder then
  mark(holder, redis.call('pttl', KEYS[1]))
  redis.call('del', KEYS[1])
end
if ARGV[1] ~= 'x' then
  local shared = redis.call('zrangebyscore', KEYS[6], '(' .. now, '+inf', 'WITHSCORES')
  for i = 1, #shared, 2 do mark(shared[i], tonumber(shared[i + 1]) - now) end
  redis.call('del', KEYS[6], KEYS[7])
end
if revoked == 0 then return 0 end
if ARGV[1] == 'x' then
  if not hand_over(ARGV[2] == '1', ARGV[4] == '1', holder) then redis.call('publish', KEYS[1], '|') end
else
  redis.call('publish', KEYS[1], '|' .. (redis.call('lindex', KEYS[3], 0) or ''))
end
return revoked
""")

#: SET_INFO -- replace a held claim's holder record (and wake the name's listeners).
#: KEYS     all seven   ARGV[1] owner id   ARGV[2] the new record
#: ARGV[3]  'h': held in the lock hash KEYS[1]; 'z': a shared holder (KEYS[6], KEYS[7])
#: ARGV[4]  '1': announce it on KEYS[1] (a proclaim: an election's observers listen)
#: returns  1 if it is held (and now carries the record), else 0
SET_INFO = Script("set_info", LIB + """
local owner = ARGV[1]
if ARGV[3] == 'h' then
  if redis.call('hget', KEYS[1], 'owner') ~= owner then return 0 end
  redis.call('hset', KEYS[1], 'info', ARGV[2])
else
  local expiry = redis.call('zscore', KEYS[6], owner)
  if not expiry or tonumber(expiry) <= server_now() then return 0 end
  local token, since = string.match(redis.call('hget', KEYS[7], owner) or '', '^(%d+)|(%d+)|')
  if not token then return 0 end
  redis.call('hset', KEYS[7], owner, token .. '|' .. since .. '|' .. ARGV[2])
end
if ARGV[4] == '1' then redis.call('publish', KEYS[1], '|') end
return 1
""")

_MODE = {"lock": "x", "elect": "x", "rw": "rw", "sem": "sem"}


def _seconds(ms: Any) -> float | None:
    return None if int(ms) < 0 else int(ms) / 1000


async def inspect(backend: RedisBackend, name: str, kind: Kind) -> LockInfo:
    """Who holds ``name`` in ``kind``'s family now, with every holder's record."""
    keys = backend._keys(name, "-", kind)
    script = INSPECT if kind in (Kind.LOCK, Kind.LEADER) else INSPECT_SHARED
    return lock_info(name, kind, await backend._run(script, keys))


def lock_info(name: str, kind: Kind, reply: Sequence[Any]) -> LockInfo:
    """The :class:`LockInfo` of an ``INSPECT`` reply (a plain lock or an election) or an
    ``INSPECT_SHARED`` one (a read-write lock or a semaphore); the transaction path
    (:mod:`aiolock.backends._redis_txn_ops`) reads the same values into the same shape."""
    family = kind.family
    if kind in (Kind.LOCK, Kind.LEADER):
        owner, token, pttl, last, queued, info, held = reply
        shared, shared_left, records = 0, -1, []
    else:
        owner, token, pttl, last, queued, shared, shared_left, info, held, records = reply
    writer = bool(owner)
    holders = int(writer) + int(shared)
    lefts = [int(pttl)] if writer and int(pttl) >= 0 else []
    if int(shared_left) >= 0:
        lefts.append(int(shared_left))
    held_by = [decode_holder(info, _seconds(held))] if writer else []
    held_by += [decode_holder(records[i], _seconds(records[i + 1]))
                for i in range(0, len(records), 2)]
    return LockInfo(
        name, holders > 0, holders=holders, token=int(token) if writer else None,
        last_token=int(last) if int(last) >= 0 else None,
        ttl_left=max(lefts) / 1000 if lefts else None, waiters=int(queued),
        held_by=tuple(held_by), family=family,
    )


async def set_info(backend: RedisBackend, claim: Claim) -> bool:
    """Store ``claim.info`` as the held claim's record; a proclaim wakes the name's
    listeners."""
    mode = "h" if claim.kind.exclusive else "z"
    keys = backend._keys(claim.name, claim.owner, claim.kind)
    announce = "1" if claim.kind is Kind.LEADER else "0"
    return int(await backend._run(SET_INFO, keys, claim.owner, claim.info, mode, announce)) == 1


async def force_release(backend: RedisBackend, name: str, kind: Kind) -> bool:
    """Revoke every holder of ``name`` in ``kind``'s family; True if any was held."""
    family = kind.family
    keys = backend._keys(name, "-", FAMILY_KIND[family])
    announce = "1" if family == "elect" else "0"
    trust = "1" if backend.publish_counts else "0"  # a dead waiter is skipped, as by RELEASE
    return int(await backend._run(REVOKE, keys, _MODE[family], announce, REVOKED_KEEP_MS, trust)) > 0


_ESCAPED = re.compile(r"%(25|7B|7D)")
_GLOB = re.compile(r"([*?\[\]\\])")


def _unescape(part: str) -> str:
    return _ESCAPED.sub(lambda m: {"25": "%", "7B": "{", "7D": "}"}[m.group(1)], part)


def pattern(backend_prefix: str, escaped_name_prefix: str) -> str:
    """The ``SCAN MATCH`` pattern of every key of the names starting with a prefix."""
    return (_GLOB.sub(r"\\\1", backend_prefix) + ":*:{"
            + _GLOB.sub(r"\\\1", escaped_name_prefix) + "*")


def parse_key(backend_prefix: str, key: str) -> tuple[str, str] | None:
    """``(family, name)`` of a lock hash (``<prefix>:<family>:{<name>}``) or a shared
    holders zset (``...}:h``); None for any other key."""
    head = backend_prefix + ":"
    if not key.startswith(head):
        return None
    family, brace, rest = key[len(head):].partition(":{")
    name, close, tail = rest.rpartition("}")
    if not brace or not close or family not in FAMILY_KIND or tail not in ("", ":h"):
        return None
    return family, _unescape(name)


async def scan(backend: RedisBackend, prefix: str) -> AsyncIterator[LockInfo]:
    """Every name starting with ``prefix`` held now, any family, as ``backend.inspect``
    reports it (the Lua path's :func:`inspect`, or the transaction path's reads)."""
    from .redis import redis_key_part

    seen: set[tuple[str, str]] = set()
    match = pattern(backend._prefix, redis_key_part(prefix))
    async for raw in backend._scan_keys(match):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        found = parse_key(backend._prefix, key)
        if found is None or found in seen or not found[1].startswith(prefix):
            continue
        seen.add(found)
        info = await backend.inspect(found[1], FAMILY_KIND[found[0]])  # (either path's)
        if info.held:
            yield info
