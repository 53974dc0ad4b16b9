"""The Lua scripts the Redis store runs server-side (used by indexer/stores/redis_store.py only).

A script runs atomically in Redis: a batch is applied whole or not at all (a reader sees it before or
after), and its lease check cannot be separated from its writes, so a replica that lost a pod's lease
cannot interleave writes with the new owner. The layout of one model's keys, all under one hash-tagged
prefix P (`kvi:{model}:`):

    P gen            the store's generation: a random token; missing or changed = the store restarted empty
    P b:<key>        string: one block's holders ("id" | "id:copies,id,..."; oldest first); <key> is the
                     block key, 8 bytes big-endian. One key per block so a score is one MGET (~0.4 us a
                     block in Redis), not a script's ~1.3 us a block of Lua calls into shard hashes
    P l:<shard>      sorted set: block key -> store clock (the shard's key LRU; oldest = lowest); <shard>
                     is the shard number as big-endian bytes, as few as the shard count needs
    P clock          the store clock (one tick per stored key)
    P nkeys          number of block keys held
    P live           hash: entry id -> (block, entry) pairs it holds
    P log:<id>       string: the 8-byte keys entry <id> stored (a log: stale items are skipped, compacted)
    P ent / P entn   hashes: entry name -> id / id -> name; P entc the next id
    P pod:<pod>      set: the entry ids of one pod (all tiers); P podids: hash of pod ids ever seen
    P lease:<pod>    the pod's ingest lease: "<replica> <epoch>", with a TTL; P epoch:<pod> its counter
    P podstate       hash: pod -> the owner's published ingest state (JSON)
    P replicas       sorted set: replica id -> heartbeat expiry (ms)

Block keys never become Lua numbers (doubles lose 64-bit precision): they stay 8-byte strings, and a key's
shard is its low 32 bits modulo the shard count, which Lua computes exactly from the last four bytes (or
cuts from them, for a power-of-256 count).
"""

from __future__ import annotations

from typing import Final

_COMMON: Final = r"""
local P = ARGV[1]
local nshards = tonumber(ARGV[3])
local width = 0
while 256 ^ width < nshards do width = width + 1 end
local aligned = 256 ^ width == nshards
-- A key's shard, as the name suffix: the shard number in `width` big-endian bytes. With a power-of-256
-- shard count (the default 65536) that is the key's own last bytes, cut without arithmetic or number
-- formatting (tostring is most of a lookup's cost otherwise).
local function shard_of(k)
  if aligned then return string.sub(k, 9 - width, 8) end
  local b5, b6, b7, b8 = string.byte(k, 5, 8)
  local s = (((b5 * 256 + b6) * 256 + b7) * 256 + b8) % nshards
  local out = {}
  for i = width, 1, -1 do
    out[i] = s % 256
    s = (s - out[i]) / 256
  end
  return string.char(unpack(out, 1, width))
end
local function parse(v)
  local ids, cps = {}, {}
  if not string.find(v, '[,:]') then
    ids[1] = v
    cps[v] = 1
    return ids, cps
  end
  for item in string.gmatch(v, '[^,]+') do
    local c = string.find(item, ':', 1, true)
    local id, n
    if c then
      id = string.sub(item, 1, c - 1)
      n = tonumber(string.sub(item, c + 1))
    else
      id = item
      n = 1
    end
    ids[#ids + 1] = id
    cps[id] = n
  end
  return ids, cps
end
local function encode(ids, cps)
  local parts = {}
  for i, id in ipairs(ids) do
    local n = cps[id]
    if n == 1 then parts[i] = id else parts[i] = id .. ':' .. n end
  end
  return table.concat(parts, ',')
end
local function without(ids, id)
  for i, other in ipairs(ids) do
    if other == id then
      table.remove(ids, i)
      return
    end
  end
end
-- Drop entry `id` from block `k` whatever its copies (a clear); a key left with no holder goes, LRU
-- included. Returns (it held the key, the key went).
local function release_key(k, id)
  local h = P .. 'b:' .. k
  local v = redis.call('GET', h)
  if not v then return false, false end
  local ids, cps = parse(v)
  if not cps[id] then return false, false end
  without(ids, id)
  cps[id] = nil
  if #ids == 0 then
    redis.call('DEL', h)
    redis.call('ZREM', P .. 'l:' .. shard_of(k), k)
    return true, true
  end
  redis.call('SET', h, encode(ids, cps))
  return true, false
end
"""

# A write script's first step (ARGV as APPLY's): nothing is written to a store that restarted empty since
# the caller last read its generation, or under a lease the caller no longer holds.
_WRITE_GUARD: Final = r"""
if redis.call('GET', P .. 'gen') ~= ARGV[2] then return redis.error_reply('GEN') end
if ARGV[8] ~= '' and redis.call('GET', ARGV[8]) ~= ARGV[9] then return redis.error_reply('LEASE') end
"""

# ARGV: P, gen, nshards, capacity, low_water, max_pods_per_key, max_copies, lease key ('' = unfenced),
# lease value, pod key (json), pod id, then the steps: 'S' entry-name keys | 'R' entry-name keys |
# 'P' parent-key | 'C'. Returns the nine ApplyStats counts, or an error reply GEN / LEASE (nothing written).
APPLY: Final = (
    _COMMON
    + _WRITE_GUARD
    + r"""
local cap = tonumber(ARGV[4])
local low = tonumber(ARGV[5])
local maxpods = tonumber(ARGV[6])
local maxcopies = tonumber(ARGV[7])
local podset = P .. 'pod:' .. ARGV[10]
-- counts: stored, refreshed, removed, missing, cleared, unknown parents, evicted keys, evicted entries, released
local c = {0, 0, 0, 0, 0, 0, 0, 0, 0}
local pod_ids = {}
for _, id in ipairs(redis.call('SMEMBERS', podset)) do pod_ids[id] = true end
local interned = {}
local live = {}
local stored_by = {}
local nkeys = 0
local clock = tonumber(redis.call('GET', P .. 'clock') or '0')

local function intern(name)
  local id = interned[name]
  if id then return id end
  id = redis.call('HGET', P .. 'ent', name)
  if not id then
    id = tostring(redis.call('INCR', P .. 'entc') - 1)
    redis.call('HSET', P .. 'ent', name, id)
    redis.call('HSET', P .. 'entn', id, name)
    redis.call('SADD', podset, id)
    redis.call('HSET', P .. 'podids', ARGV[11], '1')
  end
  pod_ids[id] = true
  interned[name] = id
  return id
end
local function add_live(id, n)
  live[id] = (live[id] or 0) + n
end
local function drop_key(h, s, k)
  redis.call('DEL', h)
  redis.call('ZREM', P .. 'l:' .. s, k)
  nkeys = nkeys - 1
end
local function evict(s)
  local l = P .. 'l:' .. s
  local n = redis.call('ZCARD', l)
  if n <= cap then return end
  local victims = redis.call('ZRANGE', l, 0, n - low - 1)
  for _, k in ipairs(victims) do
    local h = P .. 'b:' .. k
    local ids = parse(redis.call('GET', h))
    for _, id in ipairs(ids) do add_live(id, -1) end
    c[8] = c[8] + #ids
    redis.call('DEL', h)
  end
  redis.call('ZREMRANGEBYRANK', l, 0, n - low - 1)
  c[7] = c[7] + #victims
  nkeys = nkeys - #victims
end
local function store(id, blob)
  redis.call('APPEND', P .. 'log:' .. id, blob)
  stored_by[id] = true
  local touched = {}
  local stored = 0
  for i = 1, #blob, 8 do
    local k = string.sub(blob, i, i + 7)
    local s = shard_of(k)
    local h = P .. 'b:' .. k
    local v = redis.call('GET', h)
    if not v then
      redis.call('SET', h, id)
      stored = stored + 1
      nkeys = nkeys + 1
    else
      local ids, cps = parse(v)
      local n = cps[id]
      if n then
        without(ids, id)
        ids[#ids + 1] = id
        cps[id] = math.min(n + 1, maxcopies)
        c[2] = c[2] + 1
      else
        ids[#ids + 1] = id
        cps[id] = 1
        stored = stored + 1
        if #ids > maxpods then
          local oldest = table.remove(ids, 1)
          cps[oldest] = nil
          add_live(oldest, -1)
          c[8] = c[8] + 1
        end
      end
      redis.call('SET', h, encode(ids, cps))
    end
    clock = clock + 1
    redis.call('ZADD', P .. 'l:' .. s, clock, k)
    touched[s] = true
  end
  add_live(id, stored)
  c[1] = c[1] + stored
  for s in pairs(touched) do evict(s) end
end
local function remove(id, blob)
  local removed, released = 0, 0
  for i = 1, #blob, 8 do
    local k = string.sub(blob, i, i + 7)
    local s = shard_of(k)
    local h = P .. 'b:' .. k
    local v = redis.call('GET', h)
    if v then
      local ids, cps = parse(v)
      local n = cps[id]
      if n then
        if n > 1 then
          cps[id] = n - 1
          released = released + 1
        else
          without(ids, id)
          cps[id] = nil
          removed = removed + 1
        end
        if #ids == 0 then drop_key(h, s, k) else redis.call('SET', h, encode(ids, cps)) end
      end
    end
  end
  add_live(id, -removed)
  c[3] = c[3] + removed
  c[9] = c[9] + released
  c[4] = c[4] + #blob / 8 - removed - released
end
local function held_by_pod(k)
  local v = redis.call('GET', P .. 'b:' .. k)
  if not v then return false end
  for _, id in ipairs((parse(v))) do
    if pod_ids[id] then return true end
  end
  return false
end
local function clear_entry(id)
  local log = redis.call('GET', P .. 'log:' .. id)
  local cleared = 0
  if log then
    for i = 1, #log, 8 do
      local held, gone = release_key(string.sub(log, i, i + 7), id)
      if held then cleared = cleared + 1 end
      if gone then nkeys = nkeys - 1 end
    end
  end
  redis.call('DEL', P .. 'log:' .. id)
  redis.call('HDEL', P .. 'live', id)
  live[id] = nil
  stored_by[id] = nil
  return cleared
end
local function flush_live()
  for id, n in pairs(live) do
    if n ~= 0 then
      local left = redis.call('HINCRBY', P .. 'live', id, n)
      if left <= 0 then
        redis.call('HDEL', P .. 'live', id)
        redis.call('DEL', P .. 'log:' .. id)
        stored_by[id] = nil
      end
    end
  end
  live = {}
end

local i = 12
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'S' then
    store(intern(ARGV[i + 1]), ARGV[i + 2])
    i = i + 3
  elseif op == 'R' then
    remove(intern(ARGV[i + 1]), ARGV[i + 2])
    i = i + 3
  elseif op == 'P' then
    if not held_by_pod(ARGV[i + 1]) then c[6] = c[6] + 1 end
    i = i + 2
  else
    flush_live()
    for id in pairs(pod_ids) do c[5] = c[5] + clear_entry(id) end
    i = i + 1
  end
end
flush_live()
-- A log twice its entry's live count (+64) is rewritten with the keys the entry still holds, once each.
for id in pairs(stored_by) do
  local logkey = P .. 'log:' .. id
  local held = tonumber(redis.call('HGET', P .. 'live', id) or '0')
  local log = redis.call('GET', logkey)
  if log and #log / 8 > 2 * held + 64 then
    local seen, keep = {}, {}
    for j = 1, #log, 8 do
      local k = string.sub(log, j, j + 7)
      if not seen[k] then
        seen[k] = true
        local v = redis.call('GET', P .. 'b:' .. k)
        if v then
          local _, cps = parse(v)
          if cps[id] then keep[#keep + 1] = k end
        end
      end
    end
    redis.call('SET', logkey, table.concat(keep))
  end
end
if nkeys ~= 0 then redis.call('INCRBY', P .. 'nkeys', nkeys) end
redis.call('SET', P .. 'clock', clock)
return c
"""
)

# ARGV: as APPLY's first eleven, then the most keys to clear in this call. Clears up to that many of the
# pod's (block, entry) pairs, from the end of its entries' logs (an entry whose log is done is dropped), so
# a pod of millions of blocks is cleared in calls of bounded server time instead of one long script that
# stalls every other client. Returns {pairs cleared, log keys left} (left 0: the pod holds nothing more).
CLEAR_CHUNK: Final = (
    _COMMON
    + _WRITE_GUARD
    + r"""
local budget = tonumber(ARGV[12])
local cleared, dropped, left = 0, 0, 0
for _, id in ipairs(redis.call('SMEMBERS', P .. 'pod:' .. ARGV[10])) do
  local logkey = P .. 'log:' .. id
  local n = redis.call('STRLEN', logkey) / 8
  local take = math.min(n, budget)
  if take > 0 then
    local mine = 0
    local log = redis.call('GETRANGE', logkey, (n - take) * 8, -1)
    for i = 1, #log, 8 do
      local held, gone = release_key(string.sub(log, i, i + 7), id)
      if held then mine = mine + 1 end
      if gone then dropped = dropped + 1 end
    end
    budget = budget - take
    cleared = cleared + mine
    local held = tonumber(redis.call('HGET', P .. 'live', id) or '0')
    if mine > 0 then held = redis.call('HINCRBY', P .. 'live', id, 0 - mine) end
    if take == n or held <= 0 then
      redis.call('DEL', logkey)
      redis.call('HDEL', P .. 'live', id)
    else
      redis.call('SET', logkey, redis.call('GETRANGE', logkey, 0, (n - take) * 8 - 1))
      left = left + n - take
    end
  else
    left = left + n
  end
end
if dropped ~= 0 then redis.call('INCRBY', P .. 'nkeys', -dropped) end
return {cleared, left}
"""
)

# ARGV: P, gen, replica id, ttl ms, pod-states json ('' = none), then per pod: pod key, held token ('' =
# none), want ('1' / '0'), published state json ('' = none). Per pod: renew a held lease (if still ours),
# take a free one that is wanted, publish the owner's state. Also heartbeats the replica. Returns
# {replicas..., '', then per pod: lease value or '', published state or ''}; error GEN if the store's
# generation is not ours.
LEASE_TICK: Final = r"""
local P = ARGV[1]
if redis.call('GET', P .. 'gen') ~= ARGV[2] then return redis.error_reply('GEN') end
local me = ARGV[3]
local ttl = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', P .. 'replicas', now + ttl, me)
redis.call('ZREMRANGEBYSCORE', P .. 'replicas', '-inf', now)
local out = redis.call('ZRANGE', P .. 'replicas', 0, -1)
out[#out + 1] = ''
for i = 6, #ARGV, 4 do
  local pod, held, want, state = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local key = P .. 'lease:' .. pod
  local current = redis.call('GET', key)
  if held ~= '' and current == held then
    redis.call('PEXPIRE', key, ttl)
  elseif not current and want == '1' then
    local epoch = redis.call('INCR', P .. 'epoch:' .. pod)
    current = me .. ' ' .. epoch
    redis.call('SET', key, current, 'PX', ttl)
  end
  if current and current == held and state ~= '' then redis.call('HSET', P .. 'podstate', pod, state) end
  out[#out + 1] = current or ''
  out[#out + 1] = redis.call('HGET', P .. 'podstate', pod) or ''
end
return out
"""

# ARGV: P, pod key, held token. Lets go of a lease still held (a clean shutdown: no TTL to wait out).
LEASE_RELEASE: Final = r"""
local key = ARGV[1] .. 'lease:' .. ARGV[2]
if redis.call('GET', key) == ARGV[3] then redis.call('DEL', key) return 1 end
return 0
"""
