"""Trainer checkpoints: what a restarted Trainer needs to continue the run.

A checkpoint is written to the run root, beside the versions, as
safetensors shards (tensors: fp32 master weights, the optimizer's tensors,
the reference model, the torch RNG) plus one JSON record (everything else:
step, epoch, Python RNG, learning rate, scheduler estimates, the optimizer's
hyper-parameters). Never pickle: the bucket is shared, and unpickling what
someone else wrote runs their code.

Layout (docs/WORKERS.md "Checkpoint and resume")::

    checkpoints/step-00000012/<attempt>/shard-00000.safetensors
    checkpoints/step-00000012/checkpoint.json

Like a version, a checkpoint is create-only and committed by its record,
written last: the record lists each shard's key, size and SHA-256, so a
checkpoint whose record exists is complete, and every byte read back is
checked against it. ``step`` is the step the Trainer runs next, which is
also the number of versions it had published when it saved.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from aurora_store.errors import IntegrityError, ManifestError, ObjectNotFound
from aurora_store.format.manifest import canonical_json, new_attempt_id
from aurora_store.storage import Store

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINTS",
    "Checkpoint",
    "checkpoint_key",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_checkpoint",
    "load_optimizer",
    "optimizer_tensors",
    "prune_checkpoints",
    "save_checkpoint",
]

log = logging.getLogger("aurora.trainer")

CHECKPOINTS = "checkpoints"
"""Folder of the run root that holds the Trainer's checkpoints."""
CHECKPOINT_FORMAT = "aurora-trainer-checkpoint/1"
_DIR = re.compile(r"^step-(\d{8})$")
_SHARD_BYTES = 1 << 30


def _step_dir(step: int) -> str:
    return f"{CHECKPOINTS}/step-{step:08d}"


def checkpoint_key(step: int) -> str:
    """Key of the record that commits the checkpoint taken before ``step``."""
    return f"{_step_dir(step)}/checkpoint.json"


@dataclass(slots=True)
class Checkpoint:
    """One Trainer checkpoint: tensors by name, and plain JSON data."""

    step: int
    """The step the Trainer runs next (= versions published when it was saved)."""
    epoch: int
    """The Trainer epoch that saved it."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(store: Store, ck: Checkpoint, shard_bytes: int = _SHARD_BYTES) -> int:
    """Write ``ck`` create-only (shards first, the record last); returns the bytes written."""
    from safetensors.torch import save

    attempt = new_attempt_id()
    # Tensors that share storage (a tied lm_head and embedding) are stored once;
    # the record names the others as aliases, restored on load.
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    for name in sorted(ck.tensors):
        t = ck.tensors[name]
        ident = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(int(d) for d in t.shape), t.dtype)
        if t.numel() and ident in seen:
            aliases[name] = seen[ident]
        else:
            seen[ident] = name
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(n for n in ck.tensors if n not in aliases):
        t = ck.tensors[name].detach().cpu().contiguous()
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    objects = []
    total = 0
    for i, shard in enumerate(shards):
        data = save(shard, metadata={"aurora.kind": "trainer-checkpoint", "aurora.step": str(ck.step)})
        key = f"{attempt}/shard-{i:05d}.safetensors"
        store.put(f"{_step_dir(ck.step)}/{key}", data, mode="create")
        objects.append({"key": key, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
        total += len(data)
    record = {"format": CHECKPOINT_FORMAT, "step": ck.step, "epoch": ck.epoch, "objects": objects, "aliases": aliases, "meta": ck.meta}
    body = canonical_json(record)
    store.put(checkpoint_key(ck.step), body, mode="create")
    return total + len(body)


def list_checkpoints(store: Store) -> list[int]:
    """Steps of the committed checkpoints (their record exists), oldest first."""
    out = []
    for key in store.list(CHECKPOINTS):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "checkpoint.json":
            m = _DIR.match(parts[1])
            if m:
                out.append(int(m.group(1)))
    return sorted(out)


def _record(store: Store, step: int) -> dict[str, Any]:
    where = store.where(checkpoint_key(step))
    try:
        rec = json.loads(store.get(checkpoint_key(step)))
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(where, f"not JSON: {e}") from None
    if not isinstance(rec, dict) or rec.get("format") != CHECKPOINT_FORMAT:
        raise ManifestError(where, f"not a {CHECKPOINT_FORMAT} record")
    if rec.get("step") != step or not isinstance(rec.get("epoch"), int) or not isinstance(rec.get("objects"), list):
        raise ManifestError(where, "step, epoch or objects missing or wrong")
    if not isinstance(rec.get("meta"), dict):
        raise ManifestError(where, "meta must be an object")
    return rec


def load_checkpoint(store: Store, step: int) -> Checkpoint:
    """Read and verify the checkpoint taken before ``step`` (sizes and SHA-256 of every shard)."""
    from safetensors.torch import load

    rec = _record(store, step)
    tensors: dict[str, torch.Tensor] = {}
    for obj in rec["objects"]:
        if not (isinstance(obj, dict) and isinstance(obj.get("key"), str) and isinstance(obj.get("sha256"), str)):
            raise ManifestError(store.where(checkpoint_key(step)), f"bad object entry {obj!r:.80}")
        key = obj["key"]
        if key.startswith("/") or ".." in key.split("/"):
            raise ManifestError(store.where(checkpoint_key(step)), f"object key {key!r:.80} leaves the checkpoint")
        data = store.get(f"{_step_dir(step)}/{key}")
        if len(data) != obj.get("bytes") or hashlib.sha256(data).hexdigest() != obj["sha256"]:
            raise IntegrityError(f"{store.where(f'{_step_dir(step)}/{key}')}: size or SHA-256 differs from the checkpoint record")
        try:
            tensors.update(load(data))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ManifestError(store.where(f"{_step_dir(step)}/{key}"), f"unreadable safetensors: {e}") from None
    aliases = rec.get("aliases") or {}
    if not isinstance(aliases, dict):
        raise ManifestError(store.where(checkpoint_key(step)), "aliases must be an object")
    for name, target in aliases.items():
        if target not in tensors:
            raise ManifestError(store.where(checkpoint_key(step)), f"alias {name!r:.80} names a tensor the checkpoint lacks")
        tensors[name] = tensors[target]
    return Checkpoint(step=step, epoch=int(rec["epoch"]), tensors=tensors, meta=dict(rec["meta"]))


def load_latest_checkpoint(store: Store) -> Checkpoint | None:
    """The newest checkpoint that reads back whole; older ones are tried if the newest is damaged."""
    for step in reversed(list_checkpoints(store)):
        try:
            return load_checkpoint(store, step)
        except (IntegrityError, ManifestError, ObjectNotFound) as e:
            log.warning("checkpoint before step %d is unusable (%s); trying an older one", step, e)
    return None


def prune_checkpoints(store: Store, keep: int) -> list[int]:
    """Delete all but the newest ``keep`` checkpoints (record first, so a half-deleted one is never "complete")."""
    steps = list_checkpoints(store)
    gone = steps[:-keep] if keep > 0 else []
    for step in gone:
        prefix = _step_dir(step)
        keys = store.list(prefix)
        store.delete(checkpoint_key(step))
        for key in keys:
            if key != checkpoint_key(step):
                store.delete(key)
    return gone


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's state as (tensors, JSON): per-parameter tensors by ``opt.<i>.<name>``,
    non-tensor values and the parameter groups in the JSON part."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt.{idx}.{k}"] = v
            else:
                scalars.setdefault(str(idx), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Restore what :func:`optimizer_tensors` saved."""
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        if name.startswith("opt."):
            _, idx, k = name.split(".", 2)
            state.setdefault(int(idx), {})[k] = t
    for idx, kv in (meta.get("scalars") or {}).items():
        state.setdefault(int(idx), {}).update(kv)
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
