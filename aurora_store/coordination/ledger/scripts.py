"""The ledger's Lua scripts: every state change that must be atomic.

Each script is a module constant with a header saying what ``KEYS`` and
``ARGV`` are and what it returns, in the manner of redis-py's ``lock.py``;
:class:`LedgerScripts` registers them all once per client. redis-py runs a
registered script by SHA and loads it again when Redis answers NOSCRIPT
(after a restart or ``SCRIPT FLUSH``).

Time is the Redis server's ``TIME`` in milliseconds, so Actors' clocks never
matter; a test passes its own clock's reading as the ``now`` argument
instead (``""`` means "ask the server"). The scripts that need the time
share one prelude, :data:`NOW_PRELUDE`.

Every script may run twice: redis-py (or :func:`aurora_store.outage.riding`)
repeats a call whose answer was lost. So each is idempotent or says what a
repeat answers (``CREATE_STEP``: ``exists``; ``SETTLE``: ``duplicate``).

The Trainer's writes (``CREATE_STEP``, ``SEAL_STEP``, ``DROP_STEP``,
``MARK_SETTLED``, ``FENCED_HSET``, ``ENTER_EPOCH``) carry its epoch and are
refused, inside the script, when Redis holds a higher one: they answer
``{'fenced', stored_epoch}`` and change nothing (:data:`EPOCH_PRELUDE`). An
empty epoch argument skips the check (tools and tests without a Trainer).

Keys the Actors' scripts create inside a step (a lease hash, a results
hash) take the step hash's remaining TTL (:data:`TTL_PRELUDE`), so a step
whose Trainer died expires whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "NOW_PRELUDE",
    "EPOCH_PRELUDE",
    "TTL_PRELUDE",
    "REGISTER",
    "HEARTBEAT",
    "MARK_ACTOR",
    "TRIM_ACTOR",
    "CLAIM",
    "SETTLE_PRELUDE",
    "SETTLE",
    "SETTLE_MANY",
    "RELEASE",
    "CREATE_STEP",
    "SEAL_STEP",
    "DROP_STEP",
    "MARK_SETTLED",
    "ENTER_EPOCH",
    "FENCED_HSET",
    "RECORD_VERSIONED",
    "LedgerScripts",
]

# now_ms(arg) -> arg, or the server's TIME in milliseconds when arg is "".
# TIME is non-deterministic: replicate_commands makes Redis < 7 replicate the
# script's effects rather than the script (Redis >= 7 always does).
NOW_PRELUDE = """
local function now_ms(arg)
  if arg ~= '' then return arg end
  redis.replicate_commands()
  local t = redis.call('TIME')
  return string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000))
end
"""

# fenced(epoch_key, arg) -> nil if the caller may write (arg "" skips the check; a
# stored epoch lower than arg, or none, is raised to arg), else the stored epoch.
# A Redis that lost its data lost the epoch too: the next fenced write restores it.
EPOCH_PRELUDE = """
local function fenced(key, arg)
  if arg == '' then return nil end
  local cur = tonumber(redis.call('GET', key) or '-1')
  local mine = tonumber(arg)
  if cur > mine then return cur end
  if cur < mine then redis.call('SET', key, arg) end
  return nil
end
"""

# inherit_ttl(key, from): a key without a TTL takes the remaining TTL of `from`.
TTL_PRELUDE = """
local function inherit_ttl(key, from)
  if redis.call('PTTL', key) == -1 then
    local t = redis.call('PTTL', from)
    if t > 0 then redis.call('PEXPIRE', key, t) end
  end
end
"""

# Redis' Lua (unpack) takes a few thousand values per call: bulk writes go in chunks.
CHUNK_PRELUDE = """
local function chunked(cmd, key, items, first, last)
  local i = first
  while i <= last do
    local j = math.min(last, i + 499)
    redis.call(cmd, key, unpack(items, i, j))
    i = j + 1
  end
end
"""

# KEYS[1] actor hash, KEYS[2] actors set
# ARGV[1] actor id, ARGV[2] now_ms or "", ARGV[3] record TTL in ms ("0": none),
# ARGV[4..] field, value pairs
# returns now_ms
REGISTER = NOW_PRELUDE + """
local now = now_ms(ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
local kv = {'heartbeat_ms', now, 'status', 'alive'}
for i = 4, #ARGV do kv[#kv + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(kv))
local ttl = tonumber(ARGV[3])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) else redis.call('PERSIST', KEYS[1]) end
return tonumber(now)
"""

# KEYS[1] actor hash
# ARGV[1] now_ms or "", ARGV[2] record TTL in ms ("0": none), ARGV[3..] field, value pairs
# returns now_ms, or -1 if the Actor is not registered (or its record expired) or no longer alive
HEARTBEAT = NOW_PRELUDE + """
local now = now_ms(ARGV[1])
if redis.call('HGET', KEYS[1], 'status') ~= 'alive' then return -1 end
local kv = {'heartbeat_ms', now}
for i = 3, #ARGV do kv[#kv + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(kv))
local ttl = tonumber(ARGV[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return tonumber(now)
"""

# KEYS[1] actor hash
# ARGV[1] new TTL in ms ("": keep it), ARGV[2] required status ("": any), ARGV[3..] field, value pairs
# returns 1 if written, 0 if the record is gone (or not in the required status): never
# creates a record, so a write to an expired Actor leaves no key without a TTL behind.
MARK_ACTOR = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[1], 'status') ~= ARGV[2] then return 0 end
local kv = {}
for i = 3, #ARGV do kv[#kv + 1] = ARGV[i] end
if #kv > 0 then redis.call('HSET', KEYS[1], unpack(kv)) end
if ARGV[1] ~= '' then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1])) end
return 1
"""

# KEYS[1] actor hash, KEYS[2] actors set
# ARGV[1] actor id
# returns 1 if the id was removed from the set (its record is gone), else 0
TRIM_ACTOR = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
return redis.call('SREM', KEYS[2], ARGV[1])
"""

# KEYS[1] step hash, KEYS[2] assigned list (this actor, this step), KEYS[3] pool list,
# KEYS[4] lease hash, KEYS[5] expiry zset, KEYS[6] fence counter, KEYS[7] actor hash,
# KEYS[8] prompts hash, KEYS[9] done hash
# ARGV[1] actor id, ARGV[2] max prompts, ARGV[3] now_ms or ""
# returns {status, now_ms} when nothing was leased, else {'ok', now_ms, state, group,
# version, prompt, token, expiry, payload, ...} (the step's state digest, group size and
# generation version ride along, so the Actor needs no second round trip); status is
# 'ok', 'no_step', 'closed', 'not_alive' or 'not_on_version'.
# A prompt popped from a list that is already settled, currently leased or not of this
# step is a duplicate (a repeated write after a partial loss): it is dropped, not leased,
# so it can never cycle lease -> expiry -> pool.
CLAIM = NOW_PRELUDE + TTL_PRELUDE + CHUNK_PRELUDE + """
local now = tonumber(now_ms(ARGV[3]))
if redis.call('EXISTS', KEYS[1]) == 0 then return {'no_step', now} end
if redis.call('HGET', KEYS[1], 'closed') then return {'closed', now} end
if redis.call('HGET', KEYS[7], 'status') ~= 'alive' then return {'not_alive', now} end
local version = redis.call('HGET', KEYS[1], 'version')
if redis.call('HGET', KEYS[7], 'active') ~= version then return {'not_on_version', now} end
-- Leases past their expiry go back to the pool first.
local expired = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. now)
if #expired > 0 then
  chunked('HDEL', KEYS[4], expired, 1, #expired)
  chunked('ZREM', KEYS[5], expired, 1, #expired)
  chunked('RPUSH', KEYS[3], expired, 1, #expired)
  redis.call('HINCRBY', KEYS[1], 'expired', #expired)
  inherit_ttl(KEYS[3], KEYS[1])
end
local want = tonumber(ARGV[2])
local lease_ms = tonumber(redis.call('HGET', KEYS[1], 'lease_ms'))
local out = {'ok', now, '', '', ''}
local got = 0
local dropped = 0
local seen = {}
local own_left = true
-- Pop in bulk (own assignments first, then the pool), drop what is not leasable, repeat
-- while something was dropped and more is wanted.
while got < want do
  local need = math.min(want - got, 500)
  local ps = {}
  if own_left then
    ps = redis.call('LPOP', KEYS[2], need) or {}
    if #ps < need then own_left = false end
  end
  if #ps < need then
    for _, p in ipairs(redis.call('LPOP', KEYS[3], need - #ps) or {}) do ps[#ps + 1] = p end
  end
  if #ps == 0 then break end
  local payloads = redis.call('HMGET', KEYS[8], unpack(ps))
  local done = redis.call('HMGET', KEYS[9], unpack(ps))
  local leased = redis.call('HMGET', KEYS[4], unpack(ps))
  local keep = {}
  for k = 1, #ps do
    local p = ps[k]
    if (not payloads[k]) or done[k] or leased[k] or seen[p] then
      dropped = dropped + 1
    else
      seen[p] = true
      keep[#keep + 1] = k
    end
  end
  if #keep > 0 then
    local token = redis.call('INCRBY', KEYS[6], #keep) - #keep
    local exp = string.format('%d', now + lease_ms)
    local since = string.format('%d', now)
    local hkv, zkv = {}, {}
    for _, k in ipairs(keep) do
      local p = ps[k]
      token = token + 1
      local t = string.format('%d', token)
      hkv[#hkv + 1] = p
      hkv[#hkv + 1] = ARGV[1] .. '|' .. t .. '|' .. exp .. '|' .. since
      zkv[#zkv + 1] = exp
      zkv[#zkv + 1] = p
      out[#out + 1] = p
      out[#out + 1] = t
      out[#out + 1] = exp
      out[#out + 1] = payloads[k]
    end
    redis.call('HSET', KEYS[4], unpack(hkv))
    redis.call('ZADD', KEYS[5], unpack(zkv))
    got = got + #keep
  end
  if #ps < need then break end
end
if dropped > 0 then redis.call('HINCRBY', KEYS[1], 'duplicates', dropped) end
if got == 0 then return {'ok', now} end
inherit_ttl(KEYS[4], KEYS[1])
inherit_ttl(KEYS[5], KEYS[1])
local meta = redis.call('HMGET', KEYS[1], 'state', 'group', 'version')
out[3] = meta[1] or ''
out[4] = meta[2] or '1'
out[5] = meta[3] or ''
return out
"""

# settle_batch(actor, now, items): the settlement predicate over one step's keys (the
# KEYS of SETTLE and SETTLE_MANY), applied to each item {prompt, token, version, state,
# payload} in order, as if each were its own script run at `now`; returns the reasons.
# A result is accepted iff the step is open, now <= its lease expiry, version and state
# equal the job's, and the token is the prompt's current lease; a prompt is accepted at
# most once. An accepted result is written under its prompt id (results,
# results:payload) with the settle sequence number, so no lost or reordered write can
# hide another. A refused lease (expired, wrong version or digest) goes back to the pool.
# The batch's reads and writes are one command per key (HMGET, HDEL, HSET with many
# fields), not one per result; each item still sees the effects of the ones before it.
SETTLE_PRELUDE = """
local function hmget_all(key, fields)
  local out = {}
  for i = 1, #fields, 500 do
    local part = redis.call('HMGET', key, unpack(fields, i, math.min(#fields, i + 499)))
    for k = 1, #part do out[#out + 1] = part[k] end
  end
  return out
end
local function settle_batch(actor, now, items)
  local reasons = {}
  local shut = nil
  if redis.call('EXISTS', KEYS[1]) == 0 then shut = 'no_step'
  elseif redis.call('HGET', KEYS[1], 'closed') then shut = 'closed' end
  if shut then
    for i = 1, #items do reasons[i] = shut end
    return reasons
  end
  local meta = redis.call('HMGET', KEYS[1], 'version', 'state')
  -- What the batch reads, read once; each item sees the ones before it through these tables.
  local ps = {}
  for i = 1, #items do ps[i] = items[i][1] end
  local done, lease = {}, {}
  local dv, lv = hmget_all(KEYS[4], ps), hmget_all(KEYS[2], ps)
  for i = 1, #ps do
    done[ps[i]] = dv[i]
    lease[ps[i]] = lv[i]
  end
  local gone, back, acc = {}, {}, {}
  local n_expired, n_rejected = 0, 0
  for i = 1, #items do
    local it = items[i]
    local p, token = it[1], it[2]
    local d = done[p]
    if d then
      if d == actor .. '|' .. token then reasons[i] = 'duplicate' else reasons[i] = 'already_settled' end
    elseif not lease[p] then
      reasons[i] = 'not_leased'
    else
      local a, tok, exp, t0 = string.match(lease[p], '^(.*)|(%d+)|(%d+)|(%d+)$')
      if a ~= actor or tok ~= token then
        reasons[i] = 'stale_token'
      else
        local why = nil
        if now > tonumber(exp) then why = 'expired'; n_expired = n_expired + 1
        elseif it[3] ~= meta[1] then why = 'wrong_version'; n_rejected = n_rejected + 1
        elseif it[4] ~= meta[2] then why = 'wrong_digest'; n_rejected = n_rejected + 1 end
        lease[p] = false
        gone[#gone + 1] = p
        if why then
          back[#back + 1] = p
          reasons[i] = why
        else
          done[p] = actor .. '|' .. token
          acc[#acc + 1] = {i, tok, t0}
          reasons[i] = 'accepted'
        end
      end
    end
  end
  if #gone > 0 then
    chunked('HDEL', KEYS[2], gone, 1, #gone)
    chunked('ZREM', KEYS[3], gone, 1, #gone)
  end
  if #back > 0 then
    -- A refused lease goes back to the pool.
    chunked('RPUSH', KEYS[6], back, 1, #back)
    if n_expired > 0 then redis.call('HINCRBY', KEYS[1], 'expired', n_expired) end
    if n_rejected > 0 then redis.call('HINCRBY', KEYS[1], 'rejected', n_rejected) end
    inherit_ttl(KEYS[6], KEYS[1])
  end
  if #acc > 0 then
    local seq0 = redis.call('HINCRBY', KEYS[1], 'settled', #acc) - #acc
    local dkv, rkv, pkv = {}, {}, {}
    for k, x in ipairs(acc) do
      local it = items[x[1]]
      local p = it[1]
      dkv[#dkv + 1] = p
      dkv[#dkv + 1] = actor .. '|' .. it[2]
      rkv[#rkv + 1] = p
      rkv[#rkv + 1] = cjson.encode({p, actor, x[2], it[3], string.format('%d', now), x[3], seq0 + k, it[4]})
      pkv[#pkv + 1] = p
      pkv[#pkv + 1] = it[5]
    end
    chunked('HSET', KEYS[4], dkv, 1, #dkv)
    chunked('HSET', KEYS[5], rkv, 1, #rkv)
    chunked('HSET', KEYS[8], pkv, 1, #pkv)
    inherit_ttl(KEYS[4], KEYS[1])
    inherit_ttl(KEYS[5], KEYS[1])
    inherit_ttl(KEYS[8], KEYS[1])
    if redis.call('EXISTS', KEYS[7]) == 1 then redis.call('HINCRBY', KEYS[7], 'settled', #acc) end
  end
  return reasons
end
"""

# KEYS[1] step hash, KEYS[2] lease hash, KEYS[3] expiry zset, KEYS[4] done hash,
# KEYS[5] results hash, KEYS[6] pool list, KEYS[7] actor hash, KEYS[8] result payloads hash
# ARGV[1] actor, ARGV[2] prompt, ARGV[3] token, ARGV[4] version, ARGV[5] state,
# ARGV[6] result payload, ARGV[7] now_ms or ""
# returns {reason, now_ms}: the settlement predicate (paper §5.4, docs/PROTOCOL.md) of
# SETTLE_PRELUDE for one result. A repeat answers 'duplicate'.
SETTLE = NOW_PRELUDE + TTL_PRELUDE + CHUNK_PRELUDE + SETTLE_PRELUDE + """
local now = tonumber(now_ms(ARGV[7]))
local r = settle_batch(ARGV[1], now, {{ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]}})
return {r[1], now}
"""

# KEYS as SETTLE (one step, one Actor)
# ARGV[1] actor, ARGV[2] now_ms or "", then per result 5 values: prompt, token, version,
# state, payload
# returns {now_ms, reason, reason, ...}: one reason per result, in order, each what SETTLE
# would answer for it run alone at now_ms after the ones before it (a prompt twice in a
# batch: the second answers 'duplicate'). One script per batch instead of one per result.
SETTLE_MANY = NOW_PRELUDE + TTL_PRELUDE + CHUNK_PRELUDE + SETTLE_PRELUDE + """
local now = tonumber(now_ms(ARGV[2]))
local items = {}
for i = 3, #ARGV - 4, 5 do
  items[#items + 1] = {ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]}
end
local r = settle_batch(ARGV[1], now, items)
table.insert(r, 1, now)
return r
"""

# KEYS[1] lease hash, KEYS[2] expiry zset, KEYS[3] pool list, KEYS[4] assigned list,
# KEYS[5] step hash
# ARGV[1] actor
# returns the number of prompts put back in the pool (leases plus unclaimed assignments)
RELEASE = TTL_PRELUDE + """
local n = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local a = string.match(all[i + 1], '^(.*)|%d+|%d+|%d+$')
  if a == ARGV[1] then
    redis.call('HDEL', KEYS[1], all[i])
    redis.call('ZREM', KEYS[2], all[i])
    redis.call('RPUSH', KEYS[3], all[i])
    n = n + 1
  end
end
while true do
  local p = redis.call('LPOP', KEYS[4])
  if not p then break end
  redis.call('RPUSH', KEYS[3], p)
  n = n + 1
end
if n > 0 then inherit_ttl(KEYS[3], KEYS[5]) end
return n
"""

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
CREATE_STEP = NOW_PRELUDE + EPOCH_PRELUDE + CHUNK_PRELUDE + """
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

# KEYS[1] step hash, KEYS[2] steps zset, KEYS[3] epoch
# ARGV[1] step id, ARGV[2] epoch or "", ARGV[3] now_ms or ""
# returns {'sealed', total, settled} (also when already sealed: a repeat is harmless),
# {'no_step'} or {'fenced', epoch}. From now on SETTLE answers 'closed' and CLAIM
# leases nothing; the results stay readable until DROP_STEP.
SEAL_STEP = NOW_PRELUDE + EPOCH_PRELUDE + """
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

# KEYS[1] step hash, KEYS[2] steps zset, KEYS[3] epoch, KEYS[4..] the step's other keys
# (prompts, pool, lease, exp, done, results, payloads, assignees, assigned lists)
# ARGV[1] step id, ARGV[2] epoch or "", ARGV[3] tombstone TTL in ms, ARGV[4] unreturned
# (or ""), ARGV[5] now_ms or ""
# returns {'dropped'} or {'fenced', epoch}. Deletes every key of the step but its hash,
# which stays as a tombstone ({closed, dropped, total, settled, unreturned}) for ARGV[3]
# ms, so a late settle still answers 'closed'. Seals first if SEAL_STEP did not run.
DROP_STEP = NOW_PRELUDE + EPOCH_PRELUDE + """
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

# KEYS[1] step hash, KEYS[2] prompts hash, KEYS[3] lease hash, KEYS[4] expiry zset,
# KEYS[5] done hash, KEYS[6] pool list, KEYS[7] epoch, KEYS[8..] assigned lists
# ARGV[1] epoch or "", ARGV[2..] prompt ids the Trainer already holds results of
# returns {'ok', n marked} or {'fenced', epoch}. For a ledger that lost a settlement
# (an AOF-everysec restart, a failover): each prompt of this step not in done is marked
# done (by 'trainer|0'), its lease dropped and its copies removed from the lists, so it
# is never leased again. Prompts not of this step are ignored; a repeat marks nothing.
MARK_SETTLED = EPOCH_PRELUDE + TTL_PRELUDE + """
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

# KEYS[1] epoch
# ARGV[1] epoch
# returns {'ok', stored} (stored is ARGV[1] once raised) or {'fenced', stored}
ENTER_EPOCH = EPOCH_PRELUDE + """
local f = fenced(KEYS[1], ARGV[1])
if f then return {'fenced', f} end
return {'ok', tonumber(redis.call('GET', KEYS[1]))}
"""

# KEYS[1] epoch, KEYS[2] hash
# ARGV[1] epoch or "", ARGV[2..] field, value pairs
# returns {'ok'} or {'fenced', epoch}
FENCED_HSET = EPOCH_PRELUDE + """
local f = fenced(KEYS[1], ARGV[1])
if f then return {'fenced', f} end
local kv = {}
for i = 2, #ARGV do kv[#kv + 1] = ARGV[i] end
if #kv > 0 then redis.call('HSET', KEYS[2], unpack(kv)) end
return {'ok'}
"""

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


@dataclass(frozen=True, slots=True)
class LedgerScripts:
    """The ledger's scripts registered on one client (redis-py ``Script`` objects)."""

    register: Any
    """:data:`REGISTER`."""
    heartbeat: Any
    """:data:`HEARTBEAT`."""
    mark_actor: Any
    """:data:`MARK_ACTOR`."""
    trim_actor: Any
    """:data:`TRIM_ACTOR`."""
    claim: Any
    """:data:`CLAIM`."""
    settle: Any
    """:data:`SETTLE`."""
    settle_many: Any
    """:data:`SETTLE_MANY`."""
    release: Any
    """:data:`RELEASE`."""
    create_step: Any
    """:data:`CREATE_STEP`."""
    seal_step: Any
    """:data:`SEAL_STEP`."""
    drop_step: Any
    """:data:`DROP_STEP`."""
    mark_settled: Any
    """:data:`MARK_SETTLED`."""
    enter_epoch: Any
    """:data:`ENTER_EPOCH`."""
    fenced_hset: Any
    """:data:`FENCED_HSET`."""

    @classmethod
    def on(cls, redis: Any) -> LedgerScripts:
        """Register every script on ``redis`` (computes the SHAs; no round trip)."""
        return cls(
            register=redis.register_script(REGISTER),
            heartbeat=redis.register_script(HEARTBEAT),
            mark_actor=redis.register_script(MARK_ACTOR),
            trim_actor=redis.register_script(TRIM_ACTOR),
            claim=redis.register_script(CLAIM),
            settle=redis.register_script(SETTLE),
            settle_many=redis.register_script(SETTLE_MANY),
            release=redis.register_script(RELEASE),
            create_step=redis.register_script(CREATE_STEP),
            seal_step=redis.register_script(SEAL_STEP),
            drop_step=redis.register_script(DROP_STEP),
            mark_settled=redis.register_script(MARK_SETTLED),
            enter_epoch=redis.register_script(ENTER_EPOCH),
            fenced_hset=redis.register_script(FENCED_HSET),
        )
