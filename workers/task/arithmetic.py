"""The generated arithmetic task, scored in GSM8K's answer style.

A prompt reads ``"Q: 23+58=? A:"``; a completion earns reward 1.0 exactly
when its last ``#### <int>`` marker names the right integer, as GSM8K is
scored. The generated problems are easy on purpose (one- and two-digit
sums), so a model of a few hundred thousand parameters reaches some, but not
all, right answers after a short supervised warm start, and GRPO has a
signal to climb.

Everything here is pure: plain functions over strings and integers.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from workers.task.base import Passes, Problem

__all__ = [
    "ANSWER_MARK",
    "DIFFICULTIES",
    "ArithmeticTask",
    "all_problems",
    "format_prompt",
    "make_problems",
    "max_solution_chars",
    "parse_final_answer",
    "reward",
]

#: GSM8K's final-answer marker.
ANSWER_MARK = "####"

#: difficulty -> (range of the first operand, range of the second, operators).
DIFFICULTIES: dict[int, tuple[tuple[int, int], tuple[int, int], str]] = {
    1: ((0, 9), (0, 9), "+"),
    2: ((10, 99), (0, 9), "+"),
    3: ((10, 99), (10, 99), "+"),
    4: ((10, 99), (10, 99), "+-"),
}

# Longer digit strings are not answers (and int() of them is slow or refused).
_MAX_ANSWER_DIGITS = 64
_INT = re.compile(r"[-+]?\d+")

# The held-out problems are drawn with this seed (training batches walk all_problems).
_EVAL_SEED = -1


def format_prompt(question: str) -> str:
    return f"Q: {question} A:"


def make_problems(n: int, seed: int, difficulty: int = 1) -> list[Problem]:
    """``n`` problems drawn with ``seed`` at ``difficulty`` (1-4, see :data:`DIFFICULTIES`).

    Deterministic across machines and Python versions (string-seeded
    :class:`random.Random`), so a Trainer and an evaluator that agree on the
    seed agree on the problems; the first ``k`` of ``n`` are the ``k`` problems.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    (alo, ahi), (blo, bhi), ops = _ranges(difficulty)
    rng = random.Random(f"aurora-arith/{difficulty}/{seed}")
    out: list[Problem] = []
    for i in range(n):
        a, b, op = rng.randint(alo, ahi), rng.randint(blo, bhi), rng.choice(ops)
        if op == "-" and b > a:
            a, b = b, a
        out.append(_problem(a, b, op, f"arith-d{difficulty}-s{seed}-{i:06d}"))
    return out


def _ranges(difficulty: int) -> tuple[tuple[int, int], tuple[int, int], str]:
    try:
        return DIFFICULTIES[difficulty]
    except KeyError:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTIES)}, got {difficulty!r}") from None


def _problem(a: int, b: int, op: str, pid: str) -> Problem:
    c = a + b if op == "+" else a - b
    expr = f"{a}{op}{b}"
    return Problem(id=pid, prompt_text=format_prompt(f"{expr}=?"), answer=c, solution=f" {expr}={c}\n{ANSWER_MARK} {c}")


def all_problems(difficulty: int = 1) -> list[Problem]:
    """Every distinct problem of ``difficulty`` once, in a fixed order (100 sums at difficulty 1).

    Ids name the expression (``"arith-d1-3+4"``), so one problem has one id in
    every batch; a difference never goes below zero (``a - b`` with ``a >= b``).
    """
    (alo, ahi), (blo, bhi), ops = _ranges(difficulty)
    return [
        _problem(a, b, op, f"arith-d{difficulty}-{a}{op}{b}")
        for op in ops
        for a in range(alo, ahi + 1)
        for b in range(blo, bhi + 1)
        if op == "+" or a >= b
    ]


def max_solution_chars(problems: Sequence[Problem]) -> int:
    """Length of the longest reference solution: a floor for ``max_new_tokens``
    with a character-level tokenizer (add one for ``eos``)."""
    return max((len(p.solution) for p in problems), default=0)


def parse_final_answer(text: str) -> int | None:
    """The integer after the last ``####``, or ``None``.

    Whitespace around the number, thousands commas and one trailing period
    are tolerated (``"#### 1,234."``); anything else after the marker
    (``"#### 81 apples"``, ``"#### 8.5"``) is not an integer answer.
    """
    i = text.rfind(ANSWER_MARK)
    if i < 0:
        return None
    tail = text[i + len(ANSWER_MARK) :].strip().replace(",", "")
    if tail.endswith("."):
        tail = tail[:-1].rstrip()
    if len(tail) > _MAX_ANSWER_DIGITS + 1 or not _INT.fullmatch(tail):
        return None
    return int(tail)


def reward(completion_text: str, answer: int) -> float:
    """1.0 iff the completion's last ``#### <int>`` equals ``answer``, else 0.0."""
    got = parse_final_answer(completion_text)
    return 1.0 if got is not None and got == answer else 0.0


class ArithmeticTask:
    """The generated sums of :func:`make_problems` as a :class:`~workers.task.base.Task`.

    Training batches walk shuffled passes over :func:`all_problems` (a
    :class:`~workers.task.base.Passes`), as a data loader walks a data set: at
    difficulty 1 every 100 consecutive prompts are the 100 sums once each, so
    the reward of a batch of 20 changes with the policy, not with the luck of
    the draw (random draws put 0.04 of noise on the mean reward of a batch of
    32). The held-out set is drawn at random with a seed of its own, the same
    for every run; difficulty 1 has only 100 distinct sums, so the *texts* of
    held-out and training problems coincide (their ids do not).
    """

    name = "arithmetic"

    def __init__(self, difficulty: int = 1) -> None:
        if difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {sorted(DIFFICULTIES)}, got {difficulty!r}")
        self.difficulty = difficulty
        self._passes = Passes(all_problems(difficulty), f"aurora-arith-train/{difficulty}")

    def __repr__(self) -> str:
        return f"ArithmeticTask(difficulty={self.difficulty})"

    def train_problems(self, step: int, n: int, seed: int) -> list[Problem]:
        return self._passes.batch(step, n, seed)

    def eval_problems(self, n: int) -> list[Problem]:
        return make_problems(n, seed=_EVAL_SEED, difficulty=self.difficulty)

    def reward(self, completion: str, problem: Problem) -> float:
        return reward(completion, problem.answer)

    def warm_start_problems(self, n: int, seed: int) -> list[Problem]:
        """``make_problems(n, seed)``: random draws with solutions (the Trainer asks with ``seed = run seed + 1``)."""
        return make_problems(n, seed=seed, difficulty=self.difficulty)
