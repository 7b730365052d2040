"""How a :class:`~workers.engine.torch_engine.TorchEngine` holds and runs its model (``AURORA_ENGINE_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from aurora_store.config import from_env
from aurora_store.errors import ConfigError

__all__ = ["DTYPES_BY_NAME", "ENV_PREFIX", "EngineConfig"]

ENV_PREFIX = "AURORA_ENGINE_"
"""Prefix of :class:`EngineConfig`'s environment variables."""

DTYPES_BY_NAME = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How a :class:`TorchEngine` holds and runs its model."""

    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N`` (env ``AURORA_ENGINE_DEVICE``)."""
    dtype: str = "bfloat16"
    """Dtype the weights are held, generated with, and patched in (env ``AURORA_ENGINE_DTYPE``).
    bf16 is what RL deltas are cut in; on CPU it samples at about 60% of float32's speed."""
    max_batch_rows: int = 256
    """Most sequences (prompts x group) in one forward pass; more are run in turns
    (env ``AURORA_ENGINE_MAX_BATCH_ROWS``)."""
    predict_digest: bool = True
    """:meth:`TorchEngine.prepare` also computes the weights digest the delta will give, while
    generating, so the safe point does not hash every weight (env ``AURORA_ENGINE_PREDICT_DIGEST``).
    Costs one read of the weights per prepared version, off the critical path."""
    activation: str = "in-place"
    """How a prepared delta lands at the safe point (env ``AURORA_ENGINE_ACTIVATION``):
    ``in-place`` writes it into the weights (one sorted pass per tensor); ``swap`` writes it
    into a spare copy while generating and swaps the copy in (the safe point then costs a
    pointer swap per parameter, the spare costs a model's worth of memory); ``auto`` keeps a
    spare when, after it, as much memory as the weights is still free (decided at the first
    delta). See :mod:`workers.engine.spare`."""
    serve_dtype: str = "bf16"
    """What generation reads (env ``AURORA_ENGINE_SERVE_DTYPE``): ``bf16``, the held weights
    themselves, or ``fp8-block128``, an FP8 copy with 128 x 128 block scales kept current at each
    safe point while deltas still land in bf16 (:mod:`workers.engine.torch_fp8`; bf16 weights, on
    cpu, activated in place)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES_BY_NAME:
            raise ConfigError(f"EngineConfig.dtype must be one of {sorted(DTYPES_BY_NAME)}, got {self.dtype!r}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"EngineConfig.device: {self.device!r} is not a torch device") from None
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"EngineConfig.device must be cpu or cuda, got {self.device!r}")
        if self.max_batch_rows < 1:
            raise ConfigError(f"EngineConfig.max_batch_rows must be >= 1, got {self.max_batch_rows}")
        if self.activation not in ("in-place", "swap", "auto"):
            raise ConfigError(f"EngineConfig.activation must be in-place, swap or auto, got {self.activation!r}")
        if self.serve_dtype not in ("bf16", "fp8-block128"):
            raise ConfigError(f"--serve-dtype {self.serve_dtype}: the torch engine serves bf16 or fp8-block128")
        if self.serve_dtype != "bf16" and (self.dtype != "bfloat16" or dev.type != "cpu" or self.activation == "swap"):
            raise ConfigError(
                f"--serve-dtype {self.serve_dtype}: the torch engine quantizes bf16 weights held on cpu and activated in place "
                f"(here dtype {self.dtype}, device {self.device}, activation {self.activation})"
            )

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, **overrides: Any) -> EngineConfig:
        """Defaults, then ``AURORA_ENGINE_DEVICE``/``_DTYPE``/``_MAX_BATCH_ROWS``/``_SERVE_DTYPE`` …, then ``overrides``."""
        return from_env(cls, prefix, **overrides)
