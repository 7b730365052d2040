"""GLM-4-MoE (``glm4_moe``: DeepSeek-V3-style experts, standard attention) through the store, and as the workers build it.

A tiny GLM-4-MoE directory (``aurora_tools.tinymodel``: layer 0 dense, as
``first_k_dense_replace=1`` makes it, then routed experts beside a shared
expert and a sigmoid router whose ``e_score_correction_bias`` is a float32
buffer with non-zero values) goes in as a user would give it. The store
holds FORMAT.md §2's names, the float32 bias included, bit for bit, and a
delta that moves it applies bit for bit. The models the workers build hold
the bias as a frozen parameter (so that it travels with the weights) and
compute what transformers' own model computes; without it they would not.
An Actor's skeleton, built from the run root's config alone, has the bias in
its engine's plan and takes version 0's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_helpers import apply_out, clean_aurora_env, ok, saved  # noqa: F401 - clean_aurora_env: a fixture
from safetensors.torch import save_file

from aurora_store.codec.extract import fuse_weights, plan_of
from aurora_tools.tinymodel import MOE_SPECS, make_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread", "clean_aurora_env")

SPEC = MOE_SPECS["glm4_moe"]
E, I_, H = SPEC.experts, SPEC.moe_intermediate, SPEC.hidden
BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("m") / "glm4_moe", "glm4_moe")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def test_the_tiny_checkpoint_is_what_a_user_brings(glm: str) -> None:
    """A dense first layer, experts one by one, a shared expert, and a float32 non-zero bias (zeros would route as none)."""
    disk = saved(glm)
    assert "model.layers.0.mlp.gate_proj.weight" in disk and not any(n.startswith("model.layers.0.mlp.experts.") for n in disk)
    for layer in range(1, SPEC.layers):
        assert disk[BIAS.format(layer)].dtype == torch.float32 and disk[BIAS.format(layer)].abs().min() > 0
        assert f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight" in disk
        assert f"model.layers.{layer}.mlp.experts.{E - 1}.down_proj.weight" in disk


def test_snapshot_holds_format_names_and_the_float32_bias_bit_for_bit(tmp_path: Path, glm: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"file://{tmp_path}/run"
    ok(["snapshot", "create", glm, "--version", "0", "--store", store], capsys)
    v0, disk = apply_out(store, 0, tmp_path, capsys), saved(glm)
    # Layer 0 is dense: the gate and up projections fused, no experts, no router.
    assert torch.equal(
        v0["model.layers.0.mlp.gate_up_proj.weight"],
        torch.cat([disk["model.layers.0.mlp.gate_proj.weight"], disk["model.layers.0.mlp.up_proj.weight"]]),
    )
    assert not any(n.startswith("model.layers.0.mlp.") and ("experts" in n or ".gate." in n) for n in v0)
    for layer in range(1, SPEC.layers):
        p = f"model.layers.{layer}.mlp"
        w13, w2 = v0[f"{p}.experts.w13_weight"], v0[f"{p}.experts.w2_weight"]
        assert w13.shape == (E, 2 * I_, H) and w2.shape == (E, H, I_)
        for e in range(E):
            assert torch.equal(w13[e, :I_], disk[f"{p}.experts.{e}.gate_proj.weight"])
            assert torch.equal(w13[e, I_:], disk[f"{p}.experts.{e}.up_proj.weight"])
            assert torch.equal(w2[e], disk[f"{p}.experts.{e}.down_proj.weight"])
        shared = torch.cat([disk[f"{p}.shared_experts.gate_proj.weight"], disk[f"{p}.shared_experts.up_proj.weight"]])
        assert torch.equal(v0[f"{p}.shared_experts.gate_up_proj.weight"], shared)
        assert torch.equal(v0[f"{p}.gate.weight"], disk[f"{p}.gate.weight"])
        bias = v0[BIAS.format(layer)]
        assert bias.dtype == torch.float32 and torch.equal(bits(bias), bits(disk[BIAS.format(layer)]))
    assert not any(".experts.0." in n for n in v0)


def test_a_delta_that_moves_the_bias_and_experts_applies_bit_exactly(tmp_path: Path, glm: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"file://{tmp_path}/run"
    ok(["snapshot", "create", glm, "--version", "0", "--store", store], capsys)
    w1 = {n: t.clone() for n, t in saved(glm).items()}
    bits(w1[BIAS.format(1)])[3] += 1  # one float32 unit: a bf16 rounding would lose it
    bits(w1["model.layers.2.mlp.experts.5.up_proj.weight"]).view(-1)[7] += 1
    bits(w1["model.layers.1.mlp.shared_experts.down_proj.weight"]).view(-1)[11] += 1
    f1 = tmp_path / "w1.safetensors"
    save_file(w1, str(f1))
    ok(["delta", "create", glm, str(f1), "--version", "1", "--store", store], capsys)
    want = fuse_weights(w1, plan_of(w1, tied=True, family="glm4_moe"))
    got = apply_out(store, 1, tmp_path, capsys)
    assert set(got) == set(want) and all(torch.equal(bits(got[n]), bits(want[n])) for n in want)
    assert got[BIAS.format(1)][3] != saved(glm)[BIAS.format(1)][3]


def test_the_workers_models_hold_the_bias_as_a_frozen_parameter_and_compute_as_transformers(glm: str) -> None:
    from transformers import AutoModelForCausalLM

    from workers.pretrained import build_empty, load_pretrained
    from workers.router_bias import bias_as_parameter
    from workers.trainer.sharding import params_on_meta

    disk = saved(glm)
    ours = load_pretrained(glm, torch.float32).eval()
    params = dict(ours.named_parameters())
    for layer in range(1, SPEC.layers):
        p = params[BIAS.format(layer)]
        assert not p.requires_grad and p.dtype == torch.float32 and torch.equal(bits(p.data), bits(disk[BIAS.format(layer)]))
    assert not any(n.endswith("e_score_correction_bias") for n, _ in ours.named_buffers())
    assert bias_as_parameter(ours) == []  # already parameters: nothing moves twice
    theirs = AutoModelForCausalLM.from_pretrained(glm, dtype=torch.float32, local_files_only=True).eval()
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        want = theirs(ids).logits
        assert torch.equal(ours(ids).logits, want)
        # The test can fail: without the bias (what an Actor built from the config alone holds) the routing differs.
        for layer in range(1, SPEC.layers):
            params[BIAS.format(layer)].zero_()
        assert not torch.equal(ours(ids).logits, want)
    with params_on_meta():
        empty = build_empty(glm, torch.float32)
    meta = {n: p for n, p in empty.named_parameters() if n.endswith("e_score_correction_bias")}
    assert sorted(meta) == [BIAS.format(layer) for layer in range(1, SPEC.layers)]
    assert all(p.device.type == "meta" and not p.requires_grad for p in meta.values())


def test_an_actor_built_from_the_run_root_takes_the_bias_with_version_0(tmp_path: Path, glm: str) -> None:
    """The Actor's skeleton (config only) holds the bias as a parameter; the torch engine loads version 0's into it."""
    from aurora_store.lineage.fetch import fetch_snapshot
    from aurora_store.lineage.publish import PublishConfig, publish_snapshot
    from aurora_store.storage import open_store
    from workers.common import read_model_description, write_model_description
    from workers.engine.torch_engine import TorchEngine
    from workers.model import fused_weights, fusion_plan_for, hf_weights
    from workers.pretrained import load_pretrained, read_model_dir

    md = read_model_dir(glm)
    store = open_store(f"file://{tmp_path}/run")
    files = write_model_description(store, md.files["config.json"], md.files.get("tokenizer.json"), md.files)
    # A Trainer's version is the bf16 rounding of its master weights, the frozen bias too (transformers keeps it float32).
    version = {n: t.to(torch.bfloat16) for n, t in hf_weights(load_pretrained(glm, torch.float32)).items()}
    plan = fusion_plan_for(version, tied=True, family="glm4_moe")
    publish_snapshot(store, "glm", 0, fused_weights(version, plan), None, PublishConfig(), model=files)
    skeleton, tok = read_model_description(store)
    assert {n: p.dtype for n, p in skeleton.named_parameters() if n.endswith("e_score_correction_bias")} == {
        BIAS.format(layer): torch.bfloat16 for layer in range(1, SPEC.layers)
    }
    engine = TorchEngine(tok)
    engine.load(skeleton, version=None)
    assert BIAS.format(1) in engine.param_specs()  # in the plan: snapshots and deltas reach it
    engine.load_weights(fetch_snapshot(store, 0)[1], version=0)
    disk = saved(glm)
    held = dict(engine.model.named_parameters())
    for layer in range(1, SPEC.layers):
        assert torch.equal(held[BIAS.format(layer)].data, disk[BIAS.format(layer)].to(torch.bfloat16))


def test_the_publisher_takes_a_users_model_with_its_router_biases(glm: str) -> None:
    # A user's own transformers model (not built by the workers): the biases are still buffers there.
    from transformers import AutoModelForCausalLM

    from aurora_store.api.weights import named_tensors

    model = AutoModelForCausalLM.from_pretrained(glm, dtype=torch.float32)
    assert not any(n.endswith("e_score_correction_bias") for n, _ in model.named_parameters())
    named = dict(named_tensors(model))
    biases = {n for n in named if n.endswith("e_score_correction_bias")}
    assert biases == {n for n, _ in model.named_buffers() if n.endswith("e_score_correction_bias")} and biases
    for n in biases:
        assert torch.equal(named[n], model.get_buffer(n)) and named[n].abs().sum() > 0
