"""The benchmark's task: prompts of a realistic length and a reward that gives every group a signal.

Why not a real task: the Trainer's step must run GRPO's backward on every
batch, and a random model never earns a 0/1 reward (every group uniform:
no signal, no backward). Here the reward of a completion is a fixed hash
of its text, in [0, 1): random completions get spread rewards, every
group has an advantage, and the Trainer still scores each completion
itself in its reward process, as with any task
(``--task aurora_tools.bench.trainer.task:synthetic_task``).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from workers.task.base import Problem

__all__ = ["SyntheticTask", "synthetic_task"]

_WORDS = ("the", "of", "to", "and", "how", "many", "each", "total", "cost", "more", "less", "than", "times", "sum", "answer", "what")


@dataclass(frozen=True, slots=True)
class SyntheticTask:
    """Prompts of ``prompt_words`` words with numbers; reward: a hash of the completion's text."""

    prompt_words: int = 16
    name: str = "bench-synthetic"

    def _problem(self, key: str) -> Problem:
        rng = random.Random(key)
        words = [rng.choice(_WORDS) if i % 4 else str(rng.randint(0, 999)) for i in range(self.prompt_words)]
        return Problem(id=key, prompt_text=" ".join(words) + "?", answer=0)

    def train_problems(self, step: int, n: int, seed: int) -> list[Problem]:
        return [self._problem(f"s{seed}-b{step}-{i}") for i in range(n)]

    def eval_problems(self, n: int) -> list[Problem]:
        return [self._problem(f"eval-{i}") for i in range(n)]

    def reward(self, completion: str, problem: Problem) -> float:
        h = hashlib.sha256(f"{problem.id}\0{completion}".encode()).digest()
        return int.from_bytes(h[:4], "big") / 2**32

    def warm_start_problems(self, n: int, seed: int) -> list[Problem]:
        return []


def synthetic_task(data: str | None = None, eval_data: str | None = None, seed: int = 0) -> SyntheticTask:
    """The factory ``--task`` names (``data`` and ``eval_data`` are not used)."""
    return SyntheticTask()
