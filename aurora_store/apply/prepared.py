"""Deltas prepared for activation: everything but the final write, done while generating.

A :class:`~aurora_store.format.checkpoint.StagedDelta` is decoded and
validated, but applying it still checks every entry, splits fused entries
into their source tensors, searches block boundaries and makes values
writable, all at the safe point. :func:`prepare_delta` does that work ahead
of time, off the critical path (the Actor's stager thread), against the
layout of the weights it will land in:

- every entry is checked against the holder's parameters (name, shape,
  dtype, range, index bounds, value count and width);
- fused entries are split into their source tensors (q/k/v, gate/up);
- the writes of each source tensor are grouped by mode (overwrite or XOR)
  and concatenated in index order into one array of indices (int32 where
  the tensor allows: half the index traffic) and one of values, and the
  concatenation is checked strictly increasing: no element is written
  twice, and one look at the first and the last index bounds them all;
- values are owned, contiguous, unsigned copies (a segment's bytes are
  read-only).

:meth:`PreparedDelta.write` is then the safe point's whole job: it checks
that every target tensor is still there with the same size, width and
device (nothing written until all are), and runs one compiled pass per
(tensor, mode) over sorted indices: consecutive writes fall in the same or
the next cache lines, so the pass costs about the memory traffic of the
lines it touches. After preparation nothing can fail halfway: a delta is
written whole or not at all.

:func:`predicted_digest` gives the ``weights_digest`` the weights will have
once a prepared delta is written, computed while they still hold the base
(reading them through small scratch buffers, writing nothing), so an engine
can report its digest right after the safe point instead of hashing every
weight there.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.extract import bits_view
from aurora_store.codec.fusion import FusionPlan
from aurora_store.codec.kernels.jit import compiled, readonly, use_jit
from aurora_store.errors import ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta

__all__ = [
    "Layout",
    "PreparedDelta",
    "PreparedPart",
    "SortedWrites",
    "DenseWrite",
    "prepare_delta",
    "prepare_part",
    "parts_of",
    "predicted_digest",
    "layout_of_plan",
    "layout_of_shards",
    "write_sorted",
]

#: fused parameter -> its blocks: (source tensor, offset in the fused parameter, elements, offset in
#: the source tensor, elements of the source tensor). Elements of the parameter in no block are not
#: held here (another rank's shard) and are skipped.
Layout = Callable[[str], Sequence[tuple[str, int, int, int, int]]]

log = logging.getLogger(__name__)

_INT32_MAX = (1 << 31) - 1


def layout_of_plan(plan: FusionPlan) -> Layout:
    """The layout of split (Hugging Face) tensors reached through ``plan``'s reverse map."""

    def blocks(param: str) -> Sequence[tuple[str, int, int, int, int]]:
        return [(b.source, b.offset, b.numel, 0, b.numel) for b in plan.params[param].blocks]

    return blocks


@dataclass(frozen=True, slots=True)
class SortedWrites:
    """Every sparse write of one mode into one source tensor, in strictly increasing index order."""

    source: str
    numel: int
    """Elements of the source tensor (checked again against the live tensor before writing)."""
    width: int
    """Bytes per element."""
    xor: bool
    indices: np.ndarray
    """Flat indices into the source tensor (int32, or int64 past 2**31 elements), strictly increasing."""
    bits: np.ndarray
    """Unsigned values (new bits, or XOR masks), one per index."""
    dev_indices: torch.Tensor | None = None
    """On an accelerator: the indices there (int64), moved while preparing."""
    dev_bits: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class DenseWrite:
    """One contiguous range of a source tensor, overwritten or XORed."""

    source: str
    numel: int
    width: int
    xor: bool
    start: int
    bits: np.ndarray
    dev_bits: torch.Tensor | None = None


@dataclass(slots=True)
class PreparedDelta:
    """A delta ready for the safe point (built by :func:`prepare_delta` only)."""

    version: int
    base_version: int
    nnz: int
    sparse: tuple[SortedWrites, ...]
    dense: tuple[DenseWrite, ...]
    digest: str | None = None
    """The weights digest after this delta, when an engine predicted it (:func:`predicted_digest`)."""
    digest_basis: object = None
    """What the prediction was made on (an engine's own token for the weights it then held)."""

    @property
    def nbytes(self) -> int:
        """Memory held (indices and values)."""
        return sum(w.indices.nbytes + w.bits.nbytes for w in self.sparse) + sum(
            d.bits.nbytes for d in self.dense
        )

    def check_live(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every target tensor is still there, contiguous, with the size, width and device prepared for."""
        targets: list[SortedWrites | DenseWrite] = [*self.sparse, *self.dense]
        for w in targets:
            t = tensors.get(w.source)
            if t is None:
                raise ModelMismatchError(
                    f"delta {self.version}: the weights no longer hold {w.source!r}"
                )
            if t.numel() != w.numel or t.element_size() != w.width or not t.is_contiguous():
                raise ModelMismatchError(
                    f"delta {self.version}: {w.source} is {list(t.shape)} {t.dtype} now, not the tensor it was prepared for"
                )
            on_dev = w.dev_bits is not None
            if on_dev != (t.device.type != "cpu") or (
                w.dev_bits is not None and w.dev_bits.device != t.device
            ):
                raise ModelMismatchError(
                    f"delta {self.version}: {w.source} moved to {t.device} since it was prepared"
                )

    def write(self, tensors: Mapping[str, torch.Tensor], jit: bool | None = None) -> None:
        """Write every change into ``tensors`` (source name -> tensor) in place; all checks come first."""
        self.check_live(tensors)
        with torch.no_grad():
            for d in self.dense:
                view = bits_view(tensors[d.source])[d.start : d.start + d.bits.size]
                if d.dev_bits is not None:
                    if d.xor:
                        view.bitwise_xor_(d.dev_bits)
                    else:
                        view.copy_(d.dev_bits)
                    continue
                arr = view.detach().numpy().view(d.bits.dtype)
                if d.xor:
                    np.bitwise_xor(arr, d.bits, out=arr)
                else:
                    arr[:] = d.bits
            for w in self.sparse:
                flat = bits_view(tensors[w.source])
                if w.dev_indices is not None:
                    assert w.dev_bits is not None
                    if w.xor:
                        flat.index_copy_(
                            0,
                            w.dev_indices,
                            flat.index_select(0, w.dev_indices).bitwise_xor_(w.dev_bits),
                        )
                    else:
                        flat.index_copy_(0, w.dev_indices, w.dev_bits)
                    continue
                arr = flat.detach().numpy().view(w.bits.dtype)
                if not _write_whole(arr, w.indices, w.bits, w.xor, jit):
                    # Cannot happen after check_live (sizes were checked at preparation): stop loudly.
                    raise ModelMismatchError(
                        f"delta {self.version}: an index is outside {w.source}"
                    )


def _signed(width: int) -> np.dtype:
    return np.dtype(np.int16 if width == 2 else np.int32)


@dataclass(slots=True)
class PreparedPart:
    """Some entries of one delta (usually one segment's), checked and split over source tensors.

    Built by :func:`prepare_part` as soon as a segment is decoded, while the
    others are still on the wire; :func:`prepare_delta` joins the parts of
    a version. Every array here is an owned copy: the segment's bytes can go.
    """

    version: int
    entries: int
    """How many entries this part covers (a join checks that every entry of the delta is covered once)."""
    sparse: dict[tuple[str, bool], list[tuple[np.ndarray, np.ndarray]]]
    """(source tensor, xor) -> runs of (indices, values), each run strictly increasing."""
    numels: dict[str, tuple[int, int]]
    """source tensor -> (elements, bytes per element)."""
    dense: list[DenseWrite]
    basis: object = None
    """What it was prepared against (a holder's own token: its fusion plan, its sink)."""


def parts_of(staged: StagedDelta, basis: object) -> list[PreparedPart] | None:
    """``staged.parts`` when every one is a :class:`PreparedPart` made against ``basis``, else None."""
    parts = list(staged.parts)
    if parts and all(isinstance(p, PreparedPart) and p.basis is basis for p in parts):
        return parts
    return None


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
            raise ModelMismatchError(
                f"{where} is {list(e.spec.shape)} {e.spec.dtype} in the delta, {list(spec.shape)} {spec.dtype} in the model"
            )
        width = DTYPES[spec.dtype].width
        if e.bits.dtype.itemsize != width:
            raise ModelMismatchError(
                f"{where} carries {e.bits.dtype.itemsize}-byte values, the model holds {spec.dtype}"
            )
        if not 0 <= e.start < e.stop <= spec.numel:
            raise ModelMismatchError(
                f"{where} range [{e.start}, {e.stop}) does not fit its {spec.numel} elements"
            )
        if e.values not in ("new", "xor"):
            raise ModelMismatchError(f"{where}: unknown value mode {e.values!r}")
        xor = e.values == "xor"
        bits = e.bits.reshape(-1).view(DTYPES[spec.dtype].bits)
        blocks = layout(e.param)
        if e.indices is None:
            if bits.size != e.stop - e.start:
                raise ModelMismatchError(
                    f"{where}: dense range of {e.stop - e.start} elements carries {bits.size} values"
                )
            for source, off, n, loc, total in blocks:
                lo, hi = max(e.start, off), min(e.stop, off + n)
                if hi > lo:
                    numels[source] = (total, width)
                    dense.append(
                        DenseWrite(
                            source, total, width, xor, lo - off + loc, np.array(bits[lo - e.start : hi - e.start])
                        )
                    )
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
        for source, off, n, loc, total in blocks:
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
        for (a, _), (b, _) in zip(rs, rs[1:], strict=False):
            if int(b[0]) <= int(a[-1]):
                raise ModelMismatchError(
                    f"delta {staged.version}: {source} has indices out of order or written twice"
                )
        if len(rs) == 1:
            ind, val = rs[0]
        else:
            itype = np.int64 if any(r[0].dtype == np.int64 for r in rs) else np.int32
            ind = np.concatenate([r[0] for r in rs]).astype(itype, copy=False)
            val = np.concatenate([r[1] for r in rs])
        if int(ind[0]) < 0 or int(ind[-1]) >= n:
            raise ModelMismatchError(
                f"delta {staged.version}: {source} has an index outside its {n} elements"
            )
        nnz += ind.size
        ind.flags.writeable = False
        val.flags.writeable = False
        sparse.append(SortedWrites(source, n, width, xor, ind, val))
    _no_overlap(staged.version, sparse, dense)
    for w in sparse:
        _warm(w.bits.dtype.str, w.indices.dtype.str)  # compiled here, in the stager, not at the safe point
    if device is not None:
        sparse = [_to_device(w, device(w.source)) for w in sparse]
        dense = [_dense_to_device(d, device(d.source)) for d in dense]
    return PreparedDelta(staged.version, staged.base_version, nnz, tuple(sparse), tuple(dense))


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
            raise ModelMismatchError(
                f"delta {version}: {source} has elements both overwritten and XORed"
            )
        for lo, hi in spans.get(source, ()):
            for a in arrays:
                if int(np.searchsorted(a, hi)) > int(np.searchsorted(a, lo)):
                    raise ModelMismatchError(
                        f"delta {version}: {source} has elements in a dense range and a sparse entry"
                    )
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


# ---------------------------------------------------------------------------
# the write kernel


def _write(flat, offset, idx, bits, klo, khi, xor):
    """``flat[idx[k] - offset] (^)= bits[k]`` for k in [klo, khi); False (nothing written)
    if the first or last index is outside ``flat`` (the indices are strictly increasing)."""
    if khi <= klo:
        return True
    n = flat.size
    if idx[klo] < offset or idx[khi - 1] - offset >= n:
        return False
    if xor:
        for k in range(klo, khi):
            flat[np.uint64(idx[k] - offset)] ^= bits[k]
    else:
        for k in range(klo, khi):
            flat[np.uint64(idx[k] - offset)] = bits[k]
    return True


def _write_all(flat, idx, bits, xor):
    """``flat[idx] (^)= bits`` for every index; False (nothing written) if the first or last
    index is outside ``flat`` (the indices are strictly increasing). The plain loop, used where
    the prefetching one (aurora_store.codec.kernels.sorted_write) cannot be built."""
    m = idx.size
    if m == 0:
        return True
    if idx[0] < 0 or idx[m - 1] >= flat.size:
        return False
    # Unsigned positions (all >= 0, checked above): no negative-index wrap-around per element.
    if xor:
        for k in range(m):
            flat[np.uint64(idx[k])] ^= bits[k]
    else:
        for k in range(m):
            flat[np.uint64(idx[k])] = bits[k]
    return True


@functools.cache
def _write_kernel() -> Callable[..., Any]:
    """The compiled write loop: the prefetching one, or the plain one if numba cannot build it."""
    try:
        from aurora_store.codec.kernels.sorted_write import write_all

        k = compiled(write_all)
        probe = np.zeros(2, dtype=np.uint16)
        k(probe, readonly(np.array([0, 1], dtype=np.int32)), readonly(np.array([1, 2], dtype=np.uint16)), False)
        if probe.tolist() != [1, 2]:
            raise RuntimeError(f"wrote {probe.tolist()}")
        return k
    except Exception as e:  # noqa: BLE001 - an optimisation: the plain loop writes the same
        log.warning("the prefetching write kernel is unavailable (%s: %s); using the plain loop", type(e).__name__, e)
        return compiled(_write_all)


def _write_whole(
    flat: np.ndarray, indices: np.ndarray, bits: np.ndarray, xor: bool, jit: bool | None
) -> bool:
    if (
        flat.dtype != bits.dtype
        or flat.ndim != 1
        or not flat.flags.writeable
        or indices.shape != bits.shape
    ):
        raise ValueError(
            f"write: {flat.dtype} {flat.ndim}-d array for {bits.shape} {bits.dtype} values"
        )
    if use_jit(jit):
        return bool(_write_kernel()(flat, readonly(indices), readonly(bits), bool(xor)))
    return write_sorted(flat, 0, indices, bits, 0, indices.size, xor, False)


@functools.cache
def _warm(bits: str, idx: str) -> None:
    """Compile (or load from numba's cache) the write kernel for these dtypes, once per process."""
    if not use_jit(None):
        return
    flat = np.zeros(2, dtype=bits)
    i = np.array([0, 1], dtype=idx)
    i.flags.writeable = False
    v = np.array([1, 2], dtype=bits)
    v.flags.writeable = False
    for xor in (False, True):
        _write_whole(flat, i, v, xor, True)


def write_sorted(
    flat: np.ndarray,
    offset: int,
    indices: np.ndarray,
    bits: np.ndarray,
    klo: int,
    khi: int,
    xor: bool,
    jit: bool | None = None,
) -> bool:
    """One pass of sorted writes ``flat[indices[k] - offset] (^)= bits[k]``, k in ``[klo, khi)``.

    ``indices`` must be strictly increasing (what :func:`prepare_delta`
    checked); ``flat`` and ``bits`` unsigned of one width. Returns False,
    having written nothing, when the first or last index falls outside.
    """
    if flat.dtype != bits.dtype or flat.ndim != 1 or not flat.flags.writeable:
        raise ValueError(f"write_sorted: {flat.dtype} {flat.ndim}-d array for {bits.dtype} values")
    if not 0 <= klo <= khi <= indices.size:
        raise ValueError(f"write_sorted: range [{klo}, {khi}) of {indices.size} indices")
    if use_jit(jit):
        return bool(
            compiled(_write)(
                flat,
                np.int64(offset),
                readonly(indices),
                readonly(bits),
                np.int64(klo),
                np.int64(khi),
                bool(xor),
            )
        )
    if khi <= klo:
        return True
    if int(indices[klo]) < offset or int(indices[khi - 1]) - offset >= flat.size:
        return False
    at = indices[klo:khi].astype(np.int64) - offset
    if xor:
        flat[at] ^= bits[klo:khi]
    else:
        flat[at] = bits[klo:khi]
    return True


# ---------------------------------------------------------------------------
# the digest after the write


_CHUNK = (
    1 << 19
)  # elements per scratch buffer (1 MiB of bf16: stays in cache while it is patched and hashed)


def predicted_digest(
    prepared: PreparedDelta,
    tensors: Mapping[str, torch.Tensor],
    plan: FusionPlan,
    jit: bool | None = None,
) -> str | None:
    """``weights_digest(tensors, plan)`` as it will be once ``prepared`` is written; ``tensors`` unchanged.

    Reads every weight once, through a scratch buffer that gets the writes of
    its range before it is hashed: the digest of FORMAT.md §4.1 without
    writing the weights. None where it cannot be predicted here (weights on
    an accelerator, a big-endian host): the caller hashes after writing.
    """
    if sys.byteorder != "little" or any(t.device.type != "cpu" for t in tensors.values()):
        return None
    prepared.check_live(tensors)
    sparse: dict[str, list[SortedWrites]] = {}
    for w in prepared.sparse:
        sparse.setdefault(w.source, []).append(w)
    dense: dict[str, list[DenseWrite]] = {}
    for d in prepared.dense:
        dense.setdefault(d.source, []).append(d)
    h = hashlib.sha256()
    scratch: dict[int, np.ndarray] = {}
    for name in sorted(plan.params):
        p = plan.params[name]
        h.update(f"{name}|{list(p.spec.shape)}|{p.spec.dtype}\n".encode())
        for b in p.blocks:
            t = tensors[b.source]
            flat = bits_view(t.detach().contiguous()).numpy()
            flat = flat.view(np.dtype(f"u{flat.dtype.itemsize}"))
            ws, ds = sparse.get(b.source, ()), dense.get(b.source, ())
            if not ws and not ds:
                h.update(flat.data.cast("B"))
                continue
            buf = scratch.setdefault(flat.dtype.itemsize, np.empty(_CHUNK, dtype=flat.dtype))
            for lo in range(0, flat.size, _CHUNK):
                hi = min(flat.size, lo + _CHUNK)
                part = buf[: hi - lo]
                np.copyto(part, flat[lo:hi])
                for d in ds:
                    a, z = max(lo, d.start), min(hi, d.start + d.bits.size)
                    if z > a:
                        seg = d.bits[a - d.start : z - d.start]
                        if d.xor:
                            np.bitwise_xor(part[a - lo : z - lo], seg, out=part[a - lo : z - lo])
                        else:
                            part[a - lo : z - lo] = seg
                for w in ws:
                    klo, khi = (int(x) for x in np.searchsorted(w.indices, (lo, hi)))
                    if not write_sorted(part, lo, w.indices, w.bits, klo, khi, w.xor, jit):
                        raise ModelMismatchError(
                            f"delta {prepared.version}: an index is outside {b.source}"
                        )
                h.update(part.data.cast("B"))
    return "sha256:" + h.hexdigest()


def layout_of_shards(layouts: Mapping[str, Any]) -> Layout | None:
    """The layout of a tensor-parallel rank's shards (:class:`~aurora_store.apply.tp.ShardLayout`
    per fused name); None when a parameter is split by columns (not runs of rows: applied as before)."""
    blocks: dict[str, list[tuple[str, int, int, int, int]]] = {}
    for name, lay in layouts.items():
        if lay.cols is not None:
            return None
        rn = lay.row_numel
        total = 1
        for d in lay.local_shape:
            total *= d
        blocks[name] = [
            (name, p.global_row * rn, p.rows * rn, p.local_row * rn, total) for p in lay.pieces
        ]
    return blocks.__getitem__
