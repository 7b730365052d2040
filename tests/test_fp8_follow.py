"""``aurora follow --quantize fp8-block128`` (issue 27): each version as an FP8 block-quantized Hugging Face directory.

A run of a tiny Qwen3 is published with ``aurora_store.Publisher``; the
follower runs in its own process, as a user would start it, and keeps its
FP8 copy current from one version to the next. At every version the
directory's tensors must equal the recipe, computed here in torch the way
vLLM's ``per_block_cast_to_fp8`` does (per saved tensor), applied to what
``aurora delta apply`` materializes for that version; the names must be the
plain follower's, each FP8 weight with its ``_scale_inv``; and the directory
must load in transformers (on a CPU transformers dequantizes FP8 to bf16, and
says so; the values it loads are checked against the FP8 copy).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from aurora_store import Publisher
from aurora_store.api.weights import family_of, named_tensors, tied_head
from aurora_store.codec.extract import plan_of, unfuse_weights
from aurora_store.errors import ConfigError
from aurora_store.quant import is_quantized
from aurora_store.storage import open_store
from aurora_store.testing.wait import wait_until
from aurora_tools.cli.main import main as aurora
from aurora_tools.tinymodel import make_model_dir
from workers.common import write_model_description
from workers.follow.fp8 import QUANTIZATION_CONFIG, Fp8Directory
from workers.follow.switch import MARKER
from workers.pretrained import load_pretrained, read_model_dir

WAIT_S = 120.0
"""Longest a test waits for the follower to reach a version (a bound against hanging, not an assertion on speed)."""


def recipe(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The issue's recipe for a 2-D bf16 weight, as vLLM's ``per_block_cast_to_fp8`` computes it: (FP8 weight, scale_inv)."""
    rows, cols = x.shape
    pr, pc = -(-rows // 128) * 128, -(-cols // 128) * 128
    padded = torch.zeros(pr, pc, dtype=torch.float32)
    padded[:rows, :cols] = x.float()
    view = padded.view(pr // 128, 128, pc // 128, 128)
    amax = view.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    scale = amax / 448.0
    q = (view * (1.0 / scale)).to(torch.float8_e4m3fn).view(pr, pc)[:rows, :cols]
    return q.contiguous(), scale.view(pr // 128, pc // 128)


def _publish_step(model: torch.nn.Module, v: int) -> None:
    """An RL-like step: about 3% of each weight moves, and the largest element of one block shrinks."""
    g = torch.Generator().manual_seed(v)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mask = torch.rand(p.shape, generator=g) < 0.03
            p.add_((torch.randn(p.shape, generator=g) * 0.01 * mask).to(p.dtype))
            if name.endswith("mlp.down_proj.weight"):
                flat = p.view(-1)
                top = int(flat.float().abs().argmax())
                flat[top] = flat[top] * 0.1


def _follow(*args: str, stderr: Any) -> subprocess.Popen[str]:
    env = {**os.environ, "AURORA_TORCH_THREADS": "1"}
    env.pop("AURORA_REDIS_URL", None)
    return subprocess.Popen(
        [sys.executable, "-m", "aurora_tools.cli", "follow", *args], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
    )


def _version(out: Path) -> int | None:
    try:
        return int(json.loads((out / MARKER).read_text())["version"])
    except (OSError, ValueError, KeyError):
        return None


def _applied(store: str, v: int, tmp: Path, skeleton: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``aurora delta apply --version v``, under the Hugging Face names of the model."""
    path = tmp / f"v{v}.safetensors"
    assert aurora(["delta", "apply", "--store", store, "--version", str(v), "--out", str(path)]) == 0
    named = dict(named_tensors(skeleton))
    plan = plan_of(named, tied=tied_head(skeleton, named), family=family_of(skeleton))
    return unfuse_weights(load_file(path), plan)


@pytest.mark.slow
def test_each_version_is_the_recipe_applied_to_delta_apply_and_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_model_dir(tmp_path / "qwen3", "qwen3")
    store = f"file://{tmp_path}/run"
    out = tmp_path / "served"
    md = read_model_dir(model_dir)
    files = write_model_description(open_store(store), md.files["config.json"], md.files.get("tokenizer.json"), md.files)
    model = load_pretrained(model_dir)
    skeleton = load_pretrained(model_dir)
    log = tmp_path / "follow.log"
    with open(log, "w") as err:
        proc = _follow("--store", store, "--out", str(out), "--until", "2", "--poll-s", "0.1", "--quantize", "fp8-block128", stderr=err)
    try:
        with Publisher(store, model_files=files) as pub:
            for v in range(3):
                if v:
                    _publish_step(model, v)
                assert pub.publish(model) is not None
                wait_until(lambda v=v: _version(out) == v, f"v{v} in place", timeout=WAIT_S, interval=0.05, processes={"follow": proc})  # type: ignore[misc]
                got = load_file(out / "model.safetensors")
                truth = _applied(store, v, tmp_path, skeleton)
                quantized = [n for n, t in truth.items() if is_quantized(n, tuple(t.shape))]
                assert quantized and all(
                    not is_quantized(n, tuple(got[n].shape)) or n in quantized for n in got if not n.endswith("_scale_inv")
                )
                for name in quantized:
                    q, s = recipe(truth[name])
                    assert got[name].dtype == torch.float8_e4m3fn and got[f"{name}_scale_inv"].dtype == torch.float32
                    assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), f"v{v} {name}"
                    assert torch.equal(got[f"{name}_scale_inv"], s), f"v{v} {name}"
                for name, t in got.items():  # everything else is the version's bf16 tensor, as the plain follower writes it
                    if name not in quantized and not name.endswith("_scale_inv"):
                        assert t.dtype == torch.bfloat16 and torch.equal(t, truth[name]), name
                assert set(got) == {n for n in truth if n != "lm_head.weight" or n in got} | {f"{n}_scale_inv" for n in quantized}
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Traceback" not in text and [f"v{v} in place" in text for v in range(3)] == [True] * 3
    assert "snapshot + 0 deltas" in text and "v2 in place: 1 delta, FP8 work" in text  # incremental after the first version
    work = {int(v): int(w.replace(",", "")) for v, w in re.findall(r"v(\d+) in place: .*?FP8 work ([\d,]+) elements", text)}
    assert sorted(work) == [0, 1, 2] and work[2] < work[0] / 2  # the work follows the change, not the model
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == QUANTIZATION_CONFIG
    # transformers on a CPU: "Using FP8 quantized models requires a GPU or XPU, we will default to
    # dequantizing the model to bf16 since no GPU or XPU is available"; then each weight is q * scale.
    loaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    weights = dict(loaded.named_parameters())
    got = load_file(out / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    want = (
        got[name].float()
        * got[f"{name}_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)[: got[name].shape[0], : got[name].shape[1]]
    )
    assert torch.allclose(weights[name].float(), want, rtol=1e-2, atol=0)
    assert not torch.equal(weights[name].to(torch.bfloat16), model.get_parameter(name).to(torch.bfloat16))  # served FP8, not the bf16


def test_a_base_already_quantized_is_one_line() -> None:
    cfg = {"model_type": "qwen3", "quantization_config": QUANTIZATION_CONFIG}
    with pytest.raises(Exception, match="already has a quantization_config.*bf16") as e:
        Fp8Directory().files({"config.json": json.dumps(cfg).encode()})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown quantization format"):
        Fp8Directory("int4")


@pytest.mark.slow
def test_experts_are_quantized_one_by_one_under_the_names_the_plain_follower_writes(tmp_path: Path) -> None:
    import shutil

    model_dir = make_model_dir(tmp_path / "mixtral", "mixtral")
    plain = load_file(Path(model_dir) / "model.safetensors")
    out = tmp_path / "fp8"
    shutil.copytree(model_dir, out)
    d = Fp8Directory()
    first = d.convert(str(out))
    got = load_file(out / "model.safetensors")
    experts = [n for n in plain if ".experts." in n]
    assert experts and all(plain[n].dim() == 2 for n in experts)  # saved one expert, one projection at a time
    assert set(got) == set(plain) | {f"{n}_scale_inv" for n in plain if is_quantized(n, tuple(plain[n].shape))}
    for n in experts:
        q, s = recipe(plain[n])
        assert torch.equal(got[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[f"{n}_scale_inv"], s), n
    routers = [n for n in plain if n.endswith("block_sparse_moe.gate.weight")]
    assert routers and all(got[n].dtype == torch.bfloat16 for n in routers)
    # The next version: one expert's element moves; only that is requantized (its block rescaled whole when it was the peak).
    name = experts[0]
    t = plain[name].clone()
    t.view(-1)[int(t.float().abs().argmax())] *= 2
    from safetensors.torch import save_file

    save_file({**plain, name: t}, str(out / "model.safetensors"), metadata={"format": "pt"})
    again = d.convert(str(out))
    assert again.changed == 1 and again.whole_blocks == 1 < first.whole_blocks
    q, s = recipe(t)
    got = load_file(out / "model.safetensors")
    assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[f"{name}_scale_inv"], s)
