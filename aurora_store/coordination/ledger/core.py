"""What every part of the ledger shares: the client, the run's keys, the clock, the scripts,
the bounds on how long its keys live, and the Trainer's epoch fence."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aurora_store.coordination.ledger.scripts as lua
from aurora_store.config import from_env
from aurora_store.coordination.decode import as_str
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger.scripts import LedgerScripts
from aurora_store.coordination.redisconn import on_master_of, server_time_ms, translate_redis_errors
from aurora_store.errors import ConfigError, FencedOut

__all__ = ["LEDGER_ENV_PREFIX", "LedgerConfig", "LedgerCore", "SAFE_MEMORY_POLICIES", "memory_policy_problem"]

LEDGER_ENV_PREFIX = "AURORA_LEDGER_"
"""Environment variables of :class:`LedgerConfig`: ``AURORA_LEDGER_<FIELD>``."""

#: ``maxmemory-policy`` values under which Redis never drops a ledger key. Every
#: ``allkeys-*`` policy may evict any key; every ``volatile-*`` one may evict keys with a
#: TTL, and Actor records and open steps carry one (see :class:`LedgerConfig`).
SAFE_MEMORY_POLICIES = frozenset({"noeviction"})


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    """How long the ledger's keys live, so that Redis stays bounded over a long run.

    Environment: ``AURORA_LEDGER_<FIELD>``. Every TTL is refreshed while its
    owner is alive; 0 turns one off (the key lives until deleted).
    """

    actor_ttl_s: float = 600.0
    """An Actor record expires this long after its last register or heartbeat (many times any
    heartbeat timeout: an Actor that comes back later finds its heartbeat refused and joins again)."""
    departed_ttl_s: float = 120.0
    """A record marked ``left`` (graceful leave) or ``gone`` (reaped) is kept this long for
    ``aurora status``, then expires."""
    step_ttl_s: float = 86_400.0
    """An open step's keys expire this long after the Trainer last touched them (every read of a
    batch does), so a crashed Trainer's steps do not live forever. It must exceed the longest a
    live Trainer goes without reading its batches (a long training step, an outage budget)."""
    closed_ttl_s: float = 600.0
    """A closed step leaves a tombstone this long, so a late settle answers ``closed``."""
    keep_versions: int = 1000
    """Per-version hashes (weight digests, activations) keep the newest this many versions."""

    def __post_init__(self) -> None:
        if min(self.actor_ttl_s, self.departed_ttl_s, self.step_ttl_s, self.closed_ttl_s) < 0 or self.keep_versions < 0:
            raise ConfigError(f"LedgerConfig: TTLs and keep_versions must be >= 0 ({self})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> LedgerConfig:
        return from_env(cls, LEDGER_ENV_PREFIX, environ, **overrides)


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def memory_policy_problem(info: Mapping[str, Any]) -> str | None:
    """Why Redis with this ``INFO memory`` answer may lose ledger keys; None if it may not.

    Any policy but ``noeviction`` counts, whatever ``maxmemory`` is now:
    a limit can be set at runtime, and the ledger is not a cache (an evicted
    step hash duplicates or loses prompts).
    """
    policy = as_str(info.get("maxmemory_policy", b""), "replace")
    if not policy or policy in SAFE_MEMORY_POLICIES:
        return None
    if policy.startswith("allkeys-"):
        why = "it may evict any key"
    elif policy.startswith("volatile-"):
        why = "it may evict keys with a TTL, and the ledger's Actor records and open steps carry one"
    else:
        why = "it is not noeviction"
    return (
        f"Redis maxmemory-policy is {policy!r}: {why}, and an evicted ledger key loses or duplicates prompts. "
        "Set it to noeviction (redis-server --maxmemory-policy noeviction, CONFIG SET maxmemory-policy noeviction "
        "with 'maxmemory-policy noeviction' in redis.conf, or the provider's parameter group for a managed Redis)"
    )


class LedgerCore:
    """The ledger of one run: connection, keys and time. Thread-safe as far as the redis-py client is."""

    REGISTER = lua.REGISTER
    HEARTBEAT = lua.HEARTBEAT
    CLAIM = lua.CLAIM
    SETTLE = lua.SETTLE
    """The settlement predicate (see :mod:`aurora_store.coordination.ledger.scripts`)."""
    RELEASE = lua.RELEASE
    CREATE_STEP = lua.CREATE_STEP

    def __init__(self, redis: Any, run: str, clock: Callable[[], int] | None = None, config: LedgerConfig | None = None) -> None:
        """``redis``: a redis-py client; ``clock``: milliseconds, for tests (default: Redis TIME);
        ``config``: key lifetimes (default :meth:`LedgerConfig.from_env`)."""
        self.r = redis
        self.run = run
        self.keys = RunKeys(run)
        self.p = self.keys.prefix
        self.clock = clock
        self.config = config if config is not None else LedgerConfig.from_env()
        self._scripts = LedgerScripts.on(redis)

    # -- keys (docs/PROTOCOL.md; formatted by RunKeys) ----------------------------
    def k_actor(self, actor: str) -> str:
        return self.keys.actor(actor)

    def k_step(self, v: int, part: str = "") -> str:
        return self.keys.step(v, part)

    def k_assigned(self, v: int, actor: str) -> str:
        return self.keys.assigned(v, actor)

    @property
    def k_actors(self) -> str:
        return self.keys.actors

    @property
    def k_steps(self) -> str:
        return self.keys.steps

    @property
    def k_fence(self) -> str:
        return self.keys.fence

    @property
    def k_epoch(self) -> str:
        return self.keys.epoch

    # -- time -------------------------------------------------------------------
    def _now(self) -> str:
        """The ``now`` argument of the scripts: ``""`` lets the server's TIME decide."""
        return "" if self.clock is None else str(int(self.clock()))

    @translate_redis_errors("Ledger.server_time_ms")
    def server_time_ms(self) -> int:
        if self.clock is not None:
            return int(self.clock())
        return server_time_ms(self.r, self.k_fence)

    # -- what both the registry and the steps read ------------------------------
    @translate_redis_errors("Ledger.open_steps")
    def open_steps(self) -> list[int]:
        return sorted(int(x) for x in self.r.zrange(self.k_steps, 0, -1))

    # -- the Trainer's epoch ---------------------------------------------------------
    def _fence_arg(self, epoch: int | None) -> str:
        if epoch is None:
            return ""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"a Trainer epoch is an int >= 0, got {epoch!r}")
        return str(epoch)

    def _fenced(self, res: Any, epoch: int | None, what: str) -> Any:
        """``res`` of a fenced script, or :class:`FencedOut` when it answered ``fenced``."""
        if isinstance(res, (list, tuple)) and res and as_str(res[0]) == "fenced":
            raise FencedOut(
                f"{what}: refused for Trainer epoch {epoch} of run {self.run!r}: "
                f"Redis holds epoch {int(res[1])} (a newer Trainer resumed the run; this one must stop)"
            )
        return res

    @translate_redis_errors("Ledger.enter_epoch")
    def enter_epoch(self, epoch: int) -> int:
        """Take the run for Trainer ``epoch``: raise the stored epoch to it if lower; returns the stored one.

        Raises :class:`~aurora_store.errors.FencedOut` when Redis already holds
        a higher epoch (a newer Trainer took over). After Redis lost its data
        the epoch is gone; entering again (or any fenced write) restores it.
        """
        res = self._fenced(self._scripts.enter_epoch(keys=[self.k_epoch], args=[self._fence_arg(epoch)]), epoch, "enter epoch")
        return int(res[1])

    def check_epoch(self, epoch: int) -> None:
        """:class:`~aurora_store.errors.FencedOut` unless ``epoch`` may still write (same as :meth:`enter_epoch`)."""
        self.enter_epoch(epoch)

    @translate_redis_errors("Ledger.stored_epoch")
    def stored_epoch(self) -> int | None:
        """The epoch Redis holds (None: none, a fresh or emptied Redis)."""
        x = self.r.get(self.k_epoch)
        return None if x is None else int(x)

    @translate_redis_errors("Ledger.fenced_hset")
    def fenced_hset(self, key: str, mapping: Mapping[str, Any], *, epoch: int | None) -> None:
        """``HSET key mapping`` (a key of this run, e.g. the Trainer hash), refused for an older epoch."""
        if not key.startswith(self.p):
            raise ConfigError(f"{key!r} is not a key of run {self.run!r}")
        args: list[Any] = [self._fence_arg(epoch)]
        for k, v in mapping.items():
            args += [k, v]
        self._fenced(self._scripts.fenced_hset(keys=[self.k_epoch, key], args=args), epoch, f"write {key}")

    # -- Redis itself --------------------------------------------------------------
    @translate_redis_errors("Ledger.check_memory_policy")
    def check_memory_policy(self) -> str:
        """The server's ``maxmemory-policy``; :class:`~aurora_store.errors.ConfigError` if it may evict.

        Read from ``INFO memory`` (managed Redis often disables ``CONFIG``).
        Returns ``"unknown"`` when the server does not say (``INFO`` refused
        or renamed): the caller should warn, not refuse.
        """
        import redis.exceptions as rx

        try:
            info = self.r.info("memory", **on_master_of(self.r, self.k_fence))
        except rx.ResponseError:
            return "unknown"
        problem = memory_policy_problem(info)
        if problem is not None:
            raise ConfigError(problem)
        return as_str(info.get("maxmemory_policy", b""), "replace") or "unknown"
