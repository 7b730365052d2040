r"""Competition math (MATH, DeepScaleR): LaTeX answers checked for equivalence.

Rows carry the problem in ``problem`` (or ``question``) and the reference in
``answer``, or else in ``solution`` as its last ``\boxed{...}``. A
completion's final answer is, in this order, the text after its last
``####``, the content of its last ``\boxed{}``, or what follows its last
"answer is"; it earns 1.0 when ``math-verify`` finds it equal to the
reference (``\frac12``, ``\frac{1}{2}``, ``1/2`` and ``0.5`` all are), else
0.0. math-verify's own SIGALRM timeouts are switched off (they refuse to run
off the main thread); the bound is the reward runner's
(:mod:`workers.task.runner`), which kills a check that hangs in sympy.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from aurora_store.errors import TaskDataError
from workers.task.base import Problem
from workers.task.files import FileTask, row_id, string_field

__all__ = ["MATH_INSTRUCTION", "MathTask", "extract_final_answer", "last_boxed", "math_equal"]

#: Appended to each problem: the answer format the reward reads best.
MATH_INSTRUCTION = r"Put the final answer in \boxed{}."

# A longer "final answer" is not one, and parsing it in sympy could take forever.
_MAX_ANSWER_CHARS = 400
_ANSWER_IS = re.compile(r"answer is\s*:?", re.IGNORECASE)
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``) with balanced braces, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            c = text[i]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def extract_final_answer(text: str) -> str | None:
    r"""A completion's final answer: after the last ``####``, else the last ``\boxed{}``,
    else after the last "answer is" (to the end of its line); None when there is none."""
    i = text.rfind("####")
    if i >= 0:
        tail = text[i + 4 :].strip()
        tail = tail.splitlines()[0] if tail else ""
        ans: str | None = last_boxed(tail) or tail
    else:
        ans = last_boxed(text)
        if ans is None:
            matches = list(_ANSWER_IS.finditer(text))
            if matches:
                rest = text[matches[-1].end() :].strip()
                ans = rest.splitlines()[0] if rest else ""
                ans = last_boxed(ans) or ans
    return _clean(ans) if ans is not None else None


def _clean(ans: str) -> str | None:
    ans = ans.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if ans.startswith(left) and ans.endswith(right) and len(ans) >= len(left) + len(right):
            ans = ans[len(left) : len(ans) - len(right)].strip()
    return ans if ans and len(ans) <= _MAX_ANSWER_CHARS else None


def _math_verify() -> tuple[Any, Any]:
    """math-verify's ``parse`` and ``verify``, imported on first use (sympy is slow to import),
    with its "timeout is disabled" warning silenced: the runner bounds the call instead."""
    import math_verify.grader as grader
    import math_verify.parser as parser

    grader.TIMEOUT_WARNING_SHOWN = True
    parser.TIMEOUT_WARNING_SHOWN = True
    return parser.parse, grader.verify


@functools.lru_cache(maxsize=4096)
def _parsed(answer: str) -> Any:
    parse, _ = _math_verify()
    return parse("\\boxed{" + answer + "}", parsing_timeout=None)


def math_equal(reference: str, answer: str) -> bool:
    """Whether ``answer`` is mathematically equal to ``reference`` (both LaTeX or plain)."""
    ref = _clean(reference)
    got = _clean(answer)
    if ref is None or got is None:
        return False
    _, verify = _math_verify()
    gold, pred = _parsed(ref), _parsed(got)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


class MathTask(FileTask):
    r"""MATH-style rows as a task: the prompt is the problem and :data:`MATH_INSTRUCTION`,
    the answer the reference string, the solution the row's worked ``solution`` when it
    has a ``\boxed{}``, else just the boxed reference (which still teaches the format)."""

    name = "math"

    def reward(self, completion: str, problem: Problem) -> float:
        got = extract_final_answer(completion)
        return 1.0 if got is not None and math_equal(str(problem.answer), got) else 0.0

    def warm_up(self) -> None:
        """Import sympy and math-verify now, so the first reward does not pay for it
        inside its time bound (called by the reward runner in its child)."""
        math_equal("\\frac{1}{2}", "0.5")

    def _problem(self, row: dict[str, Any], where: str, default_id: str) -> Problem:
        question = string_field(row, where, "problem", "question")
        solution = row.get("solution")
        if solution is not None and not isinstance(solution, str):
            raise TaskDataError(f"{where}: field 'solution' must be a string, got {type(solution).__name__}")
        answer = row.get("answer")
        if answer is None:
            if solution is None:
                raise TaskDataError(f"{where}: field 'answer' (or a 'solution' with \\boxed{{}}) is missing")
            answer = last_boxed(solution)
            if answer is None:
                raise TaskDataError(f"{where}: no 'answer' field and no \\boxed{{}} in 'solution'")
        elif isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise TaskDataError(f"{where}: field 'answer' must be a string or a number, got {type(answer).__name__}")
        ref = str(answer).strip()
        if _clean(ref) is None:
            raise TaskDataError(f"{where}: field 'answer' is empty or longer than {_MAX_ANSWER_CHARS} characters")
        if solution is None or last_boxed(solution) is None:
            solution = f"The final answer is $\\boxed{{{ref}}}$."
        return Problem(
            id=row_id(row, default_id),
            prompt_text=f"{question.strip()}\n{MATH_INSTRUCTION}",
            answer=ref,
            solution=solution.strip(),
        )
