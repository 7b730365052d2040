"""Sharded training for the Trainer: FSDP2 (``torch.distributed.fsdp.fully_shard``).

With several processes (``torchrun --nproc-per-node N aurora trainer ...``, or
``aurora trainer --nproc N`` which spawns them) every rank holds a shard of
the fp32 master weights and of the optimizer state; nobody holds the whole
model in fp32. Rank 0 is the Trainer that talks to Redis and the store:
it collects and rewards each batch, computes the behaviour (and reference)
log-probabilities on its bf16 copy of the version the batch was sampled
from, and hands every rank its slice of the sequences. All ranks then run
the same GRPO epochs on their slices; FSDP reduce-scatters the gradients.

To publish a version, rank 0 needs the full bf16 weights. :func:`gather_bf16`
walks the parameters in a fixed order; for each one every rank joins one
all-gather (``DTensor.full_tensor``), rank 0 casts the result to bf16 and
moves it to host memory, and the full fp32 tensor is dropped before the next
parameter. So an accelerator holds its shard plus *one* full parameter at a
time, never a second full copy of the model; the published bf16 copy lives
in host memory, where extraction runs against the previous version.

On CPU (gloo) this runs the same code, which is how the tests check it on a
machine without GPUs. On CUDA each rank uses ``cuda:LOCAL_RANK`` and NCCL.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from aurora_store.api.weights import gather_bf16 as gather_bf16_api

__all__ = [
    "DistContext",
    "GrpoBatch",
    "broadcast_module",
    "exchange",
    "gather_bf16",
    "exit_process",
    "leave",
    "init_from_env",
    "local_rows",
    "shard_model",
    "grpo_epochs",
]


@dataclass(frozen=True, slots=True)
class DistContext:
    """Where this process sits in the training job."""

    rank: int
    world: int
    device: torch.device

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1


SINGLE = DistContext(0, 1, torch.device("cpu"))


def init_from_env(env: Mapping[str, str] | None = None) -> DistContext:
    """Join the process group described by torchrun's variables; one process without them.

    ``WORLD_SIZE`` > 1 needs ``RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (torchrun sets all four). NCCL on CUDA, gloo otherwise.
    """
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with torchrun or `aurora trainer --nproc N`")
    rank = int(env["RANK"])
    if torch.cuda.is_available():
        local = int(env.get("LOCAL_RANK", str(rank)))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}", rank=rank, world_size=world)
    return DistContext(rank, world, device)


def leave(ctx: DistContext) -> None:
    """Leave the process group together: a barrier, then destroy it.

    A rank that tears gloo down while a peer still talks to it can abort in
    C++ ("terminate called without an active exception"); the barrier makes
    every rank finish its last collective before any rank destroys the group.
    """
    if not ctx.sharded or not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def exit_process(rc: int = 0) -> None:
    """End a spawned rank now: flush what it printed and logged, then ``os._exit``.

    After the work is done and the group left, a rank's interpreter teardown
    can still abort in C++ ("terminate called without an active exception":
    a native thread of torch's still joinable while static objects are
    destroyed), seen one run in a few on a loaded machine. The exit status
    would then say SIGABRT for a rank that finished; skipping the teardown
    keeps the status the rank's own.
    """
    import contextlib
    import logging
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    logging.shutdown()
    os._exit(rc)


def broadcast_module(model: torch.nn.Module, src: int = 0) -> None:
    """Make every rank's (unsharded) parameters equal to rank ``src``'s, before sharding."""
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src)


def shard_model(model: torch.nn.Module, ctx: DistContext) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (embedding, norm and a tied head stay together)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: expected a causal LM with model.layers to shard")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gather_bf16(
    named: Iterator[tuple[str, torch.Tensor]] | Sequence[tuple[str, torch.Tensor]], ctx: DistContext
) -> dict[str, torch.Tensor]:
    """Full bf16 copies of the named parameters on rank 0 (``{}`` elsewhere), on rank 0's device.

    The copies stay where the weights live (a GPU's memory on CUDA), so the
    delta is extracted there and only the changed elements come to the host.
    Every rank must call this with the same names in the same order: each
    parameter is one collective (the public API's gather, :func:`aurora_store.api.weights.gather_bf16`).
    """
    return gather_bf16_api(named, ctx.leader, ctx.device)


def local_rows(n: int, ctx: DistContext) -> list[int]:
    """Rows of a batch of ``n`` sequences this rank trains on (strided, so lengths mix)."""
    return list(range(ctx.rank, n, ctx.world))


@dataclass(slots=True)
class GrpoBatch:
    """What rank 0 sends every rank for one GRPO update: the packed batch and its fixed terms."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    """[B] one per sequence."""
    old: torch.Tensor
    """[B, T] behaviour-policy log-probabilities."""
    ref: torch.Tensor | None
    """[B, T] reference log-probabilities, with a KL term."""

    def rows(self, idx: Sequence[int], device: torch.device) -> GrpoBatch:
        sel = torch.tensor(list(idx), dtype=torch.long)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, sel).to(device)

        return GrpoBatch(
            pick(self.input_ids),
            pick(self.attention_mask),
            pick(self.completion_mask),
            pick(self.advantages),
            pick(self.old),
            pick(self.ref) if self.ref is not None else None,
        )


def exchange(msg: tuple[str, GrpoBatch | None] | None, ctx: DistContext) -> tuple[str, GrpoBatch | None]:
    """Rank 0's message on every rank: ``("train", batch)``, ``("skip", None)`` or ``("stop", None)``."""
    box: list[Any] = [msg if ctx.leader else None]
    dist.broadcast_object_list(box, src=0)
    out = box[0]
    if not (isinstance(out, tuple) and len(out) == 2 and out[0] in ("train", "skip", "stop")):
        raise RuntimeError(f"rank {ctx.rank}: unexpected message from rank 0: {type(out).__name__}")
    return out


def grpo_epochs(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: GrpoBatch,
    ctx: DistContext,
    epochs: int,
    clip: float,
    kl_coef: float,
    logprobs: Callable[..., torch.Tensor],
    max_grad_norm: float = 1.0,
) -> None:
    """The clipped-ratio GRPO update, run identically on every rank over its rows.

    The loss is normalised by the token count of the *whole* batch and scaled
    by the world size, so FSDP's mean over ranks gives exactly the gradient
    one process would compute on the whole batch.
    """
    total_tokens = batch.completion_mask.float().sum()
    rows = local_rows(int(batch.input_ids.shape[0]), ctx)
    # A rank with no rows (batch smaller than the world) still joins every
    # collective: it runs row 0 with a zero mask, contributing nothing.
    mine = batch.rows(rows or [0], ctx.device)
    mask = mine.completion_mask.float() * (1.0 if rows else 0.0)
    a = mine.advantages[:, None]
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        new = logprobs(model, mine.input_ids, mine.attention_mask, mine.completion_mask, reduction="none")
        ratio = torch.exp(new - mine.old)
        obj = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
        loss = -(obj * mask).sum()
        if mine.ref is not None and kl_coef > 0:
            # k3 estimator of KL(pi || ref), per token
            d = mine.ref - new
            loss = loss + kl_coef * ((torch.exp(d) - d - 1) * mask).sum()
        (loss * (ctx.world / total_tokens)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
