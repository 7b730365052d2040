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
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from aurora_store.errors import ModelMismatchError
from aurora_store.quant.block import BlockFP8, Requant, quantize, requantize
from aurora_store.quant.recipe import FP8_BLOCK128, check_format, is_quantized, scale_name

__all__ = ["Fp8Weights", "bf16_bits"]


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
    def of(cls, weights: Mapping[str, torch.Tensor], fmt: str = FP8_BLOCK128, jit: bool | None = None) -> Fp8Weights:
        """Quantize every weight of ``weights`` (Hugging Face names, bf16) that ``fmt`` quantizes, from scratch."""
        check_format(fmt)
        return cls({n: quantize(bf16_bits(t, n), n, jit) for n, t in weights.items() if is_quantized(n, tuple(t.shape))}, fmt)

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
