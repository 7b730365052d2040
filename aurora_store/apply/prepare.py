"""Preparing a delta: every check and the split over source tensors, done off the safe point.

:func:`prepare_part` does the per-entry half as each segment is decoded;
:func:`prepare_delta` joins the parts of a version, checks what spans
entries (order, overlaps), compiles the write kernel for the dtypes met and
moves the arrays to the weights' device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from aurora_store.apply.prepared_delta import (
    DenseWrite,
    Layout,
    MappedBlock,
    PreparedDelta,
    PreparedPart,
    SortedWrites,
)
from aurora_store.apply.tp_experts import mismatch
from aurora_store.apply.write_kernel import warm
from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entries import ParamSpec
from aurora_store.errors import ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta

__all__ = ["prepare_part", "prepare_delta"]

_INT32_MAX = (1 << 31) - 1


def _signed(width: int) -> np.dtype:
    return np.dtype(np.int16 if width == 2 else np.int32)


def prepare_part(
    version: int,
    entries: Sequence[Any],
    specs: Mapping[str, ParamSpec],
    layout: Layout,
    basis: object = None,
) -> PreparedPart:
    """``entries`` (decoded entries of delta ``version``) checked against the holder and split.

    The per-entry half of :func:`prepare_delta`: every check that concerns one
    entry, the split over source tensors, and owned copies with int32 indices
    where the tensor allows. Raises :class:`~aurora_store.errors.ModelMismatchError`.
    """
    pieces: dict[tuple[str, bool], list[tuple[np.ndarray, np.ndarray]]] = {}
    numels: dict[str, tuple[int, int]] = {}
    dense: list[DenseWrite] = []
    for e in entries:
        where = f"delta {version}: {e.param}"
        spec = specs.get(e.param)
        if spec is None:
            raise ModelMismatchError(f"delta {version}: the model has no parameter {e.param!r}")
        if e.spec != spec:
            raise ModelMismatchError(mismatch(where, e.param, e.spec, spec))
        width = DTYPES[spec.dtype].width
        if e.bits.dtype.itemsize != width:
            raise ModelMismatchError(f"{where} carries {e.bits.dtype.itemsize}-byte values, the model holds {spec.dtype}")
        if not 0 <= e.start < e.stop <= spec.numel:
            raise ModelMismatchError(f"{where} range [{e.start}, {e.stop}) does not fit its {spec.numel} elements")
        if e.values not in ("new", "xor"):
            raise ModelMismatchError(f"{where}: unknown value mode {e.values!r}")
        xor = e.values == "xor"
        bits = e.bits.reshape(-1).view(DTYPES[spec.dtype].bits)
        blocks = layout(e.param)
        if e.indices is None:
            if bits.size != e.stop - e.start:
                raise ModelMismatchError(f"{where}: dense range of {e.stop - e.start} elements carries {bits.size} values")
            for blk in blocks:
                if isinstance(blk, MappedBlock):
                    _mapped(pieces, numels, blk, np.arange(e.start, e.stop, dtype=np.int64), bits, xor, width)
                    continue
                source, off, n, loc, total = blk
                lo, hi = max(e.start, off), min(e.stop, off + n)
                if hi > lo:
                    numels[source] = (total, width)
                    dense.append(DenseWrite(source, total, width, xor, lo - off + loc, np.array(bits[lo - e.start : hi - e.start])))
            continue
        idx = e.indices.reshape(-1)
        if idx.size != bits.size:
            raise ModelMismatchError(f"{where} has {idx.size} indices and {bits.size} values")
        if idx.size == 0:
            continue
        if idx.dtype.kind not in "iu":
            raise ModelMismatchError(f"{where}: indices of dtype {idx.dtype}")
        if int(idx[0]) < e.start or int(idx[-1]) >= e.stop:
            raise ModelMismatchError(f"{where}: indices must lie in [{e.start}, {e.stop})")
        if idx.size > 1 and not bool(np.all(idx[1:] > idx[:-1])):
            raise ModelMismatchError(f"{where}: indices are not strictly increasing")
        for blk in blocks:
            if isinstance(blk, MappedBlock):
                _mapped(pieces, numels, blk, idx, bits, xor, width)
                continue
            source, off, n, loc, total = blk
            numels[source] = (total, width)
            if off <= e.start and e.stop <= off + n:
                lo, hi = 0, idx.size  # the whole entry in one block (the usual case)
            else:
                lo, hi = (int(x) for x in np.searchsorted(idx, (off, off + n)))
            if hi > lo:
                itype = np.int32 if total <= _INT32_MAX else np.int64
                part = idx[lo:hi]
                if off == loc:
                    run = np.array(part, dtype=itype)  # an owned copy, narrowed
                else:
                    run = (part - (off - loc)).astype(itype, copy=False)
                    if not run.flags.owndata:
                        run = run.copy()
                pieces.setdefault((source, xor), []).append((run, np.array(bits[lo:hi])))
    return PreparedPart(version, len(entries), pieces, numels, dense, basis)


def _mapped(
    pieces: dict[tuple[str, bool], list[tuple[np.ndarray, np.ndarray]]],
    numels: dict[str, tuple[int, int]],
    blk: MappedBlock,
    idx: np.ndarray,
    bits: np.ndarray,
    xor: bool,
    width: int,
) -> None:
    """An entry's writes into a source reached through a map (fused experts): one vectorised pass."""
    numels[blk.source] = (blk.total, width)
    sel, local = blk.localize(idx)
    if sel.size:
        itype = np.int32 if blk.total <= _INT32_MAX else np.int64
        pieces.setdefault((blk.source, xor), []).append((local.astype(itype), np.array(bits[sel])))


def prepare_delta(
    staged: StagedDelta,
    specs: Mapping[str, ParamSpec],
    layout: Layout,
    device: Callable[[str], torch.device] | None = None,
    parts: Sequence[PreparedPart] | None = None,
) -> PreparedDelta:
    """``staged`` checked against the holder (``specs``, fused names) and laid out over its source tensors.

    Raises :class:`~aurora_store.errors.ModelMismatchError` for anything that
    does not fit; the weights are not touched. ``device`` (source name ->
    device) moves the arrays to an accelerator now, not at the safe point.
    ``parts``: what :func:`prepare_part` made of ``staged``'s segments as they
    were decoded, with the same ``specs`` and ``layout``; they must cover
    its entries exactly. Only the checks across entries are left to do here.
    """
    if parts is None:
        parts = [prepare_part(staged.version, staged.entries, specs, layout)]
    elif sum(p.entries for p in parts) != len(staged.entries) or any(p.version != staged.version for p in parts):
        raise ValueError(f"delta {staged.version}: the prepared parts do not cover its {len(staged.entries)} entries")
    runs: dict[tuple[str, bool], list[tuple[np.ndarray, np.ndarray]]] = {}
    numels: dict[str, tuple[int, int]] = {}
    dense: list[DenseWrite] = []
    for part in parts:
        for k, rs in part.sparse.items():
            runs.setdefault(k, []).extend(rs)
        numels.update(part.numels)
        dense.extend(part.dense)
    sparse: list[SortedWrites] = []
    nnz = sum(d.bits.size for d in dense)
    for (source, xor), rs in sorted(runs.items()):
        n, width = numels[source]
        rs.sort(key=lambda r: int(r[0][0]))
        # Each run is strictly increasing (checked per entry); so is the whole when each run
        # starts after the last index of the one before: no element twice, and the first and
        # last index bound them all (the write kernel relies on it).
        chained = all(int(b[0]) > int(a[-1]) for (a, _), (b, _) in zip(rs, rs[1:], strict=False))
        if len(rs) == 1:
            ind, val = rs[0]
        else:
            itype = np.int64 if any(r[0].dtype == np.int64 for r in rs) else np.int32
            ind = np.concatenate([r[0] for r in rs]).astype(itype, copy=False)
            val = np.concatenate([r[1] for r in rs])
            if not chained:
                # Runs through a map (experts in another order on this rank) may interleave:
                # one sort of the changed elements, then no element may be there twice.
                order = np.argsort(ind, kind="stable")
                ind, val = ind[order], val[order]
                if bool(np.any(ind[1:] <= ind[:-1])):
                    raise ModelMismatchError(f"delta {staged.version}: {source} has indices out of order or written twice")
        if int(ind[0]) < 0 or int(ind[-1]) >= n:
            raise ModelMismatchError(f"delta {staged.version}: {source} has an index outside its {n} elements")
        nnz += ind.size
        ind.flags.writeable = False
        val.flags.writeable = False
        sparse.append(SortedWrites(source, n, width, xor, ind, val))
    _no_overlapping_ranges(staged)  # runs may interleave (above) only where entries do not overlap
    _no_overlap(staged.version, sparse, dense)
    for w in sparse:
        warm(w.bits.dtype.str, w.indices.dtype.str)  # compiled here, in the stager, not at the safe point
    if device is not None:
        sparse = [_to_device(w, device(w.source)) for w in sparse]
        dense = [_dense_to_device(d, device(d.source)) for d in dense]
    return PreparedDelta(staged.version, staged.base_version, nnz, tuple(sparse), tuple(dense))


def _no_overlapping_ranges(staged: StagedDelta) -> None:
    """No two entries of one parameter cover overlapping ranges (FORMAT.md §3), whoever staged the delta."""
    ranges = sorted((e.param, e.start, e.stop) for e in staged.entries)
    for (pa, _, a_stop), (pb, b_start, _) in zip(ranges, ranges[1:], strict=False):
        if pa == pb and b_start < a_stop:
            raise ModelMismatchError(f"delta {staged.version}: {pa} has overlapping entries")


def _no_overlap(version: int, sparse: Sequence[SortedWrites], dense: Sequence[DenseWrite]) -> None:
    """No element is reached by two writes (an XOR and an overwrite, or a dense range and either)."""
    by_source: dict[str, list[np.ndarray]] = {}
    for w in sparse:
        by_source.setdefault(w.source, []).append(w.indices)
    spans: dict[str, list[tuple[int, int]]] = {}
    for d in dense:
        spans.setdefault(d.source, []).append((d.start, d.start + d.bits.size))
    for source, arrays in by_source.items():
        if len(arrays) == 2 and np.intersect1d(arrays[0], arrays[1], assume_unique=True).size:
            raise ModelMismatchError(f"delta {version}: {source} has elements both overwritten and XORed")
        for lo, hi in spans.get(source, ()):
            for a in arrays:
                if int(np.searchsorted(a, hi)) > int(np.searchsorted(a, lo)):
                    raise ModelMismatchError(f"delta {version}: {source} has elements in a dense range and a sparse entry")
    for source, ranges in spans.items():
        ranges.sort()
        for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False):
            if lo < hi:
                raise ModelMismatchError(f"delta {version}: {source} has overlapping dense ranges")


def _to_device(w: SortedWrites, dev: torch.device) -> SortedWrites:
    if dev.type == "cpu":
        return w
    sig = _signed(w.width)
    return SortedWrites(
        w.source,
        w.numel,
        w.width,
        w.xor,
        w.indices,
        w.bits,
        torch.from_numpy(w.indices.astype(np.int64)).to(dev),
        torch.from_numpy(w.bits.copy().view(sig)).to(dev),
    )


def _dense_to_device(d: DenseWrite, dev: torch.device) -> DenseWrite:
    if dev.type == "cpu":
        return d
    return DenseWrite(
        d.source,
        d.numel,
        d.width,
        d.xor,
        d.start,
        d.bits,
        torch.from_numpy(d.bits.copy().view(_signed(d.width))).to(dev),
    )
