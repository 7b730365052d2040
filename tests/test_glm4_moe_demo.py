"""``aurora demo`` on a tiny GLM-4-MoE, and ``aurora follow`` on the run it leaves (issue 26, DeepSeek-style experts).

As a user runs it: ``aurora tiny-model --family glm4_moe`` (a dense first
layer, shared experts, a sigmoid router with a non-zero float32
``e_score_correction_bias``; fine-tuned a moment so sampling earns some
reward), then ``aurora demo --model DIR --task gsm8k --data FILE --steps 4
--json``: every activation is bit-identical to the Trainer's weights and the
JSON names the family. The router bias travels as a frozen parameter
(:mod:`workers.router_bias`): the Trainer never moves it, so every version
holds the bf16 rounding of the checkpoint's (an Actor's engine computes in
bf16, buffers included). ``aurora follow`` writes a directory transformers
loads whose experts, shared experts, routers and biases equal what
``aurora delta apply`` gives for the same version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from moe_fixtures import moe_dir
from safetensors.torch import load_file

from aurora_tools.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.long, pytest.mark.usefixtures("one_torch_thread")]

STEPS = 4
FAMILY = "glm4_moe"


def _demo(model: Path, data: Path, work: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    env.update(PYTHONUNBUFFERED="1")
    argv = ["demo", "--model", str(model), "--task", "gsm8k", "--data", str(data), "--steps", str(STEPS), "--json", "--dir", str(work)]
    p = subprocess.run(
        [sys.executable, "-m", "aurora_tools.cli", *argv], env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    logs = (
        {f.name: f.read_text(errors="replace")[-2000:] for f in sorted((work / "logs").glob("*.log"))} if (work / "logs").exists() else {}
    )
    assert p.returncode == 0, (p.stderr[-4000:], logs)
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_demo_on_a_tiny_glm4_moe_is_bit_identical_and_follow_carries_the_router_bias(
    shared_tmp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    model, data = moe_dir(shared_tmp, FAMILY, supervised=True)
    work = tmp_path / "demo"
    res = _demo(model, data, work)
    assert res["bit_identical"] is True and res["activations_compared"] > STEPS, res
    assert res["model_family"] == FAMILY
    assert res["steps"] == STEPS and len(res["per_step"]) == STEPS
    assert res["prompts_lost"] == 0 and res["accepted_twice"] == 0 and res["accepted_wrong_version"] == 0
    assert any(s["changed"] > 0 for s in res["per_step"]), res["per_step"]

    store = f"file://{work / 'store'}"
    served, applied = work / "served", work / f"v{STEPS}.safetensors"
    assert main(["follow", "--store", store, "--out", str(served), "--until", str(STEPS), "--poll-s", "0.05"]) == 0, capsys.readouterr().err
    assert main(["delta", "apply", "--version", str(STEPS), "--out", str(applied), "--store", store]) == 0, capsys.readouterr().err
    loaded = AutoModelForCausalLM.from_pretrained(str(served), dtype=torch.bfloat16, local_files_only=True)
    assert loaded.config.model_type == FAMILY
    held = loaded.state_dict()  # the bias is a buffer in transformers' own model
    fused = load_file(str(applied))
    disk = load_file(str(model / "model.safetensors"))
    start = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16, local_files_only=True).state_dict()
    moved = 0
    for layer in range(1, int(loaded.config.num_hidden_layers)):  # layer 0 is dense (first_k_dense_replace=1)
        p = f"model.layers.{layer}.mlp."
        for mine, theirs in (
            ("experts.gate_up_proj", "experts.w13_weight"),
            ("experts.down_proj", "experts.w2_weight"),
            ("gate.weight", "gate.weight"),
        ):
            assert torch.equal(held[p + mine], fused[p + theirs]), (p + mine, p + theirs)
            moved += int(not torch.equal(held[p + mine], start[p + mine]))
        shared = torch.cat([held[p + "shared_experts.gate_proj.weight"], held[p + "shared_experts.up_proj.weight"]])
        assert torch.equal(shared, fused[p + "shared_experts.gate_up_proj.weight"])
        # Never trained, never dropped: the checkpoint's float32 bias, as the bf16 versions hold it.
        bias = p + "gate.e_score_correction_bias"
        want = disk[bias].to(torch.bfloat16)
        assert torch.equal(fused[bias], want) and torch.equal(held[bias].to(torch.bfloat16), want) and want.abs().min() > 0
    assert moved > 0
