"""Extraction: which elements of a parameter changed, bit for bit.

Two weights are "the same" only when their bit patterns are equal: -0.0 vs
+0.0 and NaNs with other payloads are changes, so the comparison never uses
float equality. The scan compares 64-bit words first (four bf16 elements at a
time) and only looks at lanes of words that differ; at RL densities (~1%)
that makes it a streaming read of both tensors, close to memory bandwidth.

CPU tensors go through :func:`aurora_store.codec.kernels.scan_changes`, which
returns the changed indices together with their new and old bits, gathered
while each piece of the tensors is still in cache (a compiled kernel, or
chunked numpy). Tensors on an accelerator go through
:func:`changed_indices`, which runs on their device in bounded chunks; only
the changed indices and values travel to the host.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from aurora_store.codec import kernels
from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.fusion import EMBED, TIED_HEAD, FusionPlan
from aurora_store.errors import ModelMismatchError

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "TORCH_DTYPES",
    "ParamDelta",
    "bits_view",
    "changed_indices",
    "extract",
    "fuse_weights",
    "plan_of",
    "spec_of",
    "unfuse_weights",
]

#: Elements compared per step; bounds the temporary masks (~1/4 byte per element).
DEFAULT_CHUNK_ELEMS = 1 << 24

TORCH_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}
_BITS: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
}
_NP_BITS = {torch.int16: np.uint16, torch.int32: np.uint32}


def spec_of(t: torch.Tensor, name: str = "tensor") -> ParamSpec:
    try:
        return ParamSpec(tuple(t.shape), TORCH_DTYPES[t.dtype])
    except KeyError:
        raise ModelMismatchError(f"{name}: dtype {t.dtype} is not carried (bfloat16, float16, float32)") from None


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """Flat signed-integer view of a float tensor's bit patterns (no copy)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return t.reshape(-1).view(_BITS[t.dtype])


def _to_numpy_bits(t: torch.Tensor) -> np.ndarray:
    return t.cpu().numpy().view(_NP_BITS[t.dtype])


def _numpy_bits(t: torch.Tensor) -> np.ndarray:
    """Unsigned bit patterns of a contiguous CPU float tensor, sharing its memory."""
    b = bits_view(t.detach())
    return b.numpy().view(_NP_BITS[b.dtype])


def changed_indices(base: torch.Tensor, new: torch.Tensor, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> torch.Tensor:
    """Sorted int64 flat indices where the bit patterns of ``base`` and ``new`` differ."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ModelMismatchError(f"shapes/dtypes differ: {list(base.shape)} {base.dtype} vs {list(new.shape)} {new.dtype}")
    a, b = bits_view(base), bits_view(new)
    n = a.numel()
    lanes = 8 // a.element_size()
    chunk = max(lanes, chunk_elems - chunk_elems % lanes)
    found: list[torch.Tensor] = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        ca, cb = a[lo:hi], b[lo:hi]
        whole = (hi - lo) - (hi - lo) % lanes
        aligned = whole > 0 and (ca.storage_offset() * a.element_size()) % 8 == 0 and (cb.storage_offset() * b.element_size()) % 8 == 0
        if aligned:
            wa, wb = ca[:whole].view(torch.int64), cb[:whole].view(torch.int64)
            words = torch.nonzero(wa != wb).reshape(-1)
            if words.numel():
                la = ca[:whole].view(-1, lanes)[words]
                lb = cb[:whole].view(-1, lanes)[words]
                sub = torch.nonzero(la != lb)
                found.append(words[sub[:, 0]] * lanes + sub[:, 1] + lo)
            tail_lo = whole
        else:
            tail_lo = 0
        if tail_lo < hi - lo:
            t = torch.nonzero(ca[tail_lo:] != cb[tail_lo:]).reshape(-1)
            if t.numel():
                found.append(t + (lo + tail_lo))
    if not found:
        return torch.empty(0, dtype=torch.int64, device=base.device)
    return torch.cat(found)


@dataclass(frozen=True, slots=True)
class ParamDelta:
    """The changes of one fused parameter, on the host."""

    name: str
    spec: ParamSpec
    indices: np.ndarray
    """Sorted int64 fused flat indices that changed."""
    new_bits: np.ndarray
    """New bit patterns at ``indices``."""
    old_bits: np.ndarray
    """Old bit patterns at ``indices`` (for ``xor`` values)."""
    _new: tuple[tuple[int, torch.Tensor], ...] = ()
    """(offset, flat bit view of the new source tensor) per block, for dense ranges."""

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    def read_new_range(self, start: int, stop: int) -> np.ndarray:
        """New bit patterns of the fused range ``[start, stop)``."""
        parts: list[np.ndarray] = []
        for off, t in self._new:
            lo, hi = max(start, off), min(stop, off + t.numel())
            if hi > lo:
                parts.append(_to_numpy_bits(t[lo - off : hi - off]))
        return np.concatenate(parts) if len(parts) != 1 else parts[0]


def extract(
    plan: FusionPlan,
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    chunk_elems: int = DEFAULT_CHUNK_ELEMS,
) -> Iterator[ParamDelta]:
    """Yield the changes of every parameter of ``plan``, one parameter at a time.

    ``base`` and ``new`` map source (Hugging Face or fused) names to tensors;
    unchanged parameters are yielded too, with no indices, so a caller sees
    the whole model. ``chunk_elems`` bounds the scratch memory of the scan
    on an accelerator; the CPU scan works in cache-sized pieces on its own.
    """
    for p in plan:
        pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for blk in p.blocks:
            try:
                tb, tn = base[blk.source], new[blk.source]
            except KeyError as e:
                raise ModelMismatchError(f"{blk.source}: missing from the {'base' if blk.source not in base else 'new'} weights") from e
            for which, t in (("base", tb), ("new", tn)):
                if spec_of(t, blk.source) != blk.spec:
                    raise ModelMismatchError(
                        f"{blk.source}: {which} weights are {list(t.shape)} {t.dtype}, the plan expects {list(blk.spec.shape)} {blk.spec.dtype}"
                    )
            pairs.append((blk.offset, tb.contiguous(), tn.contiguous()))
        bits_dtype = DTYPES[p.spec.dtype].bits
        if all(tb.device.type == "cpu" and tn.device.type == "cpu" for _, tb, tn in pairs):
            # All blocks in one pass, into one set of arrays (no concatenation).
            idx, new_bits, old_bits = kernels.scan_blocks([(off, _numpy_bits(tb), _numpy_bits(tn)) for off, tb, tn in pairs])
        else:
            idx_parts: list[np.ndarray] = []
            new_parts: list[np.ndarray] = []
            old_parts: list[np.ndarray] = []
            for off, tb, tn in pairs:
                t_idx = changed_indices(tb, tn, chunk_elems)
                if t_idx.numel():
                    new_parts.append(_to_numpy_bits(bits_view(tn)[t_idx]))
                    old_parts.append(_to_numpy_bits(bits_view(tb)[t_idx]))
                    idx_parts.append(t_idx.cpu().numpy() + off)
            idx = _cat(idx_parts, np.dtype(np.int64))
            new_bits, old_bits = _cat(new_parts, bits_dtype), _cat(old_parts, bits_dtype)
        yield ParamDelta(
            p.name,
            p.spec,
            idx,
            new_bits,
            old_bits,
            tuple((off, bits_view(tn)) for off, _, tn in pairs),
        )


def _cat(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    if not parts:
        return np.empty(0, dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


# ---------------------------------------------------------------------------
# fusing Hugging Face weights into engine tensors


def plan_of(weights: Mapping[str, torch.Tensor], tied: bool, where: str = "", family: str | None = None) -> FusionPlan:
    """The fusion plan (FORMAT.md §2) of Hugging Face-named (or fused) tensors.

    ``where`` prefixes the names in error messages (a file name, say);
    ``family`` is the config's ``model_type`` (see :meth:`FusionPlan.from_specs`).
    """
    prefix = f"{where}: " if where else ""
    specs = {n: spec_of(t, prefix + n) for n, t in weights.items()}
    try:
        return FusionPlan.from_specs(specs, tied_lm_head=tied, family=family)
    except ModelMismatchError as e:
        if not prefix:
            raise
        raise ModelMismatchError(f"{prefix}{e}") from None


def fuse_weights(weights: Mapping[str, torch.Tensor], plan: FusionPlan) -> dict[str, torch.Tensor]:
    """New contiguous tensors under fused names (qkv_proj, gate_up_proj): what a
    snapshot holds and an engine loads. The one implementation every caller uses.

    Fused parameters are new tensors (``torch.cat`` of the blocks in plan
    order); unfused ones are detached clones, so the result never aliases
    ``weights`` and writing into it leaves the model alone.
    """
    return {
        p.name: torch.cat([weights[b.source].detach().reshape(-1) for b in p.blocks]).view(p.spec.shape)
        if len(p.blocks) > 1
        else weights[p.blocks[0].source].detach().contiguous().clone()
        for p in plan
    }


def unfuse_weights(fused: Mapping[str, torch.Tensor], plan: FusionPlan) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_weights`: tensors under their Hugging Face names.

    Each source tensor is a view into the fused one (no copy); a tied
    ``lm_head.weight`` the plan dropped is the embedding, under both names.
    A fused tensor of the wrong shape or a missing one raises
    :class:`~aurora_store.errors.ModelMismatchError`.
    """
    out: dict[str, torch.Tensor] = {}
    for p in plan:
        t = fused.get(p.name)
        if t is None or tuple(t.shape) != tuple(p.spec.shape):
            got = "missing" if t is None else f"{list(t.shape)}"
            raise ModelMismatchError(f"{p.name}: expected {list(p.spec.shape)}, got {got}")
        flat = t.reshape(-1)
        for b in p.blocks:
            out[b.source] = flat[b.offset : b.offset + b.numel].view(b.spec.shape)
    for name in plan.dropped:
        if name == TIED_HEAD and EMBED in out:
            out[name] = out[EMBED]
    return out
