"""A user's Hugging Face model directory: accepted families, the description the run root holds, the tokenizer Actors use.

The directories are made on the spot (:mod:`aurora_tools.tinymodel`): a tiny
Qwen3 and a tiny Llama saved with ``save_pretrained``, each with a
byte-level BPE tokenizer trained by ``tokenizers`` and a chat template.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aurora_store.apply.sink import weights_digest
from aurora_store.errors import ConfigError, IntegrityError
from aurora_store.lineage.publish import PublishConfig, publish_snapshot
from aurora_store.storage import open_store
from aurora_tools.tinymodel import make_model_dir
from workers.common import (
    MODEL_PREFIX,
    model_files_listed,
    read_model_description,
    write_model_description,
)
from workers.model import fused_weights, fusion_plan_for, hf_weights
from workers.pretrained import load_pretrained, read_model_dir
from workers.tokenizer import CharTokenizer, HFTokenizer

FAMILIES = ("qwen3", "llama", "qwen2", "mistral")


@pytest.fixture(scope="module", params=FAMILIES)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_model_dir(tmp_path_factory.mktemp(request.param), request.param))


def test_the_tokenizer_renders_prompts_with_the_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = HFTokenizer.from_dir(model_dir)
    ref = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    msg = [{"role": "user", "content": "Tom has 3 apples. How many? Give the final answer after '####'."}]
    want = ref.apply_chat_template(msg, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.render_prompt(msg[0]["content"]) == list(want)
    assert tok.chat_template is not None
    # The generation config's stop ids (Qwen and Llama name several), eos first.
    gen = json.loads((model_dir / "generation_config.json").read_text())
    assert list(tok.stop_ids) == gen["eos_token_id"]
    assert len(tok.stop_ids) >= (1 if model_dir.name.startswith("mistral") else 2)
    assert tok.decode(tok.encode("12+7 = 19")) == "12+7 = 19"


def test_the_run_root_holds_the_description_and_an_actor_rebuilds_model_and_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    md = read_model_dir(model_dir)
    store = open_store(f"file://{tmp_path}/run")
    files = write_model_description(store, md.files["config.json"], md.files.get("tokenizer.json"), md.files)
    model = load_pretrained(model_dir, torch.bfloat16)
    w = {n: t.clone() for n, t in hf_weights(model).items()}
    plan = fusion_plan_for(model)
    publish_snapshot(store, "hf", 0, fused_weights(w, plan), None, PublishConfig(), model=files)
    listed, _ = model_files_listed(store)
    assert listed is not None
    assert sorted(listed) == sorted(MODEL_PREFIX + n for n in md.files)
    assert {
        "model/config.json",
        "model/tokenizer.json",
        "model/tokenizer_config.json",
        "model/generation_config.json",
        "model/chat_template.jinja",
    } <= set(listed)

    skeleton, tok = read_model_description(store)
    assert isinstance(tok, HFTokenizer)
    assert type(skeleton).__name__ == type(model).__name__
    assert {n: tuple(t.shape) for n, t in hf_weights(skeleton).items()} == {n: tuple(t.shape) for n, t in w.items()}
    ref = HFTokenizer.from_dir(model_dir)
    text = "What is $3/4$ as a fraction?"
    assert tok.render_prompt(text) == ref.render_prompt(text)
    assert tok.stop_ids == ref.stop_ids and tok.vocab_size == ref.vocab_size

    # Version 0 is the directory's checkpoint, bit for bit: the digest of its tensors, fused.
    raw = load_file(str(model_dir / "model.safetensors"))
    if "lm_head.weight" not in raw:  # tied: saved once, under the embedding's name
        raw["lm_head.weight"] = raw["model.embed_tokens.weight"]
    assert weights_digest({n: raw[n] for n in w}, plan) == weights_digest(w, plan)

    # A tokenizer file changed after version 0 is refused.
    store.put("model/chat_template.jinja", b"{{ messages }}", mode="overwrite")
    with pytest.raises(IntegrityError, match="changed after version 0"):
        read_model_description(store)


def test_the_built_in_model_is_described_the_same_way(tmp_path: Path) -> None:
    from workers.model import tiny_qwen3

    store = open_store(f"file://{tmp_path}/run")
    tok = CharTokenizer()
    m = tiny_qwen3(tok.vocab_size, seed=0)
    write_model_description(
        store, m.config.to_json_string(), tok.to_json(), {"generation_config.json": m.generation_config.to_json_string().encode()}
    )
    skeleton, got = read_model_description(store, unlisted_ok=True)
    assert isinstance(got, CharTokenizer) and got.render_prompt("Q: 1+2=? A:") == tok.encode("Q: 1+2=? A:", bos=True)
    assert store.exists("model/generation_config.json")


def test_unsupported_or_incomplete_directories_are_refused_by_name(tmp_path: Path) -> None:
    d = Path(make_model_dir(tmp_path / "q", "qwen3"))
    gpt = tmp_path / "gpt2"
    shutil.copytree(d, gpt)
    cfg = json.loads((gpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (gpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ConfigError,
        match=r"model family 'gpt2' is not supported \(supported: llama, qwen2, qwen3, mistral, qwen2_moe, qwen3_moe, mixtral, glm4_moe\)",
    ):
        read_model_dir(gpt)
    nosafe = tmp_path / "nosafe"
    shutil.copytree(d, nosafe)
    (nosafe / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no \\*.safetensors weights"):
        read_model_dir(nosafe)
    with pytest.raises(ConfigError, match="not a directory"):
        read_model_dir(tmp_path / "missing")
    notok = tmp_path / "notok"
    shutil.copytree(d, notok)
    (notok / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer files"):
        read_model_dir(notok)


def test_aurora_tiny_model_writes_a_loadable_directory_and_data(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "m"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "aurora_tools.cli",
            "tiny-model",
            "--family",
            "llama",
            "--out",
            str(out),
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    md = read_model_dir(out)
    assert md.family == "llama" and (tmp_path / "data" / "gsm8k.jsonl").exists() and (tmp_path / "data" / "math.jsonl").exists()
    again = subprocess.run(
        [sys.executable, "-m", "aurora_tools.cli", "tiny-model", "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert again.returncode != 0 and "exists" in again.stderr and "Traceback" not in again.stderr
