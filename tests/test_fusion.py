"""Fused parameter names and block offsets (FORMAT.md §2, aurora_store/fusion.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.fusion import FusionPlan, fused_name
from aurora_store.errors import ModelMismatchError

BF = "bfloat16"


def llama_like(
    layers: int = 2,
    hidden: int = 8,
    kv: int = 4,
    inter: int = 12,
    qkv_bias: bool = False,
    tied: bool = False,
    qk_norm: bool = False,
) -> dict[str, ParamSpec]:
    s: dict[str, ParamSpec] = {"model.embed_tokens.weight": ParamSpec((32, hidden), BF)}
    for i in range(layers):
        p = f"model.layers.{i}"
        s[f"{p}.input_layernorm.weight"] = ParamSpec((hidden,), BF)
        s[f"{p}.self_attn.q_proj.weight"] = ParamSpec((hidden, hidden), BF)
        s[f"{p}.self_attn.k_proj.weight"] = ParamSpec((kv, hidden), BF)
        s[f"{p}.self_attn.v_proj.weight"] = ParamSpec((kv, hidden), BF)
        if qkv_bias:
            s[f"{p}.self_attn.q_proj.bias"] = ParamSpec((hidden,), BF)
            s[f"{p}.self_attn.k_proj.bias"] = ParamSpec((kv,), BF)
            s[f"{p}.self_attn.v_proj.bias"] = ParamSpec((kv,), BF)
        if qk_norm:
            s[f"{p}.self_attn.q_norm.weight"] = ParamSpec((4,), BF)
            s[f"{p}.self_attn.k_norm.weight"] = ParamSpec((4,), BF)
        s[f"{p}.self_attn.o_proj.weight"] = ParamSpec((hidden, hidden), BF)
        s[f"{p}.post_attention_layernorm.weight"] = ParamSpec((hidden,), BF)
        s[f"{p}.mlp.gate_proj.weight"] = ParamSpec((inter, hidden), BF)
        s[f"{p}.mlp.up_proj.weight"] = ParamSpec((inter, hidden), BF)
        s[f"{p}.mlp.down_proj.weight"] = ParamSpec((hidden, inter), BF)
    s["model.norm.weight"] = ParamSpec((hidden,), BF)
    s["lm_head.weight"] = ParamSpec((32, hidden), BF)
    return s


FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"kv": 2},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_fuse_qkv_and_gate_up(family: str) -> None:
    kw = FAMILIES[family]
    specs = llama_like(**kw)
    plan = FusionPlan.from_specs(specs)
    hidden, kv, inter = 8, kw.get("kv", 4), 12
    for i in range(2):
        p = f"model.layers.{i}"
        qkv = plan.params[f"{p}.self_attn.qkv_proj.weight"]
        assert qkv.spec == ParamSpec((hidden + 2 * kv, hidden), BF)
        assert [b.source for b in qkv.blocks] == [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"]
        assert [b.offset for b in qkv.blocks] == [0, hidden * hidden, hidden * hidden + kv * hidden]
        assert qkv.is_fused
        gu = plan.params[f"{p}.mlp.gate_up_proj.weight"]
        assert gu.spec == ParamSpec((2 * inter, hidden), BF)
        assert [b.source for b in gu.blocks] == [
            f"{p}.mlp.gate_proj.weight",
            f"{p}.mlp.up_proj.weight",
        ]
        assert [b.offset for b in gu.blocks] == [0, inter * hidden]
        for keep in ("self_attn.o_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            fp = plan.params[f"{p}.{keep}"]
            assert not fp.is_fused and fp.spec == specs[f"{p}.{keep}"]
        for gone in ("q_proj", "k_proj", "v_proj"):
            assert f"{p}.self_attn.{gone}.weight" not in plan.params
        if kw.get("qkv_bias"):
            b = plan.params[f"{p}.self_attn.qkv_proj.bias"]
            assert b.spec == ParamSpec((hidden + 2 * kv,), BF)
            assert [x.offset for x in b.blocks] == [0, hidden, hidden + kv]
        if kw.get("qk_norm"):
            assert not plan.params[f"{p}.self_attn.q_norm.weight"].is_fused
    # every source tensor is carried exactly once, total size preserved
    assert sum(p.spec.numel for p in plan) == sum(s.numel for s in specs.values())
    assert "lm_head.weight" in plan.params
    assert len(plan) == len(plan.specs())


def test_fused_name() -> None:
    assert fused_name("model.layers.3.self_attn.k_proj.weight") == (
        "model.layers.3.self_attn.qkv_proj.weight",
        "k",
        1,
    )
    assert fused_name("model.layers.3.self_attn.v_proj.bias") == (
        "model.layers.3.self_attn.qkv_proj.bias",
        "v",
        2,
    )
    assert fused_name("model.layers.0.mlp.up_proj.weight") == (
        "model.layers.0.mlp.gate_up_proj.weight",
        "up",
        1,
    )
    assert fused_name("model.layers.0.self_attn.o_proj.weight") == (
        "model.layers.0.self_attn.o_proj.weight",
        None,
        0,
    )
    assert fused_name("model.layers.0.mlp.up_proj.bias")[1] is None  # gate/up fuse weights only
    assert fused_name("model.layers.0.mlp.q_proj.weight")[1] is None  # q/k/v only under self_attn


def test_tied_lm_head_dropped() -> None:
    specs = llama_like()
    plan = FusionPlan.from_specs(specs, tied_lm_head=True)
    assert "lm_head.weight" not in plan.params
    assert plan.dropped == ("lm_head.weight",)
    assert "model.embed_tokens.weight" in plan.params
    with pytest.raises(ModelMismatchError):
        plan.source("lm_head.weight")
    assert FusionPlan.from_specs(specs).dropped == ()


def test_incomplete_groups_keep_their_names() -> None:
    specs = {
        "a.self_attn.q_proj.weight": ParamSpec((4, 2), BF),
        "a.self_attn.k_proj.weight": ParamSpec((2, 2), BF),  # no v_proj
        "a.mlp.gate_proj.weight": ParamSpec((3, 2), BF),  # no up_proj
        "b.mlp.up_proj.weight": ParamSpec((3, 2), BF),  # no gate_proj
    }
    plan = FusionPlan.from_specs(specs)
    assert set(plan.params) == set(specs)
    for name, p in plan.params.items():
        assert not p.is_fused and p.spec == specs[name]
        assert [(b.source, b.offset) for b in p.blocks] == [(name, 0)]


def test_already_fused_names_pass_through() -> None:
    specs = {
        "x.self_attn.qkv_proj.weight": ParamSpec((8, 2), BF),
        "x.mlp.gate_up_proj.weight": ParamSpec((6, 2), BF),
    }
    plan = FusionPlan.from_specs(specs)
    assert plan.specs() == specs
    assert not any(p.is_fused for p in plan)


def test_fused_and_parts_together_refused() -> None:
    specs = {
        "x.self_attn.qkv_proj.weight": ParamSpec((8, 2), BF),
        "x.self_attn.q_proj.weight": ParamSpec((4, 2), BF),
        "x.self_attn.k_proj.weight": ParamSpec((2, 2), BF),
        "x.self_attn.v_proj.weight": ParamSpec((2, 2), BF),
    }
    with pytest.raises(ModelMismatchError, match="qkv_proj"):
        FusionPlan.from_specs(specs)


@pytest.mark.parametrize(
    "k_spec",
    [ParamSpec((2, 3), BF), ParamSpec((2, 2), "float16")],
)
def test_unstackable_parts_refused(k_spec: ParamSpec) -> None:
    specs = {
        "x.self_attn.q_proj.weight": ParamSpec((4, 2), BF),
        "x.self_attn.k_proj.weight": k_spec,
        "x.self_attn.v_proj.weight": ParamSpec((2, 2), BF),
    }
    with pytest.raises(ModelMismatchError, match="k_proj"):
        FusionPlan.from_specs(specs)


def test_source_lookup() -> None:
    plan = FusionPlan.from_specs(llama_like())
    name, blk = plan.source("model.layers.1.self_attn.v_proj.weight")
    assert name == "model.layers.1.self_attn.qkv_proj.weight"
    assert blk.offset == 8 * 8 + 4 * 8 and blk.numel == 4 * 8
    assert plan.source("model.norm.weight")[1].offset == 0
    with pytest.raises(ModelMismatchError):
        plan.source("model.layers.9.self_attn.q_proj.weight")


# --- reverse map against a torch.cat reference -----------------------------------


@given(
    q_rows=st.integers(1, 6),
    k_rows=st.integers(1, 6),
    cols=st.integers(1, 5),
    bias=st.booleans(),
    seed=st.integers(0, 2**31),
    density=st.floats(0.0, 1.0),
)
def test_split_matches_torch_cat(q_rows: int, k_rows: int, cols: int, bias: bool, seed: int, density: float) -> None:
    suffix = "bias" if bias else "weight"
    shapes = {"q": (q_rows,), "k": (k_rows,), "v": (k_rows,)} if bias else {"q": (q_rows, cols), "k": (k_rows, cols), "v": (k_rows, cols)}
    specs = {f"m.self_attn.{x}_proj.{suffix}": ParamSpec(s, "float32") for x, s in shapes.items()}
    plan = FusionPlan.from_specs(specs)
    fused = f"m.self_attn.qkv_proj.{suffix}"
    # each element holds a unique tag: (block number, local flat index)
    src = {
        n: torch.arange(ParamSpec(s.shape, s.dtype).numel, dtype=torch.float32).reshape(s.shape) + 1000 * k
        for k, (n, s) in enumerate(specs.items())
    }
    cat = torch.cat([src[n] for n in specs], dim=0)
    assert plan.params[fused].spec.shape == tuple(cat.shape)
    rng = np.random.default_rng(seed)
    idx = np.flatnonzero(rng.random(cat.numel()) < density).astype(np.int64)
    parts = plan.split(fused, idx)
    got = np.concatenate([i for _, i in parts]) if parts else np.empty(0, np.int64)
    assert got.size == idx.size
    flat = cat.reshape(-1)
    k = 0
    for blk, local in parts:
        assert local.size > 0
        assert np.all((local >= 0) & (local < blk.numel))
        for li in local.tolist():
            # the fused element and the split element are the same tagged value
            assert flat[idx[k]].item() == src[blk.source].reshape(-1)[li].item()
            k += 1
    # split_range agrees with torch.cat too
    lo, hi = sorted(rng.integers(0, cat.numel() + 1, size=2).tolist())
    if hi > lo:
        pieces = plan.split_range(fused, lo, hi)
        rebuilt = torch.cat([src[b.source].reshape(-1)[a:z] for b, a, z, _ in pieces])
        assert torch.equal(rebuilt, flat[lo:hi])
        assert [off for *_, off in pieces] == np.cumsum([0] + [z - a for _, a, z, _ in pieces[:-1]]).tolist()


def test_split_of_unfused_param_is_identity() -> None:
    plan = FusionPlan.from_specs({"model.norm.weight": ParamSpec((8,), BF)})
    idx = np.array([0, 3, 7])
    ((blk, local),) = plan.split("model.norm.weight", idx)
    assert blk.source == "model.norm.weight" and local is idx
