"""Evaluation by version: a fixed held-out set scored on the weights of one version, recorded with it.

Every ``eval_every`` versions (and version 0) the Trainer generates one
greedy completion per held-out problem on exactly the bf16 weights it
published at that version, on its own device (the torch engine's sampling), and
scores them with the task's reward (bounded like every reward). The
accuracy goes to Redis (``evals``: version -> JSON,
:mod:`aurora_store.coordination.evals`, read by ``aurora status``, the demo
and ``bench e2e --parity``) and to the run root as
``eval/v<version>.json`` (create-only), so a run's learning curve outlives
its Redis.
"""

from __future__ import annotations

import contextlib
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
from workers.engine.torch_config import EngineConfig
from workers.engine.torch_sampling import sample_rows
from workers.task import RewardRunner, Task
from workers.trainer.behaviour import BehaviourModel

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
    """Greedy generation on the Trainer's weightless bf16 module, the version's tensors lent to it, scored by the task.

    No copy of the model is kept for evaluation: the module is the one behaviour
    log-probabilities run on (:class:`~workers.trainer.behaviour.BehaviourModel`),
    and the version's tensors are those the Trainer already holds.
    """

    def __init__(
        self,
        task: Task,
        tokenizer: Any,
        rewards: RewardRunner,
        behaviour: BehaviourModel,
        size: int,
        max_new_tokens: int,
        max_batch_rows: int | None = None,
    ) -> None:
        self.problems = list(task.eval_problems(size))[:size]
        self.prompts = [tokenizer.render_prompt(p.prompt_text) for p in self.problems]
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.max_new_tokens = max_new_tokens
        self.behaviour = behaviour
        self.max_batch_rows = max_batch_rows or EngineConfig().max_batch_rows

    def run(self, version: int, weights: Mapping[str, torch.Tensor]) -> EvalResult:
        """Accuracy of ``weights`` (Hugging Face names, bf16: the version as published)."""
        t0 = time.perf_counter()
        if not self.problems:
            return EvalResult(version, 0.0, 0, 0.0, int(time.time() * 1000))
        dev = self.behaviour.device
        gen = torch.Generator(device=dev)
        gen.manual_seed(0)
        texts: list[str] = []
        with torch.inference_mode(), self.behaviour.lent(weights) as model:
            for lo in range(0, len(self.prompts), self.max_batch_rows):
                rows = [list(p) for p in self.prompts[lo : lo + self.max_batch_rows]]
                texts += [c.text for c in sample_rows(model, self.tokenizer, dev, rows, self.max_new_tokens, 0.0, gen)]
        scores = self.rewards.score(list(zip(texts, self.problems, strict=True)))
        acc = sum(scores) / len(scores)
        return EvalResult(version, acc, len(scores), time.perf_counter() - t0, int(time.time() * 1000))
