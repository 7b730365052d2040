"""FSDP2's all-gather and reduce-scatter for ranks on the host (gloo), without a second whole buffer.

Why: gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` each
allocate a temporary as large as the whole (unsharded) buffer and copy
through it: measured on this machine with two ranks and a 95 MiB unit, 97 MiB
more resident during each call, and the largest units are the embedding
and the untied output head (a quarter of a 0.2 B model between them). The
reduce-scatter of the head's gradient was the sharded Trainer's peak
(``aurora bench trainer --params 2e8 --nproc 2``: every rank's high-water mark
was reached inside it).

Here the same results come from collectives that work in place on slices of
FSDP's own buffers: the all-gather is one broadcast per rank, each into that
rank's slice of the output (its own slice copied in first); the
reduce-scatter is one reduce per rank, each summing that rank's slice of the
input (a scratch buffer FSDP does not read again) onto it, whose slice is
then copied to the output, and the input's memory freed at once (FSDP holds
on to it until the next unit's reduce, for a GPU stream's sake, but does not
read it again: on the host that kept a whole unit's gradient resident through
the next layer's backward pass). The bytes on the wire are those of a
reduce-scatter and an all-gather done naively (each slice once to or from
each rank); the sums of two ranks are the same bits in any order. Installed
by :func:`workers.trainer.fsdp.shard_model` on host ranks only (NCCL's
collectives work in place already).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["install_host_comms"]


def install_host_comms(modules: Sequence[Any]) -> bool:
    """Give each FSDP2 module (``fully_shard``'s) the in-place host collectives; False (nothing changed)
    where this torch has no such hook (``set_custom_all_gather`` / ``set_custom_reduce_scatter``)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:
        return False
    if not all(
        callable(getattr(m, "set_custom_all_gather", None)) and callable(getattr(m, "set_custom_reduce_scatter", None)) for m in modules
    ):
        return False

    class HostAllGather(AllGather):
        def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> None:
            world, rank = group.size(), group.rank()
            slices = output_tensor.view(-1).chunk(world)
            slices[rank].copy_(input_tensor.view(-1))
            for r, part in enumerate(slices):
                dist.broadcast(part, group_src=r, group=group)
            return None  # done: FSDP waits only on a returned Work

    class HostReduceScatter(ReduceScatter):
        def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
            avg = op == dist.ReduceOp.AVG  # FSDP's op for float32 gradients: the sum over the ranks, divided
            if not avg and op not in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
                return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            world, rank = group.size(), group.rank()
            slices = input_tensor.view(-1).chunk(world)
            for r, part in enumerate(slices):
                dist.reduce(part, group_dst=r, op=dist.ReduceOp.SUM if avg else op, group=group)  # lands on rank r's slice
            output_tensor.view(-1).copy_(slices[rank])
            if avg:
                output_tensor.div_(world)
            # The input is this comm's own scratch (allocate above), which FSDP keeps referenced until the
            # next unit's reduce (for a GPU stream's sake) but never reads again: its memory goes now.
            if input_tensor._base is None and input_tensor.storage_offset() == 0:
                input_tensor.untyped_storage().resize_(0)
            return None

    gather, scatter = HostAllGather(), HostReduceScatter()
    for m in modules:
        m.set_custom_all_gather(gather)
        m.set_custom_reduce_scatter(scatter)
    return True
