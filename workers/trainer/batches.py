"""The Trainer's batches: create each one split over the Actors, collect it, issue it again when Redis lost it.

:class:`BatchBook` keeps what the Trainer knows of its open batches (their
prompts, the results collected by prompt id, the version each is generated
on) and of the Actors (throughput estimates, completion times). The split is
the scheduler's (:mod:`~workers.trainer.scheduling`); the prompts come from
the Trainer's step source.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from aurora_store.clock import Clock
from aurora_store.coordination.ledger import AcceptedResult, Ledger
from aurora_store.coordination.records import RunRecords
from aurora_store.storage import Store
from workers.trainer.config import TrainerConfig
from workers.trainer.results import ResultReader, max_result_bytes
from workers.trainer.scheduling import (
    Collected,
    Prompts,
    actor_views,
    collect_batch,
    plan_batch,
    step_lease_ms,
    updated_tau,
)

__all__ = ["BatchBook"]

log = logging.getLogger("aurora.trainer")


class _Reissued(Exception):  # noqa: N818 - control flow inside the book, never raised to a caller
    """A lost step was issued again (perhaps on another version): collect it afresh."""


class BatchBook:
    """The open batches of one Trainer over its ledger.

    ``make_prompts(b)``: the prompts of batch ``b`` (the step source's);
    ``states``: version -> state of the versions batches are generated on;
    ``newest``: the newest version published; ``restore_fence``: called when
    Redis lost its data (the epoch with it) before a batch is issued again.
    """

    def __init__(
        self,
        ledger: Ledger,
        records: RunRecords,
        cfg: TrainerConfig,
        make_prompts: Callable[[int], Prompts],
        states: Mapping[int, str],
        newest: Callable[[], int],
        restore_fence: Callable[[], None],
        stop: threading.Event,
        clock: Clock,
        store: Store | None = None,
    ) -> None:
        self.ledger = ledger
        self.records = records
        self.cfg = cfg
        self.make_prompts = make_prompts
        self.states = states
        self.newest = newest
        self.restore_fence = restore_fence
        self.stop = stop
        self.clock = clock
        self.prompts: dict[int, Prompts] = {}
        """step -> its (prompt id, payload) pairs."""
        self.collected: dict[int, dict[str, AcceptedResult]] = {}
        """step -> results collected so far, by prompt id."""
        self.gen_of: dict[int, int] = {}
        """step -> the version its rollouts are generated on (b - K, or newer after a re-issue)."""
        self.tau: dict[str, float] = {}
        """Actor -> throughput estimate (tokens/s)."""
        self.completion_ms: list[float] = []
        """How long prompts took from lease to settle (the lease length follows them)."""
        self.counts = Collected()
        self.results = (
            ResultReader(store, max_result_bytes(cfg.group, cfg.max_new_tokens), clock, streams=cfg.streams) if store is not None else None
        )
        """Reads the results Actors wrote to the store (their counts: ``through_store``, ``refused``)."""

    def create(self, b: int, gen_version: int) -> tuple[list[str], list[str]]:
        """Issue batch ``b`` on ``gen_version`` split over the eligible Actors; returns (eligible, excluded)."""
        prompts = self.make_prompts(b)
        self.prompts[b] = prompts
        views = actor_views(self.ledger.actors(), self.tau, self.cfg.scheduler.initial_tau)
        plan = plan_batch(views, gen_version, len(prompts), self.cfg.scheduler)
        quotas = plan.quotas if plan else {}
        if plan:
            for a in plan.eligibility.excluded:
                self.tau[a] = plan.taus[a]
                self.ledger.set_tau(a, plan.taus[a])
        self.ledger.create_step(
            b,
            self.states[gen_version],
            prompts,
            quotas,
            self.cfg.group,
            step_lease_ms(self.completion_ms, self.cfg.scheduler),
            version=gen_version,
            epoch=self.records.epoch,
        )
        self.gen_of[b] = gen_version
        self.collected.setdefault(b, {})
        self.records.record_step(b)
        return (list(plan.eligibility.eligible) if plan else [], list(plan.eligibility.excluded) if plan else [])

    def reopen(self, b: int, held: int | None, versions: Mapping[int, object], newest: int) -> None:
        """On resume: keep batch ``b`` if the ledger still holds it on a version this Trainer has, else issue it on ``newest``."""
        self.prompts[b] = self.make_prompts(b)
        self.collected.setdefault(b, {})
        if held is not None and held in versions:
            self.gen_of[b] = held  # still open: its settled results count
            return
        # Lost, or closed by the Trainer that died: on the newest version,
        # which Actors may already hold (they never go back).
        if held is not None:
            self.ledger.close_step(b, epoch=self.records.epoch)
        self.create(b, newest)

    def _recreate(self, b: int) -> None:
        """Redis lost step ``b``: issue it again, on the newest version.

        The Actors may have moved past the version it was generated on (with
        no open step holding them there, they activate what was committed),
        and an Actor never goes back: a step on an older version would be
        stranded. On the same version the prompts already collected stay;
        on a newer one they are dropped too (a batch is trained against one
        behaviour policy) and every prompt is offered again.
        """
        gen = self.newest()
        if gen != self.gen_of[b]:
            log.warning("step %d: ledger lost; re-creating all %d prompt(s) on v%d (was v%d)", b, len(self.prompts[b]), gen, self.gen_of[b])
            self.collected[b].clear()
            left = self.prompts[b]
        else:
            left = [(pid, body) for pid, body in self.prompts[b] if pid not in self.collected[b]]
            log.warning("step %d: ledger lost; re-creating %d uncollected prompt(s)", b, len(left))
        self.restore_fence()  # the fence went with the rest of Redis's data
        self.gen_of[b] = gen
        self.ledger.create_step(
            b,
            self.states[gen],
            left,
            {},
            self.cfg.group,
            step_lease_ms(self.completion_ms, self.cfg.scheduler),
            version=gen,
            epoch=self.records.epoch,
        )
        raise _Reissued(b)

    def wait(self, b: int) -> None:
        """Collect batch ``b`` until it may close (all results, or its deadline), then close it."""
        reader = self.results
        while True:
            try:
                collect_batch(
                    self.ledger,
                    b,
                    self.gen_of[b],
                    len(self.prompts[b]),
                    self.collected[b],
                    self.completion_ms,
                    self.counts,
                    int(self.cfg.heartbeat_timeout_s * 1000),
                    self.cfg.progress_s,
                    self.cfg.poll_s,
                    self.stop,
                    self.clock,
                    lambda: self._recreate(b),
                    batch_deadline_s=self.cfg.batch_deadline_s,
                    min_batch_fraction=self.cfg.min_batch_fraction,
                    epoch=self.records.epoch,
                    prompts=[pid for pid, _ in self.prompts[b]],
                    state=self.states.get(self.gen_of[b]),
                    on_collect=(lambda r: reader.prefetch(b, r)) if reader is not None else None,
                )
            except _Reissued:
                continue
            if reader is not None:
                # The batch is closed: its references, read ahead as they settled, are in place now (any left, read now).
                reader.resolve(b, self.collected[b])
            return

    def update_tau(self, gen_tok: Mapping[str, int], gen_s: Mapping[str, float]) -> None:
        """Throughput estimates: tokens/s each Actor reported for its own generation."""
        for a, n in gen_tok.items():
            self.tau[a] = updated_tau(self.tau.get(a), n / gen_s[a], self.cfg.scheduler)
            self.ledger.set_tau(a, self.tau[a])
