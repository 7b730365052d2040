"""A version's bf16 weights gathered from the ranks' shards onto rank 0, on the host (gloo).

Why not ``DTensor.full_tensor()`` (an all-gather) per parameter, then a cast:
every rank then materialises each whole parameter in float32, and rank 0 holds
it next to its bf16 copy, 6 bytes per element of the largest parameter (the
embedding or the output head, a quarter of a 0.2 B model between them) on top
of the version; the other ranks need none of it. Here each rank rounds its own
shard to bf16 (the rounding is element by element, so the bits are those of
the whole tensor rounded) and sends it to rank 0 alone (``dist.gather``),
which receives every rank's rows straight into the version's memory: nothing
whole is ever made on a rank > 0, nothing float32 whole on rank 0, and half
the bytes cross the wire.

Rank 0 lays the version out in blocks of about
:data:`~workers.trainer.held.VERSION_BLOCK_BYTES` (each tensor a contiguous
view into its block), as a version made in one process is
(:func:`~workers.trainer.held.bf16_version`): a version is freed whole a step
or two later, and per-tensor bf16 allocations would leave holes in the heap
that the float32 tensors of the next update do not fit in. A sharded rank
maps blocks of that size on their own (:data:`workers.trainer.cli.MMAP_THRESHOLD`),
so a freed version goes straight back to the system.

Only FSDP2's layout is taken this way (a DTensor sharded on its first
dimension over a one-dimensional mesh, host memory); anything else goes
through the public API's gather (:func:`aurora_store.api.weights.gather_bf16`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from aurora_store.api.weights import gather_bf16 as gather_bf16_api
from workers.trainer.held import VERSION_BLOCK_BYTES

__all__ = ["gather_version", "row_sharded"]

_ALIGN = 32  # elements: each view starts on a 64-byte line, as in held.bf16_version


def row_sharded(t: Any, world: int) -> bool:
    """Whether ``t`` is a host DTensor sharded on dimension 0 over all ``world`` ranks (FSDP2's layout)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return False
    mesh = t.device_mesh
    return mesh.ndim == 1 and mesh.size() == world and tuple(t.placements) == (Shard(0),) and t.dim() >= 1 and t.device.type == "cpu"


def gather_version(
    named: Iterable[tuple[str, torch.Tensor]], rank: int, world: int, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """bf16 copies of every named tensor on rank 0 (``{}`` elsewhere); every rank calls this with the
    same names in the same order (each sharded tensor is one collective). Tied names (one tensor twice)
    share one copy. ``device``: where rank 0 wants the copies (the host path runs only for the host)."""
    items = list(named)
    if world <= 1 or (device is not None and device.type != "cpu") or not all(_host_plain(t) or row_sharded(t, world) for _, t in items):
        return gather_bf16_api(items, rank == 0, device)
    unique: list[torch.Tensor] = []
    first: dict[int, int] = {}
    names: list[tuple[str, int]] = []
    for name, t in items:
        key = id(t) if row_sharded(t, world) else (t.data_ptr(), tuple(t.shape))
        idx = first.setdefault(key, len(unique))  # type: ignore[arg-type]
        if idx == len(unique):
            unique.append(t)
        names.append((name, idx))
    views = _blocks(unique) if rank == 0 else []
    with torch.no_grad():
        for i, t in enumerate(unique):
            _gather_one(t, views[i] if rank == 0 else None, rank, world)
    if rank != 0:
        return {}
    return {name: views[i] for name, i in names}


def _host_plain(t: torch.Tensor) -> bool:
    return not hasattr(t, "full_tensor") and t.device.type == "cpu"


def _blocks(unique: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rank 0: an empty bf16 view of each tensor's full shape, packed into blocks (module docstring)."""
    cap = VERSION_BLOCK_BYTES // 2  # elements of a block
    groups: list[list[int]] = []
    used = 0
    for i, t in enumerate(unique):
        n = -(-t.numel() // _ALIGN) * _ALIGN
        if not groups or used + n > cap:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    views: list[torch.Tensor] = [torch.empty(0)] * len(unique)
    for group in groups:
        sizes = [-(-unique[i].numel() // _ALIGN) * _ALIGN for i in group]
        block = torch.empty(sum(sizes), dtype=torch.bfloat16)
        at = 0
        for i, size in zip(group, sizes, strict=True):
            views[i] = block[at : at + unique[i].numel()].view(unique[i].shape)
            at += size
    return views


def _gather_one(t: torch.Tensor, out: torch.Tensor | None, rank: int, world: int) -> None:
    """Fill ``out`` (rank 0; None elsewhere) with ``t`` rounded to bf16: a replicated tensor from rank 0's
    own copy; a row-sharded one from every rank's rows, each rank sending exactly ``ceil(rows / world)``
    rows (zeros past a short last shard), FSDP2's split (``torch.chunk`` on dimension 0)."""
    if not row_sharded(t, world):
        if out is not None:
            out.copy_(t.detach())
        return
    rows = int(t.shape[0])
    per = -(-rows // world)
    if per == 0:
        return
    local = t.to_local().detach()  # type: ignore[attr-defined]
    send = local.to(torch.bfloat16)
    if int(send.shape[0]) != per:
        padded = send.new_zeros((per, *send.shape[1:]))
        padded[: send.shape[0]].copy_(send)
        send = padded
    group = t.device_mesh.get_group()  # type: ignore[attr-defined]
    if out is None:
        dist.gather(send, None, group_dst=0, group=group)
        return
    recv: list[torch.Tensor] = []
    short: list[tuple[int, torch.Tensor]] = []
    for r in range(world):
        lo, hi = r * per, min(rows, (r + 1) * per)
        if hi - lo == per:
            recv.append(out[lo:hi])  # straight into the version (a contiguous row range)
        else:
            tmp = send.new_empty(send.shape)
            recv.append(tmp)
            if hi > lo:
                short.append((lo, tmp[: hi - lo]))
    dist.gather(send, recv, group_dst=0, group=group)
    for lo, rows_got in short:
        out[lo : lo + rows_got.shape[0]].copy_(rows_got)
