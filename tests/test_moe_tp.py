"""Fused experts under tensor and expert parallelism (aurora_store.apply.tp_experts, through aurora_store.apply.tp).

The property: for random ``E, I, H``, MoE tensor parallelism ``tp``,
expert parallelism ``ep`` (linear or round-robin placement, EPLB replicas,
a rearranged physical-to-logical map) and padded per-rank sizes, scattering
a random sparse delta through the layouts into every rank's shard gives
each rank exactly the slice of the whole updated tensor, through the sink
(``ShardedWeights``) and through the prepared path alike, and never touches
padding. The last tests check the layouts against vLLM 0.32's own
placement (``determine_expert_map``, EPLB's initial map) and weight
loaders (``RoutedExperts._load_w13``/``_load_w2``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aurora_store.apply.prepare import prepare_delta
from aurora_store.apply.prepared_delta import layout_of_shards
from aurora_store.apply.sink import FusedWeights, apply_delta
from aurora_store.apply.tp import (
    ExpertLayout,
    ShardedWeights,
    assemble,
    expert_slots,
    fused_experts,
    slots_from_expert_map,
)
from aurora_store.apply.tp_experts import initial_physical_to_logical
from aurora_store.codec.entries import DecodedEntry, ParamSpec
from aurora_store.errors import ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta

W13 = "model.layers.0.mlp.experts.w13_weight"
W2 = "model.layers.0.mlp.experts.w2_weight"


@dataclass(frozen=True)
class Setup:
    experts: int
    inter: int
    hidden: int
    tp: int
    ep: int
    placement: str
    redundant: int
    p2l: tuple[int, ...] | None
    pad_i: int
    pad_h: int

    def layouts(self, kind: str) -> list[ExpertLayout]:
        """Every rank's layout: ``tp`` x ``ep`` ranks (vLLM uses one or the other; the layouts allow both)."""
        out = []
        for r in range(self.tp):
            for q in range(self.ep):
                slots = expert_slots(self.experts, self.ep, q, self.placement, self.redundant, self.p2l, where="layer 0")
                out.append(
                    fused_experts(
                        kind,
                        self.experts,
                        self.inter,
                        self.hidden,
                        tp=self.tp,
                        tp_rank=r,
                        slots=slots,
                        local_intermediate=self.inter // self.tp + self.pad_i,
                        local_hidden=self.hidden + self.pad_h,
                        where="layer 0",
                    )
                )
        return out


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    tp = draw(st.integers(1, 3))
    ep = draw(st.integers(1, 3))
    experts = draw(st.integers(1, 9))
    redundant = draw(st.integers(0, 4)) if ep > 1 else 0
    p2l: tuple[int, ...] | None = None
    if redundant and draw(st.booleans()):
        # EPLB after a rearrangement: every logical expert still somewhere, replicas anywhere (even twice on a rank).
        base = list(range(experts)) + [draw(st.integers(0, experts - 1)) for _ in range(redundant)]
        p2l = tuple(draw(st.permutations(base)))
    return Setup(
        experts=experts,
        inter=tp * draw(st.integers(1, 4)),
        hidden=draw(st.integers(1, 6)),
        tp=tp,
        ep=ep,
        placement=draw(st.sampled_from(["linear", "round_robin"])),
        redundant=redundant,
        p2l=p2l,
        pad_i=draw(st.integers(0, 2)),
        pad_h=draw(st.integers(0, 2)),
    )


def random_bf16(shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    n = int(np.prod(shape))
    return torch.from_numpy(rng.integers(-(2**15), 2**15, size=n).astype(np.int16)).view(torch.bfloat16).reshape(shape)


def random_delta(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> StagedDelta:
    """A sparse XOR entry, a dense overwrite and a sparse overwrite over the whole tensor."""
    spec = ParamSpec(shape, "bfloat16")
    numel = spec.numel
    a, b = numel // 3, 2 * numel // 3
    entries = []
    idx1 = np.flatnonzero(rng.random(a) < 0.3).astype(np.int64)
    if idx1.size:
        entries.append(DecodedEntry(name, spec, 0, a, idx1.size, idx1, rng.integers(1, 2**16, size=idx1.size).astype(np.uint16), "xor"))
    if b > a:
        entries.append(DecodedEntry(name, spec, a, b, b - a, None, rng.integers(0, 2**16, size=b - a).astype(np.uint16), "new"))
    idx3 = (b + np.flatnonzero(rng.random(numel - b) < 0.3)).astype(np.int64)
    if idx3.size:
        entries.append(DecodedEntry(name, spec, b, numel, idx3.size, idx3, rng.integers(0, 2**16, size=idx3.size).astype(np.uint16), "new"))
    return StagedDelta(1, 0, tuple(entries))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@given(setups(), st.sampled_from(["w13", "w2"]), st.integers(0, 2**32 - 1))
def test_scattered_delta_equals_the_slice_of_the_updated_whole(s: Setup, kind: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    name = W13 if kind == "w13" else W2
    layouts = s.layouts(kind)
    shape = layouts[0].global_shape
    full = random_bf16(shape, rng)
    staged = random_delta(name, shape, rng)
    expect = full.clone()
    apply_delta(staged, FusedWeights({name: expect}))
    for lay in layouts:
        want = lay.shard(expect)  # padding zero, as the engine's loader leaves it
        # Through the sink: validated against the whole parameter, written in place.
        shard = lay.shard(full)
        ptr = shard.data_ptr()
        apply_delta(staged, ShardedWeights({name: shard}, {name: lay}, {name: "bfloat16"}))
        assert shard.data_ptr() == ptr
        assert torch.equal(bits(shard), bits(want)), lay
        # Through the prepared path (what an engine does off the safe point), the same bits.
        layout = layout_of_shards({name: lay})
        assert layout is not None
        other = lay.shard(full)
        prepare_delta(staged, {name: ParamSpec(shape, "bfloat16")}, layout).write({name: other})
        assert torch.equal(bits(other), bits(want)), lay
    # The shards put back together are the updated whole.
    assert torch.equal(bits(assemble([(lay, lay.shard(expect)) for lay in layouts])), bits(expect))


@given(setups(), st.sampled_from(["w13", "w2"]))
def test_every_replica_is_reached_once_and_the_map_agrees_with_the_cut(s: Setup, kind: str) -> None:
    layouts = s.layouts(kind)
    shape = layouts[0].global_shape
    g = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
    idx = np.arange(g.numel(), dtype=np.int64)
    hits = np.zeros(g.numel(), dtype=np.int64)
    for lay in layouts:
        sel, loc = lay.localize_np(idx)
        local = lay.shard(g).reshape(-1)
        assert np.array_equal(local.numpy()[loc], idx[sel].astype(np.float64))
        assert loc.size == lay.held == np.unique(loc).size
        assert np.all(np.diff(loc) > 0)  # sorted: one forward pass writes them
        np.add.at(hits, idx[sel], 1)
    # Each element is on (its expert's replicas) ranks of its intermediate block: count per expert.
    p2l = s.p2l if s.p2l is not None else tuple(list(range(s.experts)) + [i % s.experts for i in range(s.redundant)])
    copies = np.bincount(np.asarray(p2l), minlength=s.experts)
    per_expert = hits.reshape(s.experts, -1)
    assert np.array_equal(per_expert, np.repeat(copies[:, None], per_expert.shape[1], axis=1))


def test_prefix_layout_is_the_whole_tensor() -> None:
    lay = fused_experts("w13", 4, 6, 8)
    assert lay.is_prefix and lay.local_shape == lay.global_shape == (4, 12, 8)
    assert layout_of_shards({W13: lay})(W13) == [(W13, 0, 4 * 12 * 8, 0, 4 * 12 * 8)]  # type: ignore[misc]
    assert not fused_experts("w2", 4, 6, 8, tp=2, tp_rank=1).is_prefix
    assert not fused_experts("w2", 4, 6, 8, local_intermediate=8).is_prefix


def test_tp_rank_holds_its_gate_and_up_blocks() -> None:
    # E=2, I=4, H=1, tp=2: rank 1 holds gate rows 2,3 and up rows 6,7 of each expert.
    lay = fused_experts("w13", 2, 4, 1, tp=2, tp_rank=1)
    sel, loc = lay.localize_np(np.arange(16))
    assert sel.tolist() == [2, 3, 6, 7, 10, 11, 14, 15] and loc.tolist() == list(range(8))
    # w2 [E, H, I] with H=2: rank 0 holds columns 0,1 of every row.
    lay = fused_experts("w2", 2, 4, 2, tp=2, tp_rank=0)
    sel, loc = lay.localize_np(np.arange(16))
    assert sel.tolist() == [0, 1, 4, 5, 8, 9, 12, 13] and loc.tolist() == list(range(8))


def test_placements_follow_vllm_rules_by_hand() -> None:
    # 10 experts over 3 ranks: 4, 3, 3 (the first E mod ep ranks take one more).
    assert [expert_slots(10, 3, r) for r in range(3)] == [(0, 1, 2, 3), (4, 5, 6), (7, 8, 9)]
    assert [expert_slots(10, 3, r, "round_robin") for r in range(3)] == [(0, 3, 6, 9), (1, 4, 7), (2, 5, 8)]
    # EPLB: 4 logical + 2 redundant physical experts (4 -> 0, 5 -> 1), linear over 2 ranks.
    assert [expert_slots(4, 2, r, redundant=2) for r in range(2)] == [(0, 1, 2), (3, 0, 1)]
    assert slots_from_expert_map([-1, 1, 0, -1]) == (2, 1)
    assert slots_from_expert_map([-1, 1, 0, -1], physical_to_logical=[0, 1, 1, 0]) == (1, 1)
    assert slots_from_expert_map(None, experts=3) == (0, 1, 2)


@pytest.mark.parametrize(
    ("build", "says"),
    [
        (
            lambda: fused_experts("w13", 4, 6, 8, tp=4, tp_rank=0, where="model.layers.3.mlp.experts"),
            "not divisible by the MoE tensor-parallel size 4",
        ),
        (lambda: fused_experts("w13", 4, 6, 8, slots=[0, 4], where="model.layers.3.mlp.experts"), "outside the layer's 4 routed experts"),
        (lambda: fused_experts("w13", 4, 6, 8, gated=False, where="model.layers.3.mlp.experts"), "non-gated"),
        (lambda: fused_experts("w2", 4, 6, 8, tp=2, tp_rank=0, local_intermediate=2, where="model.layers.3.mlp.experts"), "smaller than"),
        (lambda: expert_slots(4, 2, 0, "hashed", where="model.layers.3.mlp.experts"), "expert_placement_strategy"),
        (lambda: slots_from_expert_map([0, 0, 1], where="model.layers.3.mlp.experts"), "each once"),
    ],
)
def test_unmappable_layouts_are_refused_in_one_line(build, says: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelMismatchError, match=says) as info:
        build()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("model.layers.3.mlp.experts: ")


@pytest.mark.parametrize("wrong", ["experts", "intermediate", "hidden"])
def test_delta_with_wrong_expert_shape_is_refused_whole(wrong: str) -> None:
    """A delta cut for another E, I or H: one line naming the sizes, nothing written (sink and prepared path)."""
    e, i, h = 4, 6, 8
    lay = fused_experts("w13", e, i, h, tp=2, tp_rank=1)
    rng = np.random.default_rng(0)
    shard = lay.shard(random_bf16(lay.global_shape, rng))
    before = shard.clone()
    good = random_delta(W13, lay.global_shape, rng)
    de, di, dh = e + (wrong == "experts"), i + 2 * (wrong == "intermediate"), h + (wrong == "hidden")
    bad = random_delta(W13, (de, 2 * di, dh), rng)
    staged = StagedDelta(1, 0, (*good.entries[:1], *bad.entries))
    sink = ShardedWeights({W13: shard}, {W13: lay}, {W13: "bfloat16"})
    with pytest.raises(ModelMismatchError) as info:
        apply_delta(staged, sink)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"{de} experts of intermediate size {di} and hidden size {dh} in the delta" in msg
    assert f"the model {e} experts of intermediate size {i} and hidden size {h}" in msg
    with pytest.raises(ModelMismatchError, match="in the delta"):
        prepare_delta(staged, sink.specs(), layout_of_shards({W13: lay}))  # type: ignore[arg-type]
    assert torch.equal(bits(shard), bits(before))


def test_interleaved_runs_of_two_entries_still_refuse_overlaps() -> None:
    """Experts held out of order interleave the local runs of two entries; overlapping entries are still refused."""
    lay = fused_experts("w2", 3, 2, 2, slots=[2, 0, 1])
    spec = ParamSpec(lay.global_shape, "bfloat16")
    one = np.ones(1, np.uint16)
    a = DecodedEntry(W2, spec, 0, 8, 1, np.array([0], np.int64), one, "new")  # expert 0 (slot 1)
    b = DecodedEntry(W2, spec, 8, 12, 1, np.array([8], np.int64), one, "new")  # expert 2 (slot 0)
    layout = layout_of_shards({W2: lay})
    assert layout is not None
    prepared = prepare_delta(StagedDelta(1, 0, (a, b)), {W2: spec}, layout)
    assert [w.indices.tolist() for w in prepared.sparse] == [[0, 4]]
    overlapping = DecodedEntry(W2, spec, 4, 9, 1, np.array([5], np.int64), one, "new")
    with pytest.raises(ModelMismatchError, match="overlapping entries"):
        prepare_delta(StagedDelta(1, 0, (a, b, overlapping)), {W2: spec}, layout)


# ---------------------------------------------------------------------------
# against vLLM 0.32's own placement and loaders (runs where vllm is installed; needs no GPU)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'aurora-store[vllm]')")


@needs_vllm
@pytest.mark.slow
def test_slots_match_vllm_expert_maps() -> None:
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    for experts, redundant in ((8, 0), (10, 0), (6, 3), (5, 2)):
        p2l = EplbState.build_initial_global_physical_to_logical_map(experts, redundant)
        assert list(p2l) == initial_physical_to_logical(experts, redundant)
        for ep in (2, 3, 4):
            for placement in ("linear", "round_robin"):
                for rank in range(ep):
                    n, emap, _ = determine_expert_map(ep, rank, experts + redundant, placement)
                    ours = expert_slots(experts, ep, rank, placement, redundant)
                    assert ours == slots_from_expert_map(emap, p2l), (experts, redundant, ep, placement, rank)
                    assert len(ours) == n


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize(("tp", "ep", "pad_i", "pad_h"), [(2, 1, 0, 0), (4, 1, 3, 2), (1, 2, 0, 0), (1, 3, 0, 1)])
def test_shards_match_vllm_weight_loaders(tp: int, ep: int, pad_i: int, pad_h: int) -> None:
    """Per-expert Hugging Face tensors through ``RoutedExperts._load_w13``/``_load_w2`` land where our layouts put them."""
    from types import SimpleNamespace

    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    experts, inter, hidden, redundant = 6, 8, 4, (2 if ep > 1 else 0)
    w13 = torch.arange(experts * 2 * inter * hidden, dtype=torch.float32).reshape(experts, 2 * inter, hidden)
    w2 = -torch.arange(experts * hidden * inter, dtype=torch.float32).reshape(experts, hidden, inter)
    p2l = EplbState.build_initial_global_physical_to_logical_map(experts, redundant)
    for rank in range(max(tp, ep)):
        tp_rank = rank if tp > 1 else 0
        loader = RoutedExperts.__new__(RoutedExperts)  # only the loaders' own methods and config are used
        pc = SimpleNamespace(tp_size=tp)
        object.__setattr__(loader, "moe_config", SimpleNamespace(is_act_and_mul=True, moe_parallel_config=pc))
        n_local, emap, _ = determine_expert_map(ep, rank if ep > 1 else 0, experts + redundant)
        slots = slots_from_expert_map(emap, p2l, experts=experts)
        li, lh = inter // tp + pad_i, hidden + pad_h
        p13 = torch.zeros(n_local, 2 * li, lh)
        p2 = torch.zeros(n_local, lh, li)
        for physical in range(experts + redundant):
            slot = physical if emap is None else int(emap[physical])
            if slot < 0:
                continue
            e = p2l[physical]
            loader._load_w13(p13[slot], 0, "w1", w13[e, :inter], tp_rank)
            loader._load_w13(p13[slot], 0, "w3", w13[e, inter:], tp_rank)
            loader._load_w2(p2[slot], 1, w2[e], tp_rank)
        kw = dict(tp=tp, tp_rank=tp_rank, slots=slots, local_intermediate=li, local_hidden=lh)
        assert torch.equal(p13, fused_experts("w13", experts, inter, hidden, **kw).shard(w13)), (tp, ep, rank)  # type: ignore[arg-type]
        assert torch.equal(p2, fused_experts("w2", experts, inter, hidden, **kw).shard(w2)), (tp, ep, rank)  # type: ignore[arg-type]
