"""The Actors' scripts: the registry (register, heartbeat, mark, trim, report), claims, settlement, release.

Headers and the rules every script keeps: :mod:`aurora_store.coordination.ledger.scripts`.
"""

from __future__ import annotations

from aurora_store.coordination.ledger.preludes import CHUNK_PRELUDE, NOW_PRELUDE, TTL_PRELUDE

__all__ = ["REGISTER", "HEARTBEAT", "MARK_ACTOR", "TRIM_ACTOR", "CLAIM", "SETTLE_PRELUDE", "SETTLE", "SETTLE_MANY", "RELEASE"]

# KEYS[1] actor hash, KEYS[2] actors set
# ARGV[1] actor id, ARGV[2] now_ms or "", ARGV[3] record TTL in ms ("0": none),
# ARGV[4..] field, value pairs
# returns now_ms
REGISTER = (
    NOW_PRELUDE
    + """
local now = now_ms(ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
local kv = {'heartbeat_ms', now, 'status', 'alive'}
for i = 4, #ARGV do kv[#kv + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(kv))
local ttl = tonumber(ARGV[3])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) else redis.call('PERSIST', KEYS[1]) end
return tonumber(now)
"""
)

# KEYS[1] actor hash
# ARGV[1] now_ms or "", ARGV[2] record TTL in ms ("0": none), ARGV[3..] field, value pairs
# returns now_ms, or -1 if the Actor is not registered (or its record expired) or no longer alive
HEARTBEAT = (
    NOW_PRELUDE
    + """
local now = now_ms(ARGV[1])
if redis.call('HGET', KEYS[1], 'status') ~= 'alive' then return -1 end
local kv = {'heartbeat_ms', now}
for i = 3, #ARGV do kv[#kv + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(kv))
local ttl = tonumber(ARGV[2])
if ttl > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
return tonumber(now)
"""
)

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
# ARGV[1] actor id, ARGV[2] max prompts, ARGV[3] now_ms or "", ARGV[4..] claim hashes
# (one per lease it may hand out: the k-th lease takes ARGV[3 + k]; missing ones are "")
# returns {status, now_ms} when nothing was leased, else {'ok', now_ms, state, group,
# version, prompt, token, expiry, payload, ...} (the step's state digest, group size and
# generation version ride along, so the Actor needs no second round trip); status is
# 'ok', 'no_step', 'closed', 'not_alive' or 'not_on_version'. A lease is stored as
# actor|token|expiry|leased_ms|claim_hash: only who knows the hash's preimage settles it.
# A prompt popped from a list that is already settled, currently leased or not of this
# step is a duplicate (a repeated write after a partial loss): it is dropped, not leased,
# so it can never cycle lease -> expiry -> pool.
CLAIM = (
    NOW_PRELUDE
    + TTL_PRELUDE
    + CHUNK_PRELUDE
    + """
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
    for j, k in ipairs(keep) do
      local p = ps[k]
      token = token + 1
      local t = string.format('%d', token)
      hkv[#hkv + 1] = p
      hkv[#hkv + 1] = ARGV[1] .. '|' .. t .. '|' .. exp .. '|' .. since .. '|' .. (ARGV[3 + got + j] or '')
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
)

# settle_batch(actor, now, items): the settlement predicate over one step's keys (the
# KEYS of SETTLE and SETTLE_MANY), applied to each item {prompt, token, version, state,
# payload, secret} in order, as if each were its own script run at `now`; returns the reasons.
# A result is accepted iff the step is open, now <= its lease expiry, version and state
# equal the job's, and the token is the prompt's current lease, held by this actor, whose
# claim hash is sha1(sha1(secret)) (a lease without a hash, of an older release, is settled
# on actor and token alone); a prompt is accepted at most once. Any other caller answers
# 'stale_token' and changes nothing. The accepted record keeps sha1(secret), the witness
# the Trainer checks against the claim hash, never the secret. An accepted result is written under its prompt id (results,
# results:payload) with the settle sequence number, so no lost or reordered write can
# hide another. A refused lease (expired, wrong version or digest) goes back to the pool.
# The batch's reads and writes are one command per key (HMGET, HDEL, HSET with many
# fields), not one per result; each item still sees the effects of the ones before it.
SETTLE_PRELUDE = """
local function parse_lease(v)
  local a, tok, exp, t0, ch = string.match(v, '^(.*)|(%d+)|(%d+)|(%d+)|(%x*)$')
  if a then return a, tok, exp, t0, ch end
  a, tok, exp, t0 = string.match(v, '^(.*)|(%d+)|(%d+)|(%d+)$')
  return a, tok, exp, t0, ''
end
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
      local a, tok, exp, t0, ch = parse_lease(lease[p])
      if a ~= actor or tok ~= token or (ch ~= '' and redis.sha1hex(redis.sha1hex(it[6])) ~= ch) then
        -- Not this caller's lease: another Actor's, a newer one, or a secret that is not the claimer's.
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
          acc[#acc + 1] = {i, tok, t0, ch}
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
      rkv[#rkv + 1] = cjson.encode({p, actor, x[2], it[3], string.format('%d', now), x[3], seq0 + k, it[4],
        redis.sha1hex(it[6]), x[4]})
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
# ARGV[6] result payload, ARGV[7] now_ms or "", ARGV[8] the lease's secret
# returns {reason, now_ms}: the settlement predicate (paper §5.4, docs/PROTOCOL.md) of
# SETTLE_PRELUDE for one result. A repeat answers 'duplicate'.
SETTLE = (
    NOW_PRELUDE
    + TTL_PRELUDE
    + CHUNK_PRELUDE
    + SETTLE_PRELUDE
    + """
local now = tonumber(now_ms(ARGV[7]))
local r = settle_batch(ARGV[1], now, {{ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[8] or ''}})
return {r[1], now}
"""
)

# KEYS as SETTLE (one step, one Actor)
# ARGV[1] actor, ARGV[2] now_ms or "", then per result 6 values: prompt, token, version,
# state, payload, secret
# returns {now_ms, reason, reason, ...}: one reason per result, in order, each what SETTLE
# would answer for it run alone at now_ms after the ones before it (a prompt twice in a
# batch: the second answers 'duplicate'). One script per batch instead of one per result.
SETTLE_MANY = (
    NOW_PRELUDE
    + TTL_PRELUDE
    + CHUNK_PRELUDE
    + SETTLE_PRELUDE
    + """
local now = tonumber(now_ms(ARGV[2]))
local items = {}
for i = 3, #ARGV - 5, 6 do
  items[#items + 1] = {ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]}
end
local r = settle_batch(ARGV[1], now, items)
table.insert(r, 1, now)
return r
"""
)

# KEYS[1] lease hash, KEYS[2] expiry zset, KEYS[3] pool list, KEYS[4] assigned list,
# KEYS[5] step hash
# ARGV[1] actor
# returns the number of prompts put back in the pool (leases plus unclaimed assignments)
RELEASE = (
    TTL_PRELUDE
    + """
local n = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local a = string.match(all[i + 1], '^(.*)|%d+|%d+|%d+|%x*$') or string.match(all[i + 1], '^(.*)|%d+|%d+|%d+$')
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
)
