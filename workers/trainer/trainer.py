"""The Trainer: GRPO with one-step asynchrony, publishing every step as a delta.

Per step b (docs/WORKERS.md): wait for batch b (generated on version b-1),
collect it, reward it (the Trainer's own reward function: nothing an Actor
says about rewards is trusted), take a GRPO step (group-normalized
advantages, clipped ratio objective, optional KL to the warm-started
reference) -> version b+1, publish its delta cut-through over S connections
with each segment announced, announce the version, create batch b+2 on
version b+1 split by the scheduler, announce Commit(b+1).

One process by default; with several (``torchrun`` or ``--nproc N``) the
fp32 weights and optimizer state are sharded with FSDP2 and rank 0 is the
Trainer described here, the other ranks :func:`follow` it
(:mod:`workers.trainer.fsdp`).

The parts, each given to the :class:`Trainer` through its constructor:

- the workload, through two Protocols (:mod:`~workers.trainer.sources`):
  :class:`~workers.trainer.policy.GrpoPolicy` by default (the model, the
  task, rewards, the update), a synthetic one in ``aurora bench wan``;
- :class:`~workers.trainer.batches.BatchBook`: batches over the ledger
  (issue, collect, issue again when Redis lost them), split by
  :mod:`~workers.trainer.scheduling`;
- :class:`~workers.trainer.versions.VersionPublisher`: ship each version
  and record it in the run's records (:mod:`aurora_store.coordination.records`);
- :class:`~workers.trainer.bootstrap.Bootstrap`: the epoch, a fresh run's
  version 0, resume from a checkpoint, the checkpoints themselves.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from aurora_store import metrics
from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.codec.kernels import warm_up
from aurora_store.coordination.bus import COMMIT, Bus
from aurora_store.coordination.commit import prepare_commit
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.records import RunRecords
from aurora_store.coordination.redisconn import connect
from aurora_store.coordination.retention import run_held_versions
from aurora_store.errors import ConfigError
from aurora_store.format.signing import signer_from_option
from aurora_store.lineage.publish import PublishConfig
from aurora_store.outage import Dependency, is_transient, riding
from aurora_store.storage import Store, open_store
from workers.common import Endpoints
from workers.trainer.batches import BatchBook
from workers.trainer.bootstrap import Bootstrap
from workers.trainer.config import TrainerConfig
from workers.trainer.crash import crash_point
from workers.trainer.follower import follow
from workers.trainer.fsdp import (
    SINGLE,
    DistContext,
)
from workers.trainer.malloc import tune_allocator
from workers.trainer.park import parkable, readers_paused
from workers.trainer.policy import GrpoPolicy
from workers.trainer.sources import StepSource, WeightsSource
from workers.trainer.step_metrics import save_step_metrics
from workers.trainer.versions import VersionObserver, VersionPublisher

__all__ = ["StepLog", "Trainer", "follow"]

log = logging.getLogger("aurora.trainer")


@dataclass(slots=True)
class StepLog:
    """What one Trainer step did (one line of the log and of the demo's table)."""

    step: int
    version: int
    """Version published by this step."""
    gen_version: int
    """Version batch ``step`` was generated on."""
    reward: float
    wait_s: float
    train_s: float
    extract_publish_s: float
    step_s: float
    delta_bytes: int
    full_bytes: int
    changed: int
    tokens: int
    tokens_per_s: float
    eligible: list[str]
    excluded: list[str]
    by_actor: dict[str, int]
    rejected_payloads: int = 0
    elements: int = 0
    """Elements of the published weights (tied ones once): ``changed / elements`` is the delta's density."""
    publish_s: float = 0.0
    """Of ``extract_publish_s``, the time the step waited for publishing, hashing excluded (a snapshot uploads in the background)."""
    digest_s: float = 0.0
    checkpoint_wait_s: float = 0.0
    """Of ``step_s``, the time the step waited for checkpoints: planning one, and the hold before
    ``optimizer.step()`` while the previous one was still being written (:mod:`~workers.trainer.ckpt_async`)."""
    """Of ``extract_publish_s``, the time spent hashing the weights (only at snapshot and checkpoint versions)."""


class Trainer:
    """One training run against a store and a Redis ledger.

    ``clock`` times the waits for a batch (its poll and its timeout).
    ``steps`` and ``weights``: the workload (both, or neither: then
    :class:`~workers.trainer.policy.GrpoPolicy` is both). ``publish_config``:
    how versions are cut (default ``cfg.publish_config()``); ``on_version``
    is told of every version recorded; ``stop``: the event that stops the run
    (default: a new one, :attr:`stop`).
    """

    def __init__(
        self,
        ep: Endpoints,
        cfg: TrainerConfig,
        on_step: Callable[[StepLog], None] | None = None,
        ctx: DistContext = SINGLE,
        clock: Clock = SYSTEM_CLOCK,
        *,
        steps: StepSource | None = None,
        weights: WeightsSource | None = None,
        publish_config: PublishConfig | None = None,
        on_version: VersionObserver | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        if not ctx.leader:
            raise ValueError("the Trainer runs on rank 0; other ranks run follow()")
        tune_allocator()  # before the model is built (workers.trainer.malloc: what glibc keeps beyond what is live)
        if cfg.transfer == "delta":
            # The codec's compiled kernels (extraction, encodings; about 120 MB of numba, llvmlite and
            # machine code, a fixed cost per process) load now, before the model: the first publish does
            # not stall on a compile, and the memory it costs is there before the model's, as it is in
            # `aurora bench trainer`'s baseline.
            log.info("codec kernels ready in %.1fs", warm_up())
        if (steps is None) != (weights is None):
            raise ValueError("a workload gives both a step source and a weights source (or neither: GRPO)")
        self.ep = ep
        self.cfg = cfg
        if not ctx.sharded and _device(cfg.device) != ctx.device:
            ctx = DistContext(ctx.rank, ctx.world, _device(cfg.device))
        self.ctx = ctx
        self.clock = clock
        self.on_step = on_step
        self.stop = stop if stop is not None else threading.Event()
        """Set to stop the run (a signal handler, a test); the workload may wait on it too."""
        # Redis and the store may be away for a while (docs/FAILURES.md): every
        # call through these rides it out up to the outage budget, logging once.
        self.redis_dep = Dependency("Redis", log, cfg.outage_budget_s, clock)
        self.store_dep = Dependency("the store", log, cfg.outage_budget_s, clock)
        self.raw_store = open_store(ep.store, dict(ep.storage_options))
        self.store: Store = riding(self.raw_store, self.store_dep, self.stop)
        raw = self.raw_redis = connect(ep.redis)
        self.ledger = riding(Ledger(raw, ep.run), self.redis_dep, self.stop)
        self.bus = riding(Bus(raw, ep.run), self.redis_dep, self.stop)
        self.records = riding(RunRecords(raw, ep.run), self.redis_dep, self.stop)
        """The run's records (head, states, digests, status), written fenced by this Trainer's epoch."""
        self.keys = RunKeys(ep.run)
        self.signer = signer_from_option(cfg.sign_key, cfg.sign_key_id)
        """Signs every manifest this Trainer writes (FORMAT.md §4.1); None: an unsigned run."""
        self.grpo: GrpoPolicy | None = GrpoPolicy(cfg, ctx, ep.storage_options) if steps is None else None
        """The GRPO workload (None under another one): evaluation and checkpoints are its."""
        self.step_source: StepSource = steps if steps is not None else _given(self.grpo)
        self.weights_source: WeightsSource = weights if weights is not None else _given(self.grpo)
        heartbeat_ms = int(cfg.heartbeat_timeout_s * 1000)
        self.versions = VersionPublisher(
            self.store,
            self.raw_store,
            self.records,
            self.bus,
            cfg,
            publish_config or cfg.publish_config(),
            self.signer,
            self.stop,
            held_versions=lambda: run_held_versions(raw, ep.run, heartbeat_ms),
            on_version=on_version,
        )
        if self.grpo is not None:
            self.versions.place = self.grpo.versions_device  # a resumed run's versions go where fresh ones are
            # The newest version is parked while the update runs (workers.trainer.park): one process, or
            # rank 0 of a sharded run, which alone holds the whole version.
            self.grpo.parkable = lambda: parkable(self.versions)
            self.grpo.readers_paused = lambda: readers_paused(self.versions)
        self.batches = BatchBook(
            self.ledger,
            self.records,
            cfg,
            self.step_source.prompts,
            self.versions.states,
            self.newest_version,
            lambda: self.bootstrap.enter_epoch(self.epoch),
            self.stop,
            clock,
            store=self.store,
        )
        self.bootstrap = Bootstrap(
            self.store,
            cfg,
            ctx,
            ep.run,
            self.ledger,
            self.bus,
            self.records,
            self.versions,
            self.batches,
            self.weights_source,
            self.grpo,
            self.signer,
            self.evaluate,
            self.stop,
            clock,
        )
        self._ckpt_wait_mark = 0.0
        self.eval_accuracy: dict[int, float] = {}
        """version -> held-out accuracy measured on it (``eval_every``)."""
        self.logs: list[StepLog] = []

    @property
    def epoch(self) -> int:
        """This Trainer's epoch: 1 for a fresh run, one more than any before it on resume (0 before either)."""
        return self.records.epoch or 0

    @property
    def states(self) -> dict[int, str]:
        """version -> ``state`` of the versions this Trainer published or continued from."""
        return self.versions.states

    @property
    def unreturned(self) -> int:
        """Prompts whose batch closed without their result (``min_batch_fraction`` < 1, a deadline)."""
        return self.batches.counts.unreturned

    @property
    def accepted_twice(self) -> int:
        """Results collected for a prompt already collected (the ledger accepts once: stays 0)."""
        return self.batches.counts.accepted_twice

    @property
    def accepted_wrong_version(self) -> int:
        """Results generated on another version than their batch's (stays 0)."""
        return self.batches.counts.accepted_wrong_version

    def newest_version(self) -> int:
        """The newest version this Trainer published (0 when versions are not shipped)."""
        return max(self.versions.states) if self.cfg.weight_transfer else 0

    @property
    def checkpoint_wait_s(self) -> float:
        """Seconds this Trainer's steps waited for checkpoints so far (each step's share: ``StepLog.checkpoint_wait_s``)."""
        return self.bootstrap.checkpointer.wait_s

    @property
    def resumed_from(self) -> int | None:
        """Step of the checkpoint this Trainer resumed from (None: a fresh run)."""
        return self.bootstrap.resumed_from

    # -- setup ------------------------------------------------------------------
    def setup(self) -> None:
        """A fresh run: version 0, the first batches, the first checkpoint."""
        self.bootstrap.start_fresh()

    def resume(self) -> int:
        """Continue the run from its newest checkpoint; returns the step to run next."""
        return self.bootstrap.resume()

    def evaluate(self, v: int) -> None:
        """Score the held-out set on version ``v`` when it is due (``eval_every``); recorded with ``v``."""
        every = self.cfg.eval_every
        if every <= 0 or v % every != 0 or not self.cfg.weight_transfer or self.grpo is None:
            return
        res = self.grpo.evaluate(v, self.versions.published)
        self.eval_accuracy[v] = res.accuracy
        metrics.active().evaluated(v, res.accuracy)
        log.info("eval v%d: accuracy %.3f on %d held-out problems (%.1fs)", v, res.accuracy, res.problems, res.seconds)
        self.redis_dep.call(lambda: res.record(self.raw_redis, self.keys), "record an evaluation", self.stop)
        try:
            self.store_dep.call(lambda: res.save(self.raw_store), "save an evaluation", self.stop)
        except Exception as e:  # noqa: BLE001 - the record in Redis is the one read; the object documents the run
            if not is_transient(e):
                raise
            log.warning("eval v%d: not saved to the store: %s", v, e)

    def producer(self, step: int) -> dict[str, Any]:
        """``producer`` of the manifests this Trainer writes: the step and the epoch (FORMAT.md §4)."""
        return self.bootstrap.producer(step)

    # -- the loop ---------------------------------------------------------------------
    def train_step(self, b: int) -> StepLog:
        t0 = time.perf_counter()
        counts = self.batches.counts
        twice0, wrong0 = counts.accepted_twice, counts.accepted_wrong_version
        self.batches.wait(b)
        crash_point("closed", b + 1)
        gen_version = self.batches.gen_of[b]
        t_wait = time.perf_counter() - t0
        r = self.step_source.rollouts(self.batches.collected[b])
        self.batches.update_tau(r.gen_tokens, r.gen_s)
        t1 = time.perf_counter()
        # Batches after this one are generated on versions >= b + 1 - max_lag: what rebuilds older ones
        # is released once this batch's behaviour log-probs are taken (before the backward pass).
        self.step_source.train(r, self.versions.behaviour(gen_version, b + 1 - self.cfg.max_lag))
        t_train = time.perf_counter() - t1
        v = b + 1
        new = self.weights_source.weights()
        t2 = time.perf_counter()
        delta_bytes = changed = 0
        if self.cfg.weight_transfer:
            delta_bytes, changed = self.versions.publish(v, new, self.producer(b))
        t_pub = time.perf_counter() - t2
        eligible: list[str] = []
        excluded: list[str] = []
        # Batch v + K is the first one generated on version v (lag bound K).
        if v + self.cfg.max_lag < self.cfg.steps:
            eligible, excluded = self.batches.create(v + self.cfg.max_lag, v if self.cfg.weight_transfer else 0)
        if self.cfg.weight_transfer:
            self.bus.announce(COMMIT, v)
            # Also in the Trainer's hash: an Actor following a Relay's stream
            # that went silent (the Relay died) still learns of the Commit.
            self.records.record_commit(v)
        # Started here, written while the next step runs; the run's last one is finished now.
        self.bootstrap.checkpoint(v, final=v >= self.cfg.steps or self.stop.is_set())
        ckpt_wait_s, self._ckpt_wait_mark = self.checkpoint_wait_s - self._ckpt_wait_mark, self.checkpoint_wait_s
        step_s = time.perf_counter() - t0
        plan = self.versions.plan
        full = self.versions.full_bytes
        entry = StepLog(
            step=b,
            version=v,
            gen_version=gen_version,
            reward=sum(r.rewards) / max(1, len(r.rewards)),
            wait_s=t_wait,
            train_s=t_train,
            extract_publish_s=t_pub,
            step_s=step_s,
            delta_bytes=delta_bytes,
            full_bytes=full,
            changed=changed,
            tokens=r.tokens,
            tokens_per_s=r.tokens / max(1e-9, step_s),
            eligible=eligible,
            excluded=excluded,
            by_actor=r.by_actor,
            rejected_payloads=r.bad,
            elements=sum(spec.numel for spec in plan.specs().values()) if plan is not None else 0,
            publish_s=self.versions.publish_s if self.cfg.weight_transfer else 0.0,
            digest_s=self.versions.digest_s if self.cfg.weight_transfer else 0.0,
            checkpoint_wait_s=ckpt_wait_s,
        )
        self.logs.append(entry)
        metrics.active().trainer_step(entry)
        log.info(
            "step %d -> v%d: reward %.3f, %d tokens (%.0f tok/s), wait %.2fs train %.2fs extract+publish %.2fs, delta %d B (%.1f%% of full), eligible %s excluded %s",
            b,
            v,
            entry.reward,
            r.tokens,
            entry.tokens_per_s,
            t_wait,
            t_train,
            t_pub,
            delta_bytes,
            100 * delta_bytes / max(1, full),
            eligible,
            excluded,
        )
        self._log_step_json(b, v, gen_version, twice0, wrong0)
        self.evaluate(v)
        save_step_metrics(self.raw_store, self.store_dep, self.stop, entry, self.eval_accuracy.get(v))
        if self.on_step:
            self.on_step(entry)
        return entry

    def _log_step_json(self, b: int, v: int, gen_version: int, twice0: int, wrong0: int) -> None:
        """One machine-readable line per published version (``step-json {…}``): what the
        step trained on, prompt by prompt, for audits and ``aurora bench chaos``."""
        results = self.batches.collected.get(b, {})
        ids = [pid for pid, _ in self.batches.prompts.get(b, [])]
        counts = self.batches.counts
        log.info(
            "step-json %s",
            json.dumps(
                {
                    "step": b,
                    "version": v,
                    "epoch": self.epoch,
                    "gen_version": gen_version,
                    "state": self.versions.states.get(v),
                    "published_ms": int(time.time() * 1000),
                    "prompts": ids,
                    "used": [[r.prompt, r.actor, r.token, r.version, r.state] for r in results.values()],
                    "unreturned": [pid for pid in ids if pid not in results],
                    "accepted_twice": counts.accepted_twice - twice0,
                    "accepted_wrong_version": counts.accepted_wrong_version - wrong0,
                },
                separators=(",", ":"),
            ),
        )

    def prepare_commit(self) -> None:
        """Before the first publish: know how this store commits (FORMAT.md §1).

        ``commit_via="store"`` probes that the store honours create-only writes
        and refuses one that does not (one line naming the way out);
        ``"redis"`` checks that Redis persists its data, puts the run in
        Redis-commit mode and completes manifests whose write was lost.
        """
        self.versions.commit = self.redis_dep.call(
            lambda: prepare_commit(self.raw_store, self.raw_redis, self.ep.run, self.cfg.commit_via), "prepare the commit mode", self.stop
        )

    def run(self) -> list[StepLog]:
        clean = False
        try:
            if self.cfg.weight_transfer and self.cfg.transfer != "none":
                self.prepare_commit()
            start = self.resume() if self.cfg.resume else 0
            if not self.cfg.resume:
                self.setup()
            for b in range(start, self.cfg.steps):
                if self.stop.is_set():
                    break
                self.train_step(b)
            self.versions.drain()  # the last snapshot, still uploading in the background
            clean = True
        except KeyboardInterrupt:  # stopped (SIGTERM, SIGINT) between collectives: a clean end too
            clean = True
            raise
        finally:
            if self.grpo is not None:
                self.grpo.close(release=clean)  # after a failure no message: the other ranks may be mid-collective
            if clean:
                # The checkpoint still being written is committed (the other ranks, told to stop, finish theirs).
                self.bootstrap.checkpointer.finish()
        self.records.record_status("done")
        return self.logs


def _given(policy: GrpoPolicy | None) -> GrpoPolicy:
    assert policy is not None
    return policy


def _device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available to this torch ({torch.__version__}); use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    return dev
