"""GSM8K: grade-school word problems whose reference ends in ``#### <int>``.

Rows are ``{"question": ..., "answer": "... #### 42"}`` (GSM8K's JSON lines,
or the same columns in Parquet). A completion earns 1.0 exactly when its
last ``#### <int>`` names the reference's integer (:func:`reward` of the
arithmetic task, which is scored the same way).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from aurora_store.errors import TaskDataError
from workers.task.arithmetic import ANSWER_MARK, format_prompt, parse_final_answer, reward
from workers.task.base import Problem
from workers.task.files import FileTask, row_id, string_field

__all__ = ["GSM8K_INSTRUCTION", "Gsm8kTask", "gsm8k_reward", "load_gsm8k_jsonl"]

#: Appended to each question: the answer format the reward reads.
GSM8K_INSTRUCTION = f"Give the final answer after '{ANSWER_MARK}'."

_CALC = re.compile(r"<<[^<>]*>>")


def gsm8k_reward(completion: str, reference_answer_text: str) -> float:
    """:func:`reward` against a GSM8K reference (``"... #### 42"``).

    A reference without a final integer is a data error, not a wrong answer.
    """
    ref = parse_final_answer(reference_answer_text)
    if ref is None:
        raise TaskDataError(f"reference answer has no final '{ANSWER_MARK} <int>': {_preview(reference_answer_text)}")
    return reward(completion, ref)


def _parse_row(rec: Any, where: str) -> tuple[str, int, str]:
    """(question, integer answer, worked solution without ``<<calculator>>`` notes) of one row."""
    if not isinstance(rec, dict):
        raise TaskDataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    question = string_field(rec, where, "question")
    answer = string_field(rec, where, "answer")
    ans = parse_final_answer(answer)
    if ans is None:
        raise TaskDataError(f"{where}: field 'answer' has no final '{ANSWER_MARK} <int>': {_preview(answer)}")
    return question.strip(), ans, _CALC.sub("", answer.strip())


def load_gsm8k_jsonl(path: str | os.PathLike[str], limit: int | None = None) -> list[Problem]:
    """Problems from a GSM8K-format JSONL file, one ``{"question", "answer"}`` object a line,
    with the arithmetic task's ``"Q: ... A:"`` prompts (for the character tokenizer's models).

    Blank lines are skipped. An ``"id"`` string, when present, is kept;
    otherwise the id is ``<file name>:<line>``. The worked solution keeps
    GSM8K's text without its ``<<calculator>>`` annotations. Any malformed
    line raises :class:`TaskDataError` naming the file and line.
    :class:`Gsm8kTask` reads the same rows (and Parquet, and URLs) for RL.
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
                raise TaskDataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            question, ans, solution = _parse_row(rec, where)
            rid = rec.get("id")
            out.append(
                Problem(
                    id=rid if isinstance(rid, str) else f"{name}:{lineno}",
                    prompt_text=format_prompt(question),
                    answer=ans,
                    solution=" " + solution,
                )
            )
    return out


class Gsm8kTask(FileTask):
    """GSM8K rows as a task: the prompt is the question and :data:`GSM8K_INSTRUCTION`,
    the answer the reference's final integer, the solution its worked text."""

    name = "gsm8k"

    def reward(self, completion: str, problem: Problem) -> float:
        return reward(completion, problem.answer)

    def _problem(self, row: dict[str, Any], where: str, default_id: str) -> Problem:
        question, ans, solution = _parse_row(row, where)
        return Problem(
            id=row_id(row, default_id),
            prompt_text=f"{question}\n{GSM8K_INSTRUCTION}",
            answer=ans,
            solution=solution,
        )


def _preview(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else "…" + text[-n:])
