"""A model's FP8 serving copy over torch tensors: what an engine serves and a follower writes.

:class:`Fp8Weights` quantizes every weight the format quantizes
(:func:`~aurora_store.quant.recipe.is_quantized`) from a model's bf16 tensors
and keeps each current through :meth:`Fp8Weights.requantize`, given the
changed elements of the bf16 tensor (a prepared delta's sorted writes carry
them; the old bits are read before the write). The FP8 bytes and scales are
numpy arrays that :meth:`Fp8Weights.tensors` shares with torch (no copy), so
an engine that serves from those tensors sees every requantization in place.
The bf16 tensors themselves stay with the caller; the ones not quantized
(embeddings, norms, routers, the head) are served as they are.

Whole-model work (:meth:`Fp8Weights.of`, :meth:`Fp8Weights.requantize_all`)
runs the weights on ``threads`` threads (default: the CPUs this process may
use; one for less than :data:`PARALLEL_MIN` of work): the kernels release the GIL, and a safe point has nothing else to do
with the cores while generation waits. Largest weights first, so the last
one to finish is a small one.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from aurora_store.errors import ModelMismatchError
from aurora_store.quant.block import BlockFP8, Requant, quantize, requantize
from aurora_store.quant.recipe import FP8_BLOCK128, check_format, is_quantized, scale_name

__all__ = ["Fp8Weights", "Change", "bf16_bits", "default_threads", "run_all"]

T = TypeVar("T")

#: One weight's sparse change: (name, the bf16 tensor after it, flat indices, old bits, new bits or None).
Change = tuple[str, torch.Tensor, np.ndarray, np.ndarray, "np.ndarray | None"]


#: Below this much work in all (changed elements to requantize, or elements to quantize) the
#: weights run on the calling thread: starting threads and handing them work costs about a
#: millisecond, more than a small model's whole requantization (the demo's: 0.3-0.6 ms).
PARALLEL_MIN = 1 << 20


def default_threads() -> int:
    """The CPUs this process may run on (its affinity mask where the platform has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_all(jobs: Sequence[tuple[int, Callable[[], T]]], threads: int | None) -> list[T]:
    """Run ``(size, job)`` pairs, largest first, on up to ``threads`` threads (one when their sizes
    add up to less than :data:`PARALLEL_MIN`); results in the given order.

    Every job runs to its end before an error is raised (the first one in
    the given order): no thread is still writing when the caller handles it.
    """
    width = min(len(jobs), threads if threads is not None else default_threads())
    if width <= 1 or sum(size for size, _ in jobs) < PARALLEL_MIN:
        return [job() for _, job in jobs]
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][0])
    with ThreadPoolExecutor(width, thread_name_prefix="aurora-quant") as pool:
        futures = {i: pool.submit(jobs[i][1]) for i in order}
        errors = {i: f.exception() for i, f in futures.items()}
    for i in range(len(jobs)):
        if (e := errors[i]) is not None:
            raise e
    return [futures[i].result() for i in range(len(jobs))]


def bf16_bits(t: torch.Tensor, name: str = "weight") -> np.ndarray:
    """The bit patterns (uint16, same shape, shared memory) of a CPU bf16 tensor; a clear error otherwise."""
    if t.dtype != torch.bfloat16:
        raise ModelMismatchError(
            f"{name}: is {str(t.dtype).removeprefix('torch.')}; FP8 serving quantizes a bf16 chain (an already quantized checkpoint cannot be its base)"
        )
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ModelMismatchError(f"{name}: the bf16 weight must be a contiguous CPU tensor to quantize it")
    return t.detach().view(torch.int16).numpy().view(np.uint16)


class Fp8Weights:
    """The FP8 copy of a model's quantized weights, each with its scales and per-block state."""

    def __init__(self, blocks: Mapping[str, BlockFP8], fmt: str = FP8_BLOCK128) -> None:
        self.format = check_format(fmt)
        self.blocks: dict[str, BlockFP8] = dict(blocks)

    @classmethod
    def of(
        cls, weights: Mapping[str, torch.Tensor], fmt: str = FP8_BLOCK128, jit: bool | None = None, threads: int | None = None
    ) -> Fp8Weights:
        """Quantize every weight of ``weights`` (Hugging Face names, bf16) that ``fmt`` quantizes, from scratch."""
        check_format(fmt)
        names = [n for n, t in weights.items() if is_quantized(n, tuple(t.shape))]
        bits = {n: bf16_bits(weights[n], n) for n in names}  # every dtype checked before any work
        done = run_all([(bits[n].size, functools.partial(quantize, bits[n], n, jit)) for n in names], threads)
        return cls(dict(zip(names, done, strict=True)), fmt)

    def refresh(self, weights: Mapping[str, torch.Tensor], jit: bool | None = None, threads: int | None = None) -> None:
        """Quantize every weight of the copy from scratch again, from ``weights`` (the same names and
        shapes), into the arrays it already has: what a from-scratch pass costs an engine that serves
        from them, with no allocation in it."""
        missing = sorted(set(self.blocks) - set(weights))
        if missing:
            raise ModelMismatchError(f"refresh: no weight for {missing[0]} (and {len(missing) - 1} more)")
        bits = {n: bf16_bits(weights[n], n) for n in self.blocks}
        run_all([(b.size, functools.partial(quantize, b, n, jit, self.blocks[n])) for n, b in bits.items()], threads)

    def __contains__(self, name: object) -> bool:
        return name in self.blocks

    def __iter__(self) -> Iterator[str]:
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def numel(self) -> int:
        """Elements quantized."""
        return sum(b.numel for b in self.blocks.values())

    def requantize(
        self,
        name: str,
        weight: torch.Tensor,
        indices: np.ndarray,
        old_bits: np.ndarray,
        new_bits: np.ndarray | None = None,
        jit: bool | None = None,
    ) -> Requant:
        """Bring ``name``'s copy to the from-scratch quantization of ``weight``, the bf16 tensor after a
        sparse change at ``indices`` (bits ``old_bits`` before, ``new_bits`` after: None reads them from
        ``weight``); a no-op for a weight that is not quantized."""
        blk = self.blocks.get(name)
        if blk is None:
            return Requant()
        return requantize(blk, bf16_bits(weight, name), indices, old_bits, new_bits, name, jit)

    def requantize_all(self, changes: Sequence[Change], jit: bool | None = None, threads: int | None = None) -> Requant:
        """:meth:`requantize` of each change, on up to ``threads`` threads; their :class:`Requant` summed.

        Each weight is left as :meth:`requantize` leaves it, so a refused
        change leaves its own copy as it was; the others still run to their
        end before the first refusal (in the given order) is raised. A name
        may appear once.
        """
        names = [c[0] for c in changes]
        if len(set(names)) != len(names):
            raise ValueError("requantize_all: a weight appears twice; requantize its changes in order instead")
        got = run_all([(int(c[2].size), functools.partial(self.requantize, *c, jit)) for c in changes], threads)
        return sum(got, Requant())

    def tensors(self) -> dict[str, torch.Tensor]:
        """``name`` -> its ``float8_e4m3fn`` weight and ``name_scale_inv`` -> its float32 scales, sharing memory with the copy."""
        out: dict[str, torch.Tensor] = {}
        for name, blk in self.blocks.items():
            out[name] = torch.from_numpy(blk.q).view(torch.float8_e4m3fn)
            out[scale_name(name)] = torch.from_numpy(blk.scale_inv)
        return out

    def digest(self) -> str:
        """sha256 over the served tensors in ascending name order: ``name|[d0, d1, ...]|dtype\\n`` then the raw bytes.

        Equal for two copies exactly when every FP8 byte and scale is: how a
        holder proves its copy is the from-scratch quantization of a version.
        """
        h = hashlib.sha256()
        arrays: dict[str, tuple[np.ndarray, str]] = {}
        for name, blk in self.blocks.items():
            arrays[name] = (blk.q, "float8_e4m3fn")
            arrays[scale_name(name)] = (blk.scale_inv, "float32")
        for name in sorted(arrays):
            a, dtype = arrays[name]
            h.update(f"{name}|{list(a.shape)}|{dtype}\n".encode())
            h.update(np.ascontiguousarray(a).data)
        return "sha256:" + h.hexdigest()
