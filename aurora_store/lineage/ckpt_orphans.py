"""Trainer checkpoint objects no committed record lists: what a killed or failed upload leaves behind.

A Trainer checkpoint (written by ``workers/trainer/ckpt_store.py``, committed
by ``workers/trainer/checkpoint.py``; docs/WORKERS.md "Checkpoint and
resume") is a folder of the run root::

    checkpoints/step-00000012/<attempt>/rank-00000/part-00000.bin
    checkpoints/step-00000012/checkpoint.json

The record, written last, lists every object of one attempt. A Trainer
killed while its ranks upload (or whose upload failed) leaves parts that no
record lists, and nothing else ever removes them: pruning deletes only
checkpoints whose record binds them to the run. This module says which of
those objects retention may remove (:func:`checkpoint_orphans`).

An attempt still being written looks exactly like a dead one until its
record lands, and its record lands late: the upload runs beside training,
and rank 0 commits it only before the next optimizer step, after the next
batch has been collected (however long that takes). So an attempt's objects
go only when all of these hold:

- no record of the folder lists them (a record is read as untrusted bytes,
  capped; one that cannot be read keeps its whole folder: nobody can tell
  what it lists);
- the newest object of the attempt is older than the grace (an upload
  writes part after part; one that stopped writing for that long is dead);
- the folder already holds a record (that step was committed by another
  attempt: this one can never be), or a version after the checkpoint's is
  committed in the store (the Trainer that took the checkpoint before step
  N commits it before it publishes version N + 1, so past that it is either
  committed or dead). The head is the store's own committed chain
  (:mod:`aurora_store.lineage.trusted`), never a value read from Redis.

``force`` drops the last condition (an operator who knows the Trainer is
gone for good), never the first two.

The record format is duplicated here on purpose (its folder and file names,
its ``objects`` list of keys relative to the folder): the library must not
import the Trainer, and this module reads only what it needs to keep
objects, never to trust them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from aurora_store.errors import AuroraError, ObjectNotFound
from aurora_store.format.limits import MAX_MANIFEST_BYTES
from aurora_store.outage import is_transient
from aurora_store.storage import Store

__all__ = ["CHECKPOINTS_PREFIX", "CheckpointSweep", "checkpoint_orphans", "listed_objects"]

CHECKPOINTS_PREFIX = "checkpoints/"
"""Where the Trainer writes its checkpoints (``workers.trainer.checkpoint.CHECKPOINTS``)."""
RECORD = "checkpoint.json"
"""The record that commits a checkpoint folder."""
_FOLDER = re.compile(r"step-(\d{8})")
MAX_RECORD_OBJECTS = 1 << 20
"""More objects than this in one record is not a record any Trainer writes."""


@dataclass(slots=True)
class CheckpointSweep:
    """What retention does under ``checkpoints/``."""

    remove: list[str] = field(default_factory=list)
    """Objects of dead attempts: listed by no record, old, and their attempt can no longer commit."""
    young: int = 0
    """Unlisted objects kept: their attempt wrote within the grace, or may still commit (its step is the head's or later)."""
    unreadable: list[str] = field(default_factory=list)
    """Folders kept whole: their record could not be read, so what it lists is unknown."""


def listed_objects(data: bytes) -> frozenset[str] | None:
    """The object keys (relative to its folder) a record lists, or None when the bytes are not a record.

    Only the ``objects`` list is looked at: retention needs to know what to
    keep, and reading more would only give a planted record more to say.
    """
    try:
        rec = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    objects = rec.get("objects") if isinstance(rec, dict) else None
    if not isinstance(objects, list) or len(objects) > MAX_RECORD_OBJECTS:
        return None
    keys = [o.get("key") if isinstance(o, dict) else None for o in objects]
    if not all(isinstance(k, str) for k in keys):
        return None
    return frozenset(k for k in keys if isinstance(k, str))


def _attempt(rest: str) -> str:
    """The attempt an object belongs to: the first folder under the checkpoint's (``""`` for a file beside the record)."""
    return rest.split("/", 1)[0] if "/" in rest else ""


def checkpoint_orphans(
    store: Store,
    age: Callable[[str], float | None],
    grace_s: float,
    head: int | None,
    force: bool = False,
) -> CheckpointSweep:
    """Which objects under ``checkpoints/`` no record lists and no attempt in flight may still need (see the module docstring).

    ``age(key)``: seconds since the object was written (None: unknown, kept);
    ``head``: the newest version the store's committed chain holds (None:
    unknown, so only folders that hold a record lose objects, unless
    ``force``). Reads every record before answering; a store error
    propagates (nothing decided on a partial view). Folders not named
    ``step-<8 digits>`` are not a Trainer's and are left alone.
    """
    out = CheckpointSweep()
    by_folder: dict[tuple[str, int], list[str]] = {}
    for key in store.list(CHECKPOINTS_PREFIX):
        parts = key.split("/", 2)
        m = _FOLDER.fullmatch(parts[1]) if len(parts) == 3 else None
        if m is not None:
            by_folder.setdefault((f"{parts[0]}/{parts[1]}", int(m.group(1))), []).append(parts[2])
    for (folder, step), rests in sorted(by_folder.items()):
        committed = RECORD in rests
        listed: frozenset[str] = frozenset()
        if committed:
            try:
                data = store.get_capped(f"{folder}/{RECORD}", MAX_MANIFEST_BYTES, "the limit on a checkpoint record")
            except ObjectNotFound:
                committed = False  # pruned since the listing: what is left goes by the rules below
            except AuroraError as e:
                if is_transient(e):
                    raise  # the store is away: decide nothing on a partial view
                out.unreadable.append(folder)  # too large, or refused: what it lists is unknown
                continue
            else:
                got = listed_objects(data)
                if got is None:
                    out.unreadable.append(folder)
                    continue
                listed = got
        attempts: dict[str, list[str]] = {}
        for rest in rests:
            if rest != RECORD and rest not in listed:
                attempts.setdefault(_attempt(rest), []).append(rest)
        settled = committed or force or (head is not None and head > step)
        for rests_of in attempts.values():
            ages = [age(f"{folder}/{r}") for r in rests_of]
            if settled and all(a is not None and a >= grace_s for a in ages):
                out.remove.extend(f"{folder}/{r}" for r in sorted(rests_of))
            else:
                out.young += len(rests_of)
    return out
