"""Applying a staged delta in place: the only code that writes weights.

A :class:`WeightSink` is whatever holds the model: fused tensors (what vLLM
keeps) or split Hugging Face tensors reached through the fusion reverse map.
:func:`apply_delta` checks the staged delta against the sink *before* the
first write, so a delta that does not fit changes nothing.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from aurora_store.apply.tp_experts import mismatch
from aurora_store.codec import kernels
from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entries import DecodedEntry, ParamSpec
from aurora_store.codec.extract import bits_view, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta

__all__ = ["WeightSink", "FusedWeights", "SplitWeights", "apply_delta", "weights_digest", "tree_weights_digest", "digest_as", "TREE_PREFIX"]


@runtime_checkable
class WeightSink(Protocol):
    """Where a delta lands. Implementations write in place, never reallocate,
    so an inference engine that holds these tensors sees the new version."""

    def specs(self) -> Mapping[str, ParamSpec]:
        """Fused name -> spec of every parameter the sink holds."""
        ...

    def write(self, entry: DecodedEntry, indices: torch.Tensor | None, bits: torch.Tensor) -> None:
        """Apply one validated entry; ``indices``/``bits`` are already on the sink's device."""
        ...

    def device(self, param: str) -> torch.device: ...


def _write_flat(
    flat_bits: torch.Tensor,
    indices: torch.Tensor | None,
    start: int,
    stop: int,
    bits: torch.Tensor,
    mode: str,
) -> None:
    if indices is None:
        view = flat_bits[start:stop]
        if mode == "xor":
            view.bitwise_xor_(bits)
        else:
            view.copy_(bits)
    elif flat_bits.device.type == "cpu" and indices.device.type == "cpu":
        # One pass over the changed elements (a compiled kernel where numba is
        # there); detach() shares storage, so this writes the weights in place.
        kernels.apply_bits(
            flat_bits.detach().numpy(),
            indices.numpy(),
            bits.detach().numpy(),
            mode == "xor",
        )
    else:
        _scatter_torch(flat_bits, indices, bits, mode)


def _scatter_torch(flat_bits: torch.Tensor, indices: torch.Tensor, bits: torch.Tensor, mode: str) -> None:
    """The scatter on an accelerator: one gather and one scatter, no temporaries
    the size of the tensor (indices are unique, so this is exact)."""
    if mode == "xor":
        flat_bits.index_copy_(0, indices, flat_bits.index_select(0, indices).bitwise_xor_(bits))
    else:
        flat_bits.index_copy_(0, indices, bits)


class FusedWeights:
    """Tensors under fused names, updated in place."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise ValueError(f"{name}: in-place updates need a contiguous tensor")
        self.tensors = dict(tensors)
        self._specs = {n: spec_of(t, n) for n, t in self.tensors.items()}

    def specs(self) -> Mapping[str, ParamSpec]:
        return self._specs

    def device(self, param: str) -> torch.device:
        return self.tensors[param].device

    def write(self, entry: DecodedEntry, indices: torch.Tensor | None, bits: torch.Tensor) -> None:
        _write_flat(
            bits_view(self.tensors[entry.param]),
            indices,
            entry.start,
            entry.stop,
            bits,
            entry.values,
        )


class SplitWeights:
    """Hugging Face tensors (q/k/v, gate/up kept apart), reached by the reverse map."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], plan: FusionPlan) -> None:
        self.tensors = dict(tensors)
        self.plan = plan
        for p in plan:
            for b in p.blocks:
                t = self.tensors.get(b.source)
                if t is None:
                    raise ModelMismatchError(f"{b.source}: the plan needs it, the weights lack it")
                if spec_of(t, b.source) != b.spec or not t.is_contiguous():
                    raise ModelMismatchError(
                        f"{b.source}: weights are {list(t.shape)} {t.dtype}, plan expects {list(b.spec.shape)} {b.spec.dtype}"
                    )

    def specs(self) -> Mapping[str, ParamSpec]:
        return self.plan.specs()

    def device(self, param: str) -> torch.device:
        return self.tensors[self.plan.params[param].blocks[0].source].device

    def write(self, entry: DecodedEntry, indices: torch.Tensor | None, bits: torch.Tensor) -> None:
        if indices is None:
            for blk, lo, hi, off in self.plan.split_range(entry.param, entry.start, entry.stop):
                flat = bits_view(self.tensors[blk.source])
                _write_flat(flat, None, lo, hi, bits[off : off + hi - lo], entry.values)
            return
        p = self.plan.params[entry.param]
        if len(p.blocks) == 1:
            _write_flat(bits_view(self.tensors[p.blocks[0].source]), indices, 0, 0, bits, entry.values)
            return
        for b in p.blocks:
            lo, hi = (int(x) for x in torch.searchsorted(indices, torch.tensor([b.offset, b.offset + b.numel], device=indices.device)))
            if hi > lo:
                _write_flat(
                    bits_view(self.tensors[b.source]),
                    indices[lo:hi] - b.offset,
                    0,
                    0,
                    bits[lo:hi],
                    entry.values,
                )


def check_fits(staged: StagedDelta, specs: Mapping[str, ParamSpec]) -> None:
    """Every entry names a parameter the sink has, with the same shape and dtype."""
    for e in staged.entries:
        have = specs.get(e.param)
        if have is None:
            raise ModelMismatchError(f"delta {staged.version}: the model has no parameter {e.param!r}")
        if have != e.spec:
            where = f"delta {staged.version}: {e.param}"
            raise ModelMismatchError(mismatch(where, e.param, e.spec, have))
        # Decoding validated all of this; a StagedDelta built by hand was not.
        where = f"delta {staged.version}: {e.param} [{e.start}, {e.stop})"
        if not 0 <= e.start < e.stop <= have.numel:
            raise ModelMismatchError(f"{where}: range outside the parameter's {have.numel} elements")
        if e.bits.dtype.itemsize != DTYPES[have.dtype].width:
            raise ModelMismatchError(f"{where}: {e.bits.dtype.itemsize}-byte values for a {have.dtype} parameter")
        if e.indices is None:
            if e.bits.size != e.stop - e.start:
                raise ModelMismatchError(f"{where}: dense entry holds {e.bits.size} values for {e.stop - e.start} elements")
        elif e.indices.size != e.bits.size:
            raise ModelMismatchError(f"{where}: {e.indices.size} indices but {e.bits.size} values")
        elif e.indices.size and (int(e.indices[0]) < e.start or int(e.indices[-1]) >= e.stop):
            raise ModelMismatchError(f"{where}: indices outside the range")


def apply_delta(staged: StagedDelta, sink: WeightSink) -> None:
    """Overwrite (or XOR) the changed elements in place.

    The delta was validated when staged; this re-checks that it fits the sink
    before the first write, then writes every entry.
    """
    check_fits(staged, sink.specs())
    for e in staged.entries:
        dev = sink.device(e.param)
        bits_np = e.bits.view(np.int16 if e.bits.dtype.itemsize == 2 else np.int32)
        if not bits_np.flags.writeable:
            bits_np = bits_np.copy()  # torch refuses read-only buffers (bytes from a segment)
        bits = torch.from_numpy(bits_np).to(dev, non_blocking=True)
        idx = torch.from_numpy(e.indices).to(dev, non_blocking=True) if e.indices is not None else None
        sink.write(e, idx, bits)


def _iter_bytes(t: torch.Tensor) -> Iterator[memoryview]:
    """The tensor's raw bytes in C order, little-endian whatever the host (FORMAT.md §4.1)."""
    flat = bits_view(t.detach().contiguous())
    step = 1 << 24
    for lo in range(0, flat.numel(), step):
        chunk = flat[lo : lo + step].cpu().numpy()
        if chunk.dtype.byteorder == ">" or (chunk.dtype.byteorder == "=" and sys.byteorder == "big"):
            chunk = chunk.astype(chunk.dtype.newbyteorder("<"))
        yield chunk.view(np.uint8).data


def weights_digest(tensors: Mapping[str, torch.Tensor], plan: FusionPlan | None = None) -> str:
    """``weights_digest`` of FORMAT.md §4.1 over the fused view of the weights.

    For each fused parameter in ascending order of its name: the UTF-8 bytes
    of ``name|[d0, d1, …]|dtype\n`` (``[]`` for a scalar; ``dtype`` as in a
    manifest's ``params``), then its raw little-endian bytes in C order (a
    fused tensor's bytes are its blocks' bytes one after the other: dim-0
    concatenation of row-major tensors). Equal for fused and split holders
    of the same weights, so an engine, a snapshot and the Trainer can
    compare what they hold; it is the digest snapshot manifests carry.
    """
    h = hashlib.sha256()
    if plan is None:
        plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in tensors.items()})
    for name in sorted(plan.params):
        p = plan.params[name]
        h.update(f"{name}|{list(p.spec.shape)}|{p.spec.dtype}\n".encode())
        for b in p.blocks:
            for chunk in _iter_bytes(tensors[b.source]):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


#: The prefix of FORMAT.md §4.1's tree digest (``"sha256:"`` names the streamed form).
TREE_PREFIX = "tree-sha256:"


def tree_weights_digest(tensors: Mapping[str, torch.Tensor], plan: FusionPlan | None = None, workers: int | None = None) -> str:
    """The tree form of ``weights_digest`` (FORMAT.md §4.1): a sha256 per fused tensor, then one over the list.

    For each fused parameter in ascending order of its name, the UTF-8 bytes
    of ``name|[d0, d1, …]|dtype|h\n``, ``h`` the lowercase hex sha256 of the
    tensor's raw little-endian bytes in C order (a fused tensor's bytes are its
    blocks' bytes one after the other, as in :func:`weights_digest`). Why: each
    leaf hashes on its own, so ``workers`` threads (hashlib releases the GIL
    on large buffers; default: the CPUs) cost about the largest tensor rather
    than the sum. Equal for fused and split holders of the same weights.
    """
    if plan is None:
        plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in tensors.items()})
    names = sorted(plan.params)

    def leaf(name: str) -> str:
        h = hashlib.sha256()
        for b in plan.params[name].blocks:
            for chunk in _iter_bytes(tensors[b.source]):
                h.update(chunk)
        return h.hexdigest()

    width = max(1, min(len(names), workers if workers is not None else (os.cpu_count() or 1)))
    if width == 1:
        leaves = [leaf(n) for n in names]
    else:
        with ThreadPoolExecutor(width, thread_name_prefix="aurora-digest") as pool:
            leaves = list(pool.map(leaf, names))
    top = hashlib.sha256()
    for name, h in zip(names, leaves, strict=True):
        p = plan.params[name]
        top.update(f"{name}|{list(p.spec.shape)}|{p.spec.dtype}|{h}\n".encode())
    return TREE_PREFIX + top.hexdigest()


def digest_as(expected: str, tensors: Mapping[str, torch.Tensor], plan: FusionPlan | None = None) -> str:
    """The digest of ``tensors`` in the form ``expected`` names (FORMAT.md §4.1: readers accept both
    forms and compute the one a manifest names); compare the result with ``expected``."""
    if expected.startswith(TREE_PREFIX):
        return tree_weights_digest(tensors, plan)
    return weights_digest(tensors, plan)
