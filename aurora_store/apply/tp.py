"""Tensor parallelism: which elements of a fused parameter one rank holds, and where.

With tensor parallelism (TP) an inference engine splits each fused
parameter of FORMAT.md §2 across ``tp`` ranks, so a delta written against
the whole (unsharded) parameter must be cut up: each rank keeps the entries'
elements it holds and rewrites their flat indices into its local shard.
:class:`ShardLayout` is that map for one parameter on one rank, built by one
constructor per kind of vLLM layer, following vLLM's own weight loaders
(``vllm/model_executor/layers/linear.py`` and
``vllm/model_executor/layers/vocab_parallel_embedding.py``, vLLM 0.32):

- :func:`column_parallel` (``ColumnParallelLinear``): dim 0 split in ``tp``
  equal row blocks; rank ``r`` holds block ``r``. Its bias likewise.
- :func:`merged_column_parallel` (``MergedColumnParallelLinear``, e.g.
  ``gate_up_proj``): each stacked part (gate, up) is split on its own; rank
  ``r`` holds ``[gate block r; up block r]``.
- :func:`qkv_parallel` (``QKVParallelLinear``): head-wise. Rank ``r`` holds
  query heads ``[r*H/tp, (r+1)*H/tp)`` and then its key and value heads:
  ``KV/tp`` heads from ``r*KV/tp`` when ``tp < KV``; when ``tp >= KV``, one
  head, number ``r // (tp/KV)``, replicated on ``tp/KV`` ranks.
- :func:`row_parallel` (``RowParallelLinear``, e.g. ``o_proj``,
  ``down_proj``): dim 1 (the input) split in ``tp`` column blocks; its bias
  is replicated.
- :func:`vocab_parallel` (``VocabParallelEmbedding``/``ParallelLMHead``):
  the vocabulary is padded up to a multiple of 64 and split in equal row
  blocks; rank ``r`` holds the real rows of block ``r`` at the top of its
  shard, padding rows (zeros) below. With ``tp=1`` the shard is the whole
  table plus padding, so even one rank needs this map.
- :func:`replicated` (norms, ``ReplicatedLinear``): every rank holds all of it.

Fused mixture-of-experts tensors (``w13_weight``, ``w2_weight``) are split
by expert and by intermediate block: :class:`~aurora_store.apply.tp_experts.ExpertLayout`
and its constructors (:func:`fused_experts`, :func:`expert_slots`,
:func:`slots_from_expert_map`) live in :mod:`aurora_store.apply.tp_experts`,
whose docstring lists that API, and are re-exported here;
:func:`assemble` and :class:`ShardedWeights` take either kind of layout.

A delta element may live on several ranks (replicated parameters, KV
heads, replicas of an expert); each rank applies its own copy. Every map is a handful of affine
pieces, so mapping the sorted indices of an entry costs a binary search per
piece (row splits) or one vectorized pass (column splits), never per-element
Python. :class:`ShardedWeights` is the :class:`~aurora_store.apply.sink.WeightSink`
that applies deltas through these maps, validated against the *global*
specs, so :func:`~aurora_store.apply.sink.apply_delta` still refuses a delta that
does not fit before it writes anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from aurora_store.apply.sink import _write_flat
from aurora_store.apply.tp_experts import ExpertLayout, expert_slots, fused_experts, slots_from_expert_map
from aurora_store.codec.entries import DecodedEntry, ParamSpec
from aurora_store.codec.extract import bits_view
from aurora_store.errors import ModelMismatchError

__all__ = [
    "VOCAB_PADDING",
    "AnyLayout",
    "ExpertLayout",
    "Piece",
    "ShardLayout",
    "ShardedWeights",
    "assemble",
    "column_parallel",
    "expert_slots",
    "fused_experts",
    "merged_column_parallel",
    "pad_vocab",
    "qkv_parallel",
    "replicated",
    "row_parallel",
    "slots_from_expert_map",
    "vocab_parallel",
]

#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: embedding rows are padded to a multiple of it.
VOCAB_PADDING = 64


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of whole rows of the global parameter, stored contiguously in the shard."""

    global_row: int
    """First global row (dim 0 index) of the run."""
    local_row: int
    """Row of the shard where it starts."""
    rows: int
    """Number of rows."""


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where one rank keeps the elements of one parameter.

    Either rows: the shard is ``pieces`` of global rows stacked in order,
    then padding rows up to ``local_shape[0]`` that hold no global element;
    or columns (``cols`` set): the shard is ``global[:, c0:c0+n]`` of a 2-D
    parameter.
    """

    global_shape: tuple[int, ...]
    """Shape of the whole parameter: what the Trainer holds and deltas declare."""
    local_shape: tuple[int, ...]
    """Shape of this rank's tensor."""
    pieces: tuple[Piece, ...] = ()
    """Row runs, in shard order (for a row split)."""
    cols: tuple[int, int] | None = None
    """``(first global column, columns)`` for a column split of a 2-D parameter."""

    def __post_init__(self) -> None:
        if self.cols is not None:
            c0, n = self.cols
            if len(self.global_shape) != 2 or self.pieces:
                raise ValueError("a column split needs a 2-D parameter and no row pieces")
            if not (c0 >= 0 and c0 + n <= self.global_shape[1]) or self.local_shape != (self.global_shape[0], n):
                raise ValueError(f"columns {self.cols} do not fit {self.global_shape} -> {self.local_shape}")
            return
        if self.local_shape[1:] != self.global_shape[1:]:
            raise ValueError(f"a row split keeps trailing dims: {self.global_shape} -> {self.local_shape}")
        g_rows = self.global_shape[0] if self.global_shape else 1
        l_rows = self.local_shape[0] if self.local_shape else 1
        end = 0
        for p in self.pieces:
            if p.rows < 1 or p.local_row < end or p.local_row + p.rows > l_rows:
                raise ValueError(f"piece {p} overlaps or leaves the shard's {l_rows} rows")
            if not 0 <= p.global_row <= g_rows - p.rows:
                raise ValueError(f"piece {p} leaves the parameter's {g_rows} rows")
            end = p.local_row + p.rows

    # -- facts ------------------------------------------------------------
    @property
    def row_numel(self) -> int:
        """Elements per row (1 for a 1-D parameter)."""
        n = 1
        for d in self.global_shape[1:]:
            n *= d
        return n

    @property
    def local_numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n

    @property
    def is_prefix(self) -> bool:
        """Global flat index ``i`` is local flat index ``i`` (whole parameter, maybe padded below)."""
        rows = self.global_shape[0] if self.global_shape else 1
        return self.cols is None and self.pieces == (Piece(0, 0, rows),)

    @property
    def held(self) -> int:
        """How many global elements this rank holds."""
        if self.cols is not None:
            return self.global_shape[0] * self.cols[1]
        return sum(p.rows for p in self.pieces) * self.row_numel

    # -- maps -------------------------------------------------------------
    def localize(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions into ``indices`` this rank holds, their flat indices in the shard).

        ``indices`` are sorted global flat indices (int64, any device); the
        positions come back in increasing order, and so do the local indices.
        """
        if self.cols is not None:
            k_all = self.global_shape[1]
            c0, n = self.cols
            col = indices % k_all
            keep = (col >= c0) & (col < c0 + n)
            sel = keep.nonzero().reshape(-1)
            kept = indices[sel]
            return sel, (kept // k_all) * n + (kept % k_all) - c0
        rn = self.row_numel
        bounds = torch.tensor(
            [x for p in self.pieces for x in (p.global_row * rn, (p.global_row + p.rows) * rn)],
            dtype=indices.dtype,
            device=indices.device,
        )
        cuts = torch.searchsorted(indices, bounds).tolist() if bounds.numel() else []
        sels: list[torch.Tensor] = []
        locs: list[torch.Tensor] = []
        for i, p in enumerate(self.pieces):
            lo, hi = cuts[2 * i], cuts[2 * i + 1]
            if hi > lo:
                sels.append(torch.arange(lo, hi, device=indices.device))
                locs.append(indices[lo:hi] + (p.local_row - p.global_row) * rn)
        if not sels:
            empty = indices[:0]
            return empty, empty
        if len(sels) == 1:
            return sels[0], locs[0]
        # Pieces are in shard order; sort by position so both come back increasing.
        sel = torch.cat(sels)
        loc = torch.cat(locs)
        order = torch.argsort(sel)
        return sel[order], loc[order]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's tensor cut from the whole parameter (padding rows zero): what vLLM loads."""
        if tuple(full.shape) != self.global_shape:
            raise ModelMismatchError(f"expected {list(self.global_shape)}, got {list(full.shape)}")
        if self.cols is not None:
            c0, n = self.cols
            return full[:, c0 : c0 + n].contiguous()
        out = full.new_zeros(self.local_shape)
        for p in self.pieces:
            out[p.local_row : p.local_row + p.rows] = full[p.global_row : p.global_row + p.rows]
        return out


#: A rank's layout of one parameter: dense (:class:`ShardLayout`) or fused experts (:class:`ExpertLayout`).
AnyLayout = ShardLayout | ExpertLayout


def assemble(shards: Sequence[tuple[AnyLayout, torch.Tensor]]) -> torch.Tensor:
    """The whole parameter from every rank's shard (the inverse of :meth:`ShardLayout.shard`).

    Used to digest the weights of a sharded engine; replicated elements are
    taken from whichever rank comes last (they are equal when the ranks agree).
    """
    if not shards:
        raise ValueError("no shards")
    shape = shards[0][0].global_shape
    out = shards[0][1].new_empty(shape)
    if any(isinstance(lay, ExpertLayout) for lay, _ in shards):
        return _assemble_experts(shards, out)
    covered = 0
    for lay, t in shards:
        assert isinstance(lay, ShardLayout)
        if lay.global_shape != shape or tuple(t.shape) != lay.local_shape:
            raise ModelMismatchError(f"shard {list(t.shape)} does not fit {lay}")
        if lay.cols is not None:
            c0, n = lay.cols
            out[:, c0 : c0 + n] = t
        else:
            for p in lay.pieces:
                out[p.global_row : p.global_row + p.rows] = t[p.local_row : p.local_row + p.rows]
        covered += lay.held
    numel = 1
    for d in shape:
        numel *= d
    if covered < numel:
        raise ModelMismatchError(f"shards hold {covered} of {numel} elements of a {list(shape)} parameter")
    return out


def _assemble_experts(shards: Sequence[tuple[AnyLayout, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
    """:func:`assemble` for fused experts: every (expert, intermediate block) must come from some rank."""
    first = shards[0][0]
    assert isinstance(first, ExpertLayout)
    covered: set[tuple[int, int]] = set()
    for lay, t in shards:
        if not isinstance(lay, ExpertLayout) or lay.global_shape != first.global_shape or lay.tp != first.tp or lay.kind != first.kind:
            raise ModelMismatchError(f"{first.where or first.kind}: shards of different layouts cannot be assembled")
        lay.place(out, t)
        covered |= lay.covers()
    need = first.experts * first.tp
    if len(covered) < need:
        lack = sorted({(e, r) for e in range(first.experts) for r in range(first.tp)} - covered)[:3]
        raise ModelMismatchError(
            f"{first.where or first.kind}: the shards hold {len(covered)} of {need} (expert, tensor-parallel block) pairs, e.g. not {lack}"
        )
    return out


# ---------------------------------------------------------------------------
# constructors, one per vLLM layer kind


def _check_rank(tp: int, rank: int) -> None:
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of tp={tp} is out of range")


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what} ({n}) is not divisible by tp={tp}")
    return n // tp


def replicated(shape: Sequence[int]) -> ShardLayout:
    """Every rank holds the whole parameter (norms, ``ReplicatedLinear``, row-parallel biases)."""
    s = tuple(shape)
    return ShardLayout(s, s, (Piece(0, 0, s[0] if s else 1),))


def column_parallel(shape: Sequence[int], tp: int, rank: int) -> ShardLayout:
    """``ColumnParallelLinear`` weight ``[out, in]`` or bias ``[out]``: row block ``rank``."""
    _check_rank(tp, rank)
    s = tuple(shape)
    rows = _divide(s[0], tp, "output size")
    return ShardLayout(s, (rows, *s[1:]), (Piece(rank * rows, 0, rows),))


def merged_column_parallel(output_sizes: Sequence[int], trailing: Sequence[int], tp: int, rank: int) -> ShardLayout:
    """``MergedColumnParallelLinear``: parts stacked on dim 0 (gate, up), each split on its own.

    ``trailing`` is ``(in,)`` for a weight and ``()`` for a bias.
    """
    _check_rank(tp, rank)
    pieces = []
    g = loc = 0
    for size in output_sizes:
        rows = _divide(size, tp, "a merged part's output size")
        pieces.append(Piece(g + rank * rows, loc, rows))
        g += size
        loc += rows
    return ShardLayout((g, *trailing), (loc, *trailing), tuple(pieces))


def qkv_parallel(
    head_size: int,
    num_heads: int,
    num_kv_heads: int,
    trailing: Sequence[int],
    tp: int,
    rank: int,
    v_head_size: int | None = None,
) -> ShardLayout:
    """``QKVParallelLinear``: rows ``[q; k; v]`` split head-wise, KV heads replicated when ``tp > KV``.

    ``trailing`` is ``(hidden,)`` for the weight and ``()`` for a bias.
    """
    _check_rank(tp, rank)
    vd = head_size if v_head_size is None else v_head_size
    q_heads = _divide(num_heads, tp, "query heads")
    if tp >= num_kv_heads:
        replicas = _divide(tp, num_kv_heads, "tp over KV heads")
        kv_local, kv_first = 1, rank // replicas
    else:
        kv_local = _divide(num_kv_heads, tp, "KV heads")
        kv_first = rank * kv_local
    q_rows, k_rows, v_rows = num_heads * head_size, num_kv_heads * head_size, num_kv_heads * vd
    pieces = (
        Piece(rank * q_heads * head_size, 0, q_heads * head_size),
        Piece(q_rows + kv_first * head_size, q_heads * head_size, kv_local * head_size),
        Piece(q_rows + k_rows + kv_first * vd, q_heads * head_size + kv_local * head_size, kv_local * vd),
    )
    local_rows = q_heads * head_size + kv_local * (head_size + vd)
    return ShardLayout((q_rows + k_rows + v_rows, *trailing), (local_rows, *trailing), pieces)


def row_parallel(shape: Sequence[int], tp: int, rank: int) -> ShardLayout:
    """``RowParallelLinear`` weight ``[out, in]``: column block ``rank`` of the input dim."""
    _check_rank(tp, rank)
    s = tuple(shape)
    if len(s) != 2:
        raise ValueError(f"a row-parallel weight is 2-D, got {list(s)}")
    cols = _divide(s[1], tp, "input size")
    if tp == 1:
        return replicated(s)
    return ShardLayout(s, (s[0], cols), cols=(rank * cols, cols))


def pad_vocab(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    """vLLM's ``pad_vocab_size``."""
    return -(-vocab // pad_to) * pad_to


def vocab_parallel(vocab: int, dim: int, tp: int, rank: int, padded: int | None = None) -> ShardLayout:
    """``VocabParallelEmbedding``/``ParallelLMHead`` ``[vocab, dim]``, padded and split in row blocks.

    ``padded`` is the padded vocabulary (default :func:`pad_vocab`); rank
    ``r`` holds token rows ``[r*P/tp, min((r+1)*P/tp, vocab))`` at the top of
    its ``P/tp`` rows (LoRA-added rows are not supported here).
    """
    _check_rank(tp, rank)
    p = pad_vocab(vocab) if padded is None else padded
    per = _divide(p, tp, "padded vocabulary")
    first = rank * per
    rows = max(0, min(first + per, vocab) - first)
    pieces = (Piece(first, 0, rows),) if rows else ()
    return ShardLayout((vocab, dim), (per, dim), pieces)


# ---------------------------------------------------------------------------
# the sink


class ShardedWeights:
    """A rank's own tensors under fused names, patched through their :class:`ShardLayout`.

    ``specs()`` are the *global* specs (what deltas declare), so
    :func:`~aurora_store.apply.sink.apply_delta` validates a delta against the
    whole model before it writes; each write keeps the elements this rank
    holds. Writes are in place; nothing is reallocated.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], layouts: Mapping[str, AnyLayout], dtypes: Mapping[str, str]) -> None:
        if tensors.keys() != layouts.keys():
            raise ModelMismatchError(f"tensors and layouts name different parameters: {sorted(tensors.keys() ^ layouts.keys())[:5]}")
        for name, t in tensors.items():
            lay = layouts[name]
            if tuple(t.shape) != lay.local_shape or not t.is_contiguous():
                raise ModelMismatchError(f"{name}: held as {list(t.shape)}, its layout says {list(lay.local_shape)} (contiguous)")
        self.tensors = dict(tensors)
        self.layouts = dict(layouts)
        self._specs = {n: ParamSpec(lay.global_shape, dtypes[n]) for n, lay in self.layouts.items()}

    def specs(self) -> Mapping[str, ParamSpec]:
        return self._specs

    def device(self, param: str) -> torch.device:
        return self.tensors[param].device

    def write(self, entry: DecodedEntry, indices: torch.Tensor | None, bits: torch.Tensor) -> None:
        lay = self.layouts[entry.param]
        flat = bits_view(self.tensors[entry.param])
        if lay.is_prefix:
            _write_flat(flat, indices, entry.start, entry.stop, bits, entry.values)
            return
        if isinstance(lay, ExpertLayout):
            # One vectorised map over the entry's indices, then one scatter (replicas included).
            if indices is None:
                indices = torch.arange(entry.start, entry.stop, device=bits.device)
            sel, local = lay.localize(indices)
            if sel.numel():
                _write_flat(flat, local, 0, 0, bits[sel].contiguous(), entry.values)
            return
        if indices is None:
            if lay.cols is None:
                # A dense range meets each row piece in one contiguous run.
                rn = lay.row_numel
                for p in lay.pieces:
                    lo = max(entry.start, p.global_row * rn)
                    hi = min(entry.stop, (p.global_row + p.rows) * rn)
                    if hi > lo:
                        at = lo + (p.local_row - p.global_row) * rn
                        _write_flat(flat, None, at, at + hi - lo, bits[lo - entry.start : hi - entry.start], entry.values)
                return
            indices = torch.arange(entry.start, entry.stop, device=bits.device)
        sel, local = lay.localize(indices)
        if sel.numel():
            _write_flat(flat, local.contiguous(), 0, 0, bits[sel].contiguous(), entry.values)
