"""Engines by name, as ``--engine`` chooses them; each engine module is imported only when chosen."""

from __future__ import annotations

from aurora_store.errors import ConfigError
from workers.engine.protocol import LoadingEngine, TokenCodec

__all__ = ["ENGINES", "make_engine"]

ENGINES = ("torch", "vllm")
"""The names :func:`make_engine` knows."""


def make_engine(name: str, tokenizer: TokenCodec, device: str | None = None, serve_dtype: str | None = None) -> LoadingEngine:
    """An unloaded engine by name: ``torch`` (:class:`~workers.engine.torch_engine.TorchEngine`,
    configured from ``AURORA_ENGINE_*``, ``device`` over ``AURORA_ENGINE_DEVICE``) or ``vllm``
    (:class:`~workers.engine.vllm_engine.VLLMEngine`, configured from ``AURORA_VLLM_*``; it
    places itself, so ``device`` must be None). ``serve_dtype`` (``--serve-dtype``) over
    ``AURORA_ENGINE_SERVE_DTYPE``: ``bf16``, or ``fp8-block128`` (torch engine only)."""
    if name == "torch":
        from workers.engine.torch_engine import EngineConfig, TorchEngine

        overrides = {"serve_dtype": serve_dtype} if serve_dtype is not None else {}
        return TorchEngine(tokenizer, EngineConfig.from_env(device=device, **overrides))
    if name == "vllm":
        if serve_dtype not in (None, "bf16"):
            from workers.engine.vllm_config import fp8_refusal

            raise ConfigError(fp8_refusal(serve_dtype))
        if device is not None:
            raise ConfigError(f"device {device!r}: only the torch engine takes one (vLLM places itself)")
        from workers.engine.vllm_engine import VLLMConfig, VLLMEngine, import_vllm

        import_vllm()  # fail now, with the install command, not later in a worker
        return VLLMEngine(tokenizer, VLLMConfig.from_env())
    raise ConfigError(f"unknown engine {name!r}: torch or vllm")
