"""``aurora demo`` on tiny mixture-of-experts models, and ``aurora follow`` on the run it leaves.

The evidence of issue 26 as a user would run it: ``aurora tiny-model`` makes a
tiny Qwen3-MoE and a tiny Mixtral (their own tokenizer, experts saved one by
one, fine-tuned a moment so that sampling earns some reward), then
``aurora demo --model DIR --task gsm8k --data FILE --steps 4 --json`` trains
each with GRPO while Actors (a Relay, one killed, one joining late) generate:
every activation is bit-identical to the Trainer's weights, the JSON names
the family, nothing is lost or accepted twice, and the experts moved. Then
``aurora follow`` on the run's store writes a directory transformers loads,
whose experts equal what ``aurora delta apply`` makes of the same version.
The same with ``--engine vllm`` (vLLM's CPU MoE layers), with two Actors.
"""

from __future__ import annotations

import importlib.util
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

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.usefixtures("one_torch_thread")]

STEPS = 4
MODULE = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
"""Where FORMAT.md §2 puts each family's experts and router (transformers holds both under ``mlp``)."""

VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or not (Path(__file__).parents[1] / "workers" / "engine" / "vllm_moe.py").exists(),
    reason="vLLM Actors of a mixture-of-experts model need vllm and workers/engine/vllm_moe.py",
)


def _demo(model: Path, data: Path, work: Path, *extra: str) -> dict[str, Any]:
    """``aurora demo ... --json`` as a user runs it (its own Redis and S3 server); its JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    env.update(PYTHONUNBUFFERED="1")
    argv = ["demo", "--model", str(model), "--task", "gsm8k", "--data", str(data), "--steps", str(STEPS), "--json", "--dir", str(work)]
    p = subprocess.run(
        [sys.executable, "-m", "aurora_tools.cli", *argv, *extra], env=env, capture_output=True, text=True, timeout=1800, check=False
    )
    logs = (
        {f.name: f.read_text(errors="replace")[-2000:] for f in sorted((work / "logs").glob("*.log"))} if (work / "logs").exists() else {}
    )
    assert p.returncode == 0, (p.stderr[-4000:], logs)
    return json.loads(p.stdout.strip().splitlines()[-1])


def _check_demo(res: dict[str, Any], family: str, killed: int = 1, joined: int = 1) -> None:
    assert res["bit_identical"] is True and res["activations_compared"] > STEPS, res
    assert res["model_family"] == family
    assert res["steps"] == STEPS and len(res["per_step"]) == STEPS
    assert res["prompts_lost"] == 0 and res["accepted_twice"] == 0 and res["accepted_wrong_version"] == 0
    assert res["actors_killed"] == killed and res["actors_joined"] == joined
    # The fine-tuned model earns rewards, so GRPO steps shipped non-empty deltas.
    assert any(s["changed"] > 0 for s in res["per_step"]), res["per_step"]


def _follow_matches_delta_apply(work: Path, model: Path, family: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``aurora follow`` of the demo's run, loaded by transformers, against ``aurora delta apply`` of the same version."""
    from transformers import AutoModelForCausalLM

    store = f"file://{work / 'store'}"
    served, applied = work / "served", work / f"v{STEPS}.safetensors"
    assert main(["follow", "--store", store, "--out", str(served), "--until", str(STEPS), "--poll-s", "0.05"]) == 0, capsys.readouterr().err
    assert main(["delta", "apply", "--version", str(STEPS), "--out", str(applied), "--store", store]) == 0, capsys.readouterr().err
    loaded = AutoModelForCausalLM.from_pretrained(str(served), dtype=torch.bfloat16, local_files_only=True)
    assert loaded.config.model_type == family
    held = dict(loaded.named_parameters())
    fused = load_file(str(applied))
    start = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16, local_files_only=True)
    v0 = dict(start.named_parameters())
    moved = 0
    for layer in range(int(loaded.config.num_hidden_layers)):
        pre, fmt = f"model.layers.{layer}.mlp.", f"model.layers.{layer}.{MODULE[family]}."
        for mine, theirs in (
            ("experts.gate_up_proj", "experts.w13_weight"),
            ("experts.down_proj", "experts.w2_weight"),
            ("gate.weight", "gate.weight"),
        ):
            assert torch.equal(held[pre + mine], fused[fmt + theirs]), (pre + mine, fmt + theirs)
            moved += int(not torch.equal(held[pre + mine], v0[pre + mine]))
    assert moved > 0  # the experts or routers of some layer trained away from the checkpoint
    assert not any(".experts.0." in n or n.endswith(("gate_up_proj", "down_proj")) for n in fused)  # FORMAT.md §2 names only


# Long (3 min): in `make test` the MoE paths run through test_moe_train (two ranks to an Actor, and a
# resume), test_vllm_moe, test_glm4_moe and test_moe_checkpoints; `make test-all` runs this whole demo.
@pytest.mark.long
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_demo_on_a_tiny_moe_is_bit_identical_and_follow_writes_delta_apply_s_experts(
    shared_tmp: Path, tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model, data = moe_dir(shared_tmp, family, supervised=True)
    res = _demo(model, data, tmp_path / "demo")
    _check_demo(res, family)
    _follow_matches_delta_apply(tmp_path / "demo", model, family, capsys)


@VLLM
@pytest.mark.long
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_demo_with_vllm_actors_on_a_tiny_moe_is_bit_identical(shared_tmp: Path, tmp_path: Path, family: str) -> None:
    """``aurora demo --engine vllm`` with two vLLM Actors (one behind the Relay, one on origin) instead
    of five: each vLLM engine holds a few GiB, more than a test machine has for five."""
    from aurora_store.testing.servers import RedisServer
    from aurora_tools.demo.system import DemoConfig, run_system_demo

    model, data = moe_dir(shared_tmp, family, supervised=True)
    with RedisServer() as rs:
        cfg = DemoConfig(
            steps=STEPS,
            actors_relay=1,
            actors_origin=1,
            kill_at=-1,
            join_at=-1,
            redis=rs.url,
            run=f"vllm-{family}",
            workdir=str(tmp_path),
            display=False,
            engine="vllm",
            model=str(model),
            task="gsm8k",
            data=str(data),
        )
        res = run_system_demo(cfg, say=lambda *a, **k: None).to_json()
    logs = {n: (tmp_path / "logs" / f"{n}.log").read_text(errors="replace")[-3000:] for n in ("eu-0", "us-0")}
    _check_demo(res, family, killed=0, joined=0)
    for actor, log in logs.items():
        assert f"{actor} activated v{STEPS - 1}" in log or f"{actor} activated v{STEPS}" in log, log
