"""Version- and throughput-aware scheduling: pure functions over plain data.

The paper's Algorithm 1, in pieces a test can check without a server:

- :func:`eligibility`: an Actor may work on step ``v`` if it is on ``v``, or
  on ``v-1`` with ``v`` staged (it then gets Commit(v) first); anything
  further behind is excluded for this step and its estimate decays by alpha.
- :func:`split`: ``B`` prompts in proportion to throughput estimates, with
  largest-remainder rounding so the parts sum to ``B`` exactly.
- :func:`ema`: the estimate after a settlement.
- :func:`lease_ms`: ``k`` x the median completion time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from aurora_store.errors import ConfigError

__all__ = [
    "SchedulerConfig",
    "ActorView",
    "Eligibility",
    "eligibility",
    "split",
    "ema",
    "decay",
    "lease_ms",
    "plan_step",
    "StepPlan",
]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Knobs of the scheduler, with the paper's defaults."""

    alpha: float = 0.5
    """Decay of an excluded Actor's estimate (tau <- alpha * tau)."""
    beta: float = 0.3
    """Weight of the newest measurement in the EMA of tau."""
    lease_k: float = 2.5
    """Lease length as a multiple of the median completion time (paper: 2-3x)."""
    min_lease_ms: int = 2_000
    """Floor of a lease, for the first steps and for very fast prompts."""
    max_lease_ms: int = 3_600_000
    """Ceiling of a lease."""
    initial_tau: float = 1.0
    """Estimate of an Actor nobody has measured yet (relative units)."""
    min_tau: float = 1e-6
    """An estimate never reaches zero, so a decayed Actor can come back."""
    min_prompts: int = 1
    """Prompts every eligible Actor gets at least (when the batch has enough).

    A claim takes only an Actor's own assignments and the pool, so an Actor
    whose estimate decayed while it was excluded would get a zero share, never
    settle anything, never be measured again and never come back. One prompt
    each is the probe that re-measures it; the rest is split by throughput.
    """
    split: str = "proportional"
    """``proportional`` (the paper's B_a = B * tau_a / T) or ``uniform`` (B / |eligible| each:
    the baseline of the heterogeneity experiment, which leaves fast Actors waiting on slow ones)."""

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1 or not 0 < self.beta <= 1:
            raise ConfigError(f"SchedulerConfig: alpha and beta must be in (0, 1], got {self.alpha}, {self.beta}")
        if self.lease_k <= 0 or self.min_lease_ms <= 0 or self.max_lease_ms < self.min_lease_ms:
            raise ConfigError(f"SchedulerConfig: bad lease settings {self.lease_k}, {self.min_lease_ms}, {self.max_lease_ms}")
        if self.min_prompts < 0:
            raise ConfigError(f"SchedulerConfig: min_prompts must be >= 0, got {self.min_prompts}")
        if self.initial_tau <= 0 or self.min_tau <= 0:
            raise ConfigError("SchedulerConfig: tau values must be positive")
        if self.split not in ("proportional", "uniform"):
            raise ConfigError(f"SchedulerConfig: split must be proportional or uniform, got {self.split!r}")


@dataclass(frozen=True, slots=True)
class ActorView:
    """What the scheduler knows of one Actor."""

    actor: str
    active: int | None
    """Version its engine runs now (None: still bootstrapping)."""
    staged: int | None
    """Newest version fully staged (validated, ready to activate)."""
    tau: float
    """Throughput estimate (tokens/s)."""
    alive: bool = True


@dataclass(frozen=True, slots=True)
class Eligibility:
    """Who works on step ``v``."""

    version: int
    ready: tuple[str, ...]
    """On ``v`` already."""
    needs_commit: tuple[str, ...]
    """On ``v-1`` with ``v`` staged: send Commit(v), then they are eligible."""
    excluded: tuple[str, ...]
    """Further behind (or not alive): no work this step, tau decays."""

    @property
    def eligible(self) -> tuple[str, ...]:
        return self.ready + self.needs_commit


def eligibility(actors: Sequence[ActorView], v: int, require_staged: bool = True) -> Eligibility:
    """Classify Actors for step ``v``.

    ``require_staged=False`` also admits Actors on ``v-1`` that are still
    staging ``v``: with one-step asynchrony the next batch is created the
    moment ``v`` is published, before anyone could have staged it; such an
    Actor claims its share once it has activated ``v``.
    """
    ready, commit, excluded = [], [], []
    for a in sorted(actors, key=lambda a: a.actor):
        if not a.alive or a.active is None:
            excluded.append(a.actor)
        elif a.active == v:
            ready.append(a.actor)
        elif a.active == v - 1 and (not require_staged or (a.staged is not None and a.staged >= v)):
            commit.append(a.actor)
        else:
            excluded.append(a.actor)
    return Eligibility(v, tuple(ready), tuple(commit), tuple(excluded))


def split(total: int, taus: Mapping[str, float], min_each: int = 0) -> dict[str, int]:
    """Split ``total`` prompts in proportion to ``taus``; the parts sum to ``total``.

    Floors first (the paper's B_a = floor(B * tau_a / T)), then the prompts
    left over go one each to the largest remainders (ties: by name, so the
    split is deterministic). With ``min_each``, every part first gets that
    many when ``total`` allows it for all, and only the rest is split by
    ``taus``.
    """
    if min_each < 0:
        raise ValueError(f"min_each must be >= 0, got {min_each}")
    if min_each and taus and total >= min_each * len(taus):
        rest = split(total - min_each * len(taus), taus)
        return {a: n + min_each for a, n in rest.items()}
    if total < 0:
        raise ValueError(f"cannot split {total} prompts")
    if not taus:
        if total:
            raise ValueError(f"no eligible Actor to take {total} prompts")
        return {}
    for a, t in taus.items():
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"throughput estimate of {a} must be positive and finite, got {t}")
    T = math.fsum(taus.values())
    exact = {a: total * t / T for a, t in taus.items()}
    parts = {a: int(math.floor(x)) for a, x in exact.items()}
    left = total - sum(parts.values())
    for a in sorted(taus, key=lambda a: (-(exact[a] - parts[a]), a))[:left]:
        parts[a] += 1
    return parts


def ema(tau: float, observed: float, beta: float) -> float:
    """tau <- (1 - beta) * tau + beta * observed."""
    if observed < 0 or not math.isfinite(observed):
        raise ValueError(f"observed throughput must be finite and >= 0, got {observed}")
    return (1.0 - beta) * tau + beta * observed


def decay(tau: float, alpha: float, floor: float = 1e-6) -> float:
    return max(floor, alpha * tau)


def lease_ms(completions_ms: Sequence[float], cfg: SchedulerConfig) -> int:
    """k x median completion time, clamped to the configured range."""
    if not completions_ms:
        return cfg.min_lease_ms
    xs = sorted(completions_ms)
    n = len(xs)
    med = xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
    return int(min(cfg.max_lease_ms, max(cfg.min_lease_ms, cfg.lease_k * med)))


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The scheduler's decision for one step."""

    version: int
    eligibility: Eligibility
    quotas: dict[str, int]
    """Prompts per eligible Actor; sums to the batch size."""
    taus: dict[str, float] = field(default_factory=dict)
    """Estimates after this step's decay of excluded Actors."""


def plan_step(actors: Sequence[ActorView], v: int, batch: int, cfg: SchedulerConfig, require_staged: bool = True) -> StepPlan:
    """Eligibility, decay of the excluded, and the split (by throughput unless ``cfg.split`` is uniform)."""
    el = eligibility(actors, v, require_staged)
    taus = {a.actor: max(cfg.min_tau, a.tau) for a in actors}
    for a in el.excluded:
        taus[a] = decay(taus[a], cfg.alpha, cfg.min_tau)
    weights = {a: 1.0 if cfg.split == "uniform" else taus[a] for a in el.eligible}
    quotas = split(batch, weights, cfg.min_prompts) if el.eligible else {}
    return StepPlan(v, el, quotas, taus)
