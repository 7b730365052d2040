"""The Trainer's scripts: steps (create, seal, drop, mark settled), its epoch, fenced writes and per-version records.

Each write of the Trainer carries its epoch (:data:`~aurora_store.coordination.ledger.preludes.EPOCH_PRELUDE`).
Headers and the rules every script keeps: :mod:`aurora_store.coordination.ledger.scripts`.
"""

from __future__ import annotations

from aurora_store.coordination.ledger.preludes import (
    CHUNK_PRELUDE,
    EPOCH_PRELUDE,
    NOW_PRELUDE,
    TTL_PRELUDE,
)

__all__ = ["CREATE_STEP", "SEAL_STEP", "DROP_STEP", "MARK_SETTLED", "REOFFER", "ENTER_EPOCH", "FENCED_HSET", "RECORD_VERSIONED"]

# KEYS[1] step hash, KEYS[2] prompts hash, KEYS[3] pool list, KEYS[4] steps zset,
# KEYS[5] epoch, KEYS[6] fence counter, KEYS[7] assignees set, KEYS[8..7+m] assigned lists
# (one per entry of the quota list below, same order), KEYS[8+m..7+2m] those Actors' hashes
# ARGV[1] step id, ARGV[2] version, ARGV[3] state, ARGV[4] group, ARGV[5] lease_ms,
# ARGV[6] identity (digest of version, state and prompt ids), ARGV[7] epoch or "",
# ARGV[8] now_ms or "", ARGV[9] TTL of the step's keys in ms ("0": none),
# ARGV[10] n prompts, then n (id, payload) pairs, then (actor, count) pairs
# returns {'created'}; {'exists'} if a step with the same identity is there (a repeat:
# nothing changes); {'conflict', identity} for another step under this id;
# {'sealed'} for a step sealed but not dropped yet (drop it, then create again);
# {'fenced', epoch}. A dropped step's tombstone is replaced. A quota whose Actor is not
# alive when the script runs (it left or was reaped after the caller read the registry)
# goes to the pool: nobody else could claim it.
CREATE_STEP = (
    NOW_PRELUDE
    + EPOCH_PRELUDE
    + CHUNK_PRELUDE
    + """
local f = fenced(KEYS[5], ARGV[7])
if f then return {'fenced', f} end
if redis.call('EXISTS', KEYS[1]) == 1 then
  if not redis.call('HGET', KEYS[1], 'closed') then
    local ident = redis.call('HGET', KEYS[1], 'ident') or ''
    if ident == ARGV[6] then return {'exists'} end
    return {'conflict', ident}
  end
  if not redis.call('HGET', KEYS[1], 'dropped') then return {'sealed'} end
  redis.call('DEL', KEYS[1])
end
local now = now_ms(ARGV[8])
if redis.call('EXISTS', KEYS[6]) == 0 then
  redis.call('SET', KEYS[6], string.format('%d', tonumber(now) * 1000))
end
local n = tonumber(ARGV[10])
redis.call('HSET', KEYS[1], 'version', ARGV[2], 'state', ARGV[3], 'group', ARGV[4], 'total', n,
  'lease_ms', ARGV[5], 'created_ms', now, 'settled', 0, 'expired', 0, 'rejected', 0,
  'ident', ARGV[6], 'epoch', ARGV[7])
local ids = {}
local kv = {}
for i = 0, n - 1 do
  ids[#ids + 1] = ARGV[11 + 2 * i]
  kv[#kv + 1] = ARGV[11 + 2 * i]
  kv[#kv + 1] = ARGV[12 + 2 * i]
end
if n > 0 then chunked('HSET', KEYS[2], kv, 1, #kv) end
local pos = 1
local q = 11 + 2 * n
local k = 8
local m = (#ARGV - 10 - 2 * n) / 2
while q < #ARGV do
  local c = math.min(tonumber(ARGV[q + 1]), n - pos + 1)
  if c > 0 and redis.call('HGET', KEYS[k + m], 'status') ~= 'alive' then c = 0 end
  if c > 0 then
    chunked('RPUSH', KEYS[k], ids, pos, pos + c - 1)
    redis.call('SADD', KEYS[7], ARGV[q])
    pos = pos + c
  end
  q = q + 2
  k = k + 1
end
if pos <= n then chunked('RPUSH', KEYS[3], ids, pos, n) end
redis.call('ZADD', KEYS[4], ARGV[1], ARGV[1])
local ttl = tonumber(ARGV[9])
if ttl > 0 then
  for i = 1, 7 + m do
    if i ~= 5 then redis.call('PEXPIRE', KEYS[i], ttl) end
  end
end
return {'created'}
"""
)

# KEYS[1] step hash, KEYS[2] steps zset, KEYS[3] epoch
# ARGV[1] step id, ARGV[2] epoch or "", ARGV[3] now_ms or ""
# returns {'sealed', total, settled} (also when already sealed: a repeat is harmless),
# {'no_step'} or {'fenced', epoch}. From now on SETTLE answers 'closed' and CLAIM
# leases nothing; the results stay readable until DROP_STEP.
SEAL_STEP = (
    NOW_PRELUDE
    + EPOCH_PRELUDE
    + """
local f = fenced(KEYS[3], ARGV[2])
if f then return {'fenced', f} end
if redis.call('EXISTS', KEYS[1]) == 0 then return {'no_step'} end
if not redis.call('HGET', KEYS[1], 'closed') then
  redis.call('HSET', KEYS[1], 'closed', now_ms(ARGV[3]))
end
redis.call('ZREM', KEYS[2], ARGV[1])
local total, settled = unpack(redis.call('HMGET', KEYS[1], 'total', 'settled'))
return {'sealed', tonumber(total or 0), tonumber(settled or 0)}
"""
)

# KEYS[1] step hash, KEYS[2] steps zset, KEYS[3] epoch, KEYS[4..] the step's other keys
# (prompts, pool, lease, exp, done, results, payloads, assignees, assigned lists)
# ARGV[1] step id, ARGV[2] epoch or "", ARGV[3] tombstone TTL in ms, ARGV[4] unreturned
# (or ""), ARGV[5] now_ms or ""
# returns {'dropped'} or {'fenced', epoch}. Deletes every key of the step but its hash,
# which stays as a tombstone ({closed, dropped, total, settled, unreturned}) for ARGV[3]
# ms, so a late settle still answers 'closed'. Seals first if SEAL_STEP did not run.
DROP_STEP = (
    NOW_PRELUDE
    + EPOCH_PRELUDE
    + """
local f = fenced(KEYS[3], ARGV[2])
if f then return {'fenced', f} end
redis.call('ZREM', KEYS[2], ARGV[1])
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local now = now_ms(ARGV[5])
  if not redis.call('HGET', KEYS[1], 'closed') then redis.call('HSET', KEYS[1], 'closed', now) end
  redis.call('HSET', KEYS[1], 'dropped', now)
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'unreturned', ARGV[4]) end
  redis.call('HDEL', KEYS[1], 'ident')
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]))
end
return {'dropped'}
"""
)

# KEYS[1] step hash, KEYS[2] prompts hash, KEYS[3] lease hash, KEYS[4] expiry zset,
# KEYS[5] done hash, KEYS[6] pool list, KEYS[7] epoch, KEYS[8..] assigned lists
# ARGV[1] epoch or "", ARGV[2..] prompt ids the Trainer already holds results of
# returns {'ok', n marked} or {'fenced', epoch}. For a ledger that lost a settlement
# (an AOF-everysec restart, a failover): each prompt of this step not in done is marked
# done (by 'trainer|0'), its lease dropped and its copies removed from the lists, so it
# is never leased again. Prompts not of this step are ignored; a repeat marks nothing.
MARK_SETTLED = (
    EPOCH_PRELUDE
    + TTL_PRELUDE
    + """
local f = fenced(KEYS[7], ARGV[1])
if f then return {'fenced', f} end
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[1], 'closed') then return {'ok', 0} end
local n = 0
for i = 2, #ARGV do
  local p = ARGV[i]
  if redis.call('HEXISTS', KEYS[2], p) == 1 and redis.call('HEXISTS', KEYS[5], p) == 0 then
    redis.call('HSET', KEYS[5], p, 'trainer|0')
    redis.call('HDEL', KEYS[3], p)
    redis.call('ZREM', KEYS[4], p)
    redis.call('LREM', KEYS[6], 0, p)
    for k = 8, #KEYS do redis.call('LREM', KEYS[k], 0, p) end
    n = n + 1
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[1], 'settled', n)
  inherit_ttl(KEYS[5], KEYS[1])
end
return {'ok', n}
"""
)

# KEYS[1] step hash, KEYS[2] done hash, KEYS[3] results hash, KEYS[4] result payloads hash,
# KEYS[5] lease hash, KEYS[6] expiry zset, KEYS[7] pool list, KEYS[8] epoch, KEYS[9..]
# assigned lists
# ARGV[1] epoch or "", then per prompt 3 values: prompt, its done value as the Trainer read
# it, "1" to offer it again (a prompt of the Trainer's batch) or ""
# returns {'ok', n cleared} or {'fenced', epoch}. For results the Trainer refused (not what
# SETTLE writes, or not of its batch): each prompt whose done entry still reads that value
# loses it and its result; if asked, its lease (whose holder a forged done entry may have
# answered 'already_settled') is dropped and it goes back to the pool unless queued already.
# The step's counters are left as they are (a forged entry never moved them).
REOFFER = (
    EPOCH_PRELUDE
    + TTL_PRELUDE
    + """
local f = fenced(KEYS[8], ARGV[1])
if f then return {'fenced', f} end
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[1], 'closed') then return {'ok', 0} end
local n = 0
for i = 2, #ARGV - 2, 3 do
  local p = ARGV[i]
  if redis.call('HGET', KEYS[2], p) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[2], p)
    redis.call('HDEL', KEYS[3], p)
    redis.call('HDEL', KEYS[4], p)
    n = n + 1
    if ARGV[i + 2] == '1' then
      redis.call('HDEL', KEYS[5], p)
      redis.call('ZREM', KEYS[6], p)
      local queued = false
      for k = 7, #KEYS do
        if k ~= 8 and redis.call('LPOS', KEYS[k], p) then queued = true end
      end
      if not queued then
        redis.call('RPUSH', KEYS[7], p)
        inherit_ttl(KEYS[7], KEYS[1])
      end
    end
  end
end
return {'ok', n}
"""
)

# KEYS[1] epoch
# ARGV[1] epoch
# returns {'ok', stored} (stored is ARGV[1] once raised) or {'fenced', stored}
ENTER_EPOCH = (
    EPOCH_PRELUDE
    + """
local f = fenced(KEYS[1], ARGV[1])
if f then return {'fenced', f} end
return {'ok', tonumber(redis.call('GET', KEYS[1]))}
"""
)

# KEYS[1] epoch, KEYS[2] hash
# ARGV[1] epoch or "", ARGV[2..] field, value pairs
# returns {'ok'} or {'fenced', epoch}
FENCED_HSET = (
    EPOCH_PRELUDE
    + """
local f = fenced(KEYS[1], ARGV[1])
if f then return {'fenced', f} end
local kv = {}
for i = 2, #ARGV do kv[#kv + 1] = ARGV[i] end
if #kv > 0 then redis.call('HSET', KEYS[2], unpack(kv)) end
return {'ok'}
"""
)

# KEYS[1] hash, KEYS[2] its index zset (field scored by version)
# ARGV[1] field, ARGV[2] value, ARGV[3] version, ARGV[4] versions to keep (0: all)
# returns the number of fields trimmed: those whose version is older than the newest
# version recorded minus ARGV[4] (+1), so the hash holds the newest versions only.
RECORD_VERSIONED = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local keep = tonumber(ARGV[4])
if keep <= 0 then return 0 end
local top = redis.call('ZREVRANGE', KEYS[2], 0, 0, 'WITHSCORES')
local cut = tonumber(top[2]) - keep
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cut)
for i = 1, #old, 500 do
  redis.call('HDEL', KEYS[1], unpack(old, i, math.min(#old, i + 499)))
end
if #old > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', cut) end
return #old
"""
