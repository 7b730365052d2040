"""Steps, leases, claims and settlement: the jobs of the run.

The Trainer creates a step (its prompts, assigned per the scheduler's
quotas or left in the pool), Actors claim leases on them and settle results
(:data:`~aurora_store.coordination.ledger.scripts.SETTLE` is the settlement
predicate), and the Trainer collects what was accepted and closes the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from redis.exceptions import NoScriptError

from aurora_store.coordination.decode import as_str
from aurora_store.coordination.ledger.core import LedgerCore
from aurora_store.coordination.ledger.records import (
    AcceptedResult,
    Lease,
    Settlement,
    StepStatus,
    accepted_from_redis,
    step_status_from_hash,
)
from aurora_store.coordination.ledger.scripts import SETTLE
from aurora_store.coordination.redisconn import translate_redis_errors
from aurora_store.errors import ConfigError, LedgerLost, StepExists

if TYPE_CHECKING:
    from aurora_store.coordination.ledger.records import ActorRecord

__all__ = ["StepBook"]

_STEP_PARTS = ("prompts", "pool", "lease", "exp", "done", "results", "results:payload")


class StepBook(LedgerCore):
    """The steps of the run (``steps`` zset, ``step:{v}…`` keys)."""

    if TYPE_CHECKING:
        # From the registry, beside which Ledger composes this class.
        def actors(self) -> list[ActorRecord]: ...

    # -- Trainer ---------------------------------------------------------------
    @translate_redis_errors("Ledger.ensure_fence")
    def ensure_fence(self) -> None:
        """Start fencing tokens above any a previous Redis could have issued.

        After Redis lost its state, the counter starts again from the current
        time in microseconds, which is larger than any token handed out
        before (tokens grow by one per lease), so a stale lease never matches.
        """
        self.r.set(self.k_fence, self.server_time_ms() * 1000, nx=True)

    @translate_redis_errors("Ledger.create_step")
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

    @translate_redis_errors("Ledger.step_exists")
    def step_exists(self, v: int) -> bool:
        return bool(self.r.exists(self.k_step(v)))

    @translate_redis_errors("Ledger.step_version")
    def step_version(self, v: int) -> int | None:
        """Version the rollouts of step ``v`` must be generated on (None: no such step)."""
        x = self.r.hget(self.k_step(v), "version")
        return None if x is None else int(x)

    @translate_redis_errors("Ledger.open_step_info")
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

    @translate_redis_errors("Ledger.unsettled")
    def unsettled(self, v: int) -> int | None:
        """Prompts of step ``v`` not accepted yet (pending or leased); None: no such step."""
        total, settled = self.r.hmget(self.k_step(v), "total", "settled")
        if total is None:
            return None
        return int(total) - int(settled or 0)

    @translate_redis_errors("Ledger.step_status")
    def step_status(self, v: int) -> StepStatus:
        h = self.r.hgetall(self.k_step(v))
        if not h:
            raise LedgerLost(f"step {v} of run {self.run!r} is not in the ledger")
        pending = int(self.r.llen(self.k_step(v, "pool")))
        for a in self.r.smembers(self.k_actors):
            pending += int(self.r.llen(self.k_assigned(v, as_str(a))))
        return step_status_from_hash(v, h, leased=int(self.r.hlen(self.k_step(v, "lease"))), pending=pending)

    @translate_redis_errors("Ledger.collect")
    def collect(self, v: int, start: int = 0) -> list[AcceptedResult]:
        """Accepted results of step ``v`` from position ``start`` on (call again with start += len)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.exists(self.k_step(v))
        pipe.lrange(self.k_step(v, "results"), start, -1)
        pipe.lrange(self.k_step(v, "results:payload"), start, -1)
        exists, heads, payloads = pipe.execute()
        if not exists:
            raise LedgerLost(f"step {v} of run {self.run!r} is not in the ledger")
        return [accepted_from_redis(h, body) for h, body in zip(heads, payloads, strict=False)]

    @translate_redis_errors("Ledger.close_step")
    def close_step(self, v: int) -> None:
        """Forget step ``v`` (after its results were collected)."""
        keys = [self.k_step(v)] + [self.k_step(v, x) for x in _STEP_PARTS]
        keys += [self.k_assigned(v, as_str(a)) for a in self.r.smembers(self.k_actors)]
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(*keys)
        pipe.zrem(self.k_steps, str(v))
        pipe.execute()

    # -- Actor -----------------------------------------------------------------
    @translate_redis_errors("Ledger.claim")
    def claim(self, actor: str, v: int, n: int) -> tuple[str, list[Lease]]:
        """Lease up to ``n`` prompts of step ``v``: own assignments first, then the pool.

        Returns (status, leases); status is ``ok``, ``no_step``, ``not_alive``
        or ``not_on_version`` (the Actor must activate ``v`` first).
        """
        if n <= 0:
            return "ok", []
        res = self._scripts.claim(
            keys=[
                self.k_step(v), self.k_assigned(v, actor), self.k_step(v, "pool"), self.k_step(v, "lease"),
                self.k_step(v, "exp"), self.k_fence, self.k_actor(actor), self.k_step(v, "prompts"),
            ],
            args=[actor, n, self._now()],
        )
        status = as_str(res[0])
        if status != "ok" or len(res) == 2:
            return status, []
        meta = self.r.hmget(self.k_step(v), "state", "group", "version")
        state, group, version = as_str(meta[0] or b""), int(meta[1] or 1), int(meta[2] or v)
        leases = [
            Lease(as_str(res[i]), int(res[i + 1]), version, state, group, int(res[i + 2]), bytes(res[i + 3]), step=v)
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

    @translate_redis_errors("Ledger.settle")
    def settle(self, actor: str, lease: Lease, version: int, state: str, payload: bytes) -> Settlement:
        """Report the result of a lease, generated on ``version`` with weights ``state``."""
        keys, args = self._settle_args(actor, lease, version, state, payload)
        reason, now = self._scripts.settle(keys=keys, args=args)
        return Settlement(lease.prompt, as_str(reason), int(now))

    @translate_redis_errors("Ledger.settle_many")
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
                pipe.evalsha(self._scripts.settle.sha, len(keys), *keys, *args)
            out = pipe.execute(raise_on_error=False)
            if not any(isinstance(r, NoScriptError) for r in out):
                break
            # Redis lost its script cache (restart): nothing ran, so load and repeat.
            self.r.script_load(SETTLE)
        for r in out:
            if isinstance(r, Exception):
                raise r
        return [Settlement(it[0].prompt, as_str(r[0]), int(r[1])) for it, r in zip(items, out, strict=True)]
