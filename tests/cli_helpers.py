"""Running ``aurora`` commands in-process from tests of the store's command lines, and reading what they wrote."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aurora_tools.cli import main


@pytest.fixture
def clean_aurora_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``AURORA_*`` variable of the calling shell reaches the commands (a test says what it sets)."""
    for k in list(os.environ):
        if k.startswith("AURORA_"):
            monkeypatch.delenv(k)


def ok(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``aurora argv``; it must succeed. Its standard error."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 0, err
    return err


def apply_out(store: str, v: int, tmp: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, torch.Tensor]:
    """``aurora delta apply`` of version ``v`` into a file under ``tmp``; its tensors."""
    out = tmp / f"v{v}.safetensors"
    ok(["delta", "apply", "--version", str(v), "--out", str(out), "--store", store], capsys)
    return load_file(str(out))


def saved(model_dir: str) -> dict[str, torch.Tensor]:
    """The tensors of a one-file Hugging Face model directory."""
    return load_file(os.path.join(model_dir, "model.safetensors"))
