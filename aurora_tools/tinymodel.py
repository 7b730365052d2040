"""Tiny Hugging Face model directories and data files, made on the spot, for tests, demos and trials.

Nothing can be downloaded here, so :func:`make_model_dir` builds what a
user would bring: a ``save_pretrained`` directory of a tiny Qwen3, Qwen2,
Llama or Mistral, or a mixture-of-experts Qwen3-MoE, Qwen2-MoE (with its
shared expert), Mixtral or GLM-4-MoE (DeepSeek-style: a dense first layer,
shared experts, a float32 router bias) (random bf16 weights, safetensors; the experts
saved one by one, as transformers writes them), with a byte-level BPE tokenizer trained
on the spot by the ``tokenizers`` library, a chat template in the family's
own style and a generation config naming its stop tokens.
:func:`write_gsm8k_jsonl` and :func:`write_math_jsonl` write small data
files in the GSM8K and MATH/DeepScaleR formats.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["FAMILY_STYLES", "MOE_SPECS", "TinySpec", "make_model_dir", "supervise", "write_gsm8k_jsonl", "write_math_jsonl"]

_QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

FAMILY_STYLES: dict[str, dict[str, object]] = {
    # specials in id order, then (bos, eos, pad, extra stop ids), the chat template
    "qwen3": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "stops": ["<|im_end|>", "<|endoftext|>"],
        "template": _QWEN_TEMPLATE,
    },
    "qwen2": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "stops": ["<|im_end|>", "<|endoftext|>"],
        "template": _QWEN_TEMPLATE,
    },
    "llama": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": "<|pad|>",
        "stops": ["<|eot_id|>", "<|end_of_text|>"],
        "template": _LLAMA_TEMPLATE,
    },
    "mistral": {
        "specials": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "bos": "<s>",
        "eos": "</s>",
        "pad": "<unk>",
        "stops": ["</s>"],
        "template": "{{ bos_token }}{% for message in messages %}[INST] {{ message['content'] }} [/INST]{% endfor %}",
    },
}


FAMILY_STYLES["qwen3_moe"] = FAMILY_STYLES["qwen2_moe"] = FAMILY_STYLES["glm4_moe"] = FAMILY_STYLES["qwen3"]
FAMILY_STYLES["mixtral"] = FAMILY_STYLES["mistral"]


@dataclass(frozen=True, slots=True)
class TinySpec:
    """Sizes of a tiny model (defaults: about 0.1 M parameters plus the embedding)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 32
    """vLLM's CPU attention needs a head size of at least 32."""
    intermediate: int = 128
    max_positions: int = 512
    vocab: int = 512
    """Target vocabulary of the BPE tokenizer trained for it."""
    tie_word_embeddings: bool = True
    experts: int = 4
    """Routed experts per layer (mixture-of-experts families only)."""
    experts_per_token: int = 2
    moe_intermediate: int = 40
    """Intermediate size of one routed expert (Mixtral: its ``intermediate_size``)."""
    shared_intermediate: int = 48
    """Intermediate size of Qwen2-MoE's shared expert."""


MOE_SPECS: dict[str, TinySpec] = {
    # 40 and 48 are not multiples of 32: vLLM's CPU MoE pads the per-rank intermediate size to one,
    # so these exercise a padded layout; Mixtral's 64 is a multiple (32 a rank at TP=2): no padding.
    "qwen3_moe": TinySpec(experts=8, moe_intermediate=40),
    "qwen2_moe": TinySpec(experts=4, moe_intermediate=48, shared_intermediate=40),
    "mixtral": TinySpec(experts=4, moe_intermediate=64),
    # DeepSeek-V3-style routing with standard attention: layer 0 dense (first_k_dense_replace=1), then
    # shared experts (n_shared_experts x moe_intermediate wide) beside a sigmoid router with a float32 bias.
    "glm4_moe": TinySpec(layers=3, experts=8, moe_intermediate=40),
}
"""Default sizes of the mixture-of-experts families (head size 32, top-2 routing)."""


def _moe_config(family: str, spec: TinySpec) -> dict[str, int]:
    """The config arguments of a family's experts (none for dense families)."""
    routing = {"num_experts_per_tok": spec.experts_per_token}
    if family == "mixtral":
        return {**routing, "num_local_experts": spec.experts, "intermediate_size": spec.moe_intermediate}
    if family == "glm4_moe":
        # attention_bias: GLM-4.5 has q/k/v biases; one group, so routing is plain top-k of the biased scores.
        return {
            **routing,
            "n_routed_experts": spec.experts,
            "moe_intermediate_size": spec.moe_intermediate,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "attention_bias": True,
        }
    if family in ("qwen3_moe", "qwen2_moe"):
        moe = {**routing, "num_experts": spec.experts, "moe_intermediate_size": spec.moe_intermediate, "decoder_sparse_step": 1}
        if family == "qwen2_moe":
            moe["shared_expert_intermediate_size"] = spec.shared_intermediate
        return moe
    return {}


def _router_biases(model: object, seed: int, keep: Mapping[str, object] | None) -> dict[str, object]:
    """Set each ``e_score_correction_bias`` (glm4_moe) back to float32: ``keep``'s values, or seeded non-zero ones; returns them.

    The bias is float32 in a checkpoint (a buffer, or a frozen parameter
    once :mod:`workers.router_bias` loaded it) that ``.to(bfloat16)`` rounds,
    and a model saved so would not be the one a user brings. Transformers
    initializes it to zeros, and a zero bias routes the same as none: a copy
    that lost it would go unnoticed, so a new model gets values a trained one could have.
    """
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    out: dict[str, object] = {}
    for name, t in model.state_dict().items():  # type: ignore[attr-defined]
        if name.endswith("e_score_correction_bias"):
            owner = model.get_submodule(name.rsplit(".", 1)[0])  # type: ignore[attr-defined]
            value = keep[name] if keep is not None else (torch.rand(t.shape, generator=gen) * 0.2 - 0.1).to(torch.float32)
            owner.e_score_correction_bias.data = out[name] = value
    return out


def _corpus(seed: int) -> Iterator[str]:
    rng = random.Random(f"aurora-tiny-corpus/{seed}")
    words = [
        "the",
        "a",
        "of",
        "to",
        "and",
        "is",
        "in",
        "it",
        "for",
        "on",
        "with",
        "as",
        "are",
        "was",
        "how",
        "many",
        "what",
        "each",
        "has",
        "total",
        "cost",
        "more",
        "less",
        "than",
        "times",
        "sum",
        "answer",
    ]
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        yield f"Q: {a}+{b}=? A: {a}+{b}={a + b}\n#### {a + b}"
        yield " ".join(rng.choice(words) for _ in range(12)) + f" {a} {b}."
        yield f"\\boxed{{{a}}} \\frac{{{b}}}{{{a + 1}}} = {b}/{a + 1} Give the final answer after '####'."


def make_model_dir(out: str | os.PathLike[str], family: str = "qwen3", seed: int = 0, spec: TinySpec | None = None) -> str:
    """A ``save_pretrained`` directory of a tiny ``family`` model and its tokenizer; returns its path.

    ``spec`` defaults to :data:`MOE_SPECS` for a mixture-of-experts family,
    :class:`TinySpec` otherwise. The weights are random, seeded (the same arguments give the same bits),
    saved in bf16 as safetensors; the tokenizer is a byte-level BPE trained
    on a generated corpus, with the family's special tokens and chat template.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        GenerationConfig,
        PreTrainedTokenizerFast,
    )

    spec = spec or MOE_SPECS.get(family) or TinySpec()
    style = FAMILY_STYLES[family]
    specials = list(style["specials"])  # type: ignore[call-overload]
    p = os.fspath(out)
    os.makedirs(p, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(_corpus(seed), trainer)
    kw = {k: style[k] for k in ("bos", "eos", "pad") if style[k] is not None}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        **{f"{k}_token": v for k, v in kw.items()},
        additional_special_tokens=[s for s in specials if s not in kw.values()],
    )
    tok.chat_template = style["template"]
    tok.save_pretrained(p)
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    sizes: dict[str, int] = {"intermediate_size": spec.intermediate, **_moe_config(family, spec)}
    cfg = AutoConfig.for_model(
        family,
        vocab_size=len(tok),
        hidden_size=spec.hidden,
        **sizes,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=ids.get(str(style["bos"])),
        eos_token_id=ids[str(style["eos"])],
        pad_token_id=ids[str(style["pad"])],
    )
    cfg.architectures = [type(AutoModelForCausalLM.from_config(cfg)).__name__]  # cheap at this size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    torch.nn.Module.to(model, dtype=torch.bfloat16)
    _router_biases(model, seed, None)
    model.generation_config = GenerationConfig(
        bos_token_id=cfg.bos_token_id,
        eos_token_id=[ids[s] for s in style["stops"]],  # type: ignore[attr-defined]
        pad_token_id=cfg.pad_token_id,
    )
    model.save_pretrained(p, safe_serialization=True)
    return p


def supervise(
    model_dir: str | os.PathLike[str], pairs: Sequence[tuple[str, str]], steps: int = 150, lr: float = 3e-3, seed: int = 0, batch: int = 32
) -> float:
    """Fine-tune the directory's model on (user message, answer) pairs, in place; returns the last loss.

    A random tiny model never earns a 0/1 reward, so GRPO would have no
    signal: this is the "pretrained checkpoint" a user would bring. Prompts
    are rendered with the directory's chat template, answers end with its
    eos; AdamW in float32, saved back in bf16 (safetensors).
    """
    import torch

    from workers.model import logprobs, pack_completions
    from workers.pretrained import load_pretrained
    from workers.tokenizer import HFTokenizer

    p = os.fspath(model_dir)
    model = load_pretrained(p, torch.float32).train()
    biases = {n: b.detach().clone() for n, b in model.state_dict().items() if n.endswith("e_score_correction_bias")}
    tok = HFTokenizer.from_dir(p, model_vocab=int(model.config.vocab_size))
    rows = [(tok.render_prompt(q), tok.encode(a, eos=True)) for q, a in pairs]
    rng = random.Random(f"aurora-supervise/{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        pick = [rows[rng.randrange(len(rows))] for _ in range(batch)]
        packed = pack_completions([r[0] for r in pick], [r[1] for r in pick], tok.pad_id)
        loss = -logprobs(model, *packed, reduction="mean").mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    torch.nn.Module.to(model, dtype=torch.bfloat16)
    _router_biases(model, seed, biases)
    model.save_pretrained(p, safe_serialization=True)
    return float(loss.detach())


def write_gsm8k_jsonl(path: str | os.PathLike[str], n: int = 40, seed: int = 0) -> str:
    """``n`` GSM8K-format rows (``{"question", "answer": "... #### N"}``) of small word problems."""
    rng = random.Random(f"aurora-gsm8k/{seed}")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            q = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
            f.write(
                json.dumps(
                    {"question": q, "answer": f"He has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}", "id": f"gsm-{seed}-{i}"}
                )
                + "\n"
            )
    return os.fspath(path)


def write_math_jsonl(path: str | os.PathLike[str], n: int = 40, seed: int = 0) -> str:
    """``n`` MATH/DeepScaleR-style rows (``{"problem", "answer"}``), answers plain, boxed or fractions."""
    rng = random.Random(f"aurora-math/{seed}")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            a, b = rng.randint(1, 9), rng.randint(2, 9)
            if i % 2:
                row = {"problem": f"What is ${a}/{b}$ as a fraction?", "answer": f"\\frac{{{a}}}{{{b}}}"}
            else:
                row = {"problem": f"Compute ${a} + {b}$.", "solution": f"We add: ${a}+{b} = \\boxed{{{a + b}}}$."}
            f.write(json.dumps({**row, "id": f"math-{seed}-{i}"}) + "\n")
    return os.fspath(path)
