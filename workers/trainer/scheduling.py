"""Steps over the ledger: building a batch's prompts, splitting it over Actors, collecting its results.

The split itself is the pure scheduler's (:mod:`aurora_store.coordination.scheduler`);
this module feeds it what the Trainer knows (the Actors' throughput
estimates, what each holds) and turns its plan into ledger calls.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aurora_store.clock import Clock
from aurora_store.coordination.ledger import AcceptedResult, Ledger, LedgerLost
from aurora_store.coordination.scheduler import (
    ActorView,
    SchedulerConfig,
    StepPlan,
    ema,
    lease_ms,
    plan_step,
)
from workers.task import Problem, make_problems
from workers.tokenizer import CharTokenizer

__all__ = [
    "Collected",
    "actor_views",
    "batch_prompts",
    "collect_batch",
    "plan_batch",
    "step_lease_ms",
    "updated_tau",
]

log = logging.getLogger("aurora.trainer")

Prompts = list[tuple[str, bytes]]
"""(prompt id, payload) of one batch, in order."""


def batch_prompts(
    b: int, size: int, seed: int, difficulty: int, tokenizer: CharTokenizer
) -> tuple[Prompts, dict[str, Problem]]:
    """The prompts of batch ``b`` (payloads for the Actors) and their problems (the answers stay here)."""
    problems = make_problems(size, seed=seed * 100_003 + b + 7, difficulty=difficulty)
    prompts: Prompts = []
    by_id: dict[str, Problem] = {}
    for p in problems:
        pid = f"b{b}-{p.id}"
        by_id[pid] = p
        body = {"id": pid, "text": p.prompt_text, "ids": tokenizer.encode(p.prompt_text, bos=True)}
        prompts.append((pid, json.dumps(body).encode()))
    return prompts, by_id


def actor_views(actors: Iterable[Any], tau: Mapping[str, float], initial_tau: float) -> list[ActorView]:
    """The scheduler's view of the ledger's Actors, with the Trainer's own throughput estimates.

    An Actor nobody has measured yet starts at the median of the measured
    ones: a newcomer gets a fair first share, and its own throughput takes
    over after its first settlement.
    """
    measured = sorted(tau.values())
    start = measured[len(measured) // 2] if measured else initial_tau
    views = []
    for a in actors:
        t = tau.get(a.actor, a.tau if a.tau > 0 else start)
        # A staged version is activated at the Actor's next safe point, which
        # comes as soon as its current batch is settled: count it as held.
        held = a.active if a.staged is None or a.active is None else max(a.active, a.staged)
        views.append(ActorView(a.actor, held, a.staged, t, a.status == "alive"))
    return views


def plan_batch(views: list[ActorView], gen_version: int, prompts: int, config: SchedulerConfig) -> StepPlan | None:
    """How a batch on ``gen_version`` is split over ``views`` (None when no Actor is known yet)."""
    return plan_step(views, gen_version, prompts, config, require_staged=False) if views else None


def updated_tau(prev: float | None, observed: float, config: SchedulerConfig) -> float:
    """The new throughput estimate of an Actor that just reported ``observed`` tokens/s."""
    return observed if prev is None or prev <= config.initial_tau else ema(prev, observed, config.beta)


def step_lease_ms(completion_ms: list[float], config: SchedulerConfig) -> int:
    """Lease length of a new step, from the most recent completion times."""
    return lease_ms(completion_ms[-200:], config)


@dataclass(slots=True)
class Collected:
    """What collecting a batch found beyond its results."""

    accepted_twice: int = 0
    """Results for a prompt already collected (the ledger accepts once: this must stay 0)."""
    accepted_wrong_version: int = 0
    """Results generated on another version than the batch's (must stay 0 too)."""


def collect_batch(
    ledger: Ledger,
    b: int,
    gen_version: int,
    need: int,
    collected: dict[str, AcceptedResult],
    completion_ms: list[float],
    counts: Collected,
    reap_ms: int,
    timeout_s: float,
    poll_s: float,
    stop: threading.Event,
    clock: Clock,
    recreate: Callable[[], None],
) -> None:
    """Read batch ``b``'s results into ``collected`` until ``need`` prompts are in.

    The ledger accepts once and only on the job's version; each result is
    checked again here. Silent Actors are reaped on the way. A ledger that
    lost the step (Redis restarted empty) is re-created by ``recreate``.
    Raises :class:`KeyboardInterrupt` once ``stop`` is set, and
    :class:`TimeoutError` after ``timeout_s`` without the batch complete.
    """
    deadline = clock.monotonic() + timeout_s
    pos = 0
    while len(collected) < need:
        if stop.is_set():
            raise KeyboardInterrupt
        try:
            for r in ledger.collect(b, pos):
                pos += 1
                if r.prompt in collected:
                    counts.accepted_twice += 1
                elif r.version != gen_version:
                    counts.accepted_wrong_version += 1
                else:
                    collected[r.prompt] = r
                    completion_ms.append(max(1, r.settled_ms - r.leased_ms))
            ledger.reap(reap_ms)
        except LedgerLost:
            recreate()
            pos = 0
            continue
        if len(collected) < need:
            if clock.monotonic() > deadline:
                raise TimeoutError(f"batch {b}: {len(collected)}/{need} prompts after {timeout_s}s; are Actors running?")
            clock.wait(stop, poll_s)
