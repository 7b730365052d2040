"""Mixture-of-experts checkpoints through ``aurora snapshot create``, ``delta create``, the Publisher and ``aurora follow``.

Tiny Qwen3-MoE and Mixtral directories (``aurora_tools.tinymodel``, their own
tokenizer, experts saved one by one) go in as a user would give them; what
the store holds is only FORMAT.md §2's names, a delta between two versions
applies bit for bit, and a followed directory loads with ``from_pretrained``
holding the experts ``aurora delta apply`` gives for the same version. Bad
checkpoints and a delta of the wrong shape are refused with one line and
nothing is written or applied.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from cli_helpers import apply_out, clean_aurora_env, ok, saved  # noqa: F401 - clean_aurora_env: a fixture
from safetensors.torch import load_file, save_file

from aurora_store.codec.extract import fuse_weights, plan_of
from aurora_tools.cli import main
from aurora_tools.tinymodel import MOE_SPECS, make_model_dir

pytestmark = pytest.mark.usefixtures("one_torch_thread", "clean_aurora_env")

SPEC = MOE_SPECS["qwen3_moe"]
E, I_, H = SPEC.experts, SPEC.moe_intermediate, SPEC.hidden
W13 = "model.layers.{}.mlp.experts.w13_weight"


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("m") / "qwen3_moe", "qwen3_moe")


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    lines = capsys.readouterr().err.rstrip("\n").split("\n")
    assert rc != 0 and lines[-1].startswith("aurora: error: ")
    assert sum(line.startswith("aurora:") for line in lines) == 1, lines
    return lines[-1]


def changed(w: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A copy with a few elements of some experts (and the router) moved by one bf16 unit."""
    g = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in w.items()}
    for n in sorted(out):
        if (".experts." in n or n.endswith("mlp.gate.weight")) and torch.rand((), generator=g) < 0.5:
            flat = out[n].view(-1).view(torch.int16)
            idx = torch.randint(0, flat.numel(), (5,), generator=g)
            flat[idx] += 1
    return out


def manifests(store: str) -> list[str]:
    root = Path(store[len("file://") :])
    return sorted(str(p.relative_to(root)) for p in root.rglob("manifest.json")) if root.exists() else []


def test_snapshot_of_a_moe_directory_holds_only_format_names(tmp_path: Path, qwen3_moe: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"file://{tmp_path}/run"
    ok(["snapshot", "create", qwen3_moe, "--version", "0", "--store", store], capsys)
    v0, disk = apply_out(store, 0, tmp_path, capsys), saved(qwen3_moe)
    assert not [n for n in v0 if ".experts." in n and not n.endswith(("experts.w13_weight", "experts.w2_weight"))]
    for layer in range(SPEC.layers):
        w13, w2 = v0[W13.format(layer)], v0[f"model.layers.{layer}.mlp.experts.w2_weight"]
        assert tuple(w13.shape) == (E, 2 * I_, H) and tuple(w2.shape) == (E, H, I_)
        p = f"model.layers.{layer}.mlp.experts"
        for e in range(E):
            assert torch.equal(w13[e, :I_], disk[f"{p}.{e}.gate_proj.weight"])
            assert torch.equal(w13[e, I_:], disk[f"{p}.{e}.up_proj.weight"])
            assert torch.equal(w2[e], disk[f"{p}.{e}.down_proj.weight"])
        assert torch.equal(v0[f"model.layers.{layer}.mlp.gate.weight"], disk[f"model.layers.{layer}.mlp.gate.weight"])
    assert len(v0) < len(disk) - 3 * E  # 3 x E tensors a layer became 2


def test_deltas_between_checkpoints_in_either_form_apply_bit_exactly(
    tmp_path: Path, qwen3_moe: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"file://{tmp_path}/run"
    ok(["snapshot", "create", qwen3_moe, "--version", "0", "--store", store], capsys)
    w1 = changed(saved(qwen3_moe), seed=1)
    f1 = tmp_path / "w1.safetensors"
    save_file(w1, str(f1))
    out = ok(["delta", "create", qwen3_moe, str(f1), "--version", "1", "--store", store], capsys)
    assert "delta 1:" in out
    want1 = fuse_weights(w1, plan_of(w1, tied=True))
    got1 = apply_out(store, 1, tmp_path, capsys)
    assert set(got1) == set(want1) and all(torch.equal(got1[n].view(torch.int16), want1[n].view(torch.int16)) for n in want1)
    # The next version saved as transformers 5 holds it in memory (packed experts): the same names come out.
    from workers.pretrained import load_pretrained

    model = load_pretrained(qwen3_moe, torch.bfloat16)
    model.load_state_dict({n: t for n, t in w1.items() if ".experts." not in n}, strict=False)
    mem = {n: p.data.clone() for n, p in model.named_parameters()}
    for layer in range(SPEC.layers):
        mem[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = want1[W13.format(layer)].clone()
        mem[f"model.layers.{layer}.mlp.experts.down_proj"] = want1[f"model.layers.{layer}.mlp.experts.w2_weight"].clone()
    mem.pop("lm_head.weight", None)  # tied: saved once
    w2 = changed(mem, seed=2)
    f2 = tmp_path / "w2.safetensors"
    save_file(w2, str(f2))
    ok(["delta", "create", str(f1), str(f2), "--version", "2", "--store", store], capsys)
    want2 = fuse_weights(w2, plan_of(w2, tied=True))
    got2 = apply_out(store, 2, tmp_path, capsys)
    assert set(got2) == set(want2) and all(torch.equal(got2[n].view(torch.int16), want2[n].view(torch.int16)) for n in want2)
    assert any(not torch.equal(got2[n], got1[n]) for n in got2 if n.endswith("w13_weight"))


def test_bad_checkpoints_are_one_line_and_write_nothing(tmp_path: Path, qwen3_moe: str, capsys: pytest.CaptureFixture[str]) -> None:
    store = f"file://{tmp_path}/run"
    disk = saved(qwen3_moe)
    missing = tmp_path / "missing.safetensors"
    save_file({n: t for n, t in disk.items() if ".layers.1.mlp.experts.3." not in n}, str(missing))
    msg = fails(["snapshot", "create", str(missing), "--version", "0", "--store", store], capsys)
    assert "model.layers.1" in msg and f"expert 3 of {E} is absent" in msg
    mixed = dict(disk)
    mixed["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(E, 2 * I_, H, dtype=torch.bfloat16)
    mixed["model.layers.0.mlp.experts.down_proj"] = torch.zeros(E, H, I_, dtype=torch.bfloat16)
    f = tmp_path / "mixed.safetensors"
    save_file(mixed, str(f))
    msg = fails(["snapshot", "create", str(f), "--version", "0", "--store", store], capsys)
    assert "model.layers.0" in msg and "more than one form" in msg
    # A directory whose config.json disagrees with its experts.
    bad_dir = tmp_path / "bad_dir"
    bad_dir.mkdir()
    os.link(os.path.join(qwen3_moe, "model.safetensors"), bad_dir / "model.safetensors")
    cfg = json.loads(Path(qwen3_moe, "config.json").read_text())
    (bad_dir / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": I_ + 8}))
    msg = fails(["snapshot", "create", str(bad_dir), "--version", "0", "--store", store], capsys)
    assert f"I={I_}, config.json says moe_intermediate_size={I_ + 8}" in msg
    assert manifests(store) == []
    # A new checkpoint whose experts have another I: refused before any upload.
    ok(["snapshot", "create", qwen3_moe, "--version", "0", "--store", store], capsys)
    other = make_model_dir(tmp_path / "other", "qwen3_moe", spec=type(SPEC)(experts=E, moe_intermediate=I_ + 8))
    msg = fails(["delta", "create", qwen3_moe, other, "--version", "1", "--store", store], capsys)
    assert "new weights are not the model" in msg and "w13_weight" in msg
    assert manifests(store) == ["snapshots/v0000000000/manifest.json"]
    assert not list(Path(tmp_path / "run").rglob("seg-*"))


def test_a_delta_of_the_wrong_expert_shape_is_refused_and_changes_nothing(
    tmp_path: Path, qwen3_moe: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from aurora_store.apply.sink import SplitWeights, apply_delta
    from aurora_store.errors import FormatError, ModelMismatchError
    from aurora_store.lineage.fetch import fetch_delta
    from aurora_store.storage import open_store
    from workers.pretrained import load_pretrained

    other = make_model_dir(tmp_path / "other", "qwen3_moe", spec=type(SPEC)(experts=E, moe_intermediate=I_ + 8))
    store = f"file://{tmp_path}/run"
    ok(["snapshot", "create", other, "--version", "0", "--store", store], capsys)
    w1 = tmp_path / "w1.safetensors"
    save_file(changed(saved(other), seed=3), str(w1))
    ok(["delta", "create", other, str(w1), "--version", "1", "--store", store], capsys)
    model = load_pretrained(qwen3_moe, torch.bfloat16)  # I = 40: the delta's experts have I = 48
    named = {n: p.data for n, p in model.named_parameters()}
    plan = plan_of(named, tied=True, family="qwen3_moe")
    before = {n: t.clone() for n, t in named.items()}
    with pytest.raises(FormatError) as fe:  # checked while decoding, against the model's specs
        fetch_delta(open_store(store), 1, plan.specs())
    assert "\n" not in str(fe.value) and f"{[E, 2 * (I_ + 8), H]} bfloat16 in the delta" in str(fe.value)
    _, staged = fetch_delta(open_store(store), 1, None)
    with pytest.raises(ModelMismatchError) as ei:
        apply_delta(staged, SplitWeights({b.source: named[b.source] for p in plan for b in p.blocks}, plan))
    msg = str(ei.value)  # checked again before the first write
    assert "\n" not in msg and "experts.w" in msg and "in the delta" in msg
    assert all(torch.equal(named[n], before[n]) for n in named)


@pytest.mark.slow
def test_follow_of_a_mixtral_run_writes_a_directory_transformers_loads_with_delta_apply_s_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    from aurora_store import Publisher
    from aurora_store.api.weights import family_of
    from aurora_store.storage import open_store
    from workers.common import write_model_description
    from workers.follow import FollowConfig, follow
    from workers.pretrained import load_pretrained, read_model_dir

    d = make_model_dir(tmp_path / "mixtral", "mixtral")
    store = f"file://{tmp_path}/run"
    md = read_model_dir(d)
    files = write_model_description(open_store(store), md.files["config.json"], md.files.get("tokenizer.json"), md.files)
    model = load_pretrained(d, torch.float32)
    assert family_of(model) == "mixtral"
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Publisher(store, model_files=files, digest_every=1) as pub:
        for v in range(3):
            if v:
                ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(v))
                loss = model(input_ids=ids, labels=ids).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
            p = pub.publish(model)
            assert p is not None and p.version == v
        assert "model.layers.1.block_sparse_moe.experts.w13_weight" in pub.plan.specs()  # type: ignore[union-attr]
    out = tmp_path / "served"
    assert follow(FollowConfig(store=store, out=str(out), until=2, poll_s=0.05), threading.Event()) == 0
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16, local_files_only=True)
    mine = {n: t.detach().to(torch.bfloat16) for n, t in model.named_parameters()}
    theirs = dict(loaded.named_parameters())
    assert set(theirs) == set(mine) and all(torch.equal(theirs[n], mine[n]) for n in mine)
    fused = apply_out(store, 2, tmp_path, capsys)
    for layer in range(2):
        pre = f"model.layers.{layer}"
        assert torch.equal(theirs[f"{pre}.mlp.experts.gate_up_proj"], fused[f"{pre}.block_sparse_moe.experts.w13_weight"])
        assert torch.equal(theirs[f"{pre}.mlp.experts.down_proj"], fused[f"{pre}.block_sparse_moe.experts.w2_weight"])
        assert torch.equal(theirs[f"{pre}.mlp.gate.weight"], fused[f"{pre}.block_sparse_moe.gate.weight"])
    assert any(".block_sparse_moe.experts.3.w1.weight" in n for n in load_file(str(out / "model.safetensors")))
    # Restarted on the directory it wrote: read back through the expert names, it continues and writes nothing.
    marker = next(out.resolve().glob("*.json"))
    before = marker.stat().st_mtime_ns, sorted(os.listdir(out.resolve().parent))
    assert follow(FollowConfig(store=store, out=str(out), until=2, poll_s=0.05), threading.Event()) == 0
    assert (marker.stat().st_mtime_ns, sorted(os.listdir(out.resolve().parent))) == before
