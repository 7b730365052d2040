"""Tiny mixture-of-experts model directories made with ``aurora tiny-model``, once per test session.

A tiny Qwen3-MoE or Mixtral (its own BPE tokenizer, experts saved one by one,
as transformers writes them) and GSM8K-format rows; ``supervised``: fine-tuned
on those rows first (``--supervise-steps``), so that sampling earns some
reward and GRPO steps move the experts (a random model scores 0 on every
completion, and a run of it ships empty deltas). Made in the folder xdist
workers share, the first worker to ask makes each.
"""

from __future__ import annotations

from pathlib import Path

from filelock import FileLock

from aurora_tools.cli import main

SUPERVISE_STEPS = 60
"""Enough for some rewarded samples on the tiny GSM8K rows, not to solve them."""


def moe_dir(shared_tmp: Path, family: str, supervised: bool = False) -> tuple[Path, Path]:
    """(model directory, its gsm8k.jsonl) of a tiny ``family`` model; see the module's docstring."""
    name = f"moe-{family}{'-supervised' if supervised else ''}"
    d = shared_tmp / name
    with FileLock(shared_tmp / f"{name}.lock"):
        if not (d / "done").exists():
            argv = ["tiny-model", "--family", family, "--out", str(d / "model"), "--data-dir", str(d / "data")]
            if supervised:
                argv += ["--supervise-steps", str(SUPERVISE_STEPS)]
            assert main(argv) == 0
            (d / "done").touch()
    return d / "model", d / "data" / "gsm8k.jsonl"
