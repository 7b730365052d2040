"""Evaluation by version: a fixed held-out set scored on the weights of one version, recorded with it.

Every ``eval_every`` versions (and version 0) the Trainer generates one
greedy completion per held-out problem on exactly the bf16 weights it
published at that version, with the torch engine on its own device, and
scores them with the task's reward (bounded like every reward). The
accuracy goes to Redis (``evals``: version -> JSON,
:mod:`aurora_store.coordination.evals`, read by ``aurora status``, the demo
and ``bench e2e --parity``) and to the run root as
``eval/v<version>.json`` (create-only), so a run's learning curve outlives
its Redis.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from aurora_store.coordination.evals import (
    EVAL_PREFIX,
    eval_key,
    read_evals,
    read_store_evals,
    record_eval,
)
from aurora_store.coordination.keys import RunKeys
from aurora_store.errors import VersionConflict
from aurora_store.storage import Store
from workers.engine.torch_engine import EngineConfig, TorchEngine
from workers.task import RewardRunner, Task

__all__ = ["EVAL_PREFIX", "EvalResult", "Evaluator", "eval_key", "read_evals", "read_store_evals"]


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Held-out accuracy measured on one version."""

    version: int
    accuracy: float
    """Mean reward over the held-out problems (0/1 rewards: the fraction solved)."""
    problems: int
    seconds: float
    measured_ms: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def record(self, redis: Any, keys: RunKeys) -> None:
        record_eval(redis, keys, self.version, asdict(self))

    def save(self, store: Store) -> None:
        """``eval/v<version>.json``, create-only; one already there (a resumed Trainer measuring again) is kept."""
        with contextlib.suppress(VersionConflict):
            store.put(eval_key(self.version), self.to_json().encode("utf-8"), mode="create")


class Evaluator:
    """Greedy generation on a private bf16 copy of the model, scored by the task."""

    def __init__(
        self,
        task: Task,
        tokenizer: Any,
        rewards: RewardRunner,
        template: torch.nn.Module,
        size: int,
        max_new_tokens: int,
        device: torch.device,
    ) -> None:
        self.problems = list(task.eval_problems(size))[:size]
        self.prompts = [tokenizer.render_prompt(p.prompt_text) for p in self.problems]
        self.rewards = rewards
        self.max_new_tokens = max_new_tokens
        self.engine = TorchEngine(tokenizer, EngineConfig(device=str(device)))
        self.engine.load(copy.deepcopy(template))

    def run(self, version: int, weights: Mapping[str, torch.Tensor]) -> EvalResult:
        """Accuracy of ``weights`` (Hugging Face names, bf16: the version as published)."""
        t0 = time.perf_counter()
        if not self.problems:
            return EvalResult(version, 0.0, 0, 0.0, int(time.time() * 1000))
        self.engine.load_weights(weights, version=version)
        g = self.engine.generate(self.prompts, 1, self.max_new_tokens, seed=0, temperature=0.0)
        scores = self.rewards.score([(group[0].text, p) for p, group in zip(self.problems, g.completions, strict=True)])
        acc = sum(scores) / len(scores)
        return EvalResult(version, acc, len(scores), time.perf_counter() - t0, int(time.time() * 1000))
