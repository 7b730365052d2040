"""A delta prepared for the safe point, and its parts: the writes grouped per source tensor.

:class:`PreparedDelta` is what :func:`~aurora_store.apply.prepare.prepare_delta`
makes of a staged delta; :meth:`PreparedDelta.write` is the safe point's
whole job. A :class:`Layout` says where a fused parameter's elements live in
the holder's source tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from aurora_store.apply.tp_experts import ExpertLayout
from aurora_store.apply.write_kernel import write_whole
from aurora_store.codec.extract import bits_view
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta

__all__ = [
    "Layout",
    "MappedBlock",
    "PreparedDelta",
    "PreparedPart",
    "SortedWrites",
    "DenseWrite",
    "parts_of",
    "layout_of_plan",
    "layout_of_shards",
]


class MappedBlock(NamedTuple):
    """A source tensor whose elements are not one run of the fused parameter (fused experts split by
    expert or intermediate block, :class:`~aurora_store.apply.tp_experts.ExpertLayout`): reached through
    a vectorised map instead of an offset."""

    source: str
    total: int
    """Elements of the source tensor."""
    localize: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
    """Sorted fused flat indices -> (positions held here, their flat indices in the source), by
    increasing source index; a position may appear more than once (replicas)."""


#: fused parameter -> its blocks: (source tensor, offset in the fused parameter, elements, offset in
#: the source tensor, elements of the source tensor), or a :class:`MappedBlock`. Elements of the
#: parameter in no block are not held here (another rank's shard) and are skipped.
Layout = Callable[[str], Sequence[tuple[str, int, int, int, int] | MappedBlock]]


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
        return sum(w.indices.nbytes + w.bits.nbytes for w in self.sparse) + sum(d.bits.nbytes for d in self.dense)

    def check_live(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Every target tensor is still there, contiguous, with the size, width and device prepared for."""
        targets: list[SortedWrites | DenseWrite] = [*self.sparse, *self.dense]
        for w in targets:
            t = tensors.get(w.source)
            if t is None:
                raise ModelMismatchError(f"delta {self.version}: the weights no longer hold {w.source!r}")
            if t.numel() != w.numel or t.element_size() != w.width or not t.is_contiguous():
                raise ModelMismatchError(
                    f"delta {self.version}: {w.source} is {list(t.shape)} {t.dtype} now, not the tensor it was prepared for"
                )
            on_dev = w.dev_bits is not None
            if on_dev != (t.device.type != "cpu") or (w.dev_bits is not None and w.dev_bits.device != t.device):
                raise ModelMismatchError(f"delta {self.version}: {w.source} moved to {t.device} since it was prepared")

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
                if not write_whole(arr, w.indices, w.bits, w.xor, jit):
                    # Cannot happen after check_live (sizes were checked at preparation): stop loudly.
                    raise ModelMismatchError(f"delta {self.version}: an index is outside {w.source}")


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


def layout_of_shards(layouts: Mapping[str, Any]) -> Layout | None:
    """The layout of a tensor-parallel rank's shards (:class:`~aurora_store.apply.tp.ShardLayout`
    or :class:`~aurora_store.apply.tp_experts.ExpertLayout` per fused name); None when a dense
    parameter is split by columns (not runs of rows: applied as before)."""
    blocks: dict[str, list[tuple[str, int, int, int, int] | MappedBlock]] = {}
    for name, lay in layouts.items():
        if isinstance(lay, ExpertLayout):
            total = lay.local_numel
            if lay.is_prefix:
                blocks[name] = [(name, 0, total, 0, total)]
            else:
                blocks[name] = [MappedBlock(name, total, lay.localize_np)]
            continue
        if lay.cols is not None:
            return None
        rn = lay.row_numel
        total = 1
        for d in lay.local_shape:
            total *= d
        blocks[name] = [(name, p.global_row * rn, p.rows * rn, p.local_row * rn, total) for p in lay.pieces]
    return blocks.__getitem__
