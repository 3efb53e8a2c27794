"""The Lua scripts of the Redis backend, one named constant each.

All scripts of one lock take the same KEYS, built by ``RedisBackend._keys`` and sharing
the hash tag ``{<escaped name>}`` so they live in one cluster slot:

    KEYS[1]  lock hash        fields owner, token, info (the holder record, see
                              ``aiolock._holder``) and when it was granted: since
                              (server ms), or gttl (the lease's ms at the grant: held
                              for gttl - PTTL ms, until the first renewal sets since,
                              so a grant needs no TIME; a grant writes since '' --
                              unknown -- so a hash handed over keeps no earlier
                              holder's); expires with the lease
    KEYS[2]  token counter    INCR'ed per grant; never expires, so tokens never repeat
    KEYS[3]  queue            list of waiters, in arrival order: owner ids (read-write
                              locks, semaphores), ``<owner>|<registration>`` (plain
                              locks, see ``WAITER``)
    KEYS[4]  queue deadlines  zset owner id -> server-clock ms after which the place lapses
                              (read-write locks and semaphores; plain locks use KEYS[5])
    KEYS[5]  waiter key       of one claim: its tombstone (``a``, set by an abandon) bars a
                              late grant, ``r`` marks a release, ``v`` a revocation (see
                              ``REVOKE``); for a plain lock it also registers a waiting
                              claim (see ``ACQUIRE``)

Read-write locks and semaphores add two keys (``ACQUIRE_SHARED``, ``RELEASE_SHARED``):

    KEYS[6]  holders          zset owner id -> lease expiry (server-clock ms): readers
                              of a read-write lock, or semaphore permits
    KEYS[7]  holder records   hash owner id -> ``<token>|<since>|<info>``: fencing token,
                              server ms of the grant, holder record

and use KEYS[1] for the writer of a read-write lock. Their waiting queue (KEYS[3..4])
holds waiting writers (so new readers let them go first) and fair permit waiters. Their
scripts are in :mod:`aiolock.backends._redis_scripts_shared`.

Time-dependent logic uses the server clock (``TIME``, ``PEXPIRE``), never the client's.
An election (``Kind.LEADER``, family ``elect``) is a plain lock whose grants, releases
and record changes are also announced on its own channel KEYS[1] (``|``), for observers.
"""

from __future__ import annotations

import hashlib

__all__ = ["ACQUIRE", "INSPECT", "LIB", "RELEASE", "RENEW", "WAITER", "Script"]


class Script:
    """A script's source and its SHA1 (run with EVALSHA; loaded again on NOSCRIPT)."""

    __slots__ = ("name", "sha", "source")

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


#: Lua helpers prepended to the scripts that need them.
LIB = """
local function server_now()  -- ms on the server's clock
  local t = redis.call('time')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function held_ms(since, gttl, pttl)  -- how long a lock hash's holder has held it
  if since and since ~= '' then return server_now() - tonumber(since) end
  if gttl and pttl >= 0 then return math.max(tonumber(gttl) - pttl, 0) end
  return -1
end
local function release_marker(released)  -- RELEASE*: see RELEASE's ARGV[3], ARGV[4]
  if ARGV[3] ~= '1' and ARGV[4] ~= '0' then
    if released == 1 then
      redis.call('set', KEYS[5], 'r', 'PX', ARGV[4])
    elseif redis.call('get', KEYS[5]) == 'r' then
      return 1
    end
  end
  return released
end
local function queue_head(now)  -- first live waiter in KEYS[3..4]; lapsed places dropped
  local head = redis.call('lindex', KEYS[3], 0)
  while head do
    local deadline = redis.call('zscore', KEYS[4], head)
    if deadline and tonumber(deadline) > now then break end
    redis.call('lpop', KEYS[3])
    redis.call('zrem', KEYS[4], head)
    head = redis.call('lindex', KEYS[3], 0)
  end
  return head
end
"""


#: Waiting on a plain lock (``ACQUIRE``/``RELEASE``), fair or not: wake ONE waiter.
#:
#: A claim that will wait registers when it finds the lock busy: its *waiter key*
#: ``<KEYS[1]>:x:<owner>`` (KEYS[5] of its own calls; same hash tag, so the same cluster
#: slot) holds its registration ``<lease ttl ms>|<inbox length>|<inbox><holder record>``,
#: expiring after the waiter ttl unless the waiter comes back (it does, every third of
#: that), and its *entry* ``<owner>|<registration>`` goes at the end of the list KEYS[3]
#: (an entry without ``|``, as aiolock wrote before, is the owner alone: its registration
#: is read from its waiter key; the transaction path, :mod:`aiolock.backends._redis_txn`,
#: registers its waiters the same way, in a ``MULTI``/``EXEC``, so the queue holds the
#: waiters of both paths in arrival order). A release hands the lock straight to the first live
#: waiter of the list -- new token, lease of that waiter's ttl, its holder record -- and
#: publishes ``<KEYS[1]>|<new owner>|<token>`` on that waiter's *inbox*, a pub/sub
#: channel of its process: one message, heard by one process, no retry round trip.
#:
#: Which waiters are live: each entry's waiter key is read, and an entry whose key lapsed
#: (a waiter that stopped renewing: dead, or frozen past its ttl) or holds a tombstone is
#: skipped. Where the caller says PUBLISH counts can be trusted (plain Redis: every
#: subscriber of an inbox is on this server; RELEASE's ARGV[9]), the PUBLISH's count also
#: says whether the waiter's process is still there (its inbox is subscribed while it
#: runs): a count of 0 (a dead process, or one whose pub/sub connection is down, which
#: wakes its waiters itself when it is back) moves on to the next entry at once, before
#: its key lapses. (A pattern subscriber matching the inboxes, such as ``PSUBSCRIBE *``,
#: is counted too: a dead waiter then looks live until its key lapses, and costs its lease
#: ttl once handed the lock.) Elsewhere (Cluster, Sentinel: a subscriber may sit on
#: another node) a dead waiter is skipped once its key lapsed. An abandon
#: removes its entry in the same script that sets its tombstone, so a queued entry is
#: never one of an abandoned claim. The waiter key also holds the tombstone (``'a'``, an
#: abandoned claim), the release marker (``'r'``) and the revocation mark (``'v'``),
#: which bar a grant.
#:
#: Timers, should no release come (a holder that died): the first waiter of the queue is
#: told to retry when the holder's lease ends, the others within a third of their waiter
#: ttl (they refresh their registration then). So a dead holder's lock is taken within
#: its remaining lease, or, if the first waiter died with it, a third of a waiter ttl
#: after that. A hand-off message lost (its pub/sub connection broke: reconnecting wakes
#: every waiter of the process to ask) costs its waiter at most its timer, a third of
#: its waiter ttl at most.
#:
#: A release may instead name a waiting claim of its own process (ARGV[5]): it hands the
#: lock to that one, queue or not, and says so in its reply (a local hand-off) -- the
#: backend bounds how many times in a row it does that while others wait. A non-fair
#: claim may also take a free lock at once, queue or not.
#:
#: Lua helpers of ACQUIRE, RELEASE and REVOKE: ``registration(x)``, a waiter key's value
#: -> ttl, inbox, holder record (nil for anything else: none, a tombstone, a marker);
#: ``entry(owner, x)`` a queue entry and ``parse_entry(e)`` -> owner, registration (nil
#: for an entry of the owner alone); ``take(owner, ttl, info, queued)`` grants KEYS[1] (a
#: new token; every 64th grant from the queue also renews the queue's expiry);
#: ``hand_over(announce, trust, passed)`` grants it to the first live registered waiter
#: (never ``passed``: the releasing or revoked owner) and tells its process (and, for an
#: election, the observers on KEYS[1]): the new owner and its token, or nil if nobody
#: waits (trust: the PUBLISH count decides who is live, see above). A grant deletes the
#: waiter key of the claim it goes to: any other entry of that claim is dead from then on.
WAITER = """
local function registration(x)
  if not x then return nil end
  local ttl, n, rest = string.match(x, '^(%d+)|(%d+)|(.*)$')
  if not ttl then return nil end
  n = tonumber(n)
  return tonumber(ttl), string.sub(rest, 1, n), string.sub(rest, n + 1)
end
local function entry(owner, x) return owner .. '|' .. x end
local function parse_entry(e)
  local owner, x = string.match(e, '^([^|]*)|(.*)$')
  if owner then return owner, x end
  return e, nil
end
-- the queue's expiry: renewed at least every 64 grants from it, which come within a
-- third of a waiter ttl of each other while it never empties (else waiters refresh it)
local function queue_ttl(wttl) return math.max(24 * wttl, 600000) end
local function take(owner, ttl, info, queued)
  local token = redis.call('incr', KEYS[2])
  -- since '' (unknown until the first renewal): a hand-over keeps the hash, and with it
  -- the previous holder's since, which would otherwise be taken for this grant's
  redis.call('hset', KEYS[1], 'owner', owner, 'token', token, 'info', info, 'gttl', ttl, 'since', '')
  redis.call('pexpire', KEYS[1], ttl)
  if queued and token % 64 == 0 then redis.call('pexpire', KEYS[3], queue_ttl(ttl)) end
  return token
end
local function hand_over(announce, trust, passed)
  local taken = false
  local e = redis.call('lpop', KEYS[3])
  while e do
    local next = parse_entry(e)
    -- the waiter key, not the entry: a place lapses with it (a waiter frozen past its
    -- ttl keeps its pub/sub connection, so a PUBLISH count alone would still hear it)
    local xkey = KEYS[1] .. ':x:' .. next
    local x = redis.call('get', xkey)
    local ttl, inbox, info = registration(x)
    if ttl and next ~= passed then
      -- its place is used up: a second entry of the same claim (left by a place that
      -- lapsed and was taken again) is skipped, never handed the lock it holds or held
      redis.call('del', xkey)
      local token = take(next, ttl, info, true)
      taken = true
      local heard = redis.call('publish', inbox, KEYS[1] .. '|' .. next .. '|' .. token)
      if heard > 0 or not trust then
        if announce then redis.call('publish', KEYS[1], '|') end
        return next, token
      end
    end
    e = redis.call('lpop', KEYS[3])
  end
  if taken then redis.call('del', KEYS[1]) end  -- granted to dead processes only
  return nil
end
"""

#: ACQUIRE -- grant the lock to one claim, or say how long to wait.
#: KEYS     as in the module doc (KEYS[4] unused)
#: ARGV[1]  owner id of the claim       ARGV[2]  lease ttl, ms
#: ARGV[3]  "1" for a fair claim (a free lock goes to the first live waiter only)
#: ARGV[4]  waiter ttl, ms: register as a waiter when busy (its place lapses unless it
#:          comes back within that); "0": do not register (a single try)
#: ARGV[5]  the waiter's inbox: the pub/sub channel of its process (registered only)
#: ARGV[6]  the claim's holder record (stored beside the grant; default '')
#: ARGV[7]  "1" to announce a grant on KEYS[1] (an election's observers)
#: returns  {1, token, ttl_ms}  granted (also if this owner already holds it)
#:          {0, retry_ms, token} busy: retry within the holder's remaining ttl (a single
#:                              try, or the first registered waiter), or within a third
#:                              of the waiter ttl (the other registered waiters); token:
#:                              the holder's (or the counter's), which a grant message
#:                              for this claim must exceed to be believed
#:          {-1}                the claim was abandoned or released
#:
#: A revocation mark ('v') on the claim's waiter key does not end it: a waiter handed
#: the lock (by a release or a revocation) that was revoked before the waiter heard of
#: it never held it for its caller, so it waits on (registers again, or takes a free
#: lock with a new token); revocation concerns holders, whose renewals answer it.
ACQUIRE = Script("acquire", LIB + WAITER + """
local me = ARGV[1]
local info = ARGV[6] or ''
local lock = redis.call('hmget', KEYS[1], 'owner', 'token')
if lock[1] == me then
  return {1, tonumber(lock[2]), redis.call('pttl', KEYS[1])}
end
local ttl = tonumber(ARGV[2])
local wttl = tonumber(ARGV[4])
local value = ARGV[2] .. '|' .. #ARGV[5] .. '|' .. ARGV[5] .. info  -- its registration
local retry, seen
if not lock[1] then
  local x = redis.call('get', KEYS[5])
  if x and not registration(x) and x ~= 'v' then return {-1} end
  local head = false
  if ARGV[3] == '1' then  -- fair: only the first live waiter may take a free lock
    local e = redis.call('lindex', KEYS[3], 0)
    while e do
      head = parse_entry(e)
      if head == me or registration(redis.call('get', KEYS[1] .. ':x:' .. head)) then break end
      redis.call('lpop', KEYS[3])
      e = redis.call('lindex', KEYS[3], 0)
      head = false
    end
  end
  if not head or head == me then
    if x then  -- it was registered: leave the queue
      redis.call('lrem', KEYS[3], 1, entry(me, registration(x) and x or value))
      redis.call('del', KEYS[5])
    end
    local token = take(me, ttl, info, x or head)
    if ARGV[7] == '1' then redis.call('publish', KEYS[1], '|') end
    return {1, token, ttl}
  end
  retry = redis.call('pttl', KEYS[1] .. ':x:' .. head)  -- until the head's place lapses
  seen = tonumber(redis.call('get', KEYS[2]) or '0')
else
  seen = tonumber(lock[2])
end
if wttl > 0 then
  local old = redis.call('set', KEYS[5], value, 'PX', wttl, 'GET')
  if old and not registration(old) and old ~= 'v' then  -- a tombstone (or marker): put it back
    redis.call('set', KEYS[5], old, 'PX', math.max(60000, 2 * ttl))
    return {-1}
  end
  -- its place in the queue (0: first); the queue's expiry: set when it is made, by
  -- every refresh, and every 64th grant (see take), so it never lapses under waiters
  local at = false
  if old then
    local was = entry(me, registration(old) and old or value)
    at = redis.call('lpos', KEYS[3], was)
    if at and old ~= value then  -- registered otherwise (not seen in practice): again
      redis.call('lrem', KEYS[3], 1, was)
      at = false
    end
  end
  if at then
    redis.call('pexpire', KEYS[3], queue_ttl(wttl))
  else
    local n = redis.call('rpush', KEYS[3], entry(me, value))
    if n == 1 or old then redis.call('pexpire', KEYS[3], queue_ttl(wttl)) end
    at = n - 1
  end
  -- the first waiter retries when the holder's lease ends (should its holder die);
  -- the others within a third of their waiter ttl: a release hands it to them first
  if not retry and at == 0 then retry = redis.call('pttl', KEYS[1]) end
  local refresh = math.floor(wttl / 3)
  if not retry or retry > refresh then retry = refresh end
elseif not retry then
  retry = redis.call('pttl', KEYS[1])
end
if retry < 1 then retry = 1 end
return {0, retry, seen}
""")

#: RELEASE -- give the lock back if this owner holds it, handing it to the next waiter.
#: KEYS     as in the module doc (KEYS[4] unused)
#: ARGV[1]  owner id     ARGV[2]  unused (the lock's channel)
#: ARGV[3]  "1" to abandon: also leave the queue and set the tombstone, which lives
#:          ARGV[4] ms, so an ACQUIRE of this claim still in flight cannot grant; if the
#:          lock is free, hand it to the next waiter (this claim may have been the one
#:          expected to take it);
#:          "0" to release: if ARGV[4] > 0, a release also leaves a marker ('r', ARGV[4]
#:          ms) so that a repeat of it (a client that resent it after a lost reply)
#:          still returns 1
#: ARGV[5]  owner id of a waiting claim of this process to hand the lock to (unless
#:          it was abandoned), lease ARGV[6] ms, holder record ARGV[7]; '': hand it to
#:          the first live waiter
#: ARGV[8]  "1" to announce every change on KEYS[1] (an election's observers)
#: ARGV[9]  "1" to trust PUBLISH counts to tell live waiters (see WAITER)
#: ARGV[10..12]  an abandoned claim's lease ttl, inbox and holder record: its queue
#:          entry, removed even if its waiter key lapsed (optional)
#: publishes ``<KEYS[1]>|<new owner>|<token>`` on the new owner's inbox when it handed
#:          the lock over (only that process hears it); else, when it freed the lock,
#:          ``<owner>|`` on the lock's own channel KEYS[1] (for listeners that do not
#:          register, such as Redlock's nodes and an election's observers)
#: returns  {released, new owner or '', its token or 0, queue length (after a local
#:          hand-off; else 0)}
#:          released: 1 if this owner held the lock (now released), else 0
RELEASE = Script("release", LIB + WAITER + """
local me = ARGV[1]
local announce = ARGV[8] == '1'
local holder = redis.call('hget', KEYS[1], 'owner')
local released = 0
local free = false
if holder == me then
  released = 1
  free = true
end
released = release_marker(released)
if ARGV[3] == '1' then
  local x = redis.call('set', KEYS[5], 'a', 'PX', ARGV[4], 'GET')
  if registration(x) then redis.call('lrem', KEYS[3], 1, entry(me, x)) end
  if ARGV[10] then
    local mine = entry(me, ARGV[10] .. '|' .. #ARGV[11] .. '|' .. ARGV[11] .. (ARGV[12] or ''))
    if mine ~= entry(me, x or '') then redis.call('lrem', KEYS[3], 1, mine) end
  end
  if not holder then free = true end
end
if not free then return {released, '', 0, 0} end
if ARGV[5] ~= '' and holder then
  local x = redis.call('get', KEYS[1] .. ':x:' .. ARGV[5])
  if not x or registration(x) then
    if x then
      redis.call('lrem', KEYS[3], 1, entry(ARGV[5], x))
      redis.call('del', KEYS[1] .. ':x:' .. ARGV[5])
    end
    local token = take(ARGV[5], ARGV[6], ARGV[7] or '', x)
    if announce then redis.call('publish', KEYS[1], '|') end
    return {released, ARGV[5], token, redis.call('llen', KEYS[3])}
  end
end
local next, token = hand_over(announce, ARGV[9] == '1', me)
if next then return {released, next, token, 0} end
if holder then
  redis.call('del', KEYS[1])
  -- nobody registered to be handed it: tell the lock's own channel (listeners that do
  -- not register, e.g. Redlock's nodes, an election's observers)
  redis.call('publish', KEYS[1], me .. '|')
end
return {released, '', 0, 0}
""")

#: RENEW -- extend many held claims in one call (the watchdog's batch).
#: KEYS[2i-1]   claim i's key: its lock hash (mode 'h') or holders zset (mode 'z')
#: KEYS[2i]     claim i's second key: unused for 'h'; the holder records hash for 'z'
#: ARGV[3i-2]   mode of claim i ('h' or 'z')   ARGV[3i-1]  its owner id
#: ARGV[3i]     its ttl, ms
#: returns      per claim, the ttl granted in ms, 0 if it no longer holds, or -1 if an
#:              operator revoked it (its waiter key holds the mark 'v', see REVOKE)
#: A claim's key that another client overwrote with another type (a string...) fails
#: that claim alone (0: no longer held): its reads are ``redis.pcall``s, so the error
#: reply (WRONGTYPE) does not end the script and the rest of the batch is renewed.
RENEW = Script("renew", LIB + """
local now = server_now()
local out = {}
for i = 1, #KEYS / 2 do
  local key = KEYS[2 * i - 1]
  local owner = ARGV[3 * i - 1]
  local ttl = tonumber(ARGV[3 * i])
  local base = key
  out[i] = 0
  if ARGV[3 * i - 2] == 'h' then
    local lock = redis.pcall('hmget', key, 'owner', 'since', 'gttl')
    if lock.err then lock = {} end  -- not a hash: another client's value, not held
    if lock[1] == owner then
      if (not lock[2] or lock[2] == '') and lock[3] then  -- the first renewal: fix the grant's time
        redis.call('hset', key, 'since', now - (tonumber(lock[3]) - redis.call('pttl', key)))
      end
      redis.call('pexpire', key, ttl)
      out[i] = ttl
    end
  else
    base = string.sub(key, 1, -3)  -- '<base>:h'
    local expiry = redis.pcall('zscore', key, owner)
    if type(expiry) == 'table' then expiry = false end  -- not a zset: not held
    if expiry and tonumber(expiry) > now then
      redis.call('zadd', key, now + ttl, owner)
      for _, k in ipairs({key, KEYS[2 * i]}) do
        if redis.call('pttl', k) < ttl then redis.call('pexpire', k, ttl) end
      end
      out[i] = ttl
    end
  end
  if out[i] == 0 and redis.pcall('get', base .. ':x:' .. owner) == 'v' then out[i] = -1 end
end
return out
""")

#: INSPECT -- who holds the lock now.
#: KEYS     as in the module doc (KEYS[1..3])
#: returns  {owner or '', token or -1, pttl ms (negative if not held),
#:           highest token ever given or -1, fair queue length,
#:           holder record or '', ms held or -1}
INSPECT = Script("inspect", LIB + """
local lock = redis.call('hmget', KEYS[1], 'owner', 'token', 'info', 'since', 'gttl')
local last = tonumber(redis.call('get', KEYS[2]) or '-1')
local pttl = redis.call('pttl', KEYS[1])
return {lock[1] or '', tonumber(lock[2] or '-1'), pttl, last, redis.call('llen', KEYS[3]),
        lock[3] or '', held_ms(lock[4], lock[5], pttl)}
""")
