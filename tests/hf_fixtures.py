"""Tiny "pretrained" Hugging Face checkpoints and data files, made once per test session.

Each family's directory is a ``save_pretrained`` Qwen3 or Llama with a BPE
tokenizer trained on the spot and a chat template
(:func:`aurora_tools.tinymodel.make_model_dir`), then fine-tuned for a
moment on the GSM8K- and MATH-format rows (:func:`~aurora_tools.tinymodel.supervise`)
so that sampling earns some reward: a random model never would, and GRPO
would have nothing to learn from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from aurora_tools.tinymodel import make_model_dir, supervise, write_gsm8k_jsonl, write_math_jsonl


@dataclass(frozen=True)
class Pretrained:
    family: str
    model: Path
    gsm8k: Path
    math: Path


def _pairs(gsm8k: Path, math: Path) -> list[tuple[str, str]]:
    from workers.task import make_task

    pairs = []
    for name, data in (("gsm8k", gsm8k), ("math", math)):
        t = make_task(name, str(data))
        pairs += [(p.prompt_text, p.solution) for p in t.train_problems(0, 150, 0) if p.solution]
    return pairs


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pretrained]:
    d = tmp_path_factory.mktemp("pretrained")
    gsm8k = Path(write_gsm8k_jsonl(d / "gsm8k.jsonl", 200))
    math = Path(write_math_jsonl(d / "math.jsonl", 200))
    pairs = _pairs(gsm8k, math)
    out = {}
    for family in ("qwen3", "llama"):
        model = Path(make_model_dir(d / family, family))
        supervise(model, pairs, steps=120)
        out[family] = Pretrained(family, model, gsm8k, math)
    return out
