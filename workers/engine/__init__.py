"""Inference engines: what an Actor generates with and applies deltas to.

- :mod:`~workers.engine.protocol`: the :class:`Engine` an Actor needs, the
  values engines return, and :func:`evaluate`;
- :mod:`~workers.engine.torch_engine`: :class:`~workers.engine.torch_engine.TorchEngine`;
- :mod:`~workers.engine.vllm_engine` (driver side) with
  :mod:`~workers.engine.vllm_worker` (inside vLLM's workers);
- :mod:`~workers.engine.factory`: :func:`make_engine` by name.

Importing this package loads neither torch nor vLLM; each engine module
does when it is imported.
"""

from workers.engine.factory import ENGINES, make_engine
from workers.engine.protocol import (
    Completion,
    Engine,
    EvalResult,
    Generation,
    LoadingEngine,
    PredictingEngine,
    PreparingEngine,
    RemoteStaged,
    StoreStaging,
    TextCodec,
    TokenCodec,
    VerifyingEngine,
    evaluate,
)

__all__ = [
    "ENGINES",
    "Completion",
    "Engine",
    "EvalResult",
    "Generation",
    "LoadingEngine",
    "PredictingEngine",
    "PreparingEngine",
    "RemoteStaged",
    "StoreStaging",
    "TextCodec",
    "TokenCodec",
    "VerifyingEngine",
    "evaluate",
    "make_engine",
]
