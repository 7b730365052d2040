"""Held-out accuracy by version, as the Trainer records it: in Redis (``evals``: version -> JSON) and in the run root.

The run root keeps one create-only object per evaluation, ``eval/v<version>.json``
(:func:`eval_key`), so the curve outlives Redis and the lineage notebook
reads it from the store alone.

Written by the Trainer's evaluation (workers/trainer/evaluation.py), read by
``aurora status``, the demo, ``aurora bench e2e --parity`` and the lineage
notebook. Entries are read as untrusted: one that does not parse, or whose
accuracy is not a number in [0, 1], is skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.versioned import record_versioned
from aurora_store.errors import ObjectNotFound, ObjectTooLarge
from aurora_store.storage import Store

__all__ = ["EVAL_PREFIX", "eval_key", "read_evals", "read_store_evals", "record_eval"]

EVAL_PREFIX = "eval/"
"""Where the run root keeps the evaluations."""

MAX_EVAL_BYTES = 64 << 10
"""Largest evaluation object read (they are a few hundred bytes)."""


def eval_key(version: int) -> str:
    return f"{EVAL_PREFIX}v{int(version):08d}.json"


def record_eval(redis: Any, keys: RunKeys, version: int, record: dict[str, Any]) -> None:
    """``record`` (at least ``accuracy``) for ``version``, trimmed like the other per-version hashes."""
    record_versioned(redis, keys, keys.evals, str(int(version)), json.dumps(record, sort_keys=True), int(version))


def read_evals(redis: Any, keys: RunKeys) -> dict[int, dict[str, Any]]:
    """version -> the evaluation recorded for it in Redis, in version order."""
    return _parsed((k, v) for k, v in (redis.hgetall(keys.evals) or {}).items())


def read_store_evals(store: Store) -> dict[int, dict[str, Any]]:
    """version -> the evaluation the run root holds for it (``eval/v<version>.json``), in version order."""
    found = []
    for key in store.list(EVAL_PREFIX):
        name = key[len(EVAL_PREFIX) :]
        if not (name.startswith("v") and name.endswith(".json")) or store.size(key) > MAX_EVAL_BYTES:
            continue
        try:
            found.append((name[1:-5], store.get_capped(key, MAX_EVAL_BYTES, "the limit on an evaluation record")))
        except (ObjectTooLarge, ObjectNotFound):
            continue  # replaced by something larger, or removed, since it was listed
    return _parsed(found)


def _parsed(items: Iterable[tuple[Any, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for k, v in items:
        try:
            rec = json.loads(v)
            ver = int(k)
            acc = float(rec["accuracy"])
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            continue
        if ver >= 0 and math.isfinite(acc) and 0.0 <= acc <= 1.0:
            out[ver] = {**rec, "accuracy": acc}
    return dict(sorted(out.items()))
