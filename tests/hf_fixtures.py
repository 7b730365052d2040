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
from filelock import FileLock

from aurora_tools.tinymodel import make_model_dir, supervise, write_gsm8k_jsonl, write_math_jsonl

FAMILIES = ("qwen3", "llama")


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
def pretrained(shared_tmp: Path) -> dict[str, Pretrained]:
    """Made once per run, in the folder xdist workers share: the first worker to ask makes them."""
    d = shared_tmp / "pretrained"
    gsm8k, math = d / "gsm8k.jsonl", d / "math.jsonl"
    with FileLock(shared_tmp / "pretrained.lock"):
        if not (d / "done").exists():
            d.mkdir(exist_ok=True)
            write_gsm8k_jsonl(gsm8k, 200)
            write_math_jsonl(math, 200)
            pairs = _pairs(gsm8k, math)
            for family in FAMILIES:
                supervise(make_model_dir(d / family, family), pairs, steps=120)
            (d / "done").touch()
    return {family: Pretrained(family, d / family, gsm8k, math) for family in FAMILIES}
