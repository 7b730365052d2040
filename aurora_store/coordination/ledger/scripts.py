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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["NOW_PRELUDE", "REGISTER", "HEARTBEAT", "CLAIM", "SETTLE", "RELEASE", "LedgerScripts"]

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

# KEYS[1] actor hash, KEYS[2] actors set
# ARGV[1] actor id, ARGV[2] now_ms or "", ARGV[3..] field, value pairs
# returns now_ms
REGISTER = NOW_PRELUDE + """
local now = now_ms(ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
local kv = {'heartbeat_ms', now, 'status', 'alive'}
for i = 3, #ARGV do kv[#kv + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(kv))
return tonumber(now)
"""

# KEYS[1] actor hash
# ARGV[1] now_ms or "", ARGV[2..] field, value pairs
# returns now_ms, or -1 if the Actor is not registered or no longer alive
HEARTBEAT = NOW_PRELUDE + """
local now = now_ms(ARGV[1])
if redis.call('HGET', KEYS[1], 'status') ~= 'alive' then return -1 end
local kv = {'heartbeat_ms', now}
for i = 2, #ARGV do kv[#kv + 1] = ARGV[i] end
redis.call('HSET', KEYS[1], unpack(kv))
return tonumber(now)
"""

# KEYS[1] step hash, KEYS[2] assigned list (this actor, this step), KEYS[3] pool list,
# KEYS[4] lease hash, KEYS[5] expiry zset, KEYS[6] fence counter, KEYS[7] actor hash,
# KEYS[8] prompts hash
# ARGV[1] actor id, ARGV[2] max prompts, ARGV[3] now_ms or ""
# returns {status, now_ms, prompt, token, expiry, payload, ...}; status is 'ok',
# 'no_step', 'not_alive' or 'not_on_version'
CLAIM = NOW_PRELUDE + """
local now = tonumber(now_ms(ARGV[3]))
if redis.call('EXISTS', KEYS[1]) == 0 then return {'no_step', now} end
if redis.call('HGET', KEYS[7], 'status') ~= 'alive' then return {'not_alive', now} end
local version = redis.call('HGET', KEYS[1], 'version')
if redis.call('HGET', KEYS[7], 'active') ~= version then return {'not_on_version', now} end
-- Leases past their expiry go back to the pool first.
local expired = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', '(' .. now)
for _, p in ipairs(expired) do
  redis.call('HDEL', KEYS[4], p)
  redis.call('ZREM', KEYS[5], p)
  redis.call('RPUSH', KEYS[3], p)
end
if #expired > 0 then redis.call('HINCRBY', KEYS[1], 'expired', #expired) end
local want = tonumber(ARGV[2])
local lease_ms = tonumber(redis.call('HGET', KEYS[1], 'lease_ms'))
local out = {'ok', now}
local got = 0
while got < want do
  local p = redis.call('LPOP', KEYS[2])
  if not p then p = redis.call('LPOP', KEYS[3]) end
  if not p then break end
  local token = string.format('%d', redis.call('INCR', KEYS[6]))
  local exp = string.format('%d', now + lease_ms)
  redis.call('HSET', KEYS[4], p, ARGV[1] .. '|' .. token .. '|' .. exp .. '|' .. string.format('%d', now))
  redis.call('ZADD', KEYS[5], exp, p)
  out[#out + 1] = p
  out[#out + 1] = token
  out[#out + 1] = exp
  out[#out + 1] = redis.call('HGET', KEYS[8], p) or ''
  got = got + 1
end
return out
"""

# KEYS[1] step hash, KEYS[2] lease hash, KEYS[3] expiry zset, KEYS[4] done hash,
# KEYS[5] results list, KEYS[6] pool list, KEYS[7] actor hash, KEYS[8] result payloads list
# ARGV[1] actor, ARGV[2] prompt, ARGV[3] token, ARGV[4] version, ARGV[5] state,
# ARGV[6] result payload, ARGV[7] now_ms or ""
# returns {reason, now_ms}: accepted iff now <= expiry, version and state equal the
# job's, the token is the prompt's current lease; a prompt is accepted at most once.
# This is the settlement predicate (paper §5.4, docs/PROTOCOL.md).
SETTLE = NOW_PRELUDE + """
local now = tonumber(now_ms(ARGV[7]))
local p = ARGV[2]
if redis.call('EXISTS', KEYS[1]) == 0 then return {'no_step', now} end
local done = redis.call('HGET', KEYS[4], p)
if done then
  if done == ARGV[1] .. '|' .. ARGV[3] then return {'duplicate', now} end
  return {'already_settled', now}
end
local lease = redis.call('HGET', KEYS[2], p)
if not lease then return {'not_leased', now} end
local a, tok, exp, t0 = string.match(lease, '^(.*)|(%d+)|(%d+)|(%d+)$')
if a ~= ARGV[1] or tok ~= ARGV[3] then return {'stale_token', now} end
local function release(field)
  redis.call('HDEL', KEYS[2], p)
  redis.call('ZREM', KEYS[3], p)
  redis.call('RPUSH', KEYS[6], p)
  redis.call('HINCRBY', KEYS[1], field, 1)
end
if now > tonumber(exp) then release('expired'); return {'expired', now} end
if ARGV[4] ~= redis.call('HGET', KEYS[1], 'version') then release('rejected'); return {'wrong_version', now} end
if ARGV[5] ~= redis.call('HGET', KEYS[1], 'state') then release('rejected'); return {'wrong_digest', now} end
redis.call('HDEL', KEYS[2], p)
redis.call('ZREM', KEYS[3], p)
redis.call('HSET', KEYS[4], p, ARGV[1] .. '|' .. ARGV[3])
redis.call('RPUSH', KEYS[5], cjson.encode({p, ARGV[1], tok, ARGV[4], string.format('%d', now), t0}))
redis.call('RPUSH', KEYS[8], ARGV[6])
redis.call('HINCRBY', KEYS[1], 'settled', 1)
redis.call('HINCRBY', KEYS[7], 'settled', 1)
return {'accepted', now}
"""

# KEYS[1] lease hash, KEYS[2] expiry zset, KEYS[3] pool list, KEYS[4] assigned list
# ARGV[1] actor
# returns the number of prompts put back in the pool (leases plus unclaimed assignments)
RELEASE = """
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
return n
"""


@dataclass(frozen=True, slots=True)
class LedgerScripts:
    """The ledger's scripts registered on one client (redis-py ``Script`` objects)."""

    register: Any
    """:data:`REGISTER`."""
    heartbeat: Any
    """:data:`HEARTBEAT`."""
    claim: Any
    """:data:`CLAIM`."""
    settle: Any
    """:data:`SETTLE`."""
    release: Any
    """:data:`RELEASE`."""

    @classmethod
    def on(cls, redis: Any) -> LedgerScripts:
        """Register every script on ``redis`` (computes the SHAs; no round trip)."""
        return cls(
            register=redis.register_script(REGISTER),
            heartbeat=redis.register_script(HEARTBEAT),
            claim=redis.register_script(CLAIM),
            settle=redis.register_script(SETTLE),
            release=redis.register_script(RELEASE),
        )
