"""The synthetic workload's Trainer: the real Trainer, with a sparse update on real bf16 weights instead of training.

:class:`SyntheticWorkload` is the Trainer's step source and weights source
(:mod:`workers.trainer.sources`): a seeded base every Actor builds itself is
version 0, each step changes ``density`` of its elements and waits out the
simulated training time. Everything else (epochs, batches and their
scheduling, settlement, extraction, publishing, the run's records,
announcements) is :class:`~workers.trainer.trainer.Trainer`'s own code.
:class:`WanRecorder` keeps when each version was shipped for ``aurora bench wan``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from aurora_store.codec.fusion import FusionPlan
from aurora_store.coordination.ledger import AcceptedResult
from aurora_store.storage import Store
from aurora_tools.synthetic.shapes import shape_for_params
from aurora_tools.synthetic.workload import (
    PAPER_GEN_WINDOW_S,
    PAPER_PARAMS,
    SyntheticSpec,
    base_weights,
    default_gen_s_per_prompt,
    sparse_update,
    wan_key,
)
from workers.common import Endpoints
from workers.trainer import TrainerConfig
from workers.trainer.sources import FirstVersion, Rollouts
from workers.trainer.trainer import StepLog, Trainer
from workers.trainer.versions import VersionEvent

__all__ = ["SyntheticTrainerOptions", "SyntheticWorkload", "WanRecorder", "synthetic_trainer", "trainer_main"]

log = logging.getLogger("aurora.synthetic")


@dataclass(frozen=True, slots=True)
class SyntheticTrainerOptions:
    train_s: float = 0.0
    """Simulated training time per step (the sparse update's own time counts towards it)."""
    digests: bool = False
    """Kept for the command line: the Trainer records the digest of every version it publishes."""
    shard_bytes: int = 64 << 20
    """Snapshot shard size (``full`` transfer)."""
    keep_snapshots: int = 6
    """``full`` transfer: snapshots older than this many versions are deleted (memory of the S3 server)."""


class SyntheticWorkload:
    """The synthetic model's weights and steps (see the module's docstring); ``stop`` ends a simulated step early."""

    def __init__(self, spec: SyntheticSpec, transfer: str, batch: int, train_s: float, stop: threading.Event) -> None:
        self.spec = spec
        self.transfer = transfer
        self.batch = batch
        self.train_s = train_s
        self.stop = stop
        self._buffers: list[dict[str, torch.Tensor]] = []
        """Deltas: two buffers, the newest version and the one being made (extraction compares them)."""
        self._current: dict[str, torch.Tensor] = {}
        """The newest weights (the base until the first step)."""
        self._made = 0
        """Versions made so far."""

    def first_version(self, store: Store) -> FirstVersion:
        """The seeded base every Actor builds (nothing of it is written but the description)."""
        from aurora_store.codec.extract import plan_of
        from aurora_store.codec.kernels import warm_up
        from workers.common import write_model_description

        warm_up()
        w = base_weights(self.spec.shape, self.spec.seed)
        self._buffers, self._current = [w], w
        plan: FusionPlan = plan_of(w, self.spec.shape.tied)
        write_model_description(store, self.spec.to_json(), "{}")
        log.info("synthetic base: %.3g params", self.spec.params)
        return FirstVersion(w, plan, None, base_state=self.spec.base_state)

    def prompts(self, step: int) -> list[tuple[str, bytes]]:
        return [(f"b{step}-{i}", json.dumps({"id": f"b{step}-{i}", "ids": [1, 2, 3]}).encode()) for i in range(self.batch)]

    def rollouts(self, results: Mapping[str, AcceptedResult]) -> Rollouts:
        """Tokens and generation time each Actor reports (there is nothing to reward)."""
        out = Rollouts()
        for r in results.values():
            try:
                body = json.loads(r.payload)
                n = int(body["new_tokens"])
                gen_s = max(1e-3, float(body.get("gen_s", 0.0)))
            except (ValueError, KeyError, TypeError):
                out.bad += 1
                continue
            out.by_actor[r.actor] = out.by_actor.get(r.actor, 0) + 1
            out.tokens += n
            out.gen_tokens[r.actor] = out.gen_tokens.get(r.actor, 0) + n
            out.gen_s[r.actor] = out.gen_s.get(r.actor, 0.0) + gen_s
        return out

    def train(self, rollouts: Rollouts, behaviour: Mapping[str, torch.Tensor]) -> None:
        """The simulated optimizer step: a sparse update of a copy (delta) or in place, then wait out ``train_s``."""
        t0 = time.perf_counter()
        v = self._made + 1
        if self.transfer == "delta":
            if len(self._buffers) == 1:
                self._buffers.append({n: x.clone() for n, x in self._current.items()})
            new = self._buffers[1] if self._buffers[0] is self._current else self._buffers[0]
            for n, x in new.items():
                x.copy_(self._current[n])
        else:
            new = self._current
        sparse_update(new, self.spec.density, self.spec.seed, v)
        self._current, self._made = new, v
        left = self.train_s - (time.perf_counter() - t0)
        if left > 0:
            self.stop.wait(left)

    def weights(self) -> dict[str, torch.Tensor]:
        return self._current


class WanRecorder:
    """Keeps when each version was shipped (``wan:published``); with ``full`` transfer, drops old snapshots.

    ``aurora bench wan`` runs an S3 server in memory: a run of full
    snapshots would fill it, so versions older than ``keep_snapshots`` go.
    """

    def __init__(self, redis: Any, run: str, store: Store, transfer: str, keep_snapshots: int) -> None:
        self.redis = redis
        self.run = run
        self.store = store
        self.transfer = transfer
        self.keep_snapshots = keep_snapshots

    def __call__(self, ev: VersionEvent) -> None:
        body = {"start_ms": ev.started_ms, "end_ms": ev.recorded_ms, "bytes": ev.nbytes, "kind": ev.kind}
        self.redis.hset(wan_key(self.run, "published"), str(ev.version), json.dumps(body))
        if self.transfer == "full" and ev.version > 0:
            self._drop_snapshots_before(ev.version - self.keep_snapshots + 1)

    def _drop_snapshots_before(self, oldest_kept: int) -> None:
        from aurora_store.format.manifest import manifest_key, version_dir

        for v in range(max(1, oldest_kept - 2), oldest_kept):
            keys = self.store.list(version_dir("snapshot", v))
            man = manifest_key("snapshot", v)
            for k in sorted(keys, key=lambda k: k != man):  # the manifest first: the version disappears before its objects
                self.store.delete(k)


def synthetic_trainer(
    ep: Endpoints,
    cfg: TrainerConfig,
    spec: SyntheticSpec,
    opts: SyntheticTrainerOptions | None = None,
    on_step: Callable[[StepLog], None] | None = None,
) -> Trainer:
    """The real :class:`~workers.trainer.trainer.Trainer` running the synthetic workload (``run()`` it)."""
    from aurora_store.coordination.redisconn import connect
    from aurora_store.storage import open_store

    opts = opts or SyntheticTrainerOptions()
    stop = threading.Event()
    work = SyntheticWorkload(spec, cfg.transfer, cfg.batch, opts.train_s, stop)
    recorder = WanRecorder(connect(ep.redis), ep.run, open_store(ep.store, dict(ep.storage_options)), cfg.transfer, opts.keep_snapshots)
    return Trainer(
        ep,
        cfg,
        on_step,
        steps=work,
        weights=work,
        publish_config=cfg.publish_config(shard_bytes=opts.shard_bytes),
        on_version=recorder,
        stop=stop,
    )


def trainer_main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    """``aurora bench synthetic-trainer``: the synthetic Trainer of ``aurora bench wan`` from its options, run to the end."""
    from aurora_store.coordination.redisconn import connect
    from aurora_tools.synthetic.args import synthetic_trainer_config
    from workers.common import Endpoints
    from workers.process import install_stop_handlers, limit_torch_threads, setup_logging

    setup_logging("trainer")
    limit_torch_threads()
    # The Trainer's options as `aurora trainer` resolves them; no held-out evaluation (no task to score).
    cfg = synthetic_trainer_config(args)
    shape = shape_for_params(args.params)
    per_prompt = args.gen_s_per_prompt if args.gen_s_per_prompt is not None else default_gen_s_per_prompt(shape.params, 16)
    spec = SyntheticSpec(shape, cfg.seed, args.density, per_prompt, args.tokens)
    train_s = args.train_s if args.train_s is not None else 0.3 * PAPER_GEN_WINDOW_S * shape.params / PAPER_PARAMS
    ep = Endpoints(args.store, args.redis, args.run, storage_options)
    r = connect(args.redis)

    def on_step(lg: Any) -> None:
        r.rpush(wan_key(args.run, "steps"), json.dumps({**dataclasses.asdict(lg), "t_ms": time.time() * 1000}))

    opts = SyntheticTrainerOptions(
        train_s=train_s, digests=args.digests, shard_bytes=args.shard_bytes, keep_snapshots=args.keep_snapshots or 6
    )
    tr = synthetic_trainer(ep, cfg, spec, opts, on_step)
    install_stop_handlers(tr.stop)
    try:
        tr.run()
    except KeyboardInterrupt:
        return 130
    return 0
