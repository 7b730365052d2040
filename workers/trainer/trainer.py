"""The Trainer: GRPO with one-step asynchrony, publishing every step as a delta.

Per step b (docs/WORKERS.md): wait for batch b (generated on version b-1),
collect it, reward it (the Trainer's own reward function: nothing an Actor
says about rewards is trusted), take a GRPO step (group-normalized
advantages, clipped ratio objective, optional KL to the warm-started
reference) -> version b+1, publish its delta cut-through over S connections
with each segment announced, announce the version, create batch b+2 on
version b+1 split by the scheduler, announce Commit(b+1).

The model trains in float32 and every published version is its bfloat16
rounding, so the deltas are exactly what an RL run in bf16 inference would
ship. One process by default; with several (``torchrun`` or ``--nproc N``)
the fp32 weights and optimizer state are sharded with FSDP2 and rank 0 is
the Trainer described here, the other ranks :func:`follow` it
(:mod:`workers.trainer.fsdp`).

The parts: :mod:`~workers.trainer.scheduling` (batches over the ledger),
:mod:`~workers.trainer.grpo` (rewards, advantages, the update's fixed
terms), :mod:`~workers.trainer.publishing` (extract, publish, announce).
Each step of :class:`Trainer` is a method a subclass may replace (the
synthetic workload of ``aurora bench wan`` replaces training and rollouts).
"""

from __future__ import annotations

import copy
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from aurora_store import metrics
from aurora_store.api import Publisher
from aurora_store.apply.sink import weights_digest
from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.codec.extract import fuse_weights, unfuse_weights
from aurora_store.coordination.bus import COMMIT, VERSION, Bus
from aurora_store.coordination.commit import prepare_commit
from aurora_store.coordination.ledger import AcceptedResult, Ledger
from aurora_store.coordination.redisconn import connect
from aurora_store.coordination.retention import run_held_versions
from aurora_store.errors import ChainError, ConfigError, FencedOut, VersionConflict
from aurora_store.format.signing import signer_from_option
from aurora_store.lineage.binding import ModelFile
from aurora_store.lineage.fetch import materialize, read_manifest
from aurora_store.lineage.gc import retain
from aurora_store.lineage.plan import scan_versions
from aurora_store.lineage.publish import PublishConfig
from aurora_store.outage import Dependency, is_transient, riding
from aurora_store.storage import Store, open_store
from workers.common import (
    Endpoints,
    RunKeys,
    model_files_listed,
    record_digest,
    record_expected_state,
    write_model_description,
)
from workers.model import fusion_plan_for, hf_weights, is_tied, logprobs, tiny_qwen3, warm_start
from workers.pretrained import ModelDir, load_pretrained, read_model_dir
from workers.task import Problem, RewardRunner, Task, make_task
from workers.tokenizer import CharTokenizer, HFTokenizer
from workers.trainer.checkpoint import (
    Checkpoint,
    load_latest_checkpoint,
    load_optimizer,
    optimizer_tensors,
    prune_checkpoints,
    save_checkpoint,
)
from workers.trainer.config import TrainerConfig
from workers.trainer.crash import crash_point
from workers.trainer.evaluation import Evaluator
from workers.trainer.fsdp import (
    SINGLE,
    DistContext,
    GrpoBatch,
    broadcast_module,
    exchange,
    gather_bf16,
    grpo_epochs,
    shard_model,
)
from workers.trainer.grpo import behavior_logprobs, grpo_batch, read_rollouts
from workers.trainer.publishing import Published, publish_version
from workers.trainer.scheduling import (
    Collected,
    actor_views,
    batch_prompts,
    collect_batch,
    plan_batch,
    step_lease_ms,
    updated_tau,
)
from workers.trainer.step_metrics import save_step_metrics

__all__ = ["StepLog", "Trainer", "follow"]

log = logging.getLogger("aurora.trainer")

RolloutTuple = tuple[list[list[int]], list[list[int]], list[float], list[int], int, dict[str, int], int]
"""(prompts, completions, rewards, group starts, tokens, prompts by Actor, malformed payloads)."""


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


class Trainer:
    """One training run against a store and a Redis ledger.

    ``clock`` times the waits for a batch (its poll and its timeout).
    """

    def __init__(
        self,
        ep: Endpoints,
        cfg: TrainerConfig,
        on_step: Callable[[StepLog], None] | None = None,
        ctx: DistContext = SINGLE,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not ctx.leader:
            raise ValueError("the Trainer runs on rank 0; other ranks run follow()")
        self.ep = ep
        self.cfg = cfg
        if not ctx.sharded and _device(cfg.device) != ctx.device:
            ctx = DistContext(ctx.rank, ctx.world, _device(cfg.device))
        self.ctx = ctx
        self.clock = clock
        self.on_step = on_step
        self.stop = threading.Event()
        # Redis and the store may be away for a while (docs/FAILURES.md): every
        # call through these rides it out up to the outage budget, logging once.
        self.redis_dep = Dependency("Redis", log, cfg.outage_budget_s, clock)
        self.store_dep = Dependency("the store", log, cfg.outage_budget_s, clock)
        self._raw_store = open_store(ep.store, dict(ep.storage_options))
        self.store: Store = riding(self._raw_store, self.store_dep, self.stop)
        raw = self._raw_redis = connect(ep.redis)
        self.redis = riding(raw, self.redis_dep, self.stop)
        self.ledger = riding(Ledger(raw, ep.run), self.redis_dep, self.stop)
        self.bus = riding(Bus(raw, ep.run), self.redis_dep, self.stop)
        self.keys = RunKeys(ep.run)
        self.signer = signer_from_option(cfg.sign_key, cfg.sign_key_id)
        self._commit: Callable[[str, int, bytes], None] | None = None
        """Redis-commit mode's callback (FORMAT.md §1), set by :meth:`_prepare_commit`; None: the store commits."""
        """Signs every manifest this Trainer writes (FORMAT.md §4.1); None: an unsigned run."""
        self.epoch = 0
        """This Trainer's epoch: 1 for a fresh run, one more than any before it on resume."""
        self.resumed_from: int | None = None
        """Step of the checkpoint this Trainer resumed from (None: a fresh run)."""

        self.tokenizer: CharTokenizer | HFTokenizer = CharTokenizer()
        """The built-in model's; ``--model``'s own once :meth:`_build_model` ran."""
        self.model_dir: ModelDir | None = read_model_dir(cfg.model) if cfg.model else None
        self.task: Task = make_task(
            cfg.task, cfg.data, cfg.eval_data, seed=cfg.seed, difficulty=cfg.difficulty, storage_options=dict(ep.storage_options), holdout=cfg.eval_size,
        )
        if self.model_dir is None and cfg.task in ("gsm8k", "math"):
            raise ConfigError(f"--task {cfg.task} needs --model DIR: the built-in tiny model's character tokenizer knows only the arithmetic alphabet")
        self.rewards = RewardRunner(self.task, cfg.reward_timeout_s)
        """Scores every completion in a child process, each call bounded by ``reward_timeout_s``."""
        self.evaluator: Evaluator | None = None
        self.eval_accuracy: dict[int, float] = {}
        """version -> held-out accuracy measured on it (``eval_every``)."""
        self.rng = random.Random(cfg.seed)
        self.problems: dict[str, Problem] = {}
        self.collected: dict[int, dict[str, AcceptedResult]] = {}
        self.batch_prompts: dict[int, list[tuple[str, bytes]]] = {}
        self.tau: dict[str, float] = {}
        self.completion_ms: list[float] = []
        self.states: dict[int, str] = {}
        self.logs: list[StepLog] = []
        self._counts = Collected()
        self.model_files: list[ModelFile] | None = None
        """The files under ``model/`` as version 0 lists them; every snapshot lists them again."""
        self.gen_of: dict[int, int] = {}
        """step -> the version its rollouts are generated on (b - K, or newer after a re-issue)."""

    @property
    def unreturned(self) -> int:
        """Prompts whose batch closed without their result (``min_batch_fraction`` < 1, a deadline)."""
        return self._counts.unreturned

    @property
    def accepted_twice(self) -> int:
        """Results collected for a prompt already collected (the ledger accepts once: stays 0)."""
        return self._counts.accepted_twice

    @property
    def accepted_wrong_version(self) -> int:
        """Results generated on another version than their batch's (stays 0)."""
        return self._counts.accepted_wrong_version

    # -- setup ------------------------------------------------------------------
    def setup(self) -> None:
        """A fresh run: warm start, v0, the first batches, the first checkpoint."""
        if scan_versions(self.store).latest is not None:
            raise ConfigError(f"{self.store.url} already holds versions of a run: pass --resume to continue it, or use a fresh run root")
        self._check_redis()
        # A fresh run root; a Redis that still holds an epoch for this run name (an older run
        # of the same name) is outranked, not obeyed: this Trainer is the run now.
        self._enter_epoch((self.ledger.stored_epoch() or 0) + 1)
        t0 = time.perf_counter()
        self._build_model()
        warm = self.task.warm_start_problems(2000, seed=self.cfg.seed + 1) if self.model_dir is None else []
        if warm and self.cfg.warm_start_steps > 0:
            # The built-in model starts from random weights: a short supervised phase gives GRPO
            # some rewarded samples. A user's checkpoint is version 0 as it is.
            assert isinstance(self.tokenizer, CharTokenizer)
            rep = warm_start(self.model, self.tokenizer, warm, steps=self.cfg.warm_start_steps, seed=self.cfg.seed)
            log.info("warm start: %d steps in %.1fs, loss %.3f -> %.3f", rep.steps, rep.seconds, rep.first_loss, rep.last_loss)
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False) if self.cfg.kl_coef > 0 else None
        self._prepare_training()
        self.published = self._bf16_weights()
        self.versions_bf16: dict[int, dict[str, torch.Tensor]] = {0: self.published}
        self.model_files = self._write_model_description()
        self._forget_states()
        self.publisher = self._new_publisher()
        p = self.publisher.publish(self.published, producer=self._producer(0), owned=True)
        assert p is not None and p.version == 0
        self.states[0] = p.state
        self.full_bytes = p.bytes
        self._after_publish(0, p.state, "snapshot", p.bytes, p.weights_digest)
        metrics.active().published(0, "snapshot", p.bytes)
        log.info("v0 snapshot published (%d bytes) in %.1fs total setup", p.bytes, time.perf_counter() - t0)
        self._evaluate(0)
        self._wait_for_actors()
        for b in range(self.cfg.max_lag + 1):
            self._create_batch(b, 0)
        self._checkpoint(0)

    def _wait_for_actors(self) -> None:
        """Hold the first batch until ``min_actors`` Actors are alive (their engines may take minutes to start)."""
        want = self.cfg.min_actors
        if want <= 0:
            return
        t0 = time.perf_counter()
        said = 0.0
        while not self.stop.is_set():
            alive = sum(a.status == "alive" for a in self.ledger.actors())
            if alive >= want:
                log.info("%d Actor(s) alive after %.1fs: the first batch goes out", alive, time.perf_counter() - t0)
                return
            if time.perf_counter() - said >= self.cfg.progress_s:
                log.info("waiting for %d Actor(s) before the first batch (%d alive)", want, alive)
                said = time.perf_counter()
            self.clock.wait(self.stop, self.cfg.poll_s * 4)

    def _build_model(self) -> None:
        """The fp32 master: ``--model``'s checkpoint (its tokenizer with it), or the built-in tiny Qwen3."""
        md = self.model_dir
        if md is not None:
            self.model = load_pretrained(md.path, torch.float32)
            self.tokenizer = HFTokenizer.from_dir(md.path, model_vocab=int(self.model.config.vocab_size))
            log.info("model: %s (%s, %.1f M parameters), tokenizer of %d ids%s", md.path, md.family,
                     sum(p.numel() for p in self.model.parameters()) / 1e6, self.tokenizer.vocab_size,
                     ", chat template" if self.tokenizer.chat_template else "")
        else:
            self.model = tiny_qwen3(
                self.tokenizer.vocab_size, seed=self.cfg.seed, dtype=torch.float32, head_dim=self.cfg.head_dim,
                hidden=self.cfg.tiny_hidden, intermediate=self.cfg.tiny_intermediate,
            )
        if not self.ctx.sharded:
            torch.nn.Module.to(self.model, self.ctx.device)

    def _write_model_description(self) -> list[ModelFile]:
        """``model/`` in the run root: what an Actor builds the model and its tokenizer from (FORMAT.md §1)."""
        md = self.model_dir
        if md is not None:
            return write_model_description(self.store, md.files["config.json"], md.files.get("tokenizer.json"), md.files)
        assert isinstance(self.tokenizer, CharTokenizer)
        gen = self.model.generation_config.to_json_string().encode("utf-8")
        return write_model_description(self.store, self.model.config.to_json_string(), self.tokenizer.to_json(), {"generation_config.json": gen})

    def _evaluate(self, v: int) -> None:
        """Score the held-out set on version ``v`` when it is due (``eval_every``); recorded with ``v``."""
        every = self.cfg.eval_every
        if every <= 0 or v % every != 0 or not self.cfg.weight_transfer:
            return
        if self.evaluator is None:
            self.evaluator = Evaluator(
                self.task, self.tokenizer, self.rewards, self.behavior, self.cfg.eval_size, self.cfg.max_new_tokens, self.ctx.device,
            )
        res = self.evaluator.run(v, self.published)
        self.eval_accuracy[v] = res.accuracy
        metrics.active().evaluated(v, res.accuracy)
        log.info("eval v%d: accuracy %.3f on %d held-out problems (%.1fs)", v, res.accuracy, res.problems, res.seconds)
        self.redis_dep.call(lambda: res.record(self._raw_redis, self.keys), "record an evaluation", self.stop)
        try:
            self.store_dep.call(lambda: res.save(self._raw_store), "save an evaluation", self.stop)
        except Exception as e:  # noqa: BLE001 - the record in Redis is the one read; the object documents the run
            if not is_transient(e):
                raise
            log.warning("eval v%d: not saved to the store: %s", v, e)

    def _prepare_training(self) -> None:
        """After the master weights are final: the behaviour copy, sharding, the optimizer, the plan."""
        self.model.train()
        # The policy each batch was sampled from (bf16, as the Actors ran it),
        # kept for the two versions a batch can be generated on.
        self.behavior = copy.deepcopy(self.model).eval().requires_grad_(False)
        tied = is_tied(hf_weights(self.model))
        if self.ctx.sharded:
            torch.nn.Module.to(self.model, self.ctx.device)
            broadcast_module(self.model)
            shard_model(self.model, self.ctx)
        self.opt = self.cfg.make_optimizer(self.model.parameters())
        self._followers_joined = self.ctx.sharded
        # The plan describes what is shipped: the bf16 weights (the fp32 master is the Trainer's own).
        self.plan = fusion_plan_for({n: t.to(torch.bfloat16) for n, t in hf_weights(self.behavior).items()}, tied=tied)

    def _check_redis(self) -> None:
        """Refuse a Redis that may evict the ledger's keys (its message says how to fix it)."""
        if self.ledger.check_memory_policy() == "unknown":
            log.warning("Redis does not say its maxmemory-policy (INFO refused): make sure it is noeviction, or steps and leases may vanish")

    def _producer(self, step: int) -> dict[str, Any]:
        """``producer`` of the manifests this Trainer writes: the step and the epoch (FORMAT.md §4)."""
        return {"step": step, "epoch": self.epoch}

    # -- epochs: one Trainer at a time ---------------------------------------------
    def _enter_epoch(self, epoch: int) -> None:
        """Take ``epoch`` in Redis; a newer Trainer holding a higher one fences this one out."""
        self.ledger.enter_epoch(epoch)
        self.epoch = epoch
        # `aurora status` says whether the run is signed, and by which key (a resumed
        # Trainer may sign with a new one).
        self._hset(epoch=epoch, signed=int(self.signer is not None), key_id=self.signer.key_id if self.signer else "")

    def _check_epoch(self) -> None:
        """Before a write only the current Trainer may make: raise FencedOut if a newer one took over."""
        self.ledger.check_epoch(self.epoch)

    def _hset(self, **fields: Any) -> None:
        """Write fields of the Trainer's hash, fenced: a Trainer of an older epoch changes nothing."""
        self.ledger.fenced_hset(self.keys.trainer, fields, epoch=self.epoch)

    # -- checkpoint and resume ---------------------------------------------------------
    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.checkpoint_every
        return every > 0 and step % every == 0 and not self.ctx.sharded

    def _checkpoint(self, step: int) -> None:
        """Save what a restarted Trainer needs to run ``step`` next (docs/WORKERS.md)."""
        if not self._checkpoint_due(step):
            return
        t0 = time.perf_counter()
        tensors = {f"model.{n}": p.detach() for n, p in self.model.state_dict().items()}
        opt_t, opt_meta = optimizer_tensors(self.opt)
        tensors.update(opt_t)
        if self.reference is not None:
            tensors.update({f"reference.{n}": p.detach() for n, p in self.reference.state_dict().items()})
        tensors["rng.torch"] = torch.get_rng_state()
        meta = {
            "run": self.ep.run,
            "config": self._identity(),
            "optimizer": opt_meta,
            "lr": self.cfg.lr,
            "rng": _jsonable(self.rng.getstate()),
            "tau": self.tau,
            "completion_ms": self.completion_ms[-200:],
            "accepted_twice": self._counts.accepted_twice,
            "accepted_wrong_version": self._counts.accepted_wrong_version,
            "unreturned": self._counts.unreturned,
            "full_bytes": self.full_bytes,
        }
        nbytes = save_checkpoint(self.store, Checkpoint(step=step, epoch=self.epoch, tensors=tensors, meta=meta))
        gone = prune_checkpoints(self.store, self.cfg.keep_checkpoints)
        log.info("checkpoint before step %d: %d bytes in %.2fs%s", step, nbytes, time.perf_counter() - t0, f", pruned {gone}" if gone else "")

    def _identity(self) -> dict[str, Any]:
        """The knobs a resumed run must share with the one it continues."""
        c = self.cfg
        return {"seed": c.seed, "batch": c.batch, "group": c.group, "head_dim": c.head_dim, "max_lag": c.max_lag, "difficulty": c.difficulty, "transfer": c.transfer, "task": c.task,
                "model": self.model_dir.family if self.model_dir is not None else "built-in", "tiny": [c.tiny_hidden, c.tiny_intermediate]}

    def resume(self) -> int:
        """Continue the run in the store from its newest checkpoint; returns the step to run next.

        The master weights and optimizer come from the checkpoint; versions
        published after it already exist, so the next version is a delta
        against the newest committed one, materialized from the store (the
        chain neither forks nor gaps). Open steps are reused (their settled
        results count); missing ones are created again.
        """
        index = scan_versions(self.store)
        if index.latest is None:
            log.info("--resume: %s holds no version yet; starting a fresh run", self.store.url)
            self.setup()
            return 0
        ck = load_latest_checkpoint(self.store)
        if ck is None:
            raise ConfigError(f"{self.store.url} holds versions but no usable Trainer checkpoint: it cannot be resumed")
        if self.ctx.sharded:
            raise ConfigError("--resume with several processes (--nproc, torchrun) is not supported yet: resume with one process")
        made = dict(ck.meta.get("config") or {})
        made.setdefault("task", "arithmetic")  # checkpoints of releases before tasks were pluggable
        made.setdefault("model", "built-in")
        made.setdefault("tiny", [64, 192])
        if made != self._identity():
            raise ConfigError(f"--resume: the run was made with {made}, this Trainer has {self._identity()}; use the same settings")
        self._check_redis()
        head = index.latest
        manifest_epoch = max((self._manifest_epoch(v) for v in (head,) if v is not None), default=0)
        stored = self.ledger.stored_epoch() or 0
        self._enter_epoch(max(ck.epoch, manifest_epoch, stored) + 1)
        t0 = time.perf_counter()
        self._build_model()
        self.model.load_state_dict({n[len("model."):]: t for n, t in ck.tensors.items() if n.startswith("model.")})
        self.reference = None
        if self.cfg.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
            ref = {n[len("reference."):]: t for n, t in ck.tensors.items() if n.startswith("reference.")}
            if ref:
                self.reference.load_state_dict(ref)
        self._prepare_training()
        load_optimizer(self.opt, ck.tensors, ck.meta["optimizer"])
        if "rng.torch" in ck.tensors:
            torch.set_rng_state(ck.tensors["rng.torch"])
        self.rng.setstate(_tuples(ck.meta["rng"]))
        self.tau = {str(k): float(v) for k, v in dict(ck.meta.get("tau", {})).items()}
        self.completion_ms = [float(x) for x in ck.meta.get("completion_ms", [])]
        self._counts.accepted_twice = int(ck.meta.get("accepted_twice", 0))
        self._counts.accepted_wrong_version = int(ck.meta.get("accepted_wrong_version", 0))
        self._counts.unreturned = int(ck.meta.get("unreturned", 0))
        self.full_bytes = int(ck.meta.get("full_bytes", 0))
        # The versions batches still open were generated on, from the store.
        K = self.cfg.max_lag
        self.versions_bf16 = {}
        for v in range(max(0, head - K), head + 1):
            fused, state = materialize(self.store, v, self.cfg.streams)
            self.versions_bf16[v] = {n: t.to(torch.bfloat16) for n, t in unfuse_weights(fused, self.plan).items()}
            self.states[v] = state
        self.published = self.versions_bf16[head]
        listed, _ = model_files_listed(self.store)
        self.model_files = list(listed.values()) if listed is not None else None
        if head == ck.step and weights_digest(self._bf16_weights(), self.plan) != weights_digest(self.published, self.plan):
            raise ChainError(f"the checkpoint before step {ck.step} does not match version {head} in the store")
        self.resumed_from = ck.step
        self.publisher = self._new_publisher()
        self.publisher.continue_from(head, self.states[head], self.published, owned=True)
        self._after_publish(head, self.states[head], "delta" if head in index.deltas else "snapshot", 0)
        # Steps: reuse what the ledger still holds, create what it lost, drop what is done.
        for b in self.ledger.open_steps():
            if b < head:
                self.ledger.close_step(b, epoch=self.epoch)
        for b in range(head, min(head + K + 1, self.cfg.steps)):
            self.batch_prompts[b] = self._batch_prompts(b)
            self.collected.setdefault(b, {})
            held = self.ledger.step_version(b)
            if held is not None and held in self.versions_bf16:
                self.gen_of[b] = held  # still open: its settled results count
            else:
                # Lost, or closed by the Trainer that died: on the newest version,
                # which Actors may already hold (they never go back).
                if held is not None:
                    self.ledger.close_step(b, epoch=self.epoch)
                self._create_batch(b, head)
        if head >= 1:
            self.bus.announce(COMMIT, head)
            self._hset(commit=head)
        log.info(
            "resumed epoch %d from the checkpoint before step %d; head v%d (%d version(s) since it) in %.1fs",
            self.epoch, ck.step, head, head - ck.step, time.perf_counter() - t0,
        )
        return head

    def _manifest_epoch(self, v: int) -> int:
        for kind in ("delta", "snapshot"):
            try:
                return int(read_manifest(self.store, kind, v).producer.get("epoch", 0) or 0)
            except Exception:  # noqa: BLE001 - a version of the other kind, or an old manifest without an epoch
                continue
        return 0

    def _pub_cfg(self) -> PublishConfig:
        return self.cfg.publish_config()

    def _bf16_weights(self) -> dict[str, torch.Tensor]:
        """The bf16 rounding of the master weights, in host memory (gathered one parameter at a time when sharded)."""
        return gather_bf16(list(self.model.named_parameters(remove_duplicate=False)), self.ctx)

    def _forget_states(self) -> None:
        """A fresh run: expected states an older run of this name left in Redis are not ours."""
        key = self.keys.trainer_states
        self.redis_dep.call(lambda: self._raw_redis.delete(key, self.keys.index(key)), "clear expected states", self.stop)

    def _after_publish(self, v: int, state: str, kind: str, nbytes: int, digest: str | None = None) -> None:
        digest = digest or weights_digest(self.published, self.plan)
        # On the raw client inside the outage guard: record_digest runs a script, which a
        # riding proxy's register_script would hand back unguarded.
        self.redis_dep.call(lambda: record_digest(self._raw_redis, self.keys, "trainer", v, digest), "record a digest", self.stop)
        # The state Actors must reach at v, before the head names v: an Actor refuses
        # to activate a version whose manifest says otherwise (a forged chain).
        self.redis_dep.call(lambda: record_expected_state(self._raw_redis, self.keys, v, state), "record an expected state", self.stop)
        self._hset(head=v, head_state=state, published_ms=int(time.time() * 1000), status="running")
        self.bus.announce(VERSION, v, kind=kind, state=state, bytes=nbytes)

    # -- batches ------------------------------------------------------------------
    def _batch_prompts(self, b: int) -> list[tuple[str, bytes]]:
        """(prompt id, payload) of batch ``b``; the answers stay here."""
        prompts, problems = batch_prompts(b, self.cfg.batch, self.cfg.seed, self.task, self.tokenizer, self.cfg.max_new_tokens)
        self.problems.update(problems)
        return prompts

    def _create_batch(self, b: int, gen_version: int) -> tuple[list[str], list[str]]:
        prompts = self._batch_prompts(b)
        self.batch_prompts[b] = prompts
        views = actor_views(self.ledger.actors(), self.tau, self.cfg.scheduler.initial_tau)
        plan = plan_batch(views, gen_version, len(prompts), self.cfg.scheduler)
        quotas = plan.quotas if plan else {}
        if plan:
            for a in plan.eligibility.excluded:
                self.tau[a] = plan.taus[a]
                self.ledger.set_tau(a, plan.taus[a])
        self.ledger.create_step(
            b, self.states[gen_version], prompts, quotas, self.cfg.group, step_lease_ms(self.completion_ms, self.cfg.scheduler), version=gen_version,
            epoch=self.epoch,
        )
        self.gen_of[b] = gen_version
        self.collected.setdefault(b, {})
        self._hset(step=b)
        return (list(plan.eligibility.eligible) if plan else [], list(plan.eligibility.excluded) if plan else [])

    def _recreate_batch(self, b: int) -> None:
        """Redis lost step ``b``: issue it again, on the newest version.

        The Actors may have moved past the version it was generated on (with
        no open step holding them there, they activate what was committed),
        and an Actor never goes back: a step on an older version would be
        stranded. On the same version the prompts already collected stay;
        on a newer one they are dropped too (a batch is trained against one
        behaviour policy) and every prompt is offered again.
        """
        gen = self._newest_version()
        if gen != self.gen_of[b]:
            log.warning("step %d: ledger lost; re-creating all %d prompt(s) on v%d (was v%d)", b, len(self.batch_prompts[b]), gen, self.gen_of[b])
            self.collected[b].clear()
            left = self.batch_prompts[b]
        else:
            left = [(pid, body) for pid, body in self.batch_prompts[b] if pid not in self.collected[b]]
            log.warning("step %d: ledger lost; re-creating %d uncollected prompt(s)", b, len(left))
        self._enter_epoch(self.epoch)  # the fence went with the rest of Redis's data
        self.gen_of[b] = gen
        self.ledger.create_step(
            b, self.states[gen], left, {}, self.cfg.group, step_lease_ms(self.completion_ms, self.cfg.scheduler), version=gen, epoch=self.epoch
        )
        raise _Reissued(b)

    def _newest_version(self) -> int:
        """The newest version this Trainer published (0 when versions are not shipped)."""
        return max(self.states) if self.cfg.weight_transfer else 0

    def _wait_batch(self, b: int) -> None:
        while True:
            try:
                collect_batch(
                    self.ledger, b, self.gen_of[b], len(self.batch_prompts[b]), self.collected[b], self.completion_ms, self._counts,
                    int(self.cfg.heartbeat_timeout_s * 1000), self.cfg.progress_s, self.cfg.poll_s, self.stop, self.clock,
                    lambda: self._recreate_batch(b),
                    batch_deadline_s=self.cfg.batch_deadline_s, min_batch_fraction=self.cfg.min_batch_fraction, epoch=self.epoch,
                )
                return
            except _Reissued:
                continue

    # -- GRPO -------------------------------------------------------------------------
    def _rollouts(self, b: int) -> RolloutTuple:
        r = read_rollouts(self.collected[b], self.problems, self.tokenizer, self.cfg.group, self.cfg.max_new_tokens, self.rewards)
        self._update_tau(r.gen_tokens, r.gen_s)
        return r.prompts, r.completions, r.rewards, r.groups, r.tokens, r.by_actor, r.bad

    def _update_tau(self, gen_tok: Mapping[str, int], gen_s: Mapping[str, float]) -> None:
        """Throughput estimates: tokens/s each Actor reported for its own generation."""
        for a, n in gen_tok.items():
            self.tau[a] = updated_tau(self.tau.get(a), n / gen_s[a], self.cfg.scheduler)
            self.ledger.set_tau(a, self.tau[a])

    def _behavior_logprobs(self, gen_version: int, packed: Any) -> torch.Tensor:
        """Log-probs under the weights that generated the batch: version ``gen_version`` in bf16."""
        return behavior_logprobs(self.behavior, self.versions_bf16[gen_version], packed)

    def _grpo_batch(self, prompts: list[list[int]], comps: list[list[int]], rewards: list[float], gen_version: int) -> GrpoBatch | None:
        """Advantages and the fixed log-probabilities of a batch; None when no group has any signal."""
        return grpo_batch(
            prompts, comps, rewards, self.cfg.group, self.tokenizer.pad_id, self.behavior,
            self.versions_bf16[gen_version], self.reference,
        )

    def _grpo(self, prompts: list[list[int]], comps: list[list[int]], rewards: list[float], gen_version: int) -> None:
        batch = self._grpo_batch(prompts, comps, rewards, gen_version)
        if self.ctx.sharded:
            exchange(("train", batch) if batch is not None else ("skip", None), self.ctx)
        if batch is not None:
            grpo_epochs(self.model, self.opt, batch, self.ctx, self.cfg.epochs, self.cfg.clip, self.cfg.kl_coef, logprobs)

    # -- the loop ---------------------------------------------------------------------
    def train_step(self, b: int) -> StepLog:
        t0 = time.perf_counter()
        twice0, wrong0 = self._counts.accepted_twice, self._counts.accepted_wrong_version
        self._wait_batch(b)
        crash_point("closed", b + 1)
        gen_version = self.gen_of[b]
        t_wait = time.perf_counter() - t0
        prompts, comps, rewards, _, tokens, by_actor, bad = self._rollouts(b)
        t1 = time.perf_counter()
        self._grpo(prompts, comps, rewards, gen_version)
        t_train = time.perf_counter() - t1
        v = b + 1
        new = self._bf16_weights()
        t2 = time.perf_counter()
        delta_bytes = changed = 0
        if self.cfg.weight_transfer:
            delta_bytes, changed = self._publish_version(v, b, new)
        t_pub = time.perf_counter() - t2
        eligible: list[str] = []
        excluded: list[str] = []
        # Batch v + K is the first one generated on version v (lag bound K).
        if v + self.cfg.max_lag < self.cfg.steps:
            eligible, excluded = self._create_batch(v + self.cfg.max_lag, v if self.cfg.weight_transfer else 0)
        if self.cfg.weight_transfer:
            self.bus.announce(COMMIT, v)
            # Also in the Trainer's hash: an Actor following a Relay's stream
            # that went silent (the Relay died) still learns of the Commit.
            self._hset(commit=v)
        step_s = time.perf_counter() - t0
        entry = StepLog(
            step=b, version=v, gen_version=gen_version, reward=sum(rewards) / max(1, len(rewards)), wait_s=t_wait, train_s=t_train,
            extract_publish_s=t_pub, step_s=step_s, delta_bytes=delta_bytes, full_bytes=self.full_bytes, changed=changed,
            tokens=tokens, tokens_per_s=tokens / max(1e-9, step_s), eligible=eligible, excluded=excluded, by_actor=by_actor, rejected_payloads=bad,
            elements=sum(spec.numel for spec in self.plan.specs().values()),
        )
        self.logs.append(entry)
        metrics.active().trainer_step(entry)
        log.info(
            "step %d -> v%d: reward %.3f, %d tokens (%.0f tok/s), wait %.2fs train %.2fs extract+publish %.2fs, delta %d B (%.1f%% of full), eligible %s excluded %s",
            b, v, entry.reward, tokens, entry.tokens_per_s, t_wait, t_train, t_pub, delta_bytes, 100 * delta_bytes / max(1, self.full_bytes), eligible, excluded,
        )
        self._log_step_json(b, v, gen_version, twice0, wrong0)
        self._evaluate(v)
        save_step_metrics(self._raw_store, self.store_dep, self.stop, entry, self.eval_accuracy.get(v))
        if self.on_step:
            self.on_step(entry)
        self._checkpoint(v)
        return entry

    def _log_step_json(self, b: int, v: int, gen_version: int, twice0: int, wrong0: int) -> None:
        """One machine-readable line per published version (``step-json {…}``): what the
        step trained on, prompt by prompt, for audits and ``aurora bench chaos``."""
        results = self.collected.get(b, {})
        ids = [pid for pid, _ in self.batch_prompts.get(b, [])]
        log.info("step-json %s", json.dumps({
            "step": b, "version": v, "epoch": self.epoch, "gen_version": gen_version, "state": self.states.get(v),
            "published_ms": int(time.time() * 1000), "prompts": ids,
            "used": [[r.prompt, r.actor, r.token, r.version, r.state] for r in results.values()],
            "unreturned": [pid for pid in ids if pid not in results],
            "accepted_twice": self._counts.accepted_twice - twice0,
            "accepted_wrong_version": self._counts.accepted_wrong_version - wrong0,
        }, separators=(",", ":")))

    def _new_publisher(self) -> Publisher:
        """The public API's Publisher over this Trainer's store, stream, signer and commit mode.

        It extracts, encodes, uploads and announces each segment; the Trainer
        records digests, states and the head itself (fenced by its epoch) and
        announces versions once their next batch exists.
        """
        snap = self.cfg.snapshot_every if self.cfg.transfer == "delta" else 0
        return Publisher(
            self.store, run=self.ep.run, bus=self.bus, signer=self.signer, model_files=self.model_files, commit=self._commit, prepared=True,
            plan=self.plan, snapshot_every=snap, config=self._pub_cfg(), on_segment=lambda ev: crash_point("segment", ev.version),
        )

    def _publish_version(self, v: int, b: int, new: dict[str, torch.Tensor]) -> tuple[int, int]:
        """Ship version ``v`` as ``cfg.transfer`` says; returns (bytes written, changed elements).

        Only the Trainer of the current epoch publishes: the fence is checked
        first, and a manifest already at ``v`` with other bytes (a newer
        Trainer got there first) fences this one out too.
        """
        self._check_epoch()
        digest = weights_digest(new, self.plan)
        snap_bytes = 0
        try:
            if self.cfg.transfer == "delta":
                # The delta carries the digest of the weights it makes (FORMAT.md §4.1), which
                # binds a snapshot at the same version (every snapshot_every) to the chain.
                p = self.publisher.publish(new, producer=self._producer(b), owned=True)
                assert p is not None and p.version == v, (p, v)
                out = Published(p.state, "delta", p.bytes - p.snapshot_bytes, p.changed)
                snap_bytes = p.snapshot_bytes if p.snapshot else -1
            else:  # the broadcast baselines of `aurora bench wan`
                out = publish_version(
                    self.store, self.ep.run, v, b, self.cfg.transfer, self.plan, self.published, new, self.states[v - 1],
                    self._pub_cfg(), self.bus, self._snapshot_tensors, producer=self._producer(b), weights_digest=digest,
                    signer=self.signer, commit=self._commit,
                )
        except VersionConflict as e:
            raise FencedOut(f"version {v} was published by another Trainer; this one (epoch {self.epoch}) stops: {e}") from e
        crash_point("manifest", v)
        self.published = new
        self.versions_bf16[v] = new
        self.versions_bf16.pop(v - 2, None)
        self.states[v] = out.state
        self._after_publish(v, out.state, out.kind, out.nbytes, digest)
        metrics.active().published(v, out.kind, out.nbytes)
        if snap_bytes >= 0 and self.cfg.transfer == "delta":
            metrics.active().published(v, "snapshot", snap_bytes)
            self._retain()
        return out.nbytes, out.changed

    def _snapshot_tensors(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full weights under fused names, as a snapshot holds them."""
        return fuse_weights(weights, self.plan)

    def _retain(self) -> None:
        """Retention after a snapshot: keep the newest ``keep_snapshots`` and everything after the
        oldest of them, and whatever live Actors and Relays hold or stage (read from Redis first).

        Best effort: with Redis or the store away the round is skipped (never a partial
        view of who holds what), and the next snapshot tries again.
        """
        if self.cfg.keep_snapshots <= 0:
            return
        held = run_held_versions(self._raw_redis, self.ep.run, int(self.cfg.heartbeat_timeout_s * 1000))
        try:
            plan = retain(self._raw_store, self.cfg.keep_snapshots, held)
        except Exception as e:  # noqa: BLE001 - sorted right below
            if not is_transient(e):
                raise
            log.warning("retention skipped this round: %s", e)
            return
        if plan.versions or plan.orphans:
            log.info("retention: %s", plan.summary())

    def _prepare_commit(self) -> None:
        """Before the first publish: know how this store commits (FORMAT.md §1).

        ``commit_via="store"`` probes that the store honours create-only writes
        and refuses one that does not (one line naming the way out);
        ``"redis"`` checks that Redis persists its data, puts the run in
        Redis-commit mode and completes manifests whose write was lost.
        """
        self._commit = self.redis_dep.call(
            lambda: prepare_commit(self._raw_store, self._raw_redis, self.ep.run, self.cfg.commit_via), "prepare the commit mode", self.stop
        )

    def run(self) -> list[StepLog]:
        try:
            if self.cfg.weight_transfer and self.cfg.transfer != "none":
                self._prepare_commit()
            start = self.resume() if self.cfg.resume else 0
            if not self.cfg.resume:
                self.setup()
            for b in range(start, self.cfg.steps):
                if self.stop.is_set():
                    break
                self.train_step(b)
        finally:
            self.rewards.close()
            # Only once the other ranks wait for messages: before that they wait
            # in another collective and a message would not match it.
            if getattr(self, "_followers_joined", False):
                exchange(("stop", None), self.ctx)
        self._hset(status="done")
        return self.logs


class _Reissued(Exception):  # noqa: N818 - control flow inside the Trainer, never raised to a caller
    """A lost step was issued again (perhaps on another version): collect it afresh."""


def _device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available to this torch ({torch.__version__}); use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    return dev


def _jsonable(x: Any) -> Any:
    """Tuples as lists, recursively (``random.Random.getstate()`` for JSON)."""
    return [_jsonable(i) for i in x] if isinstance(x, (tuple, list)) else x


def _tuples(x: Any) -> Any:
    """The inverse of :func:`_jsonable` for ``random.Random.setstate``."""
    return tuple(_tuples(i) for i in x) if isinstance(x, list) else x


def follow(cfg: TrainerConfig, ctx: DistContext) -> int:
    """A rank > 0 of a sharded Trainer: hold a shard, run each update rank 0 sends, join each gather.

    Returns the number of updates taken part in. The model is built like
    rank 0's and then overwritten by rank 0's warm-started weights, so every
    rank starts from the same parameters without a file in between.
    """
    if ctx.leader:
        raise ValueError("rank 0 runs the Trainer, not follow()")
    if cfg.model:
        model = load_pretrained(read_model_dir(cfg.model).path, torch.float32)
    else:
        model = tiny_qwen3(
            CharTokenizer().vocab_size, seed=cfg.seed, dtype=torch.float32, head_dim=cfg.head_dim, hidden=cfg.tiny_hidden, intermediate=cfg.tiny_intermediate,
        )
    torch.nn.Module.to(model, ctx.device)
    model.train()
    broadcast_module(model)
    shard_model(model, ctx)
    opt = cfg.make_optimizer(model.parameters())
    params = list(model.named_parameters(remove_duplicate=False))
    gather_bf16(params, ctx)  # v0
    updates = 0
    while True:
        kind, batch = exchange(None, ctx)
        if kind == "stop":
            return updates
        if kind == "train" and batch is not None:
            grpo_epochs(model, opt, batch, ctx, cfg.epochs, cfg.clip, cfg.kl_coef, logprobs)
            updates += 1
        gather_bf16(params, ctx)
