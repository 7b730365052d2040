"""``--device``: the single-process Trainer holds and trains its weights where it is told, and says clearly when it cannot."""

from __future__ import annotations

import pytest
import torch

from aurora_store.errors import ConfigError
from workers.common import Endpoints
from workers.trainer import TrainerConfig
from workers.trainer.trainer import Trainer, _device


def test_device_names_are_checked() -> None:
    assert _device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="cpu, cuda or cuda:N"):
        _device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            _device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_trainer_asked_for_cuda_without_it_stops_with_one_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="--device cuda: CUDA is not available"):
        Trainer(Endpoints(f"file://{tmp_path}/run", "redis://127.0.0.1:1/0", "dev"), TrainerConfig(device="cuda"))


def test_the_torch_engine_reads_its_device_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine.factory import make_engine
    from workers.tokenizer import CharTokenizer

    monkeypatch.setenv("AURORA_ENGINE_DEVICE", "cuda:3")  # nothing is allocated before load()
    assert str(make_engine("torch", CharTokenizer()).device) == "cuda:3"
    assert str(make_engine("torch", CharTokenizer(), "cpu").device) == "cpu"  # --device wins over the environment
