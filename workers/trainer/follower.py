"""A rank > 0 of a sharded Trainer (:func:`follow`): it mirrors rank 0's collectives, step by step.

Rank 0 is the :class:`~workers.trainer.trainer.Trainer`; every other rank
holds its shard of the master weights and optimizer state, runs each update
rank 0 sends, joins each version's gather, writes its own part of each
checkpoint and, on resume, loads its own shard of the checkpoint rank 0
chose (:mod:`~workers.trainer.sharding` lists the messages).
"""

from __future__ import annotations

from typing import Any

import torch

from aurora_store.errors import IntegrityError, ManifestError, ObjectNotFound
from aurora_store.storage import Store
from workers.model import logprobs, tiny_qwen3
from workers.pretrained import build_empty, read_model_dir
from workers.tokenizer import CharTokenizer
from workers.trainer.checkpoint import checkpoint_folder, checkpoint_shapes, load_into, load_optimizer
from workers.trainer.ckpt_async import Checkpointer
from workers.trainer.config import TrainerConfig
from workers.trainer.fsdp import DistContext, broadcast_module, exchange, gather_bf16, grpo_epochs, shard_model
from workers.trainer.sharding import hear, load_hf_shards, materialize_sharded, optimizer_targets, params_on_meta, rank_state

__all__ = ["build_sharded", "follow"]


def follow(cfg: TrainerConfig, ctx: DistContext, store: Store | None = None) -> int:
    """A rank > 0 of a sharded Trainer: hold a shard, run each update rank 0 sends, join each gather,
    write its part of each checkpoint, and on resume load its shard of the checkpoint rank 0 chose.

    Returns the number of updates taken part in. Each step mirrors rank 0's
    collectives in order (:mod:`~workers.trainer.sharding`): a fresh run builds
    the model like rank 0 (:func:`build_sharded`); a resumed one loads each
    candidate checkpoint rank 0 names, from ``store`` (the run root), reading
    only the objects its shard needs.
    """
    if ctx.leader:
        raise ValueError("rank 0 runs the Trainer, not follow()")
    model: Any = None
    opt: torch.optim.Optimizer | None = None
    ckpt = Checkpointer(store, checkpoint_folder, ctx.rank, True) if store is not None else None

    msg = hear(ctx)
    while msg[0] == "load":  # rank 0 tries checkpoints newest first until one makes its version's weights
        if model is None:
            model, opt = build_sharded(cfg, ctx, fresh=False, ckpt=ckpt)
        assert opt is not None and store is not None
        _, step, rec = msg
        try:
            targets = optimizer_targets(opt, checkpoint_shapes(store, step, rec))
            load_into(store, step, rec, {**rank_state(model, None)[0], **targets}, True)
        except (IntegrityError, ManifestError, ObjectNotFound):
            pass  # every rank saw it (DCP gathers the failures): rank 0 names it and moves on
        else:
            load_optimizer(opt, targets, rec["meta"].get("optimizer") or {})  # as GrpoPolicy.restore does
            gather_bf16(list(model.named_parameters(remove_duplicate=False)), ctx)  # rank 0 checks the weights' digest
        msg = hear(ctx)
    if msg[0] == "stop":
        return 0
    if msg[0] == "fresh":
        model, opt = build_sharded(cfg, ctx, fresh=True, ckpt=ckpt)
        gather_bf16(list(model.named_parameters(remove_duplicate=False)), ctx)  # v0
        if not _follow_checkpoint(hear(ctx), model, opt, ckpt):
            return 0
    assert model is not None and opt is not None
    params = list(model.named_parameters(remove_duplicate=False))
    updates = 0
    while True:
        kind, batch = exchange(None, ctx)
        if kind == "stop":
            if ckpt is not None:
                ckpt.finish()  # rank 0 commits the checkpoint still being written
            return updates
        if kind == "train" and batch is not None:
            grpo_epochs(model, opt, batch, ctx, cfg.epochs, cfg.clip, cfg.kl_coef, logprobs)
            updates += 1
        gather_bf16(params, ctx)
        if not _follow_checkpoint(hear(ctx), model, opt, ckpt):
            return updates


def build_sharded(cfg: TrainerConfig, ctx: DistContext, fresh: bool, ckpt: Checkpointer | None = None) -> tuple[Any, torch.optim.Optimizer]:
    """A rank > 0's model and optimizer, sharded as :meth:`GrpoPolicy.prepare_training
    <workers.trainer.policy.GrpoPolicy.prepare_training>` shards rank 0's (the same collectives, in order).

    ``--model``: built on the meta device, only this rank's shard allocated, its values read from the
    model's files (``fresh``) or from the checkpoint that follows; no rank holds the whole model at
    any time. The built-in model: built whole, then rank 0's (warm-started) weights (a broadcast).
    ``ckpt``: holds the optimizer's step while a checkpoint is written.
    """
    if cfg.model:
        path = read_model_dir(cfg.model).path
        with params_on_meta():
            m = build_empty(path, torch.float32)
        m.train()
        materialize_sharded(m, ctx, (lambda mm: load_hf_shards(mm, path)) if fresh else None)
    else:
        m = tiny_qwen3(
            CharTokenizer().vocab_size,
            seed=cfg.seed,
            dtype=torch.float32,
            head_dim=cfg.head_dim,
            hidden=cfg.tiny_hidden,
            intermediate=cfg.tiny_intermediate,
        )
        torch.nn.Module.to(m, ctx.device)
        m.train()
        broadcast_module(m)
        shard_model(m, ctx)
    o = cfg.make_optimizer(m.parameters())
    if ckpt is not None:
        ckpt.attach(o)
    return m, o


def _follow_checkpoint(msg: tuple[Any, ...], model: Any, opt: torch.optim.Optimizer, ckpt: Checkpointer | None) -> bool:
    """A follower's part of rank 0's checkpoint decision after a version; False: the run is over."""
    if msg[0] == "stop":
        if ckpt is not None:
            ckpt.finish()
        return False
    _, step, attempt, final = msg
    if attempt is not None and ckpt is not None:
        ckpt.begin(step, attempt, rank_state(model, opt)[0], None)
        if final:
            ckpt.finish()
    return True
