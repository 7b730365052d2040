"""What ``aurora bench chaos`` runs: the fleet, the faults, their schedule (:class:`ChaosConfig`).

The schedule is fixed: the faults of :data:`FAULTS` in that order, the k-th
of n triggered once the run has published version ``round(k * steps / (n + 1))``
(progress, never wall-clock guesses). The seed picks only what is left to
chance: which Actor behind the Relay is killed, which snapshot shard is
corrupted and which of its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aurora_store.config import from_env
from aurora_store.errors import ConfigError

__all__ = ["ENV_PREFIX", "FAULTS", "FAULT_TITLES", "ChaosConfig"]

ENV_PREFIX = "AURORA_CHAOS_"
"""Prefix of the benchmark's environment variables (``AURORA_CHAOS_STEPS`` …)."""

FAULTS = (
    "redis-aof",
    "actor-kill",
    "corrupt",
    "s3-pause",
    "trainer-kill",
    "redis-empty",
    "actor-stop",
    "old-trainer",
    "relay-kill",
)
"""Every fault, in schedule order. The order matters: ``corrupt`` needs a snapshot after
v0 to exist; ``old-trainer`` wakes a Trainer that was already resumed once; the faults
during which the run goes on (an Actor or the Relay down) come where the versions they
let pass still leave room for the rest, ``relay-kill`` last."""

FAULT_TITLES = {
    "redis-aof": "Redis SIGKILLed, restarted from its AOF (everysec)",
    "actor-kill": "Actor behind the Relay SIGKILLed, restarted",
    "s3-pause": "S3 server SIGSTOPped",
    "trainer-kill": "Trainer SIGKILLed mid-publish, --resume",
    "redis-empty": "Redis restarted without its data",
    "actor-stop": "origin Actor SIGSTOPped past its lease",
    "old-trainer": "old-epoch Trainer woken after a --resume",
    "relay-kill": "Relay SIGKILLed, restarted",
    "corrupt": "origin snapshot shard overwritten while an Actor lags; it catches up",
}
"""One line per fault for the table."""


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """One chaos run. Defaults: the benchmark of issue 12 (30 steps, every fault, a 60 s S3 pause)."""

    steps: int = 30
    """Trainer steps (versions after v0)."""
    batch: int = 16
    """Prompts per batch."""
    group: int = 4
    """Completions per prompt."""
    seed: int = 0
    """Seeds the Trainer and the fault schedule's choices (victim Actor, corrupted bytes)."""
    faults: tuple[str, ...] = FAULTS
    """Faults to inject (a subset of :data:`FAULTS`; always injected in :data:`FAULTS` order)."""
    actors_relay: int = 2
    """Actors in region ``eu``, behind a Relay."""
    actors_origin: int = 1
    """Actors in region ``us``, reading origin."""
    s3_pause_s: float = 60.0
    """How long the S3 server stays SIGSTOPped."""
    redis_down_s: float = 2.0
    """How long Redis stays down on each restart."""
    actor_down_s: float = 2.0
    """Between an Actor's SIGKILL and its restart."""
    actor_stop_s: float = 4.0
    """How long the stopped Actor stays SIGSTOPped; at least until its last lease has
    expired, plus a second (past the Trainer's 8 s heartbeat timeout it is also reaped)."""
    relay_down_s: float = 3.0
    """Between the Relay's SIGKILL and its restart (its heartbeat key outlives it: its Actors
    see a mirror that stopped moving, and read origin after their mirror grace)."""
    fence_wait_s: float = 30.0
    """How long the woken old-epoch Trainer is watched before the harness stops it."""
    recover_timeout_s: float = 240.0
    """A fault after which no version is published for this long ends the schedule."""
    timeout_s: float = 900.0
    """The whole benchmark: every child is killed and the report printed after this."""
    outage_budget_s: float = 300.0
    """``--outage-budget-s`` of every worker (longer than any fault here)."""
    checkpoint_every: int = 3
    """The Trainer's ``--checkpoint-every``."""
    snapshot_every: int = 5
    """The Trainer's ``--snapshot-every``."""
    actor_slowdown: float = 24.0
    """The Actors' ``--slowdown``: paces the run (a step of this tiny task takes a fraction of
    a second; about 1.1 s with 24 here) so that the versions published while an Actor or the
    Relay is down leave room in 30 steps for every fault; generation waits, it does not spin."""
    trainer_segment_kib: float = 8.0
    """The Trainer's segment size (``AURORA_SEGMENT_MIB``), small so that a delta is many
    segments and the window between its first segment and its manifest is wide enough to
    kill the Trainer in (``trainer-kill``)."""
    trainer_streams: int = 2
    """The Trainer's ``--streams`` (few: the segments of a version land one after another)."""
    mirror_grace_s: float = 1.0
    """The eu Actors' ``--mirror-grace-s``."""
    poll_s: float = 0.2
    """How often the harness reads the workers' logs and process states."""

    def __post_init__(self) -> None:
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ConfigError(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
        if self.steps < 2 or self.batch < 1 or self.group < 2:
            raise ConfigError(f"steps >= 2, batch >= 1 and group >= 2 are required (got {self.steps}, {self.batch}, {self.group})")
        if self.actors_relay < 1 or self.actors_origin < 1:
            raise ConfigError("the benchmark needs at least one Actor behind the Relay and one reading origin")
        waits = (self.s3_pause_s, self.redis_down_s, self.actor_down_s, self.actor_stop_s, self.relay_down_s, self.fence_wait_s)
        if min(waits) < 0 or self.timeout_s <= 0 or self.recover_timeout_s <= 0 or self.poll_s <= 0:
            raise ConfigError("pauses must be >= 0 and timeouts and poll_s > 0")
        if self.actor_slowdown < 1 or self.trainer_segment_kib < 1 or self.trainer_streams < 1:
            raise ConfigError("actor_slowdown >= 1, trainer_segment_kib >= 1 and trainer_streams >= 1 are required")

    @property
    def schedule(self) -> list[tuple[str, int]]:
        """(fault, the version whose publication triggers it), in injection order."""
        chosen = [f for f in FAULTS if f in self.faults]
        n = len(chosen)
        return [(f, max(1, round((k + 1) * self.steps / (n + 1)))) for k, f in enumerate(chosen)]

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, **overrides: Any) -> ChaosConfig:
        """Defaults, then ``AURORA_CHAOS_*``, then ``overrides``."""
        return from_env(cls, prefix, **overrides)
