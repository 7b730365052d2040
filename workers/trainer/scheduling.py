"""Steps over the ledger: building a batch's prompts, splitting it over Actors, collecting its results.

The split itself is the pure scheduler's (:mod:`aurora_store.coordination.scheduler`);
this module feeds it what the Trainer knows (the Actors' throughput
estimates, what each holds) and turns its plan into ledger calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aurora_store.clock import Clock
from aurora_store.coordination.ledger import AcceptedResult, Ledger, LedgerLost, StepPoll
from aurora_store.coordination.records import RunRecords
from aurora_store.coordination.scheduler import (
    ActorView,
    SchedulerConfig,
    StepPlan,
    ema,
    lease_ms,
    plan_step,
)
from aurora_store.errors import ConfigError
from workers.task import Problem, Task

__all__ = [
    "IGNORED_REASONS",
    "CATCH_UP_VERSIONS",
    "BatchClose",
    "Collected",
    "PromptRenderer",
    "Prompts",
    "actor_views",
    "batch_prompts",
    "collect_batch",
    "min_results",
    "plan_batch",
    "step_lease_ms",
    "updated_tau",
]

log = logging.getLogger("aurora.trainer")

Prompts = list[tuple[str, bytes]]
"""(prompt id, payload) of one batch, in order."""


class PromptRenderer(Protocol):
    """What batches need of a tokenizer: the ids a prompt is generated from."""

    def render_prompt(self, text: str) -> list[int]: ...


def batch_prompts(
    b: int, size: int, seed: int, task: Task, tokenizer: PromptRenderer, max_new_tokens: int
) -> tuple[Prompts, dict[str, Problem]]:
    """The prompts of batch ``b`` (payloads for the Actors) and their problems (the answers stay here).

    A payload holds the prompt's text, the ids to generate from (the
    tokenizer's chat template applied, when it has one) and the longest
    completion the Trainer accepts, so an Actor needs nothing of the run
    but the model description.
    """
    problems = task.train_problems(b, size, seed)
    prompts: Prompts = []
    by_id: dict[str, Problem] = {}
    for p in problems:
        pid = f"b{b}-{p.id}"
        by_id[pid] = p
        body = {"id": pid, "text": p.prompt_text, "ids": tokenizer.render_prompt(p.prompt_text), "max_new_tokens": max_new_tokens}
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


CATCH_UP_VERSIONS = 2
"""How far behind a batch's version an Actor may be and still get a share when nobody is closer."""


def plan_batch(views: list[ActorView], gen_version: int, prompts: int, config: SchedulerConfig) -> StepPlan | None:
    """How a batch on ``gen_version`` is split over ``views`` (None when no Actor is known yet).

    When no Actor is within one version of ``gen_version`` (every one is still
    applying an earlier delta: the first deltas after a start, a burst of
    versions, a hiccup of the store), the batch is split over the live Actors
    at most :data:`CATCH_UP_VERSIONS` behind instead of left whole in the
    shared pool. Why: a batch in the pool goes to whoever reaches the version
    first, in claims of its claim size, so one Actor took the whole batch
    while the others idled, and the step lasted two generation windows
    (``aurora bench wan --quick``'s 0.5 vs 0.85, issue 25). An assignment is
    claimed only once its Actor runs ``gen_version`` (the ledger checks the
    state), so nothing is generated on the wrong weights; an Actor that dies
    first has its assignment put back in the pool by the reaper.
    """
    if not views:
        return None
    plan = plan_step(views, gen_version, prompts, config, require_staged=False)
    if plan.quotas or prompts == 0:
        return plan
    floor = gen_version - CATCH_UP_VERSIONS
    catching = {v.actor for v in views if v.alive and v.active is not None and floor <= v.active < gen_version}
    if not catching:
        return plan
    log.info(
        "batch on v%d: no Actor is within one version yet; split over %d catching up (%s)", gen_version, len(catching), sorted(catching)
    )
    lifted = [dataclasses.replace(v, active=gen_version - 1) if v.actor in catching else v for v in views]
    return plan_step(lifted, gen_version, prompts, config, require_staged=False)


def updated_tau(prev: float | None, observed: float, config: SchedulerConfig) -> float:
    """The new throughput estimate of an Actor that just reported ``observed`` tokens/s."""
    return observed if prev is None or prev <= config.initial_tau else ema(prev, observed, config.beta)


def step_lease_ms(completion_ms: list[float], config: SchedulerConfig) -> int:
    """Lease length of a new step, from the most recent completion times."""
    return lease_ms(completion_ms[-200:], config)


@dataclass(slots=True)
class Collected:
    """What collecting batches found beyond their results (cumulative over the Trainer's batches)."""

    accepted_twice: int = 0
    """Results for a prompt already collected (the ledger accepts once: this must stay 0)."""
    accepted_wrong_version: int = 0
    """Results generated on another version than the batch's (must stay 0 too)."""
    unreturned: int = 0
    """Prompts whose batch closed without their result (``min_batch_fraction`` < 1 and a deadline)."""
    remarked: int = 0
    """Prompts the ledger had lost the settlement of (a partial Redis loss) and was told again."""
    last: BatchClose | None = None
    """How the latest batch closed."""
    ignored: dict[str, int] = field(default_factory=dict)
    """Results the Trainer refused, by why (:data:`IGNORED_REASONS`): each entry counted once,
    taken out of the ledger and its prompt offered again. Redis is writable by every Actor's
    credential, so these are forgeries or damage, never an honest Actor's settle."""
    reoffered: int = 0
    """Prompts whose refused result was taken out of the ledger (and offered again when of the batch)."""
    _seen: set[tuple[str, str, str]] = field(default_factory=set, repr=False)
    _said_at: float | None = field(default=None, repr=False)

    @property
    def ignored_total(self) -> int:
        return sum(self.ignored.values())


IGNORED_REASONS = ("malformed", "unproven", "no_result", "unknown_prompt", "wrong_version", "wrong_state")
"""Why the Trainer ignores a result in the ledger: unreadable or of the wrong types; not what the
settle script writes (no proof of its lease's secret, or its ``done`` entry names another settle);
a ``done`` entry without a result; a prompt not of the batch; another version or state than the batch's."""

_SEEN_MAX = 100_000

IGNORED_LOG_EVERY_S = 60.0
"""Ignored results are logged at their first, then at most once per this many seconds (a summary)."""


def _ignore(counts: Collected, b: int, prompt: str, why: str, key: str, clock: Clock) -> bool:
    """Count one refused result once (``key`` tells repeats of the same entry apart); True when new."""
    if (prompt, why, key) in counts._seen:
        return False
    if len(counts._seen) >= _SEEN_MAX:
        counts._seen.clear()  # memory bounded whatever a forger writes; a repeat may then count twice
    counts._seen.add((prompt, why, key))
    counts.ignored[why] = counts.ignored.get(why, 0) + 1
    now = clock.monotonic()
    if counts._said_at is None or now - counts._said_at >= IGNORED_LOG_EVERY_S:
        counts._said_at = now
        # The prompt id is untrusted text: quoted and cut, never a log line of its own.
        log.warning(
            "step %d: ignored a result in the ledger for prompt %r (%s); %d ignored so far %s: "
            "a holder of the Actors' Redis credential wrote it, or Redis damaged it; taken out of the ledger (a prompt of the batch "
            "is offered again)",
            b,
            prompt[:64],
            why,
            counts.ignored_total,
            dict(sorted(counts.ignored.items())),
        )
    return True


@dataclass(frozen=True, slots=True)
class BatchClose:
    """How one batch closed."""

    step: int
    need: int
    """Prompts of the batch."""
    collected: int
    """Results the Trainer holds for it."""
    unreturned: int
    """Prompts closed without a result: ``need - collected``."""
    reason: str
    """``complete`` (every prompt in) or ``deadline`` (``batch_deadline_s`` passed with enough in)."""
    waited_s: float

    def as_json(self) -> str:
        return json.dumps(
            {"step": self.step, "need": self.need, "collected": self.collected, "unreturned": self.unreturned, "reason": self.reason}
        )


def min_results(need: int, batch_deadline_s: float | None, min_batch_fraction: float) -> int:
    """Results a batch of ``need`` prompts must hold to close at its deadline (all of them without one)."""
    if not 0 < min_batch_fraction <= 1:
        raise ConfigError(f"min_batch_fraction must be in (0, 1], got {min_batch_fraction}")
    if batch_deadline_s is not None and batch_deadline_s <= 0:
        raise ConfigError(f"batch_deadline_s must be > 0 or None, got {batch_deadline_s}")
    if batch_deadline_s is None or need <= 0:
        return need
    return min(need, max(1, math.ceil(min_batch_fraction * need - 1e-9)))


def collect_batch(
    ledger: Ledger,
    b: int,
    gen_version: int,
    need: int,
    collected: dict[str, AcceptedResult],
    completion_ms: list[float],
    counts: Collected,
    reap_ms: int,
    progress_s: float,
    poll_s: float,
    stop: threading.Event,
    clock: Clock,
    recreate: Callable[[], None],
    *,
    batch_deadline_s: float | None = None,
    min_batch_fraction: float = 1.0,
    epoch: int | None = None,
    prompts: Collection[str] | None = None,
    state: str | None = None,
    on_collect: Callable[[AcceptedResult], None] | None = None,
) -> BatchClose:
    """Read batch ``b``'s results into ``collected`` until it may close, then close it.

    The batch closes when all ``need`` prompts are in, or once
    ``batch_deadline_s`` (None: never) has passed since the step was created
    (server clock) with at least ``min_batch_fraction`` of them in. Closing
    seals the step first (a late settle is refused with ``closed``), reads
    what arrived up to the seal, then drops the step's keys; the prompts
    still out are counted in ``counts.unreturned`` and the answer.

    Results are read by prompt id, so nothing Redis reorders or loses hides
    one; a settlement the ledger lost but the Trainer holds is marked again
    (never re-done). The ledger accepts once and only on the job's version;
    each result is checked again here. Silent Actors are reaped and open
    steps' TTLs refreshed on the way. A ledger that lost the step (Redis
    restarted empty) is re-created by ``recreate``. There is no time limit:
    a wait longer than ``progress_s`` logs progress every ``progress_s``.
    Raises :class:`KeyboardInterrupt` once ``stop`` is set and
    :class:`~aurora_store.errors.FencedOut` if a newer Trainer holds the run
    (``epoch``: this Trainer's, passed to every write).

    Every Actor's Redis credential can write the step's keys, so a result is
    taken only as the settle script writes it (a witness of its lease's
    secret, a matching ``done`` entry), for a prompt of the batch
    (``prompts``: the batch's ids; None skips that check) on ``gen_version``
    and the batch's ``state`` (None skips it). Anything else, malformed
    included, is counted once in ``counts.ignored``, logged (rate-limited),
    taken out of the ledger and its prompt offered again: never fatal.
    ``on_collect(result)``: called for each result as it is collected (the
    Trainer starts reading a result written to the store then).
    """
    t0 = clock.monotonic()
    floor = min_results(need, batch_deadline_s, min_batch_fraction)
    reap_every = max(poll_s, min(1.0, reap_ms / 4000.0))
    touch_every = max(poll_s, min(60.0, ledger.config.step_ttl_s / 10.0)) if ledger.config.step_ttl_s > 0 else None
    next_reap = next_touch = t0
    next_progress = t0 + progress_s
    created_ms: int | None = None
    told: set[str] = set()  # prompts already passed to mark_settled (once is enough)
    said_floor = said_stranded = False

    known = None if prompts is None else frozenset(prompts)

    def absorb(poll: StepPoll) -> None:
        refused: list[tuple[str, str, bool]] = []
        for p, bad, value in poll.rejected:
            if _ignore(counts, b, p, bad, value, clock):
                refused.append((p, value, known is None or p in known))
        for r in poll.results:
            why: str | None = None
            if known is not None and r.prompt not in known:
                why = "unknown_prompt"
            elif r.prompt in collected:
                counts.accepted_twice += 1
            elif r.version != gen_version:
                why = "wrong_version"
            elif state is not None and r.state != state:
                why = "wrong_state"
            else:
                collected[r.prompt] = r
                completion_ms.append(max(1, r.settled_ms - r.leased_ms))
                if on_collect is not None:
                    on_collect(r)
            if why and _ignore(counts, b, r.prompt, why, f"{r.actor}|{r.token}", clock):
                counts.accepted_wrong_version += why == "wrong_version"
                refused.append((r.prompt, f"{r.actor}|{r.token}", why != "unknown_prompt"))
        if refused:
            counts.reoffered += ledger.reoffer(b, refused, epoch=epoch)

    while True:
        if stop.is_set():
            raise KeyboardInterrupt
        try:
            poll = ledger.poll(b, collected)
        except LedgerLost:
            recreate()
            continue
        if created_ms is None:
            created_ms = poll.created_ms  # the first creation: a re-created step keeps its deadline
        absorb(poll)
        lost = [p for p in collected if p not in poll.accepted and p not in told]
        if lost:
            told.update(lost)
            n = ledger.mark_settled(b, lost, epoch=epoch)
            if n:
                counts.remarked += n
                log.warning("step %d: the ledger had lost %d settlement(s) the Trainer holds; marked settled again", b, n)
        now = clock.monotonic()
        if now >= next_reap:
            ledger.reap(reap_ms)
            next_reap = now + reap_every
        if touch_every is not None and now >= next_touch:
            ledger.touch_steps()
            next_touch = now + touch_every
        late = batch_deadline_s is not None and poll.now_ms - created_ms >= batch_deadline_s * 1000
        if len(collected) >= need or (late and len(collected) >= floor):
            return _close(ledger, b, need, collected, counts, absorb, "complete" if len(collected) >= need else "deadline", now - t0, epoch)
        if late and not said_floor:
            said_floor = True
            log.info(
                "step %d: deadline of %.0fs passed with %d/%d results; closing at %d", b, batch_deadline_s, len(collected), need, floor
            )
        if now >= next_progress:
            log.info(
                "step %d: %d/%d results after %.0fs (ledger: %d/%d settled); waiting for Actors",
                b,
                len(collected),
                need,
                now - t0,
                poll.settled,
                poll.total,
            )
            next_progress = now + progress_s
            if not said_stranded:
                said_stranded = _say_if_stranded(ledger, b, gen_version, need - len(collected), batch_deadline_s)
        clock.wait(stop, poll_s)


def _say_if_stranded(ledger: Ledger, b: int, gen_version: int, left: int, batch_deadline_s: float | None) -> bool:
    """Warn (and answer True) when every live Actor is past ``gen_version``: none can serve step ``b``.

    An Actor never goes back a version, so such a step waits for an Actor
    that starts afresh (it bootstraps at the oldest version an open step
    needs) or for ``batch_deadline_s``.
    """
    alive = [a for a in ledger.actors() if a.status == "alive"]
    if not alive or any(a.active is None or a.active <= gen_version for a in alive):
        return False
    until = (
        f"its deadline ({batch_deadline_s:.0f}s)" if batch_deadline_s is not None else "an Actor starts (--batch-deadline-s would close it)"
    )
    log.warning(
        "step %d: generated on v%d, but all %d live Actor(s) are past it (v%d and up): none can serve its %d open prompt(s); "
        "it waits until %s, and a fresh Actor starts at v%d",
        b,
        gen_version,
        len(alive),
        min(a.active or 0 for a in alive),
        left,
        until,
        gen_version,
    )
    return True


def _close(
    ledger: Ledger,
    b: int,
    need: int,
    collected: dict[str, AcceptedResult],
    counts: Collected,
    absorb: Callable[[StepPoll], None],
    reason: str,
    waited_s: float,
    epoch: int | None,
) -> BatchClose:
    """Seal, read what came in up to the seal, drop: each phase a call of its own, safe to repeat."""
    if ledger.seal_step(b, epoch=epoch) is not None:
        # LedgerLost: Redis lost the step after the seal; what it held is gone, and counted below.
        with contextlib.suppress(LedgerLost):
            absorb(ledger.poll(b, collected))
    unreturned = max(0, need - len(collected))
    ledger.drop_step(b, epoch=epoch, unreturned=unreturned)
    counts.unreturned += unreturned
    done = BatchClose(b, need, len(collected), unreturned, reason, waited_s)
    counts.last = done
    if unreturned:
        log.info("step %d: closed with %d/%d results (%s); %d prompt(s) unreturned", b, len(collected), need, reason, unreturned)
    RunRecords(ledger.r, ledger.run, ledger, epoch).record_batch_close(counts.unreturned, done.as_json())
    return done
