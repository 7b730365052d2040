"""The RL task: generated arithmetic problems, scored in GSM8K's answer style.

A prompt reads ``"Q: 23+58=? A:"``; a completion earns reward 1.0 exactly
when its last ``#### <int>`` marker names the right integer, as GSM8K is
scored. The generated problems are easy on purpose (one- and two-digit
sums), so a model of a few hundred thousand parameters reaches some, but not
all, right answers after a short supervised warm start, and GRPO has a
signal to climb. Users with their own data read GSM8K's JSONL format
(``{"question": ..., "answer": "... #### 42"}``) with :func:`load_gsm8k_jsonl`
(tokenize them with ``CharTokenizer(ASCII_ALPHABET)``).

Everything here is pure: plain functions over strings and integers.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from aurora_store.errors import TaskDataError

__all__ = [
    "ANSWER_MARK",
    "DIFFICULTIES",
    "Problem",
    "TaskDataError",
    "format_prompt",
    "gsm8k_reward",
    "load_gsm8k_jsonl",
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
_CALC = re.compile(r"<<[^<>]*>>")




@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt and its integer answer."""

    id: str
    """Stable identifier (the same seed and index give the same id)."""
    prompt_text: str
    """What the model is given, e.g. ``"Q: 23+58=? A:"``."""
    answer: int
    """The right final answer."""
    solution: str = ""
    """A correct worked completion ending in ``#### <answer>``, for supervised warm start."""


def format_prompt(question: str) -> str:
    return f"Q: {question} A:"


def make_problems(n: int, seed: int, difficulty: int = 1) -> list[Problem]:
    """``n`` problems drawn with ``seed`` at ``difficulty`` (1-4, see :data:`DIFFICULTIES`).

    Deterministic across machines and Python versions (string-seeded
    :class:`random.Random`), so a Trainer and an evaluator that agree on the
    seed agree on the problems.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    try:
        (alo, ahi), (blo, bhi), ops = DIFFICULTIES[difficulty]
    except KeyError:
        raise ValueError(
            f"difficulty must be one of {sorted(DIFFICULTIES)}, got {difficulty!r}"
        ) from None
    rng = random.Random(f"aurora-arith/{difficulty}/{seed}")
    out: list[Problem] = []
    for i in range(n):
        a, b, op = rng.randint(alo, ahi), rng.randint(blo, bhi), rng.choice(ops)
        if op == "-" and b > a:
            a, b = b, a
        c = a + b if op == "+" else a - b
        expr = f"{a}{op}{b}"
        out.append(
            Problem(
                id=f"arith-d{difficulty}-s{seed}-{i:06d}",
                prompt_text=format_prompt(f"{expr}=?"),
                answer=c,
                solution=f" {expr}={c}\n{ANSWER_MARK} {c}",
            )
        )
    return out


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


def gsm8k_reward(completion: str, reference_answer_text: str) -> float:
    """:func:`reward` against a GSM8K reference (``"... #### 42"``).

    A reference without a final integer is a data error, not a wrong answer.
    """
    ref = parse_final_answer(reference_answer_text)
    if ref is None:
        raise TaskDataError(
            f"reference answer has no final '{ANSWER_MARK} <int>': {_preview(reference_answer_text)}"
        )
    return reward(completion, ref)


def load_gsm8k_jsonl(path: str | os.PathLike[str], limit: int | None = None) -> list[Problem]:
    """Problems from a GSM8K-format JSONL file, one ``{"question", "answer"}`` object a line.

    Blank lines are skipped. An ``"id"`` string, when present, is kept;
    otherwise the id is ``<file name>:<line>``. The worked solution keeps
    GSM8K's text without its ``<<calculator>>`` annotations. Any malformed
    line raises :class:`TaskDataError` naming the file and line.
    """
    p = os.fspath(path)
    name = os.path.basename(p)
    out: list[Problem] = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            if not isinstance(rec, dict):
                raise TaskDataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            for key in ("question", "answer"):
                if key not in rec:
                    raise TaskDataError(f"{where}: field {key!r} is missing")
                if not isinstance(rec[key], str):
                    raise TaskDataError(
                        f"{where}: field {key!r} must be a string, got {type(rec[key]).__name__}"
                    )
            ans = parse_final_answer(rec["answer"])
            if ans is None:
                raise TaskDataError(
                    f"{where}: field 'answer' has no final '{ANSWER_MARK} <int>': {_preview(rec['answer'])}"
                )
            rid = rec.get("id")
            out.append(
                Problem(
                    id=rid if isinstance(rid, str) else f"{name}:{lineno}",
                    prompt_text=format_prompt(rec["question"].strip()),
                    answer=ans,
                    solution=" " + _CALC.sub("", rec["answer"].strip()),
                )
            )
    return out


def _preview(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else "…" + text[-n:])
