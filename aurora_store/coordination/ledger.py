"""The job ledger: Actors, per-prompt leases and settlement, on Redis.

Every state change that must be atomic is one Lua script (a class constant
with a header saying what KEYS and ARGV are and what it returns). Time comes
from the Redis server clock (``TIME``) so Actors' clocks never matter; tests
pass a clock (milliseconds) instead, and the scripts use it.

The settlement predicate (paper §5.4) is :attr:`Ledger.SETTLE`: a result is
accepted iff it arrives no later than its lease expiry, for the version and
state digest the job was created with, under the current fencing token; a
prompt is accepted at most once. Expired leases go back to the pool inside
the next claim, with nobody's help.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aurora_store.coordination.redisconn import key_prefix
from aurora_store.errors import ConfigError, LedgerLost, StepExists

try:
    from redis.exceptions import NoScriptError
except ImportError:  # pragma: no cover - redis is a dependency
    NoScriptError = Exception  # type: ignore[misc,assignment]

__all__ = [
    "Lease",
    "Settlement",
    "ActorRecord",
    "StepStatus",
    "AcceptedResult",
    "Ledger",
    "StepExists",
    "LedgerLost",
    "SETTLE_REASONS",
]

#: Every answer ``settle`` can give.
SETTLE_REASONS = ("accepted", "duplicate", "already_settled", "not_leased", "stale_token", "expired", "wrong_version", "wrong_digest", "no_step")






@dataclass(frozen=True, slots=True)
class Lease:
    """One prompt leased to one Actor."""

    prompt: str
    token: int
    """Fencing token: only the newest lease of a prompt can settle it."""
    version: int
    """Version v_j the rollout must be generated on."""
    state: str
    """State digest h(v_j) the rollout must carry."""
    group: int
    """Completions to generate for the prompt (GRPO group size)."""
    expiry_ms: int
    """Server-clock deadline of the lease."""
    payload: bytes
    """The prompt itself, as the Trainer stored it."""
    step: int = -1
    """Ledger step id the lease belongs to (defaults to ``version``)."""

    @property
    def step_id(self) -> int:
        return self.version if self.step < 0 else self.step


@dataclass(frozen=True, slots=True)
class Settlement:
    """The ledger's answer to one result."""

    prompt: str
    reason: str
    """One of :data:`SETTLE_REASONS`."""
    now_ms: int

    @property
    def accepted(self) -> bool:
        return self.reason == "accepted"


@dataclass(frozen=True, slots=True)
class AcceptedResult:
    """A result the ledger accepted, as the Trainer collects it."""

    prompt: str
    actor: str
    token: int
    version: int
    settled_ms: int
    leased_ms: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ActorRecord:
    """An Actor as the registry knows it."""

    actor: str
    region: str
    engine: str
    status: str
    """``alive``, ``left`` (graceful) or ``gone`` (heartbeat lost)."""
    active: int | None
    staged: int | None
    active_state: str
    tau: float
    heartbeat_ms: int
    settled: int
    leases: int


@dataclass(frozen=True, slots=True)
class StepStatus:
    version: int
    total: int
    settled: int
    leased: int
    pending: int
    expired: int
    rejected: int


def _i(x: Any, default: int | None = None) -> int | None:
    if x is None or x == b"" or x == "":
        return default
    return int(x)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class Ledger:
    """The ledger of one run. Thread-safe as far as the redis-py client is."""

    # KEYS[1] actor hash, KEYS[2] actors set
    # ARGV[1] actor id, ARGV[2] now_ms or "", ARGV[3..] field, value pairs
    # returns now_ms
    REGISTER = """
    local now = ARGV[2]
    if now == '' then redis.replicate_commands(); local t = redis.call('TIME'); now = string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000)) end
    redis.call('SADD', KEYS[2], ARGV[1])
    local kv = {'heartbeat_ms', now, 'status', 'alive'}
    for i = 3, #ARGV do kv[#kv + 1] = ARGV[i] end
    redis.call('HSET', KEYS[1], unpack(kv))
    return tonumber(now)
    """

    # KEYS[1] actor hash
    # ARGV[1] now_ms or "", ARGV[2..] field, value pairs
    # returns now_ms, or -1 if the Actor is not registered or no longer alive
    HEARTBEAT = """
    local now = ARGV[1]
    if now == '' then redis.replicate_commands(); local t = redis.call('TIME'); now = string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000)) end
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
    CLAIM = """
    local now = ARGV[3]
    if now == '' then redis.replicate_commands(); local t = redis.call('TIME'); now = string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000)) end
    now = tonumber(now)
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
    SETTLE = """
    local now = ARGV[7]
    if now == '' then redis.replicate_commands(); local t = redis.call('TIME'); now = string.format('%d', t[1] * 1000 + math.floor(t[2] / 1000)) end
    now = tonumber(now)
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

    def __init__(self, redis: Any, run: str, clock: Callable[[], int] | None = None) -> None:
        """``redis``: a redis-py client; ``clock``: milliseconds, for tests (default: Redis TIME)."""
        self.r = redis
        self.run = run
        self.p = key_prefix(run)
        self.clock = clock
        self._register = redis.register_script(self.REGISTER)
        self._heartbeat = redis.register_script(self.HEARTBEAT)
        self._claim = redis.register_script(self.CLAIM)
        self._settle = redis.register_script(self.SETTLE)
        self._release = redis.register_script(self.RELEASE)

    # -- keys ---------------------------------------------------------------
    def k_actor(self, actor: str) -> str:
        return f"{self.p}actor:{actor}"

    def k_step(self, v: int, part: str = "") -> str:
        return f"{self.p}step:{v}" + (f":{part}" if part else "")

    def k_assigned(self, v: int, actor: str) -> str:
        return f"{self.p}step:{v}:assigned:{actor}"

    @property
    def k_actors(self) -> str:
        return f"{self.p}actors"

    @property
    def k_steps(self) -> str:
        return f"{self.p}steps"

    @property
    def k_fence(self) -> str:
        return f"{self.p}fence"

    def _now(self) -> str:
        return "" if self.clock is None else str(int(self.clock()))

    def server_time_ms(self) -> int:
        if self.clock is not None:
            return int(self.clock())
        s, us = self.r.time()
        return int(s) * 1000 + int(us) // 1000

    # -- Actors ---------------------------------------------------------------
    @staticmethod
    def _check_id(actor: str) -> str:
        if not actor or "|" in actor or len(actor) > 200:
            raise ConfigError(f"actor id {actor!r} must be 1-200 characters without '|'")
        return actor

    def register(self, actor: str, region: str = "default", engine: str = "torch", tau: float | None = None) -> int:
        """Join (or rejoin) the run. Returns the server time (ms)."""
        self._check_id(actor)
        fields: list[Any] = ["region", region, "engine", engine, "active", "", "staged", "", "active_state", ""]
        if tau is not None:
            fields += ["tau", repr(float(tau))]
        return int(self._register(keys=[self.k_actor(actor), self.k_actors], args=[actor, self._now(), *fields]))

    def heartbeat(self, actor: str, active: int | None = None, staged: int | None = None, active_state: str | None = None) -> bool:
        """Refresh liveness and report versions. False: the ledger considers this Actor gone or left."""
        fields: list[Any] = []
        if active is not None:
            fields += ["active", str(active)]
        if staged is not None:
            fields += ["staged", str(staged)]
        if active_state is not None:
            fields += ["active_state", active_state]
        return int(self._heartbeat(keys=[self.k_actor(actor)], args=[self._now(), *fields])) >= 0

    def lease_counts(self) -> dict[str, int]:
        """Leases held per Actor across open steps, counted from the lease hashes.

        Counted rather than stored: a counter would drift when CLAIM returns
        someone else's expired lease to the pool.
        """
        out: dict[str, int] = {}
        for v in self.open_steps():
            for raw in self.r.hvals(self.k_step(v, "lease")):
                a = _s(raw).rsplit("|", 3)[0]
                out[a] = out.get(a, 0) + 1
        return out

    def actor(self, actor: str, lease_counts: Mapping[str, int] | None = None) -> ActorRecord | None:
        h = self.r.hgetall(self.k_actor(actor))
        if not h:
            return None
        counts = self.lease_counts() if lease_counts is None else lease_counts
        g = {_s(k): v for k, v in h.items()}
        return ActorRecord(
            actor=actor,
            region=_s(g.get("region", b"")),
            engine=_s(g.get("engine", b"")),
            status=_s(g.get("status", b"")),
            active=_i(g.get("active")),
            staged=_i(g.get("staged")),
            active_state=_s(g.get("active_state", b"")),
            tau=float(g.get("tau", b"0") or 0),
            heartbeat_ms=_i(g.get("heartbeat_ms"), 0) or 0,
            settled=_i(g.get("settled"), 0) or 0,
            leases=counts.get(actor, 0),
        )

    def actors(self) -> list[ActorRecord]:
        ids = sorted(_s(x) for x in self.r.smembers(self.k_actors))
        counts = self.lease_counts()
        return [a for a in (self.actor(i, counts) for i in ids) if a is not None]

    def set_tau(self, actor: str, tau: float) -> None:
        self.r.hset(self.k_actor(actor), "tau", repr(float(tau)))

    def leave(self, actor: str) -> int:
        """Graceful leave: release every lease and assignment at once; returns prompts released."""
        # Status first: a claim racing this leave then answers not_alive
        # instead of handing a lease to an Actor that is going away.
        self.r.hset(self.k_actor(actor), "status", "left")
        return self.release_actor(actor)

    def release_actor(self, actor: str) -> int:
        n = 0
        for v in self.open_steps():
            n += int(
                self._release(
                    keys=[self.k_step(v, "lease"), self.k_step(v, "exp"), self.k_step(v, "pool"), self.k_assigned(v, actor)],
                    args=[actor],
                )
            )
        return n

    def reap(self, heartbeat_timeout_ms: int) -> list[str]:
        """Mark Actors silent for longer than the timeout ``gone`` and release their work."""
        now = self.server_time_ms()
        gone = []
        for a in self.actors():
            if a.status == "alive" and now - a.heartbeat_ms > heartbeat_timeout_ms:
                self.r.hset(self.k_actor(a.actor), "status", "gone")
                self.release_actor(a.actor)
                gone.append(a.actor)
        return gone

    # -- Steps (Trainer) --------------------------------------------------------
    def ensure_fence(self) -> None:
        """Start fencing tokens above any a previous Redis could have issued.

        After Redis lost its state, the counter starts again from the current
        time in microseconds, which is larger than any token handed out
        before (tokens grow by one per lease), so a stale lease never matches.
        """
        self.r.set(self.k_fence, self.server_time_ms() * 1000, nx=True)

    def create_step(
        self,
        v: int,
        state: str,
        prompts: Sequence[tuple[str, bytes]],
        quotas: Mapping[str, int],
        group: int,
        lease_ms: int,
        version: int | None = None,
    ) -> None:
        """Create the jobs of step ``v``: each prompt assigned to an Actor per ``quotas``.

        ``version`` is the policy version the rollouts must be generated on
        (default ``v``); with one-step asynchrony two batches may share a
        version, so the step id and the version are separate. Prompts beyond
        the quotas (or all, with no quotas) go to the shared pool.
        """
        if lease_ms <= 0 or group <= 0:
            raise ConfigError(f"step {v}: lease_ms and group must be positive")
        ids = [p for p, _ in prompts]
        if len(set(ids)) != len(ids) or any("|" in p for p in ids):
            raise ConfigError(f"step {v}: prompt ids must be unique and contain no '|'")
        if sum(quotas.values()) > len(ids):
            raise ConfigError(f"step {v}: quotas sum to {sum(quotas.values())}, only {len(ids)} prompts")
        self.ensure_fence()
        # Quotas of Actors that are not registered and alive would strand their
        # prompts (nobody else can claim an assignment); they go to the pool.
        alive = {a.actor for a in self.actors() if a.status == "alive"}
        quotas = {a: n for a, n in quotas.items() if a in alive}
        pipe = self.r.pipeline(transaction=True)
        pipe.hsetnx(self.k_step(v), "version", str(v if version is None else version))
        res = pipe.execute()
        if not res[0]:
            raise StepExists(f"step {v} of run {self.run!r} already has jobs")
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(
            self.k_step(v),
            mapping={"state": state, "group": group, "total": len(ids), "lease_ms": lease_ms, "created_ms": self.server_time_ms(), "settled": 0, "expired": 0, "rejected": 0},
        )
        if prompts:
            pipe.hset(self.k_step(v, "prompts"), mapping=dict(prompts))
        i = 0
        for actor, n in sorted(quotas.items()):
            if n > 0:
                pipe.rpush(self.k_assigned(v, actor), *ids[i : i + n])
                i += n
        if i < len(ids):
            pipe.rpush(self.k_step(v, "pool"), *ids[i:])
        pipe.zadd(self.k_steps, {str(v): v})
        pipe.execute()

    def step_exists(self, v: int) -> bool:
        return bool(self.r.exists(self.k_step(v)))

    def open_steps(self) -> list[int]:
        return sorted(int(x) for x in self.r.zrange(self.k_steps, 0, -1))

    def step_version(self, v: int) -> int | None:
        """Version the rollouts of step ``v`` must be generated on (None: no such step)."""
        x = self.r.hget(self.k_step(v), "version")
        return None if x is None else int(x)

    def open_step_info(self) -> list[tuple[int, int, int]]:
        """(step, version, unsettled prompts) of every open step, in one round trip."""
        steps = self.open_steps()
        if not steps:
            return []
        pipe = self.r.pipeline(transaction=False)
        for v in steps:
            pipe.hmget(self.k_step(v), "version", "total", "settled")
        out = []
        for v, (ver, total, settled) in zip(steps, pipe.execute(), strict=True):
            if ver is not None and total is not None:
                out.append((v, int(ver), int(total) - int(settled or 0)))
        return out

    def unsettled(self, v: int) -> int | None:
        """Prompts of step ``v`` not accepted yet (pending or leased); None: no such step."""
        total, settled = self.r.hmget(self.k_step(v), "total", "settled")
        if total is None:
            return None
        return int(total) - int(settled or 0)

    def step_status(self, v: int) -> StepStatus:
        h = self.r.hgetall(self.k_step(v))
        if not h:
            raise LedgerLost(f"step {v} of run {self.run!r} is not in the ledger")
        g = {_s(k): v for k, v in h.items()}
        pending = int(self.r.llen(self.k_step(v, "pool")))
        for a in self.r.smembers(self.k_actors):
            pending += int(self.r.llen(self.k_assigned(v, _s(a))))
        return StepStatus(
            version=v,
            total=int(g.get("total", 0)),
            settled=int(g.get("settled", 0)),
            leased=int(self.r.hlen(self.k_step(v, "lease"))),
            pending=pending,
            expired=int(g.get("expired", 0)),
            rejected=int(g.get("rejected", 0)),
        )

    def collect(self, v: int, start: int = 0) -> list[AcceptedResult]:
        """Accepted results of step ``v`` from position ``start`` on (call again with start += len)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.exists(self.k_step(v))
        pipe.lrange(self.k_step(v, "results"), start, -1)
        pipe.lrange(self.k_step(v, "results:payload"), start, -1)
        exists, heads, payloads = pipe.execute()
        if not exists:
            raise LedgerLost(f"step {v} of run {self.run!r} is not in the ledger")
        out = []
        for h, body in zip(heads, payloads, strict=False):
            p, actor, token, version, settled, leased = json.loads(h)
            out.append(AcceptedResult(str(p), str(actor), int(token), int(version), int(settled), int(leased), bytes(body)))
        return out

    def close_step(self, v: int) -> None:
        """Forget step ``v`` (after its results were collected)."""
        keys = [self.k_step(v)] + [self.k_step(v, x) for x in ("prompts", "pool", "lease", "exp", "done", "results", "results:payload")]
        keys += [self.k_assigned(v, _s(a)) for a in self.r.smembers(self.k_actors)]
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(*keys)
        pipe.zrem(self.k_steps, str(v))
        pipe.execute()

    # -- Work (Actor) -----------------------------------------------------------
    def claim(self, actor: str, v: int, n: int) -> tuple[str, list[Lease]]:
        """Lease up to ``n`` prompts of step ``v``: own assignments first, then the pool.

        Returns (status, leases); status is ``ok``, ``no_step``, ``not_alive``
        or ``not_on_version`` (the Actor must activate ``v`` first).
        """
        if n <= 0:
            return "ok", []
        res = self._claim(
            keys=[
                self.k_step(v), self.k_assigned(v, actor), self.k_step(v, "pool"), self.k_step(v, "lease"),
                self.k_step(v, "exp"), self.k_fence, self.k_actor(actor), self.k_step(v, "prompts"),
            ],
            args=[actor, n, self._now()],
        )
        status = _s(res[0])
        if status != "ok" or len(res) == 2:
            return status, []
        meta = self.r.hmget(self.k_step(v), "state", "group", "version")
        state, group, version = _s(meta[0] or b""), int(meta[1] or 1), int(meta[2] or v)
        leases = [
            Lease(_s(res[i]), int(res[i + 1]), version, state, group, int(res[i + 2]), bytes(res[i + 3]), step=v)
            for i in range(2, len(res), 4)
        ]
        return status, leases

    def _settle_args(self, actor: str, lease: Lease, version: int, state: str, payload: bytes) -> tuple[list[str], list[Any]]:
        v = lease.step_id
        keys = [
            self.k_step(v), self.k_step(v, "lease"), self.k_step(v, "exp"), self.k_step(v, "done"),
            self.k_step(v, "results"), self.k_step(v, "pool"), self.k_actor(actor), self.k_step(v, "results:payload"),
        ]
        return keys, [actor, lease.prompt, str(lease.token), str(version), state, payload, self._now()]

    def settle(self, actor: str, lease: Lease, version: int, state: str, payload: bytes) -> Settlement:
        """Report the result of a lease, generated on ``version`` with weights ``state``."""
        keys, args = self._settle_args(actor, lease, version, state, payload)
        reason, now = self._settle(keys=keys, args=args)
        return Settlement(lease.prompt, _s(reason), int(now))

    def settle_many(self, actor: str, items: Iterable[tuple[Lease, int, str, bytes]]) -> list[Settlement]:
        """Several settlements in one round trip (each still atomic on its own)."""
        items = list(items)
        if not items:
            return []
        calls = [self._settle_args(actor, lease, version, state, payload) for lease, version, state, payload in items]
        # EVALSHA queued directly: a pipeline carrying Script objects makes
        # redis-py send SCRIPT EXISTS first, a second round trip.
        for _attempt in range(2):
            pipe = self.r.pipeline(transaction=False)
            for keys, args in calls:
                pipe.evalsha(self._settle.sha, len(keys), *keys, *args)
            out = pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) for r in out):
                break
            # Redis lost its script cache (restart): nothing ran, so load and repeat.
            self.r.script_load(self.SETTLE)
        for r in out:
            if isinstance(r, Exception):
                raise r
        return [Settlement(it[0].prompt, _s(r[0]), int(r[1])) for it, r in zip(items, out, strict=True)]


def wait_until(pred: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll ``pred`` until true or the timeout passes (for processes that cannot block on Redis)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
