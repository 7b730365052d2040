"""Quantization of the served weights: FP8 block copies of a bf16 chain (issue 27).

The chain stays bf16 and lossless; an Actor or a follower that serves FP8
keeps the bf16 truth beside an FP8 copy and brings the copy up to date after
each delta, bit for bit what quantizing that version from scratch gives.
Everything about it lives here, used by the Actor's engines, ``aurora
follow --quantize`` and ``aurora bench fp8``:

- :mod:`~aurora_store.quant.recipe`: format names, which weights are
  quantized, the shape of the scales;
- :mod:`~aurora_store.quant.block`: one weight: :func:`quantize` and the
  incremental :func:`requantize`, over numpy bit patterns;
- :mod:`~aurora_store.quant.kernels`: the block recomputation and the
  one-pass requantization of a change, compiled with numba;
  :mod:`~aurora_store.quant.twins`: their numpy twins;
- :mod:`~aurora_store.quant.weights`: a model's FP8 copy over torch tensors
  (:class:`Fp8Weights`), its checkpoint names and its digest. Imports torch;
  the names above do not.

A layer beside ``apply`` and ``storage``: it imports ``codec`` (the kernels'
numba switch) and the shared modules, and nothing in the library imports
it: the workers and the tools do. How a thin caller keeps a copy current
after a delta: gather the old bits at a prepared delta's sorted indices of
each quantized source tensor, write the delta, then
:meth:`Fp8Weights.requantize` with those indices, the old bits and the new
ones (the delta's values, or ``old ^ mask`` for XOR writes).
"""

from __future__ import annotations

from aurora_store.quant.block import BlockFP8, Requant, quantize, requantize
from aurora_store.quant.recipe import FORMATS, FP8_BLOCK128, SCALE_SUFFIX, check_format, is_quantized, scale_name, scale_shape

__all__ = [
    "FP8_BLOCK128",
    "FORMATS",
    "SCALE_SUFFIX",
    "BlockFP8",
    "Requant",
    "check_format",
    "is_quantized",
    "quantize",
    "requantize",
    "scale_name",
    "scale_shape",
]
