"""Lua functions the ledger's scripts share, prepended to each script that uses them.

:data:`NOW_PRELUDE` (the time), :data:`EPOCH_PRELUDE` (the Trainer's epoch
fence), :data:`TTL_PRELUDE` (keys created inside a step take its TTL) and
:data:`CHUNK_PRELUDE` (bulk writes in chunks). See
:mod:`aurora_store.coordination.ledger.scripts`.
"""

from __future__ import annotations

__all__ = ["NOW_PRELUDE", "EPOCH_PRELUDE", "TTL_PRELUDE", "CHUNK_PRELUDE"]

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
