"""What the ranks of a sharded Trainer say to each other about starting and checkpointing.

Rank 0 decides (a fresh run or which checkpoint to resume from, whether a
checkpoint is due after a version) and every other rank follows
(:func:`~workers.trainer.trainer.follow`); each decision is one broadcast at a
point every rank reaches in the same order, so the collectives that follow it
(a DCP load or save, a gather) match. With one process nothing is sent.

Messages (tuples, first item the kind):

- ``("fresh",)``: build the model as rank 0 does: ``--model`` on the meta device, each rank then
  reading only its own shard from the model's files; the built-in one whole, taking rank 0's
  (warm-started) weights by a broadcast;
- ``("load", step, record)``: load the checkpoint before ``step`` (its record
  already checked by rank 0) into this rank's shard, then join the gather that
  checks its weights; followed by another ``load``, or ``("resumed",)``;
- ``("checkpoint", step, attempt, final)`` after each version's gather:
  ``attempt`` None when no checkpoint is due; ``final``: finish it now (the run ends);
- ``("stop", None)`` (:func:`~workers.trainer.fsdp.exchange`'s) at any of these points: the run is over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from workers.trainer.checkpoint import make_optimizer_state, optimizer_tensors
from workers.trainer.fsdp import DistContext

__all__ = [
    "hear",
    "is_meta",
    "load_hf_shards",
    "materialize_module",
    "materialize_sharded",
    "optimizer_targets",
    "params_on_meta",
    "rank_state",
    "tell",
    "tied_by_identity",
]


def tell(ctx: DistContext, msg: tuple[Any, ...]) -> None:
    """Rank 0: send ``msg`` to every other rank (nothing with one process)."""
    if ctx.sharded:
        import torch.distributed as dist

        dist.broadcast_object_list([msg], src=0)


def hear(ctx: DistContext) -> tuple[Any, ...]:
    """A rank > 0: rank 0's next message."""
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    msg = box[0]
    if not (isinstance(msg, tuple) and msg and msg[0] in ("fresh", "load", "resumed", "checkpoint", "stop")):
        raise RuntimeError(f"rank {ctx.rank}: unexpected message from rank 0: {type(msg).__name__}")
    return msg


def rank_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's part of a checkpoint: the master weights (``model.<name>``, DTensor shards when
    sharded) and the optimizer's tensors (``opt.<index>.<name>``), live (no copy); the optimizer's
    non-tensor state as JSON.

    An Adam optimizer's state is made first if it is still empty (the checkpoint before step 0):
    every rank calls this at the same checkpoint, so every rank's part names the same tensors
    (DCP plans the save over all of them; a rank without the moments would leave holes)."""
    tensors = {f"model.{n}": p.detach() for n, p in model.state_dict().items()}
    meta: dict[str, Any] = {}
    if opt is not None:
        make_optimizer_state(opt)
        opt_t, meta = optimizer_tensors(opt)
        tensors.update({n: t.detach() for n, t in opt_t.items()})
    return tensors, meta


def optimizer_targets(opt: torch.optim.Optimizer, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Tensors to load a checkpoint's optimizer state into (``opt.<index>.<name>`` of ``shapes``):
    like the parameter (a DTensor shard when sharded) where the stored tensor has its shape, else plain."""
    params = [p for g in opt.param_groups for p in g["params"]]
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dtype) in shapes.items():
        if not name.startswith("opt."):
            continue
        idx = int(name.split(".")[1])
        if not 0 <= idx < len(params):
            raise ValueError(f"{name}: the optimizer has {len(params)} parameters")
        p = params[idx]
        out[name] = torch.zeros_like(p, dtype=dtype) if tuple(p.shape) == shape else torch.zeros(shape, dtype=dtype)
    return out


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Parameters of modules built inside go to the meta device as they are registered (nothing of the
    model's size is allocated or initialised); buffers stay real (rotary tables are computed, not loaded)."""
    orig = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        orig(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = orig  # type: ignore[method-assign]


def is_meta(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are still on the meta device (built by :func:`params_on_meta`)."""
    return any(p.device.type == "meta" for p in model.parameters())


def tied_by_identity(model: torch.nn.Module) -> bool:
    """Whether ``lm_head.weight`` is the embedding's parameter, read from the parameters' identity.

    :func:`workers.model.is_tied` compares storages, which meta tensors do not
    have (every one reads as address 0); the module's own parameter objects say
    the same thing before anything is allocated. Any other parameter under two
    names is refused, as there: a delta would reach its elements twice.
    """
    from aurora_store.codec.fusion import EMBED, TIED_HEAD
    from aurora_store.errors import ModelMismatchError

    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = False
    for group in names.values():
        if len(group) == 1:
            continue
        if sorted(group) != sorted((TIED_HEAD, EMBED)):
            raise ModelMismatchError(f"{group[1]} is the parameter {group[0]}; only {TIED_HEAD} may alias {EMBED}")
        tied = True
    return tied


def materialize_sharded(model: torch.nn.Module, ctx: DistContext, load: Callable[[torch.nn.Module], None] | None) -> None:
    """Shard a meta-device ``model`` (FSDP2), allocate only this rank's shard on its device, keep its
    buffers, then ``load`` the shard's values (None: a checkpoint load follows)."""
    from workers.trainer.fsdp import shard_model

    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    shard_model(model, ctx)
    model.to_empty(device=ctx.device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in buffers:
                b.copy_(buffers[n].to(b.device))
    if load is not None:
        load(model)


def materialize_module(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Allocate a meta-device ``module`` (unsharded) on ``device``, keeping its buffers; its values follow."""
    buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    module.to_empty(device=device)
    with torch.no_grad():
        for n, b in module.named_buffers():
            if n in buffers:
                b.copy_(buffers[n].to(b.device))
    return module


def load_hf_shards(model: torch.nn.Module, path: str) -> None:
    """Fill this rank's shard of every parameter from a Hugging Face directory's safetensors files,
    reading only its rows (``safe_open(...).get_slice``; packed experts from the per-expert tensors
    checkpoints save, :class:`~workers.trainer.hf_rows.CheckpointRows`); a parameter the files lack must be tied."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from aurora_store.errors import ConfigError
    from workers.trainer.hf_rows import CheckpointRows

    with torch.no_grad(), CheckpointRows(path, model) as saved:
        for name, p in model.named_parameters():
            full = tuple(p.shape)
            if isinstance(p, DTensor):
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                local = p.to_local()
                rows = saved.rows(name, offset[0], offset[0] + shape[0], full) if shape[0] else None
            else:
                local, rows = p, saved.rows(name, 0, full[0], full)
            if rows is not None:
                if tuple(rows.shape) != tuple(local.shape):
                    raise ConfigError(f"--model {path}: {name} holds {list(rows.shape)}, this rank's shard is {list(local.shape)}")
                local.copy_(rows)  # converted as it is copied: no second copy of the rows in the shard's dtype
