"""What ``aurora bench codec`` measures with: best-of timing, a kernel path, copies and bit-for-bit checks."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import zstandard

from aurora_store.apply.sink import FusedWeights, apply_delta
from aurora_store.codec import kernels
from aurora_store.codec.entries import EncodeOptions, ParamSpec
from aurora_store.codec.extract import ParamDelta, bits_view, extract
from aurora_store.codec.fusion import Block, FusionPlan
from aurora_store.format.checkpoint import EncodedSegment, encode_segments, stage_segments

__all__ = [
    "Progress",
    "timed",
    "best_of",
    "extract_all",
    "extract_encode",
    "encode",
    "decode_apply",
    "Clock",
    "kernel_path",
    "same_deltas",
    "memcpy",
    "restore",
    "identical",
    "zstd_u32_bytes",
]

R = TypeVar("R")


class Progress:
    """Progress lines on stderr, stamped with the time since the start."""

    def __init__(self, enabled: bool = True) -> None:
        self.t0 = time.perf_counter()
        self.enabled = enabled

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def timed(fn: Callable[..., R], *args: Any) -> tuple[float, R]:
    """(wall seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


class Clock:
    """The best wall time and the best CPU time (this process's, on its one thread) of
    repeated calls. On a shared machine the wall time counts the moments another
    process held the core; the CPU time does not, so it is the nearer figure for
    "per core" when the box is busy (it still pays for the caches and memory
    bandwidth that others use)."""

    def __init__(self) -> None:
        self.wall = math.inf
        self.cpu = math.inf

    def __call__(self, fn: Callable[..., R], *args: Any) -> R:
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn(*args)
        t1, c1 = time.perf_counter(), time.process_time()
        self.wall = min(self.wall, t1 - t0)
        self.cpu = min(self.cpu, c1 - c0)
        return out


def best_of(reps: int, fn: Callable[..., R], *args: Any) -> tuple[float, R]:
    """(fastest wall time of ``reps`` calls, the last call's result)."""
    best, out = timed(fn, *args)
    for _ in range(reps - 1):
        t, out = timed(fn, *args)
        best = min(best, t)
    return best, out


def extract_all(plan: FusionPlan, base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> list[ParamDelta]:
    return list(extract(plan, base, new))


def extract_encode(
    plan: FusionPlan,
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    options: EncodeOptions,
) -> list[EncodedSegment]:
    """What a publisher does: extraction feeding the encoder, one parameter at a time."""
    return list(encode_segments(extract(plan, base, new), 1, options))


def encode(deltas: list[ParamDelta], options: EncodeOptions) -> list[EncodedSegment]:
    return list(encode_segments(deltas, 1, options))


def decode_apply(named: list[tuple[str, bytes]], specs: Mapping[str, ParamSpec], sink: FusedWeights) -> None:
    apply_delta(stage_segments(named, 1, specs), sink)


@contextlib.contextmanager
def kernel_path(name: str) -> Iterator[None]:
    """Run the body on one kernel path (``jit`` or ``numpy``), the way a user
    picks it: through ``AURORA_NO_JIT``, restored afterwards."""
    before = os.environ.get(kernels.JIT_ENV)
    if name == "numpy":
        os.environ[kernels.JIT_ENV] = "1"
    else:
        os.environ.pop(kernels.JIT_ENV, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(kernels.JIT_ENV, None)
        else:
            os.environ[kernels.JIT_ENV] = before


def same_deltas(a: list[ParamDelta], b: list[ParamDelta]) -> bool:
    """Bit-for-bit equality of two extractions (indices, new and old bits)."""
    return len(a) == len(b) and all(
        x.name == y.name
        and x.indices.dtype == y.indices.dtype
        and x.indices.tobytes() == y.indices.tobytes()
        and x.new_bits.tobytes() == y.new_bits.tobytes()
        and x.old_bits.tobytes() == y.old_bits.tobytes()
        for x, y in zip(a, b, strict=False)
    )


def memcpy(tensors: Iterable[torch.Tensor], scratch: torch.Tensor) -> None:
    """Copy every tensor's bytes into ``scratch``: the reference for a scan."""
    for t in tensors:
        src = bits_view(t)
        scratch[: src.numel()].copy_(src)


def restore(t: torch.Tensor, blocks: Iterable[Block], weights: Mapping[str, torch.Tensor]) -> None:
    """Overwrite fused tensor ``t`` with the bits of its source tensors."""
    flat = bits_view(t)
    for b in blocks:
        flat[b.offset : b.offset + b.numel].copy_(bits_view(weights[b.source]))


def identical(plan: FusionPlan, fused: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> bool:
    """Bit-for-bit equality of fused tensors with the (split) reference weights."""
    for p in plan:
        flat = bits_view(fused[p.name])
        for b in p.blocks:
            if not torch.equal(flat[b.offset : b.offset + b.numel], bits_view(weights[b.source])):
                return False
    return True


def zstd_u32_bytes(deltas: Iterable[ParamDelta], level: int = 1) -> int:
    """zstd over the naive payload (u32 indices, then raw new values) of each parameter."""
    cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
    total = 0
    for d in deltas:
        if d.nnz:
            raw = d.indices.astype("<u4").tobytes() + d.new_bits.astype("<u2").tobytes()
            total += len(cctx.compress(raw))
    return total
