"""Tasks by name: the built-ins, or ``package.module:factory`` for your own.

A custom factory is called as ``factory(data=..., eval_data=..., seed=...)``
(plus ``storage_options=...`` when it has that parameter, or ``**kwargs``)
and returns an object with the methods of :class:`~workers.task.base.Task`
and a ``name``. The reward runs in a child process, so the object must be
picklable, and its module importable there (on ``sys.path``, not
``__main__``): define the class at the top level of a module.
:func:`workers.task.data.load_rows` reads the data file for it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from aurora_store.errors import ConfigError
from workers.task.arithmetic import DIFFICULTIES, ArithmeticTask
from workers.task.base import TASK_METHODS, Task
from workers.task.files import DEFAULT_HOLDOUT
from workers.task.gsm8k import Gsm8kTask
from workers.task.math_task import MathTask

__all__ = ["BUILTIN_TASKS", "make_task"]

#: The tasks :func:`make_task` knows by name.
BUILTIN_TASKS = ("arithmetic", "gsm8k", "math")


def make_task(
    name: str,
    data: str | None = None,
    eval_data: str | None = None,
    *,
    seed: int = 0,
    difficulty: int = 1,
    storage_options: Mapping[str, Any] | None = None,
    holdout: int = DEFAULT_HOLDOUT,
) -> Task:
    """The task ``name`` (``arithmetic``, ``gsm8k``, ``math`` or ``package.module:factory``).

    ``difficulty`` is the arithmetic task's; ``holdout`` is how many rows of
    ``data`` are held out for evaluation when ``eval_data`` is None (at most
    half of them). Raises :class:`ConfigError` for a task that cannot be made
    and :class:`~aurora_store.errors.TaskDataError` for bad data.
    """
    if name == "arithmetic":
        if data is not None or eval_data is not None:
            raise ConfigError("task 'arithmetic' generates its problems: --data and --eval-data are not used by it")
        if difficulty not in DIFFICULTIES:
            raise ConfigError(f"--difficulty must be one of {sorted(DIFFICULTIES)}, got {difficulty!r}")
        return ArithmeticTask(difficulty)
    if name in ("gsm8k", "math"):
        if data is None:
            raise ConfigError(f"task {name!r} needs --data (a JSON-lines or Parquet file of its problems)")
        if holdout < 1:
            raise ConfigError(f"the held-out size must be >= 1, got {holdout}")
        cls = Gsm8kTask if name == "gsm8k" else MathTask
        return cls(data, eval_data, seed=seed, holdout=holdout, storage_options=storage_options)
    if ":" not in name:
        raise ConfigError(f"unknown task {name!r}: use one of {', '.join(BUILTIN_TASKS)} or package.module:factory")
    return _custom(name, data, eval_data, seed, storage_options)


def _custom(spec: str, data: str | None, eval_data: str | None, seed: int, storage_options: Mapping[str, Any] | None) -> Task:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"task {spec!r}: expected package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"task {spec!r}: cannot import {module_name!r} ({e})") from None
    except Exception as e:  # the module's own code failed: say how, in one line
        raise ConfigError(f"task {spec!r}: importing {module_name!r} failed ({type(e).__name__}: {e})") from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError(f"task {spec!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ConfigError(f"task {spec!r}: {attr!r} is not callable")
    kwargs: dict[str, Any] = {"data": data, "eval_data": eval_data, "seed": seed}
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: just call it
        params = {}
    if "storage_options" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs["storage_options"] = storage_options
    if params:
        try:
            inspect.signature(factory).bind(**kwargs)
        except TypeError as e:
            raise ConfigError(f"task {spec!r}: the factory must accept data=, eval_data=, seed= keywords ({e})") from None
    task = factory(**kwargs)
    missing = [m for m in TASK_METHODS if not callable(getattr(task, m, None))]
    if missing:
        raise ConfigError(f"task {spec!r}: the factory returned {type(task).__name__}, which lacks {', '.join(missing)}")
    if not isinstance(getattr(task, "name", None), str):
        raise ConfigError(f"task {spec!r}: the factory's {type(task).__name__} has no string 'name'")
    return task
