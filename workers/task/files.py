"""What every file-backed task shares: the train/held-out split and the walk over rows.

The held-out set is the eval file when one is given; otherwise the last
``holdout`` rows of the data file after a shuffle with a fixed seed (the
same for every run seed, so runs with different seeds are evaluated on the
same problems), and those rows are removed from training. Training walks a
seeded shuffle of the remaining rows in order, reshuffled each epoch:
position ``k = step * n + j`` of batch ``step`` is row ``perm(epoch)[k % m]``
with ``epoch = k // m``, so the prompts of a batch are a function of (step,
n, seed) and a resumed run draws the same ones.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping
from typing import Any

from aurora_store.errors import TaskDataError
from workers.task.base import Passes, Problem
from workers.task.data import load_rows

__all__ = ["DEFAULT_HOLDOUT", "FileTask", "row_id", "string_field"]

#: Rows held out of a data file for evaluation when no eval file is given.
DEFAULT_HOLDOUT = 64

_SPLIT_SEED = "aurora-holdout/v1"

#: ``(row, where, default_id) -> Problem``; ``where`` names the file and row for errors.
RowParser = Callable[[dict[str, Any], str, str], Problem]


class FileTask:
    """Problems read from a data file (and an optional eval file), split as the module says.

    Subclasses set :attr:`name`, implement :meth:`_problem` (one row to a
    :class:`Problem`, raising :class:`TaskDataError` naming ``where``) and
    :meth:`reward`. Everything is read once, in the constructor.
    """

    name = "file"

    def __init__(
        self,
        data: str,
        eval_data: str | None = None,
        *,
        seed: int = 0,
        holdout: int = DEFAULT_HOLDOUT,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if holdout < 1:
            raise ValueError(f"holdout must be >= 1, got {holdout}")
        self.seed = seed
        train = self._problems(data, storage_options, id_prefix="")
        if eval_data is not None:
            held = self._problems(eval_data, storage_options, id_prefix="eval/")
            shared = {p.id for p in train} & {p.id for p in held}
            if shared:
                raise TaskDataError(
                    f"{eval_data}: {len(shared)} row id(s) also in {data} (e.g. {min(shared)!r}): held-out rows must not be trained on"
                )
        else:
            if len(train) < 2:
                raise TaskDataError(f"{data}: needs at least 2 rows to hold some out for evaluation (or give --eval-data)")
            order = list(range(len(train)))
            random.Random(_SPLIT_SEED).shuffle(order)
            h = min(holdout, len(train) // 2)
            held = [train[i] for i in order[-h:]]
            train = [train[i] for i in sorted(order[:-h])]
        self._train = train
        self._eval = held
        self._passes = Passes(train, "aurora-train")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self._train)} training rows, {len(self._eval)} held out)"

    @property
    def train_size(self) -> int:
        """Rows trained on (the data file less the held-out rows)."""
        return len(self._train)

    def train_problems(self, step: int, n: int, seed: int) -> list[Problem]:
        return self._passes.batch(step, n, seed)

    def eval_problems(self, n: int) -> list[Problem]:
        return self._eval[: max(n, 0)]

    def warm_start_problems(self, n: int, seed: int) -> list[Problem]:
        solved = [p for p in self._train if p.solution]
        random.Random(f"aurora-warm/{seed}").shuffle(solved)
        return solved[: max(n, 0)]

    def reward(self, completion: str, problem: Problem) -> float:
        raise NotImplementedError

    def _problem(self, row: dict[str, Any], where: str, default_id: str) -> Problem:
        raise NotImplementedError

    def _problems(self, src: str, storage_options: Mapping[str, Any] | None, id_prefix: str) -> list[Problem]:
        base = os.path.basename(src.split("?", 1)[0].rstrip("/"))
        out: list[Problem] = []
        first_row: dict[str, int] = {}
        for n, row in enumerate(load_rows(src, storage_options), start=1):
            p = self._problem(row, f"{src}: row {n}", f"{id_prefix}{base}:{n}")
            if p.id in first_row:
                raise TaskDataError(f"{src}: row {n}: id {p.id!r} repeats row {first_row[p.id]}")
            first_row[p.id] = n
            out.append(p)
        return out


def string_field(row: dict[str, Any], where: str, *keys: str) -> str:
    """The first of ``keys`` present in ``row``, which must be a string."""
    for key in keys:
        if key in row and row[key] is not None:
            value = row[key]
            if not isinstance(value, str):
                raise TaskDataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
            return value
    names = " or ".join(repr(k) for k in keys)
    raise TaskDataError(f"{where}: field {names} is missing")


def row_id(row: dict[str, Any], default: str) -> str:
    """The row's own ``"id"`` when it is a string (or an int), else ``default``."""
    rid = row.get("id")
    if isinstance(rid, str) and rid:
        return rid
    if isinstance(rid, int) and not isinstance(rid, bool):
        return str(rid)
    return default
