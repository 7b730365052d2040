"""Custom tasks for tests/test_tasks_builtin.py, importable by reward child processes.

``make_task("task_helpers:slow_task")`` loads them the way a user's own task
is loaded; the reward runner's children import this module from ``sys.path``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from workers.task import Problem


class ScriptedTask:
    """A task whose reward does what the problem's answer says: ``"sleep:S:R"`` sleeps S
    seconds then returns R, ``"raise"`` raises, ``"exit"`` kills the process, ``"nan"`` returns NaN, ``"str"`` a string,
    anything else is returned as a float."""

    name = "scripted"

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def train_problems(self, step: int, n: int, seed: int) -> list[Problem]:
        return [Problem(f"s{step}-{i}", "q", "1") for i in range(n)]

    def eval_problems(self, n: int) -> list[Problem]:
        return [Problem(f"e{i}", "q", "1") for i in range(n)]

    def reward(self, completion: str, problem: Problem) -> Any:
        how = str(problem.answer)
        if how.startswith("sleep:"):
            _, secs, result = how.split(":")
            time.sleep(float(secs))
            return float(result)
        if how == "exit":
            os._exit(3)  # the process dies under the runner
        if how == "raise":
            raise ZeroDivisionError("scripted failure")
        if how == "nan":
            return float("nan")
        if how == "str":
            return "one"
        return float(how)

    def warm_start_problems(self, n: int, seed: int) -> list[Problem]:
        return []


def scripted_task(data: str | None = None, eval_data: str | None = None, seed: int = 0) -> ScriptedTask:
    """The factory ``make_task("task_helpers:scripted_task")`` calls."""
    return ScriptedTask(seed)


def not_a_task(data: str | None = None, eval_data: str | None = None, seed: int = 0) -> object:
    return object()


def wrong_signature(path: str) -> ScriptedTask:
    return ScriptedTask()


NOT_CALLABLE = 3
