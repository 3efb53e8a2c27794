"""The Lua scripts of Redis read-write locks and semaphores (``ACQUIRE_SHARED``,
``RELEASE_SHARED``, ``INSPECT_SHARED``), one named constant each.

They take the keys of :mod:`aiolock.backends._redis_scripts` (its module doc: KEYS[1..7])
and its Lua helpers (``LIB``).
"""

from __future__ import annotations

from ._redis_scripts import LIB, Script

__all__ = ["ACQUIRE_SHARED", "INSPECT_SHARED", "RELEASE_SHARED"]


#: ACQUIRE_SHARED -- grant a read lock, a write lock or a semaphore permit, or say how
#:          long to wait. Writers are not starved: a waiting writer keeps a place in the
#:          queue and new readers wait behind it; writers go first come, first served.
#: KEYS     all seven (see the module doc)
#: ARGV[1]  owner id   ARGV[2]  lease ttl, ms   ARGV[3]  "1" for a fair claim
#: ARGV[4]  waiter ttl, ms   ARGV[5]  'r' read, 'w' write or 'p' permit
#: ARGV[6]  permit limit (semaphores)   ARGV[7]  the claim's holder record (default '')
#: returns  as ACQUIRE: {1, token, ttl_ms} | {0, retry_ms} | {-1}
ACQUIRE_SHARED = Script("acquire_shared", LIB + """
if redis.call('exists', KEYS[5]) == 1 then return {-1} end
local owner = ARGV[1]
local info = ARGV[7] or ''
local ttl = tonumber(ARGV[2])
local kind = ARGV[5]
local now = server_now()
for _, o in ipairs(redis.call('zrangebyscore', KEYS[6], '-inf', now)) do
  redis.call('zrem', KEYS[6], o)
  redis.call('hdel', KEYS[7], o)
end
local head = queue_head(now)
if kind == 'w' then
  if redis.call('hget', KEYS[1], 'owner') == owner then
    return {1, tonumber(redis.call('hget', KEYS[1], 'token')), redis.call('pttl', KEYS[1])}
  end
elseif redis.call('zscore', KEYS[6], owner) then
  return {1, tonumber(string.match(redis.call('hget', KEYS[7], owner), '^%d+')), ttl}
end
local busy = false
local retry = 0
local writer = redis.call('pttl', KEYS[1])
local function head_left()
  return tonumber(redis.call('zscore', KEYS[4], head)) - now
end
if kind == 'r' then
  if writer ~= -2 then busy, retry = true, writer
  elseif head then busy, retry = true, head_left() end
elseif kind == 'w' then
  local first = redis.call('zrange', KEYS[6], 0, 0, 'WITHSCORES')
  if writer ~= -2 then busy, retry = true, writer
  elseif first[2] then busy, retry = true, tonumber(first[2]) - now
  elseif head and head ~= owner then busy, retry = true, head_left() end
else
  if ARGV[3] == '1' and head and head ~= owner then busy, retry = true, head_left()
  elseif redis.call('zcard', KEYS[6]) >= tonumber(ARGV[6]) then
    local first = redis.call('zrange', KEYS[6], 0, 0, 'WITHSCORES')
    busy, retry = true, tonumber(first[2]) - now
  end
end
if not busy then
  if head == owner then
    redis.call('lpop', KEYS[3])
    redis.call('zrem', KEYS[4], owner)
  end
  local token = redis.call('incr', KEYS[2])
  if kind == 'w' then
    redis.call('hset', KEYS[1], 'owner', owner, 'token', token, 'info', info, 'since', now)
    redis.call('pexpire', KEYS[1], ttl)
  else
    redis.call('zadd', KEYS[6], now + ttl, owner)
    redis.call('hset', KEYS[7], owner, token .. '|' .. now .. '|' .. info)
    for i = 6, 7 do
      if redis.call('pttl', KEYS[i]) < ttl then redis.call('pexpire', KEYS[i], ttl) end
    end
  end
  return {1, token, ttl}
end
if kind == 'w' or (kind == 'p' and ARGV[3] == '1') then
  local wttl = tonumber(ARGV[4])
  if not redis.call('zscore', KEYS[4], owner) then redis.call('rpush', KEYS[3], owner) end
  redis.call('zadd', KEYS[4], now + wttl, owner)
  for i = 3, 4 do
    if redis.call('pttl', KEYS[i]) < 2 * wttl then redis.call('pexpire', KEYS[i], 2 * wttl) end
  end
  local refresh = math.floor(wttl / 3)
  if retry > refresh then retry = refresh end
end
if retry < 1 then retry = 1 end
return {0, retry}
""")

#: RELEASE_SHARED -- give back a read lock, a write lock or a permit; wake waiters.
#: KEYS     all seven   ARGV[1..4] as RELEASE   ARGV[5] 'r', 'w' or 'p'
#: publishes ``<owner>|<first queued owner or ''>`` when something was freed
#: returns  1 if this owner held it (now released), else 0
RELEASE_SHARED = Script("release_shared", LIB + """
local owner = ARGV[1]
local released = 0
local wake = false
if ARGV[5] == 'w' then
  if redis.call('hget', KEYS[1], 'owner') == owner then
    redis.call('del', KEYS[1])
    released = 1
  end
else
  local expiry = redis.call('zscore', KEYS[6], owner)
  if expiry then
    redis.call('zrem', KEYS[6], owner)
    redis.call('hdel', KEYS[7], owner)
    if tonumber(expiry) > server_now() then
      released = 1
    end
  end
end
wake = released == 1
released = release_marker(released)
if ARGV[3] == '1' then
  redis.call('set', KEYS[5], '1', 'PX', ARGV[4])
  if redis.call('zrem', KEYS[4], owner) == 1 then
    redis.call('lrem', KEYS[3], 1, owner)
    wake = true
  end
end
if wake then
  redis.call('publish', ARGV[2], owner .. '|' .. (redis.call('lindex', KEYS[3], 0) or ''))
end
return released
""")

#: INSPECT_SHARED -- who holds a read-write lock or semaphore now.
#: KEYS     all seven
#: returns  {writer owner or '', writer token or -1, writer pttl, highest token or -1,
#:           queue length, live shared holders, ms until the last shared lease ends,
#:           writer's holder record or '', ms the writer has held it or -1,
#:           {record, ms held, record, ms held, ...} of the live shared holders}
INSPECT_SHARED = Script("inspect_shared", LIB + """
local now = server_now()
local w = redis.call('hmget', KEYS[1], 'owner', 'token', 'info', 'since', 'gttl')
local last = tonumber(redis.call('get', KEYS[2]) or '-1')
local owners = redis.call('zrangebyscore', KEYS[6], '(' .. now, '+inf')
local records = {}
if #owners > 0 then
  for _, r in ipairs(redis.call('hmget', KEYS[7], unpack(owners))) do
    local since, info = string.match(r or '', '^%d+|(%d+)|(.*)$')
    records[#records + 1] = info or ''
    records[#records + 1] = since and now - tonumber(since) or -1
  end
end
local lastend = redis.call('zrange', KEYS[6], -1, -1, 'WITHSCORES')
local left = -1
if lastend[2] and tonumber(lastend[2]) > now then left = tonumber(lastend[2]) - now end
local pttl = redis.call('pttl', KEYS[1])
return {w[1] or '', tonumber(w[2] or '-1'), pttl, last, redis.call('llen', KEYS[3]), #owners,
        left, w[3] or '', held_ms(w[4], w[5], pttl), records}
""")


#: Every script, loaded together: a release must never wait for its own script to load
#: while an acquire sent after it (already loaded) overtakes it on the same connection.
