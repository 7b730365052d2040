"""Engines by name, as ``--engine`` chooses them; each engine module is imported only when chosen."""

from __future__ import annotations

from aurora_store.errors import ConfigError
from workers.engine.protocol import LoadingEngine, TokenCodec

__all__ = ["ENGINES", "make_engine"]

ENGINES = ("torch", "vllm")
"""The names :func:`make_engine` knows."""


def make_engine(name: str, tokenizer: TokenCodec, device: str | None = None) -> LoadingEngine:
    """An unloaded engine by name: ``torch`` (:class:`~workers.engine.torch_engine.TorchEngine`,
    configured from ``AURORA_ENGINE_*``, ``device`` over ``AURORA_ENGINE_DEVICE``) or ``vllm``
    (:class:`~workers.engine.vllm_engine.VLLMEngine`, configured from ``AURORA_VLLM_*``; it
    places itself, so ``device`` must be None)."""
    if name == "torch":
        from workers.engine.torch_engine import EngineConfig, TorchEngine

        return TorchEngine(tokenizer, EngineConfig.from_env(device=device))
    if name == "vllm":
        if device is not None:
            raise ConfigError(f"device {device!r}: only the torch engine takes one (vLLM places itself)")
        from workers.engine.vllm_engine import VLLMConfig, VLLMEngine, import_vllm

        import_vllm()  # fail now, with the install command, not later in a worker
        return VLLMEngine(tokenizer, VLLMConfig.from_env())
    raise ConfigError(f"unknown engine {name!r}: torch or vllm")
