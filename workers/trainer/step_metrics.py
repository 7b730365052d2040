"""The Trainer's per-step record in the run root: ``metrics/step-<8 digits>.json``.

Object stores cannot append, so a run's numbers over time are one small
create-only object per step (:func:`aurora_store.metrics.step_record`):
readable from the store alone after Redis and the processes are gone. They
document the run; nothing reads them back, so a write that fails is one
warning line and the step goes on.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from aurora_store.errors import VersionConflict
from aurora_store.metrics import StepRecord, step_record
from aurora_store.outage import Dependency
from aurora_store.storage import Store

__all__ = ["save_step_metrics"]

log = logging.getLogger("aurora.trainer")


def save_step_metrics(store: Store, dep: Dependency, stop: threading.Event, s: StepRecord, eval_accuracy: float | None = None) -> bool:
    """Write step ``s``'s record, riding out a store outage on ``dep``; returns whether it is there.

    A record already there (a resumed Trainer repeating the step) is kept.
    Any failure (an outage past the budget, a store that refuses the key)
    is one warning, never the Trainer's end.
    """
    key, body = step_record(s, eval_accuracy)
    try:
        with contextlib.suppress(VersionConflict):
            dep.call(lambda: store.put(key, body, mode="create"), "save a step's metrics", stop)
        return True
    except Exception as e:  # noqa: BLE001 - a record of the run, never worth the run
        log.warning("step %d: %s not saved: %s", s.step, key, e)
        return False
