"""A tiny qwen3 checkpoint on GSM8K-format data through the whole system (:mod:`hf_system`)."""

from __future__ import annotations

from pathlib import Path

from hf_fixtures import Pretrained
from hf_system import MARKS, run_family

pytestmark = MARKS


def test_qwen3_on_gsm8k_through_the_whole_system(pretrained: dict[str, Pretrained], tmp_path: Path) -> None:
    run_family(pretrained, tmp_path, "qwen3", "gsm8k")
