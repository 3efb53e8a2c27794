"""The two Lua scripts Redlock adds to the Redis backend's (see ``_redis_scripts``).

Both take the keys of one lock on one node, as ``RedisBackend._keys`` builds them:

    KEYS[1]  lock hash        fields owner, token
    KEYS[2]  token counter    INCR'ed by ACQUIRE; never expires
    KEYS[3]  tombstone        of one claim, set by an abandon (REPAIR only)
"""

from __future__ import annotations

from ._redis_scripts import Script

__all__ = ["RAISE", "REPAIR"]

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
#:          restarted empty), unless someone else holds the node or the claim was
#:          abandoned. Raises the counter as RAISE does.
#: ARGV[1]  owner id    ARGV[2]  token    ARGV[3]  ttl, ms
#: returns  1 if ``owner`` now holds the lock on this node, else 0
REPAIR = Script("redlock_repair", """
if redis.call('exists', KEYS[3]) == 1 then return 0 end
local token = tonumber(ARGV[2])
if tonumber(redis.call('get', KEYS[2]) or '0') < token then
  redis.call('set', KEYS[2], ARGV[2])
end
local holder = redis.call('hget', KEYS[1], 'owner')
if holder and holder ~= ARGV[1] then return 0 end
redis.call('hset', KEYS[1], 'owner', ARGV[1], 'token', ARGV[2])
redis.call('pexpire', KEYS[1], ARGV[3])
return 1
""")
