"""What a task is: problems with answers, and a reward that scores a completion.

A task is any object with the four methods of :class:`Task` (a structural
:class:`~typing.Protocol`: no base class to inherit). The Trainer draws the
prompts of batch ``b`` with ``train_problems(b, n, seed)``, so the data
position is the step and a resumed run draws the same prompts; it scores
completions with ``reward`` in a child process (:mod:`workers.task.runner`),
so a task must be picklable and its reward must not rely on the parent's
state.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["TASK_METHODS", "Passes", "Problem", "Task"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt and its answer."""

    id: str
    """Stable identifier (the same seed and index give the same id)."""
    prompt_text: str
    """What the model is given: for the arithmetic task ``"Q: 23+58=? A:"``, for data-backed
    tasks the user message (the question and the answer format it asks for)."""
    answer: Any
    """The right final answer, in the task's terms: an ``int`` for ``arithmetic`` and ``gsm8k``,
    the reference string (LaTeX or plain) for ``math``."""
    solution: str = ""
    """A correct worked completion, for the supervised warm start (empty: none known)."""


#: The methods :func:`workers.task.make_task` checks a custom task for.
TASK_METHODS = ("train_problems", "eval_problems", "reward", "warm_start_problems")


@runtime_checkable
class Task(Protocol):
    """Prompts and rewards of one RL task (see the module docstring)."""

    name: str
    """Short name for logs (``"arithmetic"``, ``"gsm8k"``, ...)."""

    def train_problems(self, step: int, n: int, seed: int) -> list[Problem]:
        """The ``n`` prompts of training batch ``step``: deterministic in (step, n, seed),
        ids unique within the batch."""
        ...

    def eval_problems(self, n: int) -> list[Problem]:
        """The first ``n`` problems of a fixed held-out set (the same on every call, never
        a training row); fewer when the set is smaller."""
        ...

    def reward(self, completion: str, problem: Problem) -> float:
        """The score of ``completion`` for ``problem``: pure, may be slow (it runs under a
        wall-clock bound in a child process)."""
        ...

    def warm_start_problems(self, n: int, seed: int) -> list[Problem]:
        """Up to ``n`` problems with a :attr:`Problem.solution` for the supervised warm
        start (may be empty)."""
        ...


class Passes:
    """Training batches as shuffled passes over a fixed list of problems (a data loader with shuffling).

    Draw ``k = step * n + j`` of batch ``step`` is ``problems[perm(seed, e)[k % m]]``
    with pass ``e = k // m``, each pass a fresh permutation seeded by
    ``f"{salt}/{seed}/{e}"``: within a pass every problem is drawn once, so
    any ``m`` consecutive draws hold the same mix, and a batch is a function of
    (step, n, seed), so a resumed run draws the same prompts. A batch that
    crosses into the next pass (or is larger than the list) can draw a problem
    twice: the second copy's id gets ``#2``.
    """

    def __init__(self, problems: Sequence[Problem], salt: str) -> None:
        if not problems:
            raise ValueError("Passes needs at least one problem")
        self.problems = list(problems)
        self.salt = salt
        self._perms: dict[tuple[int, int], list[int]] = {}

    def batch(self, step: int, n: int, seed: int) -> list[Problem]:
        if step < 0 or n < 0:
            raise ValueError(f"step and n must be >= 0, got {step} and {n}")
        m = len(self.problems)
        out: list[Problem] = []
        seen: dict[str, int] = {}
        for k in range(step * n, step * n + n):
            epoch, i = divmod(k, m)
            p = self.problems[self._perm(seed, epoch)[i]]
            times = seen.get(p.id, 0) + 1
            seen[p.id] = times
            out.append(p if times == 1 else dataclasses.replace(p, id=f"{p.id}#{times}"))
        return out

    def _perm(self, seed: int, epoch: int) -> list[int]:
        key = (seed, epoch)
        perm = self._perms.get(key)
        if perm is None:
            perm = list(range(len(self.problems)))
            random.Random(f"{self.salt}/{seed}/{epoch}").shuffle(perm)
            if len(self._perms) >= 4:  # batches walk forwards: a few passes suffice
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = perm
        return perm
