"""Mixture-of-experts names (FORMAT.md §2): Hugging Face per-expert and packed tensors <-> ``w13_weight`` / ``w2_weight``.

The models are transformers' own (Qwen3-MoE, Qwen2-MoE with its shared
expert, Mixtral, and GLM-4-MoE for the DeepSeek-style names), tiny, random:
what ``save_pretrained`` writes (experts one by one) and what transformers 5
holds in memory (packed) must reach the same format tensors, bit for bit,
and come back. A checkpoint with an expert missing, shapes that disagree or
two forms in one layer is refused with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.experts import check_config, expert_dims
from aurora_store.codec.extract import fuse_weights, plan_of, spec_of, unfuse_weights
from aurora_store.codec.fusion import FusionPlan, fused_name
from aurora_store.errors import ModelMismatchError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, I_, H = 4, 40, 64
"""Experts, expert intermediate size (not a multiple of 32), hidden size of the in-memory models."""

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": E, "moe_intermediate_size": I_, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": E, "moe_intermediate_size": I_, "shared_expert_intermediate_size": 48, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": E, "intermediate_size": I_, "num_experts_per_tok": 2},
    "glm4_moe": {
        "n_routed_experts": E,
        "moe_intermediate_size": I_,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
    },
}
MODULE = {"qwen3_moe": "mlp", "qwen2_moe": "mlp", "mixtral": "block_sparse_moe", "glm4_moe": "mlp"}
PROJ = {"mixtral": ("w1", "w3", "w2")}


def hf_model(family: str, seed: int = 0) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        family,
        vocab_size=96,
        hidden_size=H,
        intermediate_size=CONFIGS[family].get("intermediate_size", 72),
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        **{k: v for k, v in CONFIGS[family].items() if k != "intermediate_size"},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    return torch.nn.Module.to(model, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, dict[str, torch.Tensor]]]:
    """family -> (the model, what save_pretrained wrote: per-expert names)."""
    out = {}
    for family in CONFIGS:
        model = hf_model(family)
        d = tmp_path_factory.mktemp(family)
        model.save_pretrained(str(d))
        out[family] = (model, load_file(str(d / "model.safetensors")))
    return out


def specs(tensors: dict[str, torch.Tensor]) -> dict[str, ParamSpec]:
    return {n: spec_of(t, n) for n, t in tensors.items()}


def held(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_checkpoint_names_become_two_expert_tensors_per_layer_and_come_back(saved: Any, family: str) -> None:
    _, disk = saved[family]
    assert any(".experts.3." in n for n in disk)  # transformers writes the experts one by one
    plan = plan_of(disk, tied=False, family=family)
    fused = fuse_weights(disk, plan)
    moe = f"model.layers.1.{MODULE[family]}"
    assert not [n for n in fused if ".experts." in n and not n.endswith(("w13_weight", "w2_weight"))]
    w13, w2 = fused[f"{moe}.experts.w13_weight"], fused[f"{moe}.experts.w2_weight"]
    assert tuple(w13.shape) == (E, 2 * I_, H) and tuple(w2.shape) == (E, H, I_)
    assert expert_dims(f"{moe}.experts.w13_weight", spec_of(w13, "w13")) == (E, I_, H)
    assert expert_dims(f"{moe}.experts.w2_weight", spec_of(w2, "w2")) == (E, I_, H)
    gate, up, down = PROJ.get(family, ("gate_proj", "up_proj", "down_proj"))
    for e in range(E):
        assert torch.equal(w13[e, :I_], disk[f"{moe}.experts.{e}.{gate}.weight"])
        assert torch.equal(w13[e, I_:], disk[f"{moe}.experts.{e}.{up}.weight"])
        assert torch.equal(w2[e], disk[f"{moe}.experts.{e}.{down}.weight"])
    assert f"{moe}.gate.weight" in fused  # the router keeps its name
    if family == "qwen2_moe":
        assert "model.layers.1.mlp.shared_expert.gate_up_proj.weight" in fused and "model.layers.1.mlp.shared_expert_gate.weight" in fused
    if family == "glm4_moe":
        assert (
            "model.layers.1.mlp.shared_experts.gate_up_proj.weight" in fused and "model.layers.1.mlp.gate.e_score_correction_bias" in fused
        )
        assert "model.layers.0.mlp.gate_up_proj.weight" in fused  # a dense first layer stays dense
    back = unfuse_weights(fused, plan)
    assert set(back) == set(disk) and all(torch.equal(back[n], disk[n]) for n in disk)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_experts_held_in_memory_reach_the_same_tensors_and_the_reverse_map_gives_either_form(saved: Any, family: str) -> None:
    model, disk = saved[family]
    mem = held(model)
    assert any(n.endswith("experts.gate_up_proj") for n in mem)
    disk_plan, mem_plan = plan_of(disk, tied=False, family=family), plan_of(mem, tied=False, family=family)
    a, b = fuse_weights(disk, disk_plan), fuse_weights(mem, mem_plan)
    common = set(b)  # glm4_moe's router bias is a buffer: saved, not a parameter
    assert set(a) - common <= {n for n in a if n.endswith("e_score_correction_bias")}
    assert all(torch.equal(a[n], b[n]) for n in common)
    assert {n: s for n, s in disk_plan.specs().items() if n in common} == mem_plan.specs()
    as_saved = unfuse_weights(b, mem_plan.with_experts("per_expert"))
    assert all(torch.equal(as_saved[n], disk[n]) for n in as_saved) and set(as_saved) <= set(disk)
    as_held = unfuse_weights(a, disk_plan.with_experts("packed"))
    assert all(torch.equal(as_held[n], mem[n]) for n in mem) and set(mem) <= set(as_held)


def test_mixtral_in_memory_needs_its_family_for_the_format_module(saved: Any) -> None:
    model, _ = saved["mixtral"]
    mem = held(model)
    names = set(plan_of(mem, tied=False, family="mixtral").specs())
    assert "model.layers.0.block_sparse_moe.experts.w13_weight" in names and "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not [n for n in names if ".mlp." in n]
    # Without it the names keep the module they were found in (what the engine's names then refuse).
    assert "model.layers.0.mlp.experts.w13_weight" in set(plan_of(mem, tied=False).specs())


def test_fused_name_gives_each_projection_its_block_position() -> None:
    p = "model.layers.2.mlp.experts"
    assert fused_name(f"{p}.3.gate_proj.weight") == (f"{p}.w13_weight", "gate", 6)
    assert fused_name(f"{p}.3.up_proj.weight") == (f"{p}.w13_weight", "up", 7)
    assert fused_name(f"{p}.3.down_proj.weight") == (f"{p}.w2_weight", "down", 3)
    assert fused_name(f"{p}.gate_up_proj") == (f"{p}.w13_weight", "gate_up", 0)
    m = "model.layers.2.block_sparse_moe"
    assert fused_name(f"{m}.experts.1.w3.weight") == (f"{m}.experts.w13_weight", "up", 3)
    assert fused_name("model.layers.2.mlp.experts.down_proj", "mixtral") == (f"{m}.experts.w2_weight", "down", 0)
    assert fused_name("model.layers.2.mlp.gate.weight", "mixtral") == (f"{m}.gate.weight", None, 0)
    assert fused_name("model.layers.2.mlp.gate.weight", "qwen3_moe") == ("model.layers.2.mlp.gate.weight", None, 0)
    assert fused_name("model.layers.2.mlp.shared_expert.up_proj.weight") == (
        "model.layers.2.mlp.shared_expert.gate_up_proj.weight",
        "up",
        1,
    )


def test_a_format_flat_index_splits_to_the_expert_row_and_column_the_format_says(saved: Any) -> None:
    _, disk = saved["qwen3_moe"]
    plan = plan_of(disk, tied=False)
    name = "model.layers.0.mlp.experts.w13_weight"
    e, r, c = 2, 5, 7
    up_flat, gate_flat = e * 2 * I_ * H + (I_ + r) * H + c, e * 2 * I_ * H + r * H + c
    got = plan.split(name, np.array([gate_flat, up_flat], dtype=np.int64))
    assert [(b.source, list(ix)) for b, ix in got] == [
        (f"model.layers.0.mlp.experts.{e}.gate_proj.weight", [r * H + c]),
        (f"model.layers.0.mlp.experts.{e}.up_proj.weight", [r * H + c]),
    ]
    ranges = plan.split_range("model.layers.0.mlp.experts.w2_weight", H * I_ - 1, H * I_ + 1)
    assert [(b.source, lo, hi) for b, lo, hi, _ in ranges] == [
        ("model.layers.0.mlp.experts.0.down_proj.weight", H * I_ - 1, H * I_),
        ("model.layers.0.mlp.experts.1.down_proj.weight", 0, 1),
    ]


# ---------------------------------------------------------------------------
# bad checkpoints: one line, no plan


def refused(s: dict[str, ParamSpec], family: str | None = None) -> str:
    with pytest.raises(ModelMismatchError) as ei:
        FusionPlan.from_specs(s, family=family)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def qwen_layer(experts: int = 8, inter: int = I_, hidden: int = H) -> dict[str, ParamSpec]:
    bf, p = "bfloat16", "model.layers.0.mlp"
    s = {f"{p}.gate.weight": ParamSpec((experts, hidden), bf)}
    for e in range(experts):
        s[f"{p}.experts.{e}.gate_proj.weight"] = ParamSpec((inter, hidden), bf)
        s[f"{p}.experts.{e}.up_proj.weight"] = ParamSpec((inter, hidden), bf)
        s[f"{p}.experts.{e}.down_proj.weight"] = ParamSpec((hidden, inter), bf)
    return s


def test_a_checkpoint_missing_an_expert_is_refused() -> None:
    s = {n: v for n, v in qwen_layer().items() if ".experts.3." not in n}
    assert "expert 3 of 8 is absent" in refused(s)
    s = {n: v for n, v in qwen_layer().items() if n != "model.layers.0.mlp.experts.7.down_proj.weight"}
    assert "expert 7 of 8 has no down projection" in refused(s)
    # The last expert gone: the router's 8 rows still tell.
    s = {n: v for n, v in qwen_layer().items() if ".experts.7." not in n}
    assert "expert 7 of 8 is absent" in refused(s)


def test_expert_shapes_that_disagree_are_refused_naming_the_tensor() -> None:
    s = qwen_layer()
    s["model.layers.0.mlp.experts.5.up_proj.weight"] = ParamSpec((I_ + 8, H), "bfloat16")
    msg = refused(s)
    assert "experts.5.up_proj.weight" in msg and f"I={I_}" in msg
    s = qwen_layer()
    s["model.layers.0.mlp.gate.weight"] = ParamSpec((8, H + 1), "bfloat16")
    assert "gate.weight" in refused(s) and "[E, H]" in refused(s)
    s = qwen_layer()
    s["model.layers.0.mlp.experts.8.gate_proj.weight"] = ParamSpec((I_, H), "bfloat16")
    assert "expert 8 is named, but the router" in refused(s)


def test_packed_and_per_expert_names_mixed_in_one_layer_are_refused() -> None:
    s = qwen_layer(experts=2)
    s["model.layers.0.mlp.experts.gate_up_proj"] = ParamSpec((2, 2 * I_, H), "bfloat16")
    s["model.layers.0.mlp.experts.down_proj"] = ParamSpec((2, H, I_), "bfloat16")
    msg = refused(s)
    assert "model.layers.0" in msg and "more than one form" in msg and "packed" in msg and "per-expert" in msg


def test_packings_other_than_the_format_s_are_refused() -> None:
    p, bf = "model.layers.0.mlp.experts", "bfloat16"
    transposed = {f"{p}.gate_up_proj": ParamSpec((4, H, 2 * I_), bf), f"{p}.down_proj": ParamSpec((4, I_, H), bf)}
    assert "other packings (transposed, interleaved) are refused" in refused(transposed)
    assert "down_proj / w2_weight is not" in refused({f"{p}.gate_up_proj": ParamSpec((4, 2 * I_, H), bf)})
    good = {f"{p}.gate_up_proj": ParamSpec((4, 2 * I_, H), bf), f"{p}.down_proj": ParamSpec((4, H, I_), bf)}
    assert FusionPlan.from_specs(good).specs() == {
        f"{p}.w13_weight": ParamSpec((4, 2 * I_, H), bf),
        f"{p}.w2_weight": ParamSpec((4, H, I_), bf),
    }


def test_expert_sizes_are_checked_against_the_config() -> None:
    s = FusionPlan.from_specs(qwen_layer()).specs()
    check_config(s, {"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": I_, "hidden_size": H}, "dir")
    with pytest.raises(ModelMismatchError, match="has E=8, config.json says num_experts=16"):
        check_config(s, {"model_type": "qwen3_moe", "num_experts": 16}, "dir")
    with pytest.raises(ModelMismatchError, match="has I=40, config.json says moe_intermediate_size=48"):
        check_config(s, {"model_type": "qwen3_moe", "moe_intermediate_size": 48}, "dir")


def test_a_tiny_moe_directory_loads_and_names_its_family(tmp_path: Path) -> None:
    from aurora_tools.tinymodel import MOE_SPECS, make_model_dir
    from workers.pretrained import load_pretrained, read_model_dir

    d = make_model_dir(tmp_path / "m", "qwen2_moe")
    md = read_model_dir(d)
    assert md.family == "qwen2_moe" and md.config["head_dim"] in (32, 64)
    assert md.config["moe_intermediate_size"] == MOE_SPECS["qwen2_moe"].moe_intermediate
    assert any(s.moe_intermediate % 32 for s in MOE_SPECS.values())  # vLLM's CPU MoE pads these
    model = load_pretrained(d, torch.bfloat16)
    assert model.config.num_experts == MOE_SPECS["qwen2_moe"].experts
