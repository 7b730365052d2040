"""Which steps ``aurora bench trainer`` times, and the figures it reports from the Trainer's step records.

This module is the one place that maps what the Trainer records of a step
(``metrics/step-<8 digits>.json`` in the run root, :func:`aurora_store.metrics.step_record`)
to the benchmark's keys. Pure functions: no run, no server.

Steps and periods. Step ``b`` trains on batch ``b``, publishes version
``b + 1``, starts the checkpoint of version ``b + 1`` when one is due
(written in the background; the next step's ``optimizer.step()`` waits for
it) and then writes its record. The benchmark times *periods*: period ``b``
runs from record ``b - 1`` to record ``b``, all of step ``b``; every second
of the run after warm-up falls in exactly one period. The run goes one step
past the window: its last step finishes its checkpoint before it ends, a
wait that no step of a longer run has.

Memory is watched one step longer than time (:attr:`Window.memory_end`): the
step after the window's snapshot runs while that snapshot is still being
uploaded from the version it holds, which makes it the step most likely to
be the run's peak.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["KEYS", "Window", "figures", "window_for"]

KEYS = ("params", "peak_bytes_per_param", "step_s", "publish_s", "digest_s", "checkpoint_wait_s")
"""The keys the issue names (a contract), in order."""

_WARM = 2
"""Steps before the window: the first ones pay for first calls (allocations, compiled kernels)."""


@dataclass(frozen=True, slots=True)
class Window:
    """Timed periods ``first..last`` (step numbers) of a run of ``steps`` steps."""

    first: int
    last: int
    steps: int
    checkpoints: tuple[int, ...]
    """Versions whose checkpoint is started inside the window."""
    snapshots: tuple[int, ...]
    """Versions published with a snapshot inside the window."""

    @property
    def periods(self) -> int:
        return self.last - self.first + 1

    @property
    def memory_end(self) -> int:
        """The version whose commit ends the memory window: the one published by the step after the
        window (the snapshot's upload, published by the window's last step, runs in it)."""
        return self.last + 2


def window_for(checkpoint_every: int, snapshot_every: int) -> Window:
    """The shortest window after warm-up of at least ``checkpoint_every + 1`` periods that holds a
    checkpoint's start and the wait for it, and ends with the step that publishes a snapshot; the run
    goes two steps further (the step after the snapshot, in the memory window, and a last one).

    Period ``b`` publishes version ``b + 1`` and starts its checkpoint when one is due; ``n``
    consecutive versions hold a multiple of ``checkpoint_every`` below the last, whose wait
    falls in the next period, still inside.
    """
    if checkpoint_every < 0 or snapshot_every < 0:
        raise ValueError("checkpoint_every and snapshot_every must be >= 0")
    n = checkpoint_every + 1 if checkpoint_every > 0 else 2
    end_version = n + _WARM  # version published by the last period
    if snapshot_every > 0:
        end_version = snapshot_every * math.ceil(end_version / snapshot_every)
    last = end_version - 1
    first = last - n + 1
    ck = tuple(v for v in range(first + 1, last + 1) if checkpoint_every > 0 and v % checkpoint_every == 0)
    snaps = tuple(v for v in range(first + 1, last + 2) if snapshot_every > 0 and v % snapshot_every == 0)
    return Window(first, last, last + 3, ck, snaps)


def _num(rec: Mapping[str, Any], key: str) -> float | None:
    v = rec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def figures(records: Mapping[int, Mapping[str, Any]], w: Window) -> dict[str, Any]:
    """Means over the window's periods, from the step records (step -> parsed record).

    - ``step_s``: the period (record ``b`` time minus record ``b - 1`` time);
    - ``publish_s``: the time the step waited for publishing, hashing excluded
      (``publish_wait_s``; a Trainer that does not split it: the whole publish);
    - ``digest_s``: the time it hashed weights (0 where not recorded);
    - ``checkpoint_wait_s``: the time it waited for a checkpoint, as recorded;
      from a Trainer that does not record it (one that saves checkpoints after
      a step's record, synchronously) the part of the period outside the step's
      own record (evaluation is off in the benchmark);
    - also ``train_s`` and ``wait_s`` (waiting for the batch), for the table.

    Raises ValueError when a record the window needs is missing or unreadable.
    """
    need = range(w.first - 1, w.last + 1)
    missing = [b for b in need if b not in records or _num(records[b], "time_ms") is None]
    if missing:
        raise ValueError(f"the Trainer's step records of steps {missing} are missing or unreadable")
    rows: dict[str, list[float]] = {k: [] for k in ("step_s", "publish_s", "digest_s", "checkpoint_wait_s", "train_s", "wait_s")}
    recorded_wait = True
    for b in range(w.first, w.last + 1):
        rec = records[b]
        period = (_num(rec, "time_ms") or 0.0) / 1000 - (_num(records[b - 1], "time_ms") or 0.0) / 1000
        whole = _num(rec, "publish_s") or 0.0
        publish = _num(rec, "publish_wait_s")
        ck = _num(rec, "checkpoint_wait_s")
        if ck is None:
            recorded_wait = False
            ck = max(0.0, period - (_num(rec, "step_s") or 0.0))
        rows["step_s"].append(max(period, 1e-9))
        rows["publish_s"].append(whole if publish is None else publish)
        rows["digest_s"].append(_num(rec, "digest_s") or 0.0)
        rows["checkpoint_wait_s"].append(ck)
        rows["train_s"].append(_num(rec, "train_s") or 0.0)
        rows["wait_s"].append(_num(rec, "wait_s") or 0.0)
    out: dict[str, Any] = {k: _mean(v) for k, v in rows.items()}
    out["overhead_fraction"] = (out["publish_s"] + out["digest_s"] + out["checkpoint_wait_s"]) / out["step_s"]
    out["checkpoint_wait_recorded"] = recorded_wait
    out["per_step"] = [{k: round(rows[k][i], 4) for k in rows} | {"step": w.first + i} for i in range(w.periods)]
    return out
