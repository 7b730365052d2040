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
walks the parameters in a fixed order, one collective each: on the host every
rank sends its shard, rounded to bf16, to rank 0 alone, which receives the rows
into the version's memory (:mod:`~workers.trainer.gather`); on an accelerator
every rank joins an all-gather (``DTensor.full_tensor``) and rank 0 casts the
result, dropping the full fp32 tensor before the next parameter. Either way a
rank holds its shard plus at most *one* full parameter at a time, never a
second full copy of the model; the published bf16 copy lives where
``versions_on`` says (rank 0's device, or the host when it is short), where
extraction runs against the previous version.

Each rank runs its rows ``micro_batch`` at a time (the same number of passes
on every rank: each forward and backward is a collective), optionally with
activation checkpointing; both travel with the batch from rank 0.

On CPU (gloo) this runs the same code, which is how the tests check it on a
machine without GPUs. On CUDA each rank uses ``cuda:LOCAL_RANK`` and NCCL.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

__all__ = [
    "DistContext",
    "GrpoBatch",
    "abandon",
    "broadcast_module",
    "exchange",
    "gather_bf16",
    "exit_process",
    "leave",
    "init_from_env",
    "local_rows",
    "shard_model",
    "grpo_epochs",
    "micro_batches",
    "set_activation_checkpointing",
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


def abandon(rank: int, error: BaseException) -> NoReturn:
    """End a rank whose work raised: say why in one line now, then exit without another collective.

    Why not :func:`leave`: the other ranks may sit in a collective this rank will
    never join (rank 1 in a version's gather while rank 0 failed before it), and
    a barrier does not match one: both would wait for good, and the error would
    be printed only after that barrier. Exiting closes this rank's connections,
    so a peer's pending collective fails at once ("Connection closed by peer")
    and that rank ends the same way; whoever started the ranks (``--nproc``'s
    parent, torchrun) stops any rank left waiting outside a collective.
    The line is the command line's own (``aurora: error: ...``), the rank named;
    a bug's traceback goes to the debug log, as there.
    """
    import logging
    import sys

    from aurora_store.errors import AuroraError
    from aurora_store.redact import redact_text

    if isinstance(error, KeyboardInterrupt):
        print(f"aurora: trainer rank {rank}: interrupted", file=sys.stderr)
        exit_process(130)
    if isinstance(error, SystemExit):
        code = error.code if isinstance(error.code, int) else 1
        if not isinstance(error.code, int) and error.code is not None:
            print(f"aurora: error: trainer rank {rank}: {redact_text(str(error.code))}", file=sys.stderr)
        exit_process(code)
    said = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), type(error).__name__)
    if isinstance(error, (AuroraError, OSError, ValueError)):
        line = redact_text(said)
    else:  # a bug, or a peer that went away under a collective (gloo says so in its message)
        logging.getLogger("aurora.trainer").debug("trainer rank %d ended with an unexpected error", rank, exc_info=error)
        line = f"unexpected {type(error).__name__}: {redact_text(said)}"
    print(f"aurora: error: trainer rank {rank}: {line}", file=sys.stderr)
    exit_process(1)


def exit_process(rc: int = 0) -> NoReturn:
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
    """``fully_shard`` each decoder layer, an untied embedding and head each on their own, then the root.

    What a rank holds beyond its shards is the unit being gathered (and, in the
    backward pass, its unsharded gradient): the embedding and an untied head
    are the largest tensors of a model (a quarter of a 0.2 B one), so each is a
    unit of its own, gathered only while it runs. A tied head is the
    embedding's parameter: the two stay in the root's unit. On the host the
    units gather and reduce in place (:mod:`~workers.trainer.host_comms`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__}: expected a causal LM with model.layers to shard")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    embed, head = _embeddings(model)
    if embed is not None and head is not None and embed.weight is not head.weight:
        fully_shard(embed, mesh=mesh)
        # An embedding's backward reads only the indices, never the weight: not gathered again for it
        # (a whole float32 copy of the embedding less at the end of every backward pass).
        embed.set_unshard_in_backward(False)
        fully_shard(head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if ctx.device.type == "cpu":  # gloo's own gather and scatter copy through a whole second buffer
        from torch.distributed.fsdp import FSDPModule

        from workers.trainer.host_comms import install_host_comms

        install_host_comms([m for m in model.modules() if isinstance(m, FSDPModule)])
    return model


def _embeddings(model: torch.nn.Module) -> tuple[Any, Any]:
    """The input embedding and output head modules (Hugging Face's accessors), None where there is none."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embed = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    ok = all(isinstance(getattr(m, "weight", None), torch.nn.Parameter) for m in (embed, head))
    return (embed, head) if ok else (None, None)


def gather_bf16(
    named: Iterator[tuple[str, torch.Tensor]] | Sequence[tuple[str, torch.Tensor]], ctx: DistContext
) -> dict[str, torch.Tensor]:
    """Full bf16 copies of the named parameters on rank 0 (``{}`` elsewhere), on rank 0's device.

    The copies stay where the weights live (a GPU's memory on CUDA), so the
    delta is extracted there and only the changed elements come to the host.
    Every rank must call this with the same names in the same order: each
    parameter is one collective. On the host each rank sends its bf16 rows to
    rank 0 alone, into the version's blocks (:func:`~workers.trainer.gather.gather_version`);
    elsewhere the public API's all-gather (:func:`aurora_store.api.weights.gather_bf16`).
    """
    from workers.trainer.gather import gather_version

    return gather_version(named, ctx.rank, ctx.world, ctx.device)


def local_rows(n: int, ctx: DistContext) -> list[int]:
    """Rows of a batch of ``n`` sequences this rank trains on (strided, so lengths mix)."""
    return list(range(ctx.rank, n, ctx.world))


@dataclass(slots=True)
class GrpoBatch:
    """What rank 0 sends every rank for one GRPO update: the packed batch, its fixed terms, and how to run it.

    ``micro_batch`` and ``checkpointing`` travel with the batch so that every
    rank runs the same number of forward and backward passes (each is a
    collective under FSDP) and nothing but rank 0's configuration decides them.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    """[B] one per sequence."""
    old: torch.Tensor
    """[B, T] behaviour-policy log-probabilities."""
    ref: torch.Tensor | None
    """[B, T] reference log-probabilities, with a KL term."""
    micro_batch: int = 0
    """Rows per forward and backward pass on each rank (gradients accumulate); 0: all of a rank's rows at once."""
    checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them."""
    router_aux_coef: float = 0.0
    """Weight of a mixture-of-experts model's router auxiliary loss (0: not computed)."""

    def rows(self, idx: Sequence[int], device: torch.device) -> GrpoBatch:
        sel = torch.tensor(list(idx), dtype=torch.long)

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, sel.to(t.device)).to(device)

        return GrpoBatch(
            pick(self.input_ids),
            pick(self.attention_mask),
            pick(self.completion_mask),
            pick(self.advantages),
            pick(self.old),
            pick(self.ref) if self.ref is not None else None,
            self.micro_batch,
            self.checkpointing,
            self.router_aux_coef,
        )

    def to(self, device: torch.device | str) -> GrpoBatch:
        """The same batch with every tensor on ``device`` (the host, before it is sent to other ranks)."""
        return self.rows(range(int(self.input_ids.shape[0])), torch.device(device))


def exchange(msg: tuple[str, GrpoBatch | None] | None, ctx: DistContext) -> tuple[str, GrpoBatch | None]:
    """Rank 0's message on every rank: ``("train", batch)``, ``("skip", None)`` or ``("stop", None)``."""
    box: list[Any] = [msg if ctx.leader else None]
    dist.broadcast_object_list(box, src=0)
    out = box[0]
    if not (isinstance(out, tuple) and len(out) == 2 and out[0] in ("train", "skip", "stop")):
        raise RuntimeError(f"rank {ctx.rank}: unexpected message from rank 0: {type(out).__name__}")
    return out


def set_activation_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Turn Hugging Face gradient checkpointing (every decoder layer, non-reentrant) on or off; idempotent."""
    if bool(getattr(model, "is_gradient_checkpointing", False)) == on:
        return
    if on:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise TypeError(f"{type(model).__name__}: activation checkpointing needs a Hugging Face model")
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()  # type: ignore[operator]


def micro_batches(rows: int, world: int, micro_batch: int) -> int:
    """Forward/backward passes each rank runs over a batch of ``rows`` (the same on every rank)."""
    most = -(-rows // world)  # the most rows any rank holds (strided split)
    if micro_batch <= 0 or most <= micro_batch:
        return 1
    return -(-most // micro_batch)


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
    one process would compute on the whole batch; the micro-batches' losses
    are sums over their own tokens with that same divisor, so accumulating
    their gradients gives the whole batch's gradient too. Gradients are freed
    after the last optimizer step (they take no memory between steps).

    A sharded rank gives the free pages of its heap back before the update and
    after it (:func:`workers.trainer.malloc.trim`), as the Trainer does on rank 0:
    what the gathers, the checkpoint's thread and the update itself left free
    would otherwise stay resident between updates. Measured with ``aurora bench
    trainer --params 2e8 --nproc 2``: rank 1 held about 1.7 GB between updates
    instead of 2.1 GB; its peak, inside the update, did not move (the update
    reuses free heap pages as it goes).
    """
    from workers.trainer.malloc import trim

    if ctx.sharded:
        trim()
    set_activation_checkpointing(model, batch.checkpointing)
    n = int(batch.input_ids.shape[0])
    scale = ctx.world / float(batch.completion_mask.float().sum())
    rows = local_rows(n, ctx)
    # A rank with no rows (batch smaller than the world) still joins every
    # collective: it runs row 0 with a zero mask, contributing nothing.
    mine = batch.rows(rows or [0], ctx.device)
    held = len(rows)
    passes = micro_batches(n, ctx.world, batch.micro_batch)
    size = -(-held // passes) if held else 1
    for _ in range(epochs):
        opt.zero_grad(set_to_none=True)
        for i in range(passes):
            lo, hi = i * size, min(held, (i + 1) * size)
            weight = 1.0 if hi > lo else 0.0
            if hi <= lo:  # this rank ran out of rows: one idle pass keeps the collectives in step
                lo, hi = 0, 1
            _grpo_pass(model, mine, lo, hi, weight * scale, clip, kl_coef, logprobs)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
    opt.zero_grad(set_to_none=True)
    if ctx.sharded:
        trim()


def _grpo_pass(
    model: torch.nn.Module,
    mine: GrpoBatch,
    lo: int,
    hi: int,
    scale: float,
    clip: float,
    kl_coef: float,
    logprobs: Callable[..., torch.Tensor],
) -> None:
    """Forward and backward over rows ``lo:hi`` of this rank's rows; gradients accumulate."""
    ids, attn, comp = mine.input_ids[lo:hi], mine.attention_mask[lo:hi], mine.completion_mask[lo:hi]
    # Padding columns after every row's last token are dropped (causal attention: nothing before them changes).
    width = int(attn.any(0).nonzero().max()) + 1
    ids, attn, comp = ids[:, :width], attn[:, :width], comp[:, :width]
    old = mine.old[lo:hi, :width]
    mask = comp.float()
    a = mine.advantages[lo:hi, None]
    aux: list[torch.Tensor] | None = [] if mine.router_aux_coef > 0 else None
    # fuse_grads: only .backward() follows, and the passes accumulate (workers.fused_grad; one process only).
    new = logprobs(model, ids, attn, comp, reduction="none", fuse_grads=True, **({"router_aux": aux} if aux is not None else {}))
    ratio = torch.exp(new - old)
    obj = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    loss = -(obj * mask).sum()
    if mine.ref is not None and kl_coef > 0:
        # k3 estimator of KL(pi || ref), per token
        d = mine.ref[lo:hi, :width] - new
        loss = loss + kl_coef * ((torch.exp(d) - d - 1) * mask).sum()
    if aux:
        # The router's loss is a mean over the pass's tokens: weighted by its completion tokens, the
        # passes (and ranks) of a batch add up to the batch's token-weighted mean, as the GRPO term does.
        loss = loss + mine.router_aux_coef * torch.stack(aux).sum() * mask.sum()
    (loss * scale).backward()
