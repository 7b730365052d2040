"""A tiny llama checkpoint on MATH-format data through the whole system (:mod:`hf_system`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_fixtures import Pretrained
from hf_system import MARKS, run_family

# long: the Qwen3 system test runs the same path in CI (make test); make test-all runs both.
pytestmark = [*MARKS, pytest.mark.long]


def test_llama_on_math_through_the_whole_system(pretrained: dict[str, Pretrained], tmp_path: Path) -> None:
    run_family(pretrained, tmp_path, "llama", "math")
