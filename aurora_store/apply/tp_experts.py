"""Fused experts under tensor and expert parallelism: which elements of ``w13``/``w2`` one rank holds, and where.

FORMAT.md §2 names a mixture-of-experts layer's routed experts globally:
``P + w13_weight`` ``[E, 2I, H]`` (each expert's ``I`` gate rows, then its
``I`` up rows) and ``P + w2_weight`` ``[E, H, I]``. An engine cuts them up
two ways, following vLLM 0.32's ``RoutedExperts`` weight loader and its
``ExpertMapManager`` (``vllm/model_executor/layers/fused_moe/``):

- **tensor parallelism** (``tp`` ranks, MoE ``tp_rank``): every rank holds
  every expert's slice ``[r*I/tp, (r+1)*I/tp)`` of the intermediate
  dimension: ``w13`` rows ``[gate block r; up block r]``, ``w2`` column
  block ``r``. The per-rank intermediate size may be padded on allocation
  (``local_intermediate``, vLLM's ``maybe_roundup_sizes``): gate rows start
  at row 0 and up rows at row ``local_intermediate`` of each expert, the
  rows and columns between are padding that no delta reaches; likewise a
  padded hidden size (``local_hidden``).
- **expert parallelism**: a rank holds whole experts in local *slots*;
  ``slots[s]`` is the global (logical) expert in slot ``s``. vLLM places
  its *physical* experts linearly (default) or round-robin over the EP
  ranks, and with EPLB keeps redundant physical replicas of some logical
  experts (initially ``E + i`` replicating ``i mod E``, later rearranged):
  :func:`expert_slots` computes vLLM's initial placement,
  :func:`slots_from_expert_map` reads a live layer's. A logical expert may
  sit in several slots, on several ranks or on one: every replica is
  written.

vLLM 0.32 uses either tensor or expert parallelism for a MoE layer (with
EP, its MoE ``tp`` is 1); an :class:`ExpertLayout` allows both at once.

The layout API, for an engine (the vLLM engine's MoE path builds on it):

- :func:`fused_experts` ``(kind, experts, intermediate, hidden, *, tp=1, tp_rank=0, slots=None,
  local_intermediate=0, local_hidden=0, gated=True, where="")`` -> :class:`ExpertLayout`
  (``kind`` is ``"w13"`` or ``"w2"``; 0 means unpadded);
- :func:`expert_slots` ``(experts, ep, ep_rank, placement="linear", redundant=0,
  physical_to_logical=None, where="")`` -> the slots vLLM gives rank ``ep_rank``;
  :func:`initial_physical_to_logical` ``(experts, redundant)``: EPLB's initial map;
- :func:`slots_from_expert_map` ``(expert_map, physical_to_logical=None, experts=None, where="")``
  -> the slots of a live layer (vLLM's ``expert_map``: global physical expert -> local slot
  or -1; None without expert parallelism);
- :class:`ExpertLayout`: ``global_shape``, ``local_shape``, ``local_numel``, ``held``,
  ``is_prefix``, ``localize_np(indices)`` (numpy) / ``localize(indices)`` (torch): sorted
  global flat indices -> (positions held, their local flat indices), sorted by local index,
  a position once per replica; ``shard(full)`` (the rank's tensor, padding zero);
  ``place(out, local)`` (its inverse, into a whole tensor); ``covers()``;
- :func:`mismatch`: the one-line refusal of a delta tensor of another shape (for experts:
  the ``E``, ``I`` and ``H`` of both).

:func:`~aurora_store.apply.tp.assemble` (the whole tensor from every rank's
shard, for a digest) and :class:`~aurora_store.apply.tp.ShardedWeights` (the
weight sink) take these layouts beside the dense ones, and
:func:`~aurora_store.apply.prepared_delta.layout_of_shards` prepares deltas
for them (a :class:`~aurora_store.apply.prepared_delta.MappedBlock` each). Layouts that cannot be mapped (intermediate size not
divisible by ``tp``, a slot naming no routed expert, padding smaller than
the shard, a non-gated ``w13``) raise
:class:`~aurora_store.errors.ModelMismatchError` with one line naming the
layer (``where``) and the engine setting at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.experts import expert_dims
from aurora_store.errors import ModelMismatchError

__all__ = [
    "KINDS",
    "ExpertLayout",
    "expert_slots",
    "fused_experts",
    "initial_physical_to_logical",
    "mismatch",
    "slots_from_expert_map",
]

KINDS = ("w13", "w2")
"""The two fused-experts tensors of FORMAT.md §2."""


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def mismatch(where: str, param: str, got: ParamSpec, want: ParamSpec) -> str:
    """The one line refusing a delta tensor whose shape or dtype differ from the model's; for fused
    experts it names the experts, intermediate and hidden sizes, which is what an operator compares."""
    g, w = expert_dims(param, got), expert_dims(param, want)
    if g is not None and w is not None and g != w:
        return (
            f"{where} has {g[0]} experts of intermediate size {g[1]} and hidden size {g[2]} in the delta, "
            f"the model {w[0]} experts of intermediate size {w[1]} and hidden size {w[2]}"
        )
    return f"{where} is {list(got.shape)} {got.dtype} in the delta, {list(want.shape)} {want.dtype} in the model"


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Where one rank keeps the elements of one fused-experts parameter (built by :func:`fused_experts`)."""

    kind: str
    """``"w13"`` (``[E, 2I, H]``, gate rows then up rows per expert) or ``"w2"`` (``[E, H, I]``)."""
    experts: int
    """``E``: routed (logical) experts of the whole layer."""
    intermediate: int
    """``I``: the whole layer's intermediate size."""
    hidden: int
    """``H``."""
    slots: tuple[int, ...]
    """The logical expert held in each local slot (dim 0 of the local tensor)."""
    tp: int = 1
    """MoE tensor-parallel ranks (the intermediate dimension is split in ``tp`` blocks)."""
    tp_rank: int = 0
    local_intermediate: int = 0
    """Per-rank intermediate size as allocated (``>= I/tp``; 0: exactly ``I/tp``)."""
    local_hidden: int = 0
    """Hidden size as allocated (``>= H``; 0: exactly ``H``)."""
    where: str = ""
    """The layer's name, for error messages."""
    _rounds: tuple[np.ndarray, ...] = field(init=False, repr=False, compare=False)
    """Per replica round ``k``: global expert -> its ``k``-th local slot, or -1."""
    _monotone: bool = field(init=False, repr=False, compare=False)
    """One round whose slots increase with the expert: local order is global order."""

    def __post_init__(self) -> None:
        at = _at(self.where)
        if self.kind not in KINDS:
            raise ModelMismatchError(f"{at}unknown fused-experts tensor {self.kind!r} (FORMAT.md §2 has {', '.join(KINDS)})")
        if min(self.experts, self.intermediate, self.hidden) < 1:
            raise ModelMismatchError(
                f"{at}experts, intermediate and hidden sizes must be >= 1, got {self.experts}, {self.intermediate}, {self.hidden}"
            )
        if self.tp < 1 or not 0 <= self.tp_rank < self.tp:
            raise ModelMismatchError(f"{at}MoE tensor-parallel rank {self.tp_rank} of tp={self.tp} is out of range")
        if self.intermediate % self.tp:
            raise ModelMismatchError(
                f"{at}intermediate size {self.intermediate} is not divisible by the MoE tensor-parallel size "
                f"{self.tp} (tensor_parallel_size without enable_expert_parallel)"
            )
        il = self.intermediate // self.tp
        if self.local_intermediate == 0:
            object.__setattr__(self, "local_intermediate", il)
        if self.local_hidden == 0:
            object.__setattr__(self, "local_hidden", self.hidden)
        if self.local_intermediate < il or self.local_hidden < self.hidden:
            raise ModelMismatchError(
                f"{at}the engine allocates intermediate {self.local_intermediate} and hidden {self.local_hidden} per "
                f"expert, smaller than the {il} and {self.hidden} this rank holds (an unknown repacking)"
            )
        bad = [s for s in self.slots if not 0 <= s < self.experts]
        if bad:
            raise ModelMismatchError(
                f"{at}local slots hold experts {bad[:3]}, outside the layer's {self.experts} routed experts "
                "(shared experts fused into the routed ones, VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS, or another layer's expert map)"
            )
        rounds: list[np.ndarray] = []
        seen = np.zeros(self.experts, dtype=np.int64)
        for s, e in enumerate(self.slots):  # once per slot, at construction
            k = int(seen[e])
            seen[e] += 1
            if k == len(rounds):
                rounds.append(np.full(self.experts, -1, dtype=np.int64))
            rounds[k][e] = s
        object.__setattr__(self, "_rounds", tuple(rounds))
        # One round (no expert twice here) and slots in increasing expert order: a sorted
        # global index list maps to a sorted local one, no sort needed.
        mono = len(rounds) <= 1 and all(a < b for a, b in zip(self.slots, self.slots[1:], strict=False))
        object.__setattr__(self, "_monotone", mono)

    # -- facts ------------------------------------------------------------
    @property
    def shard_intermediate(self) -> int:
        """``I/tp``: intermediate rows (w13: per part) or columns (w2) of real data per slot."""
        return self.intermediate // self.tp

    @property
    def global_shape(self) -> tuple[int, ...]:
        e, i, h = self.experts, self.intermediate, self.hidden
        return (e, 2 * i, h) if self.kind == "w13" else (e, h, i)

    @property
    def local_shape(self) -> tuple[int, ...]:
        s, i, h = len(self.slots), self.local_intermediate, self.local_hidden
        return (s, 2 * i, h) if self.kind == "w13" else (s, h, i)

    @property
    def held(self) -> int:
        """Global elements this rank holds, once per replica (what ``localize`` of every index returns)."""
        return len(self.slots) * (2 if self.kind == "w13" else 1) * self.shard_intermediate * self.hidden

    @property
    def is_prefix(self) -> bool:
        """Global flat index ``i`` is local flat index ``i``: every expert in order, unsplit, unpadded."""
        return (
            self.tp == 1
            and self.slots == tuple(range(self.experts))
            and self.local_intermediate == self.intermediate
            and self.local_hidden == self.hidden
        )

    @property
    def local_numel(self) -> int:
        n = 1
        for d in self.local_shape:
            n *= d
        return n

    # -- maps -------------------------------------------------------------
    def localize_np(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(positions into ``indices`` this rank holds, their local flat indices), by increasing local index.

        ``indices`` are sorted global flat indices; a position appears once
        per replica of its expert on this rank. One vectorised pass per
        replica round (one round unless a rank holds an expert twice).
        """
        idx = np.asarray(indices).astype(np.int64, copy=False)
        i, h, r0 = self.intermediate, self.hidden, self.tp_rank * self.shard_intermediate
        li, lh = self.local_intermediate, self.local_hidden
        if self.kind == "w13":
            e, rest = np.divmod(idx, 2 * i * h)
            row, col = np.divmod(rest, h)
            up = (row >= i).astype(np.int64)
            row = row - up * i - r0  # the row inside this rank's gate (or up) block
            inside = ((row >= 0) & (row < self.shard_intermediate)) if self.tp > 1 else None
            within = (row + up * li) * lh + col  # up rows start at local row li
            per_slot = 2 * li * lh
        else:
            e, rest = np.divmod(idx, h * i)
            row, col = np.divmod(rest, i)
            col = col - r0
            inside = ((col >= 0) & (col < self.shard_intermediate)) if self.tp > 1 else None
            within = row * li + col
            per_slot = lh * li
        sels: list[np.ndarray] = []
        locs: list[np.ndarray] = []
        for table in self._rounds:
            slot = table[e]
            keep = slot >= 0 if inside is None else (slot >= 0) & inside
            sel = np.flatnonzero(keep)
            sels.append(sel)
            locs.append(slot[sel] * per_slot + within[sel])
        if not sels:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        sel, loc = (sels[0], locs[0]) if len(sels) == 1 else (np.concatenate(sels), np.concatenate(locs))
        if not self._monotone:
            order = np.argsort(loc, kind="stable")
            sel, loc = sel[order], loc[order]
        return sel, loc

    def localize(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`localize_np` for a torch tensor of indices (computed on the host, returned on its device)."""
        sel, loc = self.localize_np(indices.detach().cpu().numpy())
        dev = indices.device
        return torch.from_numpy(sel).to(dev), torch.from_numpy(loc).to(dev)

    def _views(self, local: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The real-data views of a local tensor: (gate rows, up rows) for w13, (columns,) for w2."""
        il, li, h = self.shard_intermediate, self.local_intermediate, self.hidden
        if self.kind == "w13":
            return local[:, :il, :h], local[:, li : li + il, :h]
        return (local[:, :h, :il],)

    def _sources(self, full: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        i, r0, il = self.intermediate, self.tp_rank * self.shard_intermediate, self.shard_intermediate
        if self.kind == "w13":
            return full[experts, r0 : r0 + il], full[experts, i + r0 : i + r0 + il]
        return (full[experts, :, r0 : r0 + il],)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's tensor cut from the whole parameter, padding zero: what the engine's loader leaves."""
        if tuple(full.shape) != self.global_shape:
            raise ModelMismatchError(f"{_at(self.where)}expected {list(self.global_shape)}, got {list(full.shape)}")
        out = full.new_zeros(self.local_shape)
        experts = torch.tensor(self.slots, dtype=torch.long, device=full.device)
        for dst, src in zip(self._views(out), self._sources(full, experts), strict=True):
            dst.copy_(src)
        return out

    def place(self, out: torch.Tensor, local: torch.Tensor) -> None:
        """Write this rank's held elements of ``local`` into the whole parameter ``out`` (the inverse of :meth:`shard`)."""
        if tuple(out.shape) != self.global_shape or tuple(local.shape) != self.local_shape:
            raise ModelMismatchError(f"{_at(self.where)}shard {list(local.shape)} does not fit {self}")
        if not self.slots:
            return
        i, r0, il = self.intermediate, self.tp_rank * self.shard_intermediate, self.shard_intermediate
        experts = torch.tensor(self.slots, dtype=torch.long, device=out.device)
        views = self._views(local)
        if self.kind == "w13":
            out[experts, r0 : r0 + il] = views[0]
            out[experts, i + r0 : i + r0 + il] = views[1]
        else:
            out[experts, :, r0 : r0 + il] = views[0]

    def covers(self) -> set[tuple[int, int]]:
        """(expert, tp block) pairs this rank holds: what :func:`~aurora_store.apply.tp.assemble` checks are all there."""
        return {(e, self.tp_rank) for e in self.slots}


# ---------------------------------------------------------------------------
# constructors


def fused_experts(
    kind: str,
    experts: int,
    intermediate: int,
    hidden: int,
    *,
    tp: int = 1,
    tp_rank: int = 0,
    slots: Sequence[int] | None = None,
    local_intermediate: int = 0,
    local_hidden: int = 0,
    gated: bool = True,
    where: str = "",
) -> ExpertLayout:
    """The layout of ``P + {kind}_weight`` on one rank.

    ``slots``: the logical expert in each local slot (default: all, in
    order: no expert parallelism); ``tp``/``tp_rank``: the MoE tensor
    parallelism (vLLM's ``moe_parallel_config.tp_size``/``tp_rank``, 1 and 0
    under expert parallelism); ``local_intermediate``/``local_hidden``: the
    sizes the engine allocated per slot when it pads them. ``gated=False``
    (a ``w13`` of up rows only) is refused: FORMAT.md §2 stacks gate and up.
    """
    if not gated:
        raise ModelMismatchError(
            f"{_at(where)}the engine's w13 holds no gate rows (a non-gated activation); FORMAT.md §2's [E, 2I, H] stacks gate and up"
        )
    return ExpertLayout(
        kind,
        experts,
        intermediate,
        hidden,
        tuple(range(experts)) if slots is None else tuple(int(s) for s in slots),
        tp,
        tp_rank,
        local_intermediate,
        local_hidden,
        where,
    )


def initial_physical_to_logical(experts: int, redundant: int = 0) -> list[int]:
    """vLLM's initial EPLB arrangement: physical expert ``p`` is logical ``p`` then, for ``p >= E``, ``(p - E) mod E``."""
    return list(range(experts)) + [i % experts for i in range(redundant)]


def expert_slots(
    experts: int,
    ep: int,
    ep_rank: int,
    placement: str = "linear",
    redundant: int = 0,
    physical_to_logical: Sequence[int] | None = None,
    where: str = "",
) -> tuple[int, ...]:
    """The logical experts in rank ``ep_rank``'s slots, as vLLM 0.32's ``determine_expert_map`` places them.

    The ``E + redundant`` physical experts are dealt out over ``ep`` ranks,
    as evenly as possible (the first ``P mod ep`` ranks take one more):
    ``linear`` gives each rank a contiguous run, ``round_robin`` gives rank
    ``r`` physical experts ``r, r + ep, …``. Each physical expert is the
    logical expert ``physical_to_logical`` names (default: vLLM's initial
    EPLB arrangement, :func:`initial_physical_to_logical`). vLLM itself
    falls back from ``round_robin`` to ``linear`` in several settings
    (redundant experts, EPLB, no expert groups): pass the placement the
    layer really uses, or read its map with :func:`slots_from_expert_map`.
    """
    at = _at(where)
    if ep < 1 or not 0 <= ep_rank < ep:
        raise ModelMismatchError(f"{at}expert-parallel rank {ep_rank} of {ep} is out of range")
    p2l = initial_physical_to_logical(experts, redundant) if physical_to_logical is None else [int(x) for x in physical_to_logical]
    physical = len(p2l)
    if physical != experts + redundant:
        raise ModelMismatchError(
            f"{at}the physical-to-logical map names {physical} physical experts, not {experts} + {redundant} redundant"
        )
    base, rem = divmod(physical, ep)
    count = base + (1 if ep_rank < rem else 0)
    if placement == "linear":
        first = ep_rank * base + min(ep_rank, rem)
        local = range(first, first + count)
    elif placement == "round_robin":
        local = range(ep_rank, physical, ep)
    else:
        raise ModelMismatchError(f"{at}expert placement {placement!r} (expert_placement_strategy) is neither linear nor round_robin")
    return tuple(p2l[p] for p in local)


def slots_from_expert_map(
    expert_map: Sequence[int] | np.ndarray | torch.Tensor | None,
    physical_to_logical: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    experts: int | None = None,
    where: str = "",
) -> tuple[int, ...]:
    """The slots of a live vLLM layer from its ``expert_map`` (global physical expert -> local slot, -1 elsewhere).

    ``expert_map`` None (no expert parallelism) means every physical expert
    in order, which needs ``experts``. ``physical_to_logical``: the layer's
    live EPLB map (default: physical is logical). Refused: a map whose
    slots are not ``0 … n-1`` each once.
    """
    at = _at(where)
    if expert_map is None:
        if experts is None and physical_to_logical is None:
            raise ModelMismatchError(f"{at}no expert map and no expert count")
        physical = np.arange(experts if physical_to_logical is None else len(physical_to_logical))
        slot_of = physical
    else:
        slot_of = np.asarray(expert_map.cpu() if isinstance(expert_map, torch.Tensor) else expert_map, dtype=np.int64).reshape(-1)
        physical = np.flatnonzero(slot_of >= 0)
    order = np.argsort(slot_of[physical], kind="stable")
    local_physical = physical[order]
    got = slot_of[local_physical]
    if not np.array_equal(got, np.arange(got.size)):
        raise ModelMismatchError(f"{at}the expert map's local slots are {got[:8].tolist()}…, not 0 … {got.size - 1} each once")
    if physical_to_logical is None:
        return tuple(int(p) for p in local_physical)
    p2l = np.asarray(physical_to_logical.cpu() if isinstance(physical_to_logical, torch.Tensor) else physical_to_logical, dtype=np.int64)
    if local_physical.size and int(local_physical[-1]) >= p2l.size:
        raise ModelMismatchError(f"{at}the expert map names physical expert {int(local_physical[-1])}, the EPLB map has {p2l.size}")
    return tuple(int(x) for x in p2l[local_physical])
