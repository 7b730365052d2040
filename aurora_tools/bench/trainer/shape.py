"""A Qwen3-style model of about N parameters, and its directory (``save_pretrained``, a trained tokenizer).

Why a shape search: ``--params 2e8`` must mean a model whose proportions
are those of the family at that size (MLP three times the width, 128-wide
heads, half as many key/value heads, about 36 hidden units per layer of
depth, as Qwen3-0.6B's 1024 wide and 28 deep), with a vocabulary of
32,768 rows so the embedding and the head stay a small part, as in the
large models whose memory the benchmark stands for (untied, as Qwen3-8B
and above).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

__all__ = ["VOCAB", "Shape", "build_model_dir", "shape_for"]

VOCAB = 32768
"""Embedding rows of every model the benchmark builds."""
_WIDTHS = (32, 64, 128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 2048, 2560, 3072, 4096, 5120, 8192)
_UNITS_PER_LAYER = 36.0
"""Width over depth the search aims at (Qwen3-0.6B: 1024 / 28)..."""
_MAX_DEPTH = 36.0
"""...up to this depth (Qwen3-4B and 8B: 36 layers; wider past it)."""


@dataclass(frozen=True, slots=True)
class Shape:
    """Sizes of a Qwen3-style decoder (Hugging Face ``Qwen3Config`` names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int = VOCAB
    tie_word_embeddings: bool = False

    def layer_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        q = h * self.num_attention_heads * hd
        kv = 2 * h * self.num_key_value_heads * hd
        o = self.num_attention_heads * hd * h
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + 2 * hd  # input and post-attention norms, q_norm and k_norm
        return q + kv + o + mlp + norms

    def params(self) -> int:
        """Parameters of the model (the tied head counted once), as ``model.parameters()`` sums them."""
        emb = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return emb + self.num_hidden_layers * self.layer_params() + self.hidden_size


def _shape(width: int, layers: int) -> Shape:
    head_dim = min(128, width)
    heads = max(1, width // head_dim)
    kv = heads // 2 if heads % 2 == 0 else heads
    return Shape(width, layers, heads, kv, head_dim, 3 * width)


def shape_for(params: float) -> Shape:
    """The width whose depth for ``params`` parameters is nearest the family's proportion (at least one layer)."""
    target = int(params)
    best: tuple[float, Shape] | None = None
    for w in _WIDTHS:
        s0 = _shape(w, 0)
        room = target - s0.params()
        if room < s0.layer_params():
            continue
        layers = max(1, round(room / s0.layer_params()))
        score = abs(math.log(layers / min(w / _UNITS_PER_LAYER, _MAX_DEPTH)))
        if best is None or score < best[0]:
            best = (score, _shape(w, layers))
    if best is None:
        smallest = _shape(_WIDTHS[0], 1).params()
        raise ValueError(f"--params {params:g}: too small for a {VOCAB}-row vocabulary (at least {smallest:.3g})")
    return best[1]


def build_model_dir(out: str | os.PathLike[str], shape: Shape, seed: int = 0) -> str:
    """A ``save_pretrained`` directory of a random bf16 Qwen3 of ``shape`` with a small trained BPE tokenizer.

    The tokenizer (and generation config, chat template) are
    :func:`aurora_tools.tinymodel.make_model_dir`'s; the model then replaces
    its tiny one, with :data:`VOCAB` embedding rows (more than the
    tokenizer's ids, as real checkpoints pad theirs).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from aurora_tools.tinymodel import TinySpec, make_model_dir

    hf_logging.disable_progress_bar()  # --json: standard error stays for errors
    p = make_model_dir(out, "qwen3", seed=seed, spec=TinySpec(vocab=2048))
    with open(os.path.join(p, "config.json"), encoding="utf-8") as f:
        tiny = json.load(f)
    special = {k: tiny.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    cfg = AutoConfig.for_model("qwen3", **asdict(shape), max_position_embeddings=4096, **special)
    cfg.architectures = ["Qwen3ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    for stale in ("model.safetensors", "model.safetensors.index.json"):
        if os.path.exists(os.path.join(p, stale)):
            os.remove(os.path.join(p, stale))
    gen = os.path.join(p, "generation_config.json")
    with open(gen, "rb") as f:
        kept = f.read()  # the tiny model's names the stop tokens; save_pretrained writes a default one
    model.save_pretrained(p, safe_serialization=True)
    with open(gen, "wb") as f:
        f.write(kept)
    del model
    return p
