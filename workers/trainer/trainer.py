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
the Trainer described here, the other ranks follow it (workers/fsdp.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from aurora_store.codec.entries import EncodeOptions
from aurora_store.codec.extract import extract
from aurora_store.coordination.bus import COMMIT, SEGMENT, VERSION, Bus
from aurora_store.coordination.ledger import AcceptedResult, Ledger, LedgerLost
from aurora_store.coordination.redisconn import connect
from aurora_store.coordination.scheduler import ActorView, SchedulerConfig, ema, lease_ms, plan_step
from aurora_store.lineage.fetch import scan_versions
from aurora_store.lineage.publish import (
    PublishConfig,
    SegmentEvent,
    publish_delta,
    publish_snapshot,
)
from aurora_store.storage.store import Store, open_store
from workers.common import Endpoints, RunKeys, record_digest, write_model_description
from workers.model import (
    fused_weights,
    fusion_plan_for,
    hf_weights,
    is_tied,
    logprobs,
    pack_completions,
    tiny_qwen3,
    warm_start,
)
from workers.task import Problem, make_problems, reward
from workers.tokenizer import CharTokenizer
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

__all__ = ["TrainerConfig", "StepLog", "Trainer", "add_arguments", "main"]

log = logging.getLogger("aurora.trainer")


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    """Knobs of a training run (defaults: the CPU demo)."""

    steps: int = 20
    """Optimizer steps (versions published after v0)."""
    batch: int = 32
    """Prompts per batch."""
    group: int = 8
    """Completions per prompt (GRPO group)."""
    max_new_tokens: int = 14
    lr: float = 1e-3
    clip: float = 0.2
    """PPO-style ratio clip."""
    epochs: int = 4
    """Passes over each batch (the ratio moves away from 1 after the first)."""
    kl_coef: float = 0.0
    """Weight of the KL to the warm-started reference (0: no reference kept)."""
    snapshot_every: int = 10
    """Write a full snapshot every N versions (late joiners start there)."""
    warm_start_steps: int = 85
    """Supervised steps before RL: enough for some rewarded samples (about 10% here), not more."""
    difficulty: int = 1
    head_dim: int = 16
    """Attention head size of the tiny policy model; vLLM's CPU attention needs >= 32 (``aurora demo --engine vllm``)."""
    seed: int = 0
    streams: int = 8
    segment_bytes: int = 1 << 20
    heartbeat_timeout_s: float = 8.0
    """An Actor silent this long is marked gone and its work released."""
    wait_timeout_s: float = 300.0
    """Give up on a batch nobody finishes."""
    weight_transfer: bool = True
    """False: the "ideal" baseline of ``aurora bench e2e``: versions are trained but never
    shipped, every batch is generated on v0, so the weight path costs nothing."""
    transfer: str = "delta"
    """How each version is shipped (``aurora bench wan`` baselines): ``delta`` (sparse delta,
    Aurora), ``full`` (a full snapshot every version), ``none`` (nothing moves: the version
    and its state are only announced; Actors of the synthetic workload advance for free)."""
    max_lag: int = 1
    """Lag bound K: batch b is generated on version max(0, b - K). 1 is one-step asynchrony;
    2 and 4 are the full-broadcast baselines that hide transfer behind K batches."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    options: EncodeOptions = field(default_factory=EncodeOptions)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.group < 2:
            raise ValueError("steps >= 1, batch >= 1 and group >= 2 are required (GRPO needs a group)")
        if self.transfer not in ("delta", "full", "none") or self.max_lag < 1:
            raise ValueError(f"transfer must be delta, full or none and max_lag >= 1 (got {self.transfer!r}, {self.max_lag})")


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


def unshipped_state(v: int) -> str:
    """``state`` of a version announced but never shipped (``transfer="none"``)."""
    import hashlib

    return "sha256:" + hashlib.sha256(f"unshipped:{v}".encode()).hexdigest()


class Trainer:
    """One training run against a store and a Redis ledger."""

    def __init__(
        self, ep: Endpoints, cfg: TrainerConfig, on_step: Callable[[StepLog], None] | None = None, ctx: DistContext = SINGLE
    ) -> None:
        if not ctx.leader:
            raise ValueError("the Trainer runs on rank 0; other ranks run follow()")
        self.ep = ep
        self.cfg = cfg
        self.ctx = ctx
        self.on_step = on_step
        self.store: Store = open_store(ep.store, dict(ep.storage_options))
        self.redis = connect(ep.redis)
        self.ledger = Ledger(self.redis, ep.run)
        self.bus = Bus(self.redis, ep.run)
        self.keys = RunKeys(ep.run)
        self.tokenizer = CharTokenizer()
        self.rng = random.Random(cfg.seed)
        self.problems: dict[str, Problem] = {}
        self.collected: dict[int, dict[str, AcceptedResult]] = {}
        self.batch_prompts: dict[int, list[tuple[str, bytes]]] = {}
        self.tau: dict[str, float] = {}
        self.completion_ms: list[float] = []
        self.states: dict[int, str] = {}
        self.logs: list[StepLog] = []
        self.stop = threading.Event()
        self.accepted_twice = 0
        self.accepted_wrong_version = 0

    # -- setup ------------------------------------------------------------------
    def setup(self) -> None:
        if scan_versions(self.store).latest is not None:
            raise RuntimeError(f"{self.store.url} already holds versions; resuming a run is not supported yet, use a fresh run root")
        t0 = time.perf_counter()
        self.model = tiny_qwen3(self.tokenizer.vocab_size, seed=self.cfg.seed, dtype=torch.float32, head_dim=self.cfg.head_dim)
        warm = make_problems(2000, seed=self.cfg.seed + 1, difficulty=self.cfg.difficulty)
        rep = warm_start(self.model, self.tokenizer, warm, steps=self.cfg.warm_start_steps, seed=self.cfg.seed)
        log.info("warm start: %d steps in %.1fs, loss %.3f -> %.3f", rep.steps, rep.seconds, rep.first_loss, rep.last_loss)
        self.model.train()
        import copy

        self.reference = None
        if self.cfg.kl_coef > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        # The policy each batch was sampled from (bf16, as the Actors ran it),
        # kept for the two versions a batch can be generated on.
        self.behavior = copy.deepcopy(self.model).eval().requires_grad_(False)
        tied = is_tied(hf_weights(self.model))
        if self.ctx.sharded:
            torch.nn.Module.to(self.model, self.ctx.device)
            broadcast_module(self.model)
            shard_model(self.model, self.ctx)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr, weight_decay=0.0)
        self.published = self._bf16_weights()
        self._followers_joined = self.ctx.sharded
        self.versions_bf16: dict[int, dict[str, torch.Tensor]] = {0: self.published}
        # The plan describes what is shipped: the bf16 weights (the fp32 master is the Trainer's own).
        self.plan = fusion_plan_for(self.published, tied=tied)
        write_model_description(self.store, self.model.config.to_json_string(), self.tokenizer.to_json())
        m = publish_snapshot(self.store, self.ep.run, 0, fused_weights(self.published, self.plan), None, self._pub_cfg())
        self.states[0] = m.state
        self.full_bytes = m.total_bytes
        self._after_publish(0, m.state, "snapshot", m.total_bytes)
        log.info("v0 snapshot published (%d bytes) in %.1fs total setup", m.total_bytes, time.perf_counter() - t0)
        for b in range(self.cfg.max_lag + 1):
            self._create_batch(b, 0)

    def _pub_cfg(self) -> PublishConfig:
        return PublishConfig(streams=self.cfg.streams, segment_bytes=self.cfg.segment_bytes, options=self.cfg.options)

    def _bf16_weights(self) -> dict[str, torch.Tensor]:
        """The bf16 rounding of the master weights, in host memory (gathered one parameter at a time when sharded)."""
        return gather_bf16(list(self.model.named_parameters(remove_duplicate=False)), self.ctx)

    def _after_publish(self, v: int, state: str, kind: str, nbytes: int) -> None:
        from aurora_store.apply.sink import weights_digest

        record_digest(self.redis, self.keys, "trainer", v, weights_digest(self.published, self.plan))
        self.redis.hset(self.keys.trainer, mapping={"head": v, "head_state": state, "published_ms": int(time.time() * 1000), "status": "running"})
        self.bus.announce(VERSION, v, kind=kind, state=state, bytes=nbytes)

    # -- batches ------------------------------------------------------------------
    def _actor_views(self) -> list[ActorView]:
        # An Actor nobody has measured yet starts at the median of the measured
        # ones: a newcomer gets a fair first share, and its own throughput
        # takes over after its first settlement.
        measured = sorted(self.tau.values())
        start = measured[len(measured) // 2] if measured else self.cfg.scheduler.initial_tau
        views = []
        for a in self.ledger.actors():
            tau = self.tau.get(a.actor, a.tau if a.tau > 0 else start)
            # A staged version is activated at the Actor's next safe point, which
            # comes as soon as its current batch is settled: count it as held.
            held = a.active if a.staged is None or a.active is None else max(a.active, a.staged)
            views.append(ActorView(a.actor, held, a.staged, tau, a.status == "alive"))
        return views

    def _batch_prompts(self, b: int) -> list[tuple[str, bytes]]:
        """(prompt id, payload) of batch ``b``; the answers stay here."""
        problems = make_problems(self.cfg.batch, seed=self.cfg.seed * 100_003 + b + 7, difficulty=self.cfg.difficulty)
        prompts = []
        for p in problems:
            pid = f"b{b}-{p.id}"
            self.problems[pid] = p
            body = {"id": pid, "text": p.prompt_text, "ids": self.tokenizer.encode(p.prompt_text, bos=True)}
            prompts.append((pid, json.dumps(body).encode()))
        return prompts

    def _create_batch(self, b: int, gen_version: int) -> tuple[list[str], list[str]]:
        prompts = self._batch_prompts(b)
        self.batch_prompts[b] = prompts
        views = self._actor_views()
        plan = plan_step(views, gen_version, len(prompts), self.cfg.scheduler, require_staged=False) if views else None
        quotas = plan.quotas if plan else {}
        if plan:
            for a in plan.eligibility.excluded:
                self.tau[a] = plan.taus[a]
                self.ledger.set_tau(a, plan.taus[a])
        self.ledger.create_step(
            b, self.states[gen_version], prompts, quotas, self.cfg.group, lease_ms(self.completion_ms[-200:], self.cfg.scheduler), version=gen_version
        )
        self.collected.setdefault(b, {})
        self.redis.hset(self.keys.trainer, "step", b)
        return (list(plan.eligibility.eligible) if plan else [], list(plan.eligibility.excluded) if plan else [])

    def _recreate_batch(self, b: int, gen_version: int) -> None:
        """Redis lost the step: re-issue only the prompts not collected yet."""
        left = [(pid, body) for pid, body in self.batch_prompts[b] if pid not in self.collected[b]]
        log.warning("step %d: ledger lost; re-creating %d uncollected prompt(s)", b, len(left))
        self.ledger.create_step(b, self.states[gen_version], left, {}, self.cfg.group, lease_ms(self.completion_ms[-200:], self.cfg.scheduler), version=gen_version)

    def _wait_batch(self, b: int, gen_version: int) -> None:
        deadline = time.monotonic() + self.cfg.wait_timeout_s
        pos = 0
        need = len(self.batch_prompts[b])
        while len(self.collected[b]) < need:
            if self.stop.is_set():
                raise KeyboardInterrupt
            try:
                for r in self.ledger.collect(b, pos):
                    pos += 1
                    # The ledger accepts once and only on the job's version; we check again.
                    if r.prompt in self.collected[b]:
                        self.accepted_twice += 1
                    elif r.version != gen_version:
                        self.accepted_wrong_version += 1
                    else:
                        self.collected[b][r.prompt] = r
                        self.completion_ms.append(max(1, r.settled_ms - r.leased_ms))
                self.ledger.reap(int(self.cfg.heartbeat_timeout_s * 1000))
            except LedgerLost:
                self._recreate_batch(b, gen_version)
                pos = 0
                continue
            if len(self.collected[b]) < need:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"batch {b}: {len(self.collected[b])}/{need} prompts after {self.cfg.wait_timeout_s}s; are Actors running?")
                time.sleep(0.05)

    # -- GRPO -------------------------------------------------------------------------
    def _rollouts(self, b: int) -> tuple[list[list[int]], list[list[int]], list[float], list[int], int, dict[str, int], int]:
        prompts: list[list[int]] = []
        comps: list[list[int]] = []
        rewards: list[float] = []
        groups: list[int] = []
        tokens = 0
        by_actor: dict[str, int] = {}
        bad = 0
        gen_s: dict[str, float] = {}
        gen_tok: dict[str, int] = {}
        for pid, r in sorted(self.collected[b].items()):
            prob = self.problems[pid]
            try:
                body = json.loads(r.payload)
                cs = [list(map(int, c)) for c in body["completions"]]
                if len(cs) != self.cfg.group or any(len(c) > self.cfg.max_new_tokens for c in cs):
                    raise ValueError("wrong group size or completion length")
                if any(not 0 <= t < self.tokenizer.vocab_size for c in cs for t in c):
                    raise ValueError("token id outside the vocabulary")
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            by_actor[r.actor] = by_actor.get(r.actor, 0) + 1
            n_tok = sum(len(c) for c in cs)
            tokens += n_tok
            gen_tok[r.actor] = gen_tok.get(r.actor, 0) + n_tok
            gen_s[r.actor] = gen_s.get(r.actor, 0.0) + max(1e-3, float(body.get("gen_s", 0.0)))
            ids = self.tokenizer.encode(prob.prompt_text, bos=True)
            groups.append(len(prompts))
            for c in cs:
                prompts.append(ids)
                comps.append(c if c else [self.tokenizer.eos_id])
                rewards.append(reward(self.tokenizer.decode(c), prob.answer))
        self._update_tau(gen_tok, gen_s)
        return prompts, comps, rewards, groups, tokens, by_actor, bad

    def _update_tau(self, gen_tok: Mapping[str, int], gen_s: Mapping[str, float]) -> None:
        """Throughput estimates: tokens/s each Actor reported for its own generation."""
        for a, n in gen_tok.items():
            observed = n / gen_s[a]
            prev = self.tau.get(a)
            self.tau[a] = observed if prev is None or prev <= self.cfg.scheduler.initial_tau else ema(prev, observed, self.cfg.scheduler.beta)
            self.ledger.set_tau(a, self.tau[a])

    def _behavior_logprobs(self, gen_version: int, packed: Any) -> torch.Tensor:
        """Log-probs under the weights that generated the batch: version ``gen_version`` in bf16.

        With one-step asynchrony the batch was sampled from an older policy
        than the one being trained; the clipped ratio must be taken against
        that behaviour policy, not against the current weights.
        """
        weights = self.versions_bf16[gen_version]
        with torch.no_grad():
            for name, t in hf_weights(self.behavior).items():
                t.copy_(weights[name].to(t.dtype))
            return logprobs(self.behavior, packed.input_ids, packed.attention_mask, packed.completion_mask, reduction="none")

    def _grpo_batch(self, prompts: list[list[int]], comps: list[list[int]], rewards: list[float], gen_version: int) -> GrpoBatch | None:
        """Advantages and the fixed log-probabilities of a batch; None when no group has any signal."""
        if not prompts:
            return None
        g = self.cfg.group
        r = torch.tensor(rewards, dtype=torch.float32).view(-1, g)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
        keep = adv.abs() > 1e-6
        if not bool(keep.any()):
            return None  # every group uniform: no signal this step
        idx = torch.nonzero(keep).view(-1).tolist()
        packed = pack_completions([prompts[i] for i in idx], [comps[i] for i in idx], self.tokenizer.pad_id)
        old = self._behavior_logprobs(gen_version, packed)
        with torch.no_grad():
            ref = logprobs(self.reference, *packed, reduction="none") if self.reference is not None else None
        return GrpoBatch(packed.input_ids, packed.attention_mask, packed.completion_mask, adv[idx], old, ref)

    def _grpo(self, prompts: list[list[int]], comps: list[list[int]], rewards: list[float], gen_version: int) -> None:
        batch = self._grpo_batch(prompts, comps, rewards, gen_version)
        if self.ctx.sharded:
            exchange(("train", batch) if batch is not None else ("skip", None), self.ctx)
        if batch is not None:
            grpo_epochs(self.model, self.opt, batch, self.ctx, self.cfg.epochs, self.cfg.clip, self.cfg.kl_coef, logprobs)

    # -- the loop ---------------------------------------------------------------------
    def train_step(self, b: int) -> StepLog:
        t0 = time.perf_counter()
        gen_version = max(0, b - self.cfg.max_lag) if self.cfg.weight_transfer else 0
        self._wait_batch(b, gen_version)
        t_wait = time.perf_counter() - t0
        prompts, comps, rewards, _, tokens, by_actor, bad = self._rollouts(b)
        self.ledger.close_step(b)
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
            self.redis.hset(self.keys.trainer, "commit", v)
        step_s = time.perf_counter() - t0
        entry = StepLog(
            step=b, version=v, gen_version=gen_version, reward=sum(rewards) / max(1, len(rewards)), wait_s=t_wait, train_s=t_train,
            extract_publish_s=t_pub, step_s=step_s, delta_bytes=delta_bytes, full_bytes=self.full_bytes, changed=changed,
            tokens=tokens, tokens_per_s=tokens / max(1e-9, step_s), eligible=eligible, excluded=excluded, by_actor=by_actor, rejected_payloads=bad,
        )
        self.logs.append(entry)
        log.info(
            "step %d -> v%d: reward %.3f, %d tokens (%.0f tok/s), wait %.2fs train %.2fs extract+publish %.2fs, delta %d B (%.1f%% of full), eligible %s excluded %s",
            b, v, entry.reward, tokens, entry.tokens_per_s, t_wait, t_train, t_pub, delta_bytes, 100 * delta_bytes / max(1, self.full_bytes), eligible, excluded,
        )
        if self.on_step:
            self.on_step(entry)
        return entry

    def _publish_version(self, v: int, b: int, new: dict[str, torch.Tensor]) -> tuple[int, int]:
        """Ship version ``v`` as ``cfg.transfer`` says; returns (bytes written, changed elements)."""

        def announce(ev: SegmentEvent) -> None:
            self.bus.announce(SEGMENT, ev.version, index=ev.index, key=ev.key, bytes=ev.bytes, sha256=ev.sha256)

        nbytes = changed = 0
        if self.cfg.transfer == "delta":
            m = publish_delta(self.store, self.ep.run, v, extract(self.plan, self.published, new), self.states[v - 1], self._pub_cfg(), on_segment=announce, producer={"step": b})
            state, kind, nbytes, changed = m.state, "delta", m.total_bytes, m.nnz
        elif self.cfg.transfer == "full":
            m = publish_snapshot(self.store, self.ep.run, v, self._snapshot_tensors(new), None, self._pub_cfg(), producer={"step": b})
            state, kind, nbytes = m.state, "snapshot", m.total_bytes
        else:
            # Nothing moves: the version exists only as an announcement.
            state, kind = unshipped_state(v), "none"
        self.published = new
        self.versions_bf16[v] = new
        self.versions_bf16.pop(v - 2, None)
        self.states[v] = state
        self._after_publish(v, state, kind, nbytes)
        if self.cfg.transfer == "delta" and self.cfg.snapshot_every and v % self.cfg.snapshot_every == 0:
            publish_snapshot(self.store, self.ep.run, v, self._snapshot_tensors(self.published), state, self._pub_cfg())
        return nbytes, changed

    def _snapshot_tensors(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full weights under fused names, as a snapshot holds them."""
        return fused_weights(weights, self.plan)

    def run(self) -> list[StepLog]:
        try:
            self.setup()
            for b in range(self.cfg.steps):
                if self.stop.is_set():
                    break
                self.train_step(b)
        finally:
            # Only once the other ranks wait for messages: before that they wait
            # in another collective and a message would not match it.
            if getattr(self, "_followers_joined", False):
                exchange(("stop", None), self.ctx)
        self.redis.hset(self.keys.trainer, "status", "done")
        return self.logs


def follow(cfg: TrainerConfig, ctx: DistContext) -> int:
    """A rank > 0 of a sharded Trainer: hold a shard, run each update rank 0 sends, join each gather.

    Returns the number of updates taken part in. The model is built like
    rank 0's and then overwritten by rank 0's warm-started weights, so every
    rank starts from the same parameters without a file in between.
    """
    if ctx.leader:
        raise ValueError("rank 0 runs the Trainer, not follow()")
    tokenizer = CharTokenizer()
    model = tiny_qwen3(tokenizer.vocab_size, seed=cfg.seed, dtype=torch.float32, head_dim=cfg.head_dim)
    torch.nn.Module.to(model, ctx.device)
    model.train()
    broadcast_module(model)
    shard_model(model, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, metavar="URL", help="run root (s3://bucket/prefix/run, file:///path)")
    p.add_argument("--redis", required=True, metavar="URL", help="redis://[user:password@]host:port/db or rediss://")
    p.add_argument("--run", required=True, metavar="NAME", help="run name (Redis namespace)")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE")
    d = TrainerConfig()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch, help="prompts per step")
    p.add_argument("--group", type=int, default=d.group, help="completions per prompt")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--kl-coef", type=float, default=d.kl_coef)
    p.add_argument("--snapshot-every", type=int, default=d.snapshot_every)
    p.add_argument("--streams", type=int, default=d.streams)
    p.add_argument("--seed", type=int, default=d.seed)
    from aurora_tools.synthetic.workload import add_trainer_arguments

    add_trainer_arguments(p)
    p.add_argument(
        "--nproc", type=int, default=1, metavar="N",
        help="train with N processes sharding the weights with FSDP2 (one per GPU; gloo on CPU). "
        "Under torchrun (WORLD_SIZE set) this is ignored: torchrun made the processes",
    )


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    return TrainerConfig(
        steps=args.steps, batch=args.batch, group=args.group, lr=args.lr, kl_coef=args.kl_coef,
        snapshot_every=args.snapshot_every, streams=args.streams, seed=args.seed,
    )


def _spawned_rank(rank: int, world: int, port: int, args: argparse.Namespace, storage_options: Mapping[str, Any]) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rc = main(args, storage_options)
    if rc:
        raise SystemExit(rc)


def main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    import os

    if getattr(args, "workload", "grpo") == "synthetic":
        from aurora_tools.synthetic.workload import trainer_main

        return trainer_main(args, storage_options)
    from workers.common import install_stop_handlers, limit_torch_threads, setup_logging
    from workers.trainer.fsdp import init_from_env

    nproc = getattr(args, "nproc", 1)
    if nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {nproc}")
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # The parsed arguments travel to the new processes: only plain values pickle.
        plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
        mp.spawn(_spawned_rank, args=(nproc, port, plain, dict(storage_options)), nprocs=nproc)
        return 0
    ctx = init_from_env()
    setup_logging("trainer" if ctx.leader else f"trainer-rank{ctx.rank}")
    limit_torch_threads()
    if not ctx.leader:
        n = follow(config_from_args(args), ctx)
        log.info("rank %d: %d updates, done", ctx.rank, n)
        return 0
    tr = Trainer(Endpoints(args.store, args.redis, args.run, storage_options), config_from_args(args), ctx=ctx)
    install_stop_handlers(tr.stop)
    try:
        logs = tr.run()
    except KeyboardInterrupt:
        log.info("stopped")
        return 130
    if logs:
        log.info("done: reward %.3f -> %.3f over %d steps", logs[0].reward, logs[-1].reward, len(logs))
    return 0

