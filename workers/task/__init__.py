"""RL tasks: problems with answers, and rewards that score completions.

A task (:class:`Task`) gives the prompts of each training batch, a fixed
held-out set, a reward, and problems with worked solutions for the
supervised warm start. :func:`make_task` builds one by name:

- ``arithmetic``: generated sums (:func:`make_problems`), scored by the
  GSM8K-style final integer (:func:`reward`); the demo's task.
- ``gsm8k``: GSM8K rows (``{"question", "answer": "... #### 42"}``).
- ``math``: MATH / DeepScaleR rows, answers checked with math-verify.
- ``package.module:factory``: your own (:mod:`workers.task.registry`).

Data files are JSON lines or Parquet, local or ``s3://``
(:func:`load_rows`). Rewards run under a wall-clock bound in child
processes (:class:`RewardRunner`).
"""

from __future__ import annotations

from aurora_store.errors import TaskDataError
from workers.task.arithmetic import (
    ANSWER_MARK,
    DIFFICULTIES,
    ArithmeticTask,
    format_prompt,
    make_problems,
    max_solution_chars,
    parse_final_answer,
    reward,
)
from workers.task.base import Problem, Task
from workers.task.data import load_rows
from workers.task.files import DEFAULT_HOLDOUT, FileTask
from workers.task.gsm8k import Gsm8kTask, gsm8k_reward, load_gsm8k_jsonl
from workers.task.math_task import MathTask, extract_final_answer, math_equal
from workers.task.registry import BUILTIN_TASKS, make_task
from workers.task.runner import RewardRunner

__all__ = [
    "ANSWER_MARK",
    "BUILTIN_TASKS",
    "DEFAULT_HOLDOUT",
    "DIFFICULTIES",
    "ArithmeticTask",
    "FileTask",
    "Gsm8kTask",
    "MathTask",
    "Problem",
    "RewardRunner",
    "Task",
    "TaskDataError",
    "extract_final_answer",
    "format_prompt",
    "gsm8k_reward",
    "load_gsm8k_jsonl",
    "load_rows",
    "make_problems",
    "make_task",
    "math_equal",
    "max_solution_chars",
    "parse_final_answer",
    "reward",
]
