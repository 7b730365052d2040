"""One weight's FP8 copy, quantized from scratch or kept current through sparse changes.

:func:`quantize` is the recipe (:mod:`aurora_store.quant.recipe`) applied to
a whole bf16 weight. :func:`requantize` brings the copy to exactly what
:func:`quantize` would give after a sparse change of the weight, doing work
proportional to the change: at RL densities nearly every block holds a
changed element, so skipping untouched blocks alone saves nothing, but a
block keeps its scale unless its largest magnitude changed. Each block
keeps its largest magnitude (``peak``) and how many elements hold it
(``ties``), so a change tells, without looking at the rest of the block:

- a changed element above ``peak``: the new largest magnitude is among the
  changes; the scale changes unless both sit under the ``1e-4`` floor;
- otherwise, if some element is still at ``peak`` (``ties`` minus the
  changed elements that left it plus those that reached it), the scale
  stays and only the changed elements are requantized;
- otherwise the largest element shrank: the block is rescanned and
  requantized whole.

Blocks whose scale changes are requantized whole as well. Everything is
numpy arrays of bit patterns: the bf16 weights as uint16, the FP8 copy as
``float8_e4m3fn`` bytes (uint8); :mod:`aurora_store.quant.weights` holds the
torch views an engine serves from.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from aurora_store.errors import ModelMismatchError
from aurora_store.quant import kernels
from aurora_store.quant.recipe import blocks_of, scale_shape

__all__ = ["BlockFP8", "Requant", "quantize", "requantize"]


@dataclass(slots=True)
class BlockFP8:
    """One weight's FP8 copy, its scales, and the per-block state that keeps them current."""

    shape: tuple[int, ...]
    """The weight's shape: ``[rows, cols]`` or a stack of experts ``[E, rows, cols]``."""
    q: np.ndarray
    """``float8_e4m3fn`` bytes (uint8), ``shape``."""
    scale_inv: np.ndarray
    """float32 per block, :func:`~aurora_store.quant.recipe.scale_shape` of ``shape``."""
    peak: np.ndarray
    """Largest magnitude per block, as bf16 bits without the sign (uint16)."""
    ties: np.ndarray
    """Elements at ``peak`` per block (int32)."""

    @property
    def numel(self) -> int:
        return int(self.q.size)

    @property
    def blocks(self) -> int:
        return int(self.scale_inv.size)

    def copy(self) -> BlockFP8:
        return BlockFP8(self.shape, self.q.copy(), self.scale_inv.copy(), self.peak.copy(), self.ties.copy())


@dataclass(slots=True)
class Requant:
    """What one :func:`requantize` (or a sum of them) did."""

    changed: int = 0
    """bf16 elements changed."""
    scales_changed: int = 0
    """Blocks whose scale changed."""
    shrunk: int = 0
    """Blocks rescanned because their largest element shrank (with no tie left)."""
    whole_blocks: int = 0
    """Blocks rescanned and requantized whole (scale changed, or shrunk)."""
    work: int = 0
    """Changed elements plus every element of the blocks redone whole (a change inside one counted twice)."""

    def __add__(self, other: Requant) -> Requant:
        return Requant(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def _bits(a: np.ndarray, what: str) -> np.ndarray:
    if a.dtype == np.int16:
        return a.view(np.uint16)
    if a.dtype != np.uint16:
        raise ModelMismatchError(f"{what}: FP8 block quantization reads bfloat16 weights (as 16-bit patterns), got {a.dtype}")
    return a


def _flat_bits(bits: np.ndarray, name: str) -> np.ndarray:
    bits = _bits(bits, name)
    if not bits.flags.c_contiguous:
        raise ModelMismatchError(f"{name}: the weight must be C-contiguous")
    return bits.reshape(-1)


def quantize(bits: np.ndarray, name: str = "weight", jit: bool | None = None, out: BlockFP8 | None = None) -> BlockFP8:
    """The recipe applied to a whole weight (its bf16 bit patterns, 2-D or a 3-D stack of experts).

    ``out``: a copy of the same shape to overwrite instead of new arrays (a
    from-scratch pass over a copy an engine already serves from; its
    contents before do not matter). Raises
    :class:`~aurora_store.errors.ModelMismatchError` for another dtype or
    shape, or when a value is infinite or NaN (no finite scale serves it).
    """
    shape = tuple(int(d) for d in bits.shape)
    _, rows, cols = blocks_of(shape, name)
    flat = _flat_bits(bits, name)
    sshape = scale_shape(shape)
    if out is None:
        out = BlockFP8(
            shape,
            np.empty(shape, np.uint8),
            np.empty(sshape, np.float32),
            np.empty(sshape, np.uint16),
            np.empty(sshape, np.int32),
        )
    elif out.shape != shape:
        raise ModelMismatchError(f"{name}: the weight is {list(shape)}, its FP8 copy {list(out.shape)}")
    kernels.quantize_blocks(
        flat, rows, cols, None, out.q.reshape(-1), out.scale_inv.reshape(-1), out.peak.reshape(-1), out.ties.reshape(-1), jit
    )
    if int(out.peak.max()) >= kernels.NONFINITE:
        raise ModelMismatchError(f"{name}: holds an infinite or NaN value; FP8 block quantization needs finite weights")
    return out


def requantize(
    fp8: BlockFP8,
    bits: np.ndarray,
    indices: np.ndarray,
    old_bits: np.ndarray,
    new_bits: np.ndarray | None = None,
    name: str = "weight",
    jit: bool | None = None,
) -> Requant:
    """Bring ``fp8`` to :func:`quantize` of ``bits``, the weight after a sparse change, in place.

    ``indices``: the changed elements' flat indices (int32 or int64, strictly
    increasing, as a prepared delta's are); ``old_bits``/``new_bits``: their
    bf16 bits before and after the change (uint16; ``new_bits`` None reads
    them from ``bits``: a delta's writer has them at hand, and then the
    weight is read only where a block is redone whole). ``fp8`` must be
    current for the weight before the change. Nothing is written (and a
    :class:`~aurora_store.errors.ModelMismatchError` raised) if a shape or
    dtype differs, an index is out of order or out of bounds, or a new value
    is infinite or NaN.
    """
    shape = tuple(int(d) for d in bits.shape)
    if shape != fp8.shape:
        raise ModelMismatchError(f"{name}: the weight is {list(shape)}, its FP8 copy {list(fp8.shape)}")
    _, rows, cols = blocks_of(shape, name)
    flat = _flat_bits(bits, name)
    old = _bits(np.asarray(old_bits), f"{name} (old values)")
    if indices.ndim != 1 or indices.dtype not in (np.int32, np.int64) or old.shape != indices.shape:
        raise ModelMismatchError(f"{name}: {indices.shape} {indices.dtype} indices for {old.shape} old values (int32/int64, one each)")
    if indices.size == 0:
        return Requant()
    if new_bits is None:
        if int(indices.min()) < 0 or int(indices.max()) >= flat.size:
            raise ModelMismatchError(f"{name}: change has indices out of order or out of bounds; FP8 copy left as it was")
        new = flat[indices]
    else:
        new = _bits(np.asarray(new_bits), f"{name} (new values)")
        if new.shape != indices.shape:
            raise ModelMismatchError(f"{name}: {new.shape} new values for {indices.shape} indices")
    q, scale, peak, ties = fp8.q.reshape(-1), fp8.scale_inv.reshape(-1), fp8.peak.reshape(-1), fp8.ties.reshape(-1)
    got = kernels.requantize_changes(
        rows, cols, np.ascontiguousarray(indices), np.ascontiguousarray(old), np.ascontiguousarray(new), q, scale, peak, ties, jit
    )
    if isinstance(got, int):
        why = "holds an infinite or NaN value after the change" if got == -1 else "change has indices out of order or out of bounds"
        raise ModelMismatchError(f"{name}: {why}; FP8 copy left as it was")
    rescan, grown = got
    rescaled = elements = 0
    for blocks, scan in ((rescan, True), (grown, False)):
        if blocks.size:
            r, n = kernels.quantize_blocks(flat, rows, cols, blocks, q, scale, peak, ties, jit, scan=scan)
            rescaled, elements = rescaled + r, elements + n
    return Requant(
        changed=int(indices.size),
        scales_changed=rescaled,
        shrunk=int(rescan.size),
        whole_blocks=int(rescan.size + grown.size),
        work=int(indices.size) + elements,
    )
