"""The Lua scripts Redlock runs on each of its Redis nodes: its own, not the Redis
backend's (a Redlock node never queues waiters or hands a lock over: a majority decides).

Every script takes the keys of one name of one family on one node, as
:func:`aiolock.backends._redlock_node.keys` builds them (the layout of ``redis://``):

    KEYS[1]  lock hash        fields owner, token, info (the holder record), since
                              (server-clock ms of the grant); expires with the lease;
                              also the name's pub/sub channel
    KEYS[2]  token counter    INCR'ed per grant; never expires
    KEYS[3]  claim key        ``<KEYS[1]>:x:<owner>``, of one claim: 'a' abandoned,
                              'r' released, 'v' revoked (by ``force_release``); any of
                              them bars a late grant of that claim

Each publishes on KEYS[1] when the name changes hands or data: ``<releaser>|`` when a
holder left, ``|`` for a new leader or new data (observers of an election).
"""

from __future__ import annotations

from ._redis_scripts import Script

__all__ = [
    "ACQUIRE", "INSPECT", "RAISE", "RELEASE", "RENEW", "REPAIR", "REVOKE", "SCAN", "SCRIPTS",
    "SET_INFO",
]

_NOW = """
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

#: ACQUIRE -- grant the name to one claim on this node, with its holder record.
#: ARGV[1]  owner id   ARGV[2]  lease ttl, ms   ARGV[3]  holder record
#: ARGV[4]  "1" to tell listeners of a grant (an election's observers)
#: returns  {1, token, ttl ms} granted (also if this owner holds it already)
#:          {0, ms the holder's lease still runs}   {-1} the claim is barred (KEYS[3])
ACQUIRE = Script("redlock_acquire", _NOW + """
local lock = redis.call('hmget', KEYS[1], 'owner', 'token')
if lock[1] == ARGV[1] then return {1, tonumber(lock[2]), redis.call('pttl', KEYS[1])} end
if lock[1] then return {0, math.max(redis.call('pttl', KEYS[1]), 1)} end
if redis.call('exists', KEYS[3]) == 1 then return {-1} end
local token = redis.call('incr', KEYS[2])
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'token', token, 'info', ARGV[3], 'since', now)
redis.call('pexpire', KEYS[1], ARGV[2])
if ARGV[4] == '1' then redis.call('publish', KEYS[1], '|') end
return {1, token, tonumber(ARGV[2])}
""")

#: RELEASE -- give the name back if this owner holds it here.
#: ARGV[1]  owner id
#: ARGV[2]  'd' drop (a failed attempt's partial grant: leaves no mark, it retries),
#:          'r' release (with a marker if ARGV[3] > 0, so that a resend of it after a
#:          lost reply still returns 1), 'a' abandon (tombstone of ARGV[3] ms)
#: returns  1 if this owner held it (now released), else 0
RELEASE = Script("redlock_release", """
local held = redis.call('hget', KEYS[1], 'owner') == ARGV[1]
local released = 0
if held then
  redis.call('del', KEYS[1])
  redis.call('publish', KEYS[1], ARGV[1] .. '|')
  released = 1
end
if ARGV[2] == 'a' then
  redis.call('set', KEYS[3], 'a', 'PX', ARGV[3])
elseif ARGV[2] == 'r' and ARGV[3] ~= '0' then
  if held then
    redis.call('set', KEYS[3], 'r', 'PX', ARGV[3])
  elseif redis.call('get', KEYS[3]) == 'r' then
    released = 1
  end
end
return released
""")

#: RENEW -- extend many claims held on this node (the watchdog's batch).
#: KEYS[2i-1], KEYS[2i]  claim i's lock hash and claim key
#: ARGV[2i-1], ARGV[2i]  its owner id and ttl, ms
#: returns  per claim: the ttl granted, 0 if it no longer holds, -1 if it was revoked
#: A key another client overwrote with another type fails its claim alone (0): the reads
#: are ``redis.pcall``s, so a WRONGTYPE error reply does not end the batch.
RENEW = Script("redlock_renew", """
local out = {}
for i = 1, #KEYS / 2 do
  out[i] = 0
  if redis.pcall('hget', KEYS[2 * i - 1], 'owner') == ARGV[2 * i - 1] then
    redis.call('pexpire', KEYS[2 * i - 1], ARGV[2 * i])
    out[i] = tonumber(ARGV[2 * i])
  elseif redis.pcall('get', KEYS[2 * i]) == 'v' then
    out[i] = -1
  end
end
return out
""")

#: INSPECT -- who holds the name here.
#: returns  {owner or '', token or -1, pttl ms, highest token ever or -1, holder record,
#:           ms since the grant or -1}
INSPECT = Script("redlock_inspect", _NOW + """
local h = redis.call('hmget', KEYS[1], 'owner', 'token', 'info', 'since')
local last = tonumber(redis.call('get', KEYS[2]) or '-1')
local since = -1
if h[4] and h[4] ~= '' then since = math.max(now - tonumber(h[4]), 0) end  -- '': Redis's grant
return {h[1] or '', tonumber(h[2] or '-1'), redis.call('pttl', KEYS[1]), last, h[3] or '', since}
""")

#: SET_INFO -- replace the holder record of the claim that holds the name here.
#: ARGV[1]  owner id   ARGV[2]  holder record   ARGV[3]  '1': tell the listeners (a proclaim)
#: returns  1 if this owner holds it (record replaced), else 0
SET_INFO = Script("redlock_set_info", """
if redis.call('hget', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('hset', KEYS[1], 'info', ARGV[2])
if ARGV[3] == '1' then redis.call('publish', KEYS[1], '|') end
return 1
""")

#: REVOKE -- an operator's force_release: drop the holder here and mark its claim
#:          revoked (its renewal then answers -1) for ARGV[1] ms or twice its lease.
#: returns  1 if someone held it, else 0
REVOKE = Script("redlock_revoke", """
local owner = redis.call('hget', KEYS[1], 'owner')
if not owner then return 0 end
local keep = math.max(tonumber(ARGV[1]), 2 * redis.call('pttl', KEYS[1]))
redis.call('set', KEYS[1] .. ':x:' .. owner, 'v', 'PX', keep)
redis.call('del', KEYS[1])
redis.call('publish', KEYS[1], owner .. '|')
return 1
""")

#: SCAN -- one step of a SCAN over this node's lock hashes (never blocks the server).
#: ARGV[1]  cursor   ARGV[2]  MATCH pattern   ARGV[3]  COUNT
#: returns  {next cursor, key, key, ...}: the matched keys that hold an owner now
SCAN = Script("redlock_scan", """
local step = redis.call('scan', ARGV[1], 'match', ARGV[2], 'count', ARGV[3])
local out = {step[1]}
for _, key in ipairs(step[2]) do
  if redis.call('type', key).ok == 'hash' and redis.call('hexists', key, 'owner') == 1 then
    out[#out + 1] = key
  end
end
return out
""")

#: RAISE -- make this node's counter at least the token of a Redlock grant, and label
#:          the owner's lock hash with that token (so INSPECT reports it).
#: ARGV[1]  owner id    ARGV[2]  token
#: returns  1 if ``owner`` holds the lock on this node (the raise counts), else 0
RAISE = Script("redlock_raise", """
local token = tonumber(ARGV[2])
if tonumber(redis.call('get', KEYS[2]) or '0') < token then
  redis.call('set', KEYS[2], ARGV[2])
end
if redis.call('hget', KEYS[1], 'owner') == ARGV[1] then
  redis.call('hset', KEYS[1], 'token', ARGV[2])
  return 1
end
return 0
""")

#: REPAIR -- put a lease that a majority still holds back on a node that lost it (e.g.
#:          restarted empty), unless someone else holds the node or the claim is barred
#:          (KEYS[3]). Raises the counter as RAISE does.
#: ARGV[1]  owner id    ARGV[2]  token    ARGV[3]  ttl, ms    ARGV[4]  holder record
#: returns  1 if ``owner`` now holds the lock on this node, else 0
REPAIR = Script("redlock_repair", _NOW + """
if redis.call('exists', KEYS[3]) == 1 then return 0 end
local token = tonumber(ARGV[2])
if tonumber(redis.call('get', KEYS[2]) or '0') < token then
  redis.call('set', KEYS[2], ARGV[2])
end
local holder = redis.call('hget', KEYS[1], 'owner')
if holder and holder ~= ARGV[1] then return 0 end
if not holder then redis.call('hset', KEYS[1], 'since', now) end
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'token', ARGV[2], 'info', ARGV[4])
redis.call('pexpire', KEYS[1], ARGV[3])
return 1
""")

#: Every script, loaded together when a node connects (see ``_redlock_node.prepare``).
SCRIPTS = (ACQUIRE, RELEASE, RENEW, INSPECT, SET_INFO, REVOKE, SCAN, RAISE, REPAIR)
