"""The synthetic workload's Trainer: a sparse update on real bf16 weights instead of training."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

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
from workers.trainer import TrainerConfig
from workers.trainer.trainer import Trainer

__all__ = ["SyntheticTrainerOptions", "SyntheticTrainer", "trainer_main"]

log = logging.getLogger("aurora.synthetic")


@dataclass(frozen=True, slots=True)
class SyntheticTrainerOptions:
    train_s: float = 0.0
    """Simulated training time per step (the sparse update's own time counts towards it)."""
    digests: bool = False
    """Record the weights digest of every version (costs a sha256 over the weights)."""
    shard_bytes: int = 64 << 20
    """Snapshot shard size (``full`` transfer)."""
    keep_snapshots: int = 6
    """``full`` transfer: snapshots older than this many versions are deleted (memory of the S3 server)."""


class SyntheticTrainer(Trainer):
    """The Trainer with simulated training on a synthetic model (see the module doc).

    Everything after the update (extraction, publishing, announcements,
    scheduling, settlement) is :class:`~workers.trainer.trainer.Trainer`'s own code.
    """

    def __init__(
        self, ep: Any, cfg: TrainerConfig, spec: SyntheticSpec, opts: SyntheticTrainerOptions | None = None, on_step: Any = None
    ) -> None:
        super().__init__(ep, cfg, on_step)
        self.spec = spec
        self.opts = opts or SyntheticTrainerOptions()

    def setup(self) -> None:
        from aurora_store.codec.extract import plan_of
        from aurora_store.lineage.plan import scan_versions
        from workers.common import write_model_description

        if scan_versions(self.store).latest is not None:
            raise RuntimeError(f"{self.store.url} already holds versions; use a fresh run root")
        from aurora_store.codec.kernels import warm_up

        t0 = time.perf_counter()
        warm_up()
        w = base_weights(self.spec.shape, self.spec.seed)
        self.published = w
        self._buffers: list[dict[str, torch.Tensor]] = [w]
        self.versions_bf16 = {0: w}
        self.plan = plan_of(w, self.spec.shape.tied)
        write_model_description(self.store, self.spec.to_json(), "{}")
        self.states[0] = self.spec.base_state
        self.full_bytes = sum(x.numel() * x.element_size() for x in w.values())
        self._after_publish(0, self.spec.base_state, "base", 0)
        self.publisher = self._new_publisher()
        self.publisher.continue_from(0, self.spec.base_state, w, owned=True)  # every Actor builds the same base
        log.info("synthetic base ready: %.3g params, %d bytes, in %.1fs", self.spec.params, self.full_bytes, time.perf_counter() - t0)
        for b in range(self.cfg.max_lag + 1):
            self._create_batch(b, 0)

    def _pub_cfg(self) -> Any:
        from aurora_store.lineage.publish import PublishConfig

        return PublishConfig(streams=self.cfg.streams, segment_bytes=self.cfg.segment_bytes, options=self.cfg.options, shard_bytes=self.opts.shard_bytes)

    def _batch_prompts(self, b: int) -> list[tuple[str, bytes]]:
        return [(f"b{b}-{i}", json.dumps({"id": f"b{b}-{i}", "ids": [1, 2, 3]}).encode()) for i in range(self.cfg.batch)]

    def _rollouts(self, b: int) -> tuple[list[list[int]], list[list[int]], list[float], list[int], int, dict[str, int], int]:
        tokens = bad = 0
        by_actor: dict[str, int] = {}
        gen_s: dict[str, float] = {}
        gen_tok: dict[str, int] = {}
        for r in self.collected[b].values():
            try:
                body = json.loads(r.payload)
                n = int(body["new_tokens"])
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            by_actor[r.actor] = by_actor.get(r.actor, 0) + 1
            tokens += n
            gen_tok[r.actor] = gen_tok.get(r.actor, 0) + n
            gen_s[r.actor] = gen_s.get(r.actor, 0.0) + max(1e-3, float(body.get("gen_s", 0.0)))
        self._update_tau(gen_tok, gen_s)
        return [], [], [], [], tokens, by_actor, bad

    def _grpo(self, prompts: Any, comps: Any, rewards: Any, gen_version: int) -> None:
        """The simulated optimizer step: a sparse update of a copy (delta) or in place, then sleep out ``train_s``."""
        t0 = time.perf_counter()
        v = len(self.logs) + 1
        if self.cfg.transfer == "delta":
            # Two buffers: the published version and the one being made (extraction compares them).
            if len(self._buffers) == 1:
                self._buffers.append({n: x.clone() for n, x in self.published.items()})
            new = self._buffers[1] if self._buffers[0] is self.published else self._buffers[0]
            for n, x in new.items():
                x.copy_(self.published[n])
        else:
            new = self.published
        sparse_update(new, self.spec.density, self.spec.seed, v)
        self._new = new
        left = self.opts.train_s - (time.perf_counter() - t0)
        if left > 0:
            self.stop.wait(left)

    def _bf16_weights(self) -> dict[str, torch.Tensor]:
        return cast(dict[str, torch.Tensor], cast(Any, self)._new)

    def _publish_version(self, v: int, b: int, new: dict[str, torch.Tensor]) -> tuple[int, int]:
        self._pub_t0_ms = time.time() * 1000
        out = super()._publish_version(v, b, new)
        if self.cfg.transfer == "full":
            self._drop_snapshots_before(v - self.opts.keep_snapshots + 1)
        return out

    def _drop_snapshots_before(self, oldest_kept: int) -> None:
        from aurora_store.format.manifest import manifest_key, version_dir

        for v in range(max(1, oldest_kept - 2), oldest_kept):
            keys = self.store.list(version_dir("snapshot", v))
            man = manifest_key("snapshot", v)
            for k in sorted(keys, key=lambda k: k != man):  # the manifest first: the version disappears before its objects
                self.store.delete(k)

    def _after_publish(self, v: int, state: str, kind: str, nbytes: int, digest: str | None = None) -> None:
        from aurora_store.coordination.bus import VERSION
        from workers.common import record_digest

        if self.opts.digests:
            from aurora_store.apply.sink import weights_digest

            record_digest(self.redis, self.keys, "trainer", v, weights_digest(self.published, self.plan))
        now_ms = time.time() * 1000
        self.redis.hset(self.keys.trainer, mapping={"head": v, "head_state": state, "published_ms": int(now_ms), "status": "running"})
        self.redis.hset(
            wan_key(self.ep.run, "published"), str(v),
            json.dumps({"start_ms": getattr(self, "_pub_t0_ms", now_ms), "end_ms": now_ms, "bytes": nbytes, "kind": kind}),
        )
        self.bus.announce(VERSION, v, kind=kind, state=state, bytes=nbytes)


def trainer_main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    from aurora_store.coordination.redisconn import connect
    from aurora_store.coordination.scheduler import SchedulerConfig
    from workers.common import Endpoints, install_stop_handlers, limit_torch_threads, setup_logging

    setup_logging("trainer")
    limit_torch_threads()
    shape = shape_for_params(args.params)
    per_prompt = args.gen_s_per_prompt if args.gen_s_per_prompt is not None else default_gen_s_per_prompt(shape.params, 16)
    spec = SyntheticSpec(shape, args.seed, args.density, per_prompt, args.tokens)
    train_s = args.train_s if args.train_s is not None else 0.3 * PAPER_GEN_WINDOW_S * shape.params / PAPER_PARAMS
    cfg = TrainerConfig(
        # No held-out evaluation: the synthetic model has no task to score (and no behaviour copy).
        steps=args.steps, batch=args.batch, group=args.group, snapshot_every=0, checkpoint_every=0, eval_every=0, streams=args.streams, seed=args.seed,
        segment_bytes=args.segment_bytes, heartbeat_timeout_s=args.heartbeat_timeout, transfer=args.transfer, max_lag=args.max_lag,
        scheduler=SchedulerConfig(split=args.split, min_lease_ms=int(1000 * args.min_lease_s)),
        # Redis-commit mode (a store without conditional writes, e.g. rclone serve s3): as the real Trainer.
        commit_via=getattr(args, "commit_via", None) or "store",
    )
    ep = Endpoints(args.store, args.redis, args.run, storage_options)
    r = connect(args.redis)

    def on_step(lg: Any) -> None:
        r.rpush(wan_key(args.run, "steps"), json.dumps({**dataclasses.asdict(lg), "t_ms": time.time() * 1000}))

    tr = SyntheticTrainer(ep, cfg, spec, SyntheticTrainerOptions(train_s=train_s, digests=args.digests, shard_bytes=args.shard_bytes, keep_snapshots=args.keep_snapshots or 6), on_step)
    install_stop_handlers(tr.stop)
    try:
        tr.run()
    except KeyboardInterrupt:
        return 130
    return 0

