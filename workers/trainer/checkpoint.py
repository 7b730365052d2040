"""Trainer checkpoints: what a restarted Trainer needs to continue the run.

A checkpoint is written to the run root, beside the versions, through
``torch.distributed.checkpoint`` (DCP): every rank writes the chunks it holds
(fp32 master weights, the optimizer's tensors; rank 0 also the reference model
and the torch RNG) as raw tensor bytes in part objects
(:mod:`~workers.trainer.ckpt_store`), and rank 0 writes one JSON record
(everything else: step, epoch, Python RNG, learning rate, scheduler estimates,
the optimizer's hyper-parameters, and the layout of every tensor's chunks).
It can be loaded at any world size. Never pickle: the bucket is shared, and
unpickling what someone else wrote runs their code.

Layout (docs/WORKERS.md "Checkpoint and resume")::

    checkpoints/step-00000012/<attempt>/rank-00000/part-00000.bin
    checkpoints/step-00000012/checkpoint.json

Like a version, a checkpoint is create-only and committed by its record,
written last: the record lists each object's key, size and SHA-256, so a
checkpoint whose record exists is complete, and every byte read back is
checked against it (never against a listing). ``step`` is the step the
Trainer runs next, which is also the number of versions it had published
when it saved.

A checkpoint is bound like a snapshot (FORMAT.md §4.1): its record names the
version it trained from (``version``, equal to ``step``), that version's
``state`` and the ``weights_digest`` of the weights it would publish, and is
signed when the run is. A name in a listing is only a candidate: resume and
pruning use a checkpoint only when that version is committed with that
digest (:func:`bound_checkpoints`), so a copy with other tensors planted as
``step-99999999`` is ignored, never "the newest".
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from aurora_store.coordination.records import epoch_problem
from aurora_store.errors import IntegrityError, ManifestError, ObjectNotFound, StoreError
from aurora_store.format.limits import MAX_MANIFEST_BYTES
from aurora_store.format.manifest import canonical_json, new_attempt_id
from aurora_store.format.signing import Signer, TrustKeys
from aurora_store.lineage.binding import manifest_weights_digest
from aurora_store.storage import Store
from workers.trainer.ckpt_store import PART_BYTES, ObjectEntry, StoreReader, StoreWriter, parse_layout
from workers.trainer.optim_state import load_optimizer, make_optimizer_state, optimizer_tensors

__all__ = [
    "CHECKPOINT_FORMAT",
    "CHECKPOINTS",
    "Binding",
    "Checkpoint",
    "CheckpointRecord",
    "bound_checkpoints",
    "checkpoint_folder",
    "checkpoint_key",
    "checkpoint_shapes",
    "commit_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_into",
    "load_latest_checkpoint",
    "load_optimizer",
    "make_optimizer_state",
    "optimizer_tensors",
    "prune_checkpoints",
    "read_checkpoint",
    "read_checkpoint_record",
    "save_checkpoint",
    "unbound_reason",
]

log = logging.getLogger("aurora.trainer")

CHECKPOINTS = "checkpoints"
"""Folder of the run root that holds the Trainer's checkpoints."""
CHECKPOINT_FORMAT = "aurora-trainer-checkpoint/2"
"""Format 2: DCP chunks in raw part objects (format 1, safetensors shards of one process, is not read)."""
_DIR = re.compile(r"^step-(\d{8})$")
_STATE = re.compile(r"^sha256:[0-9a-f]{64}$")


def _step_dir(step: int) -> str:
    return f"{CHECKPOINTS}/step-{step:08d}"


def checkpoint_folder(step: int) -> str:
    """Folder (under the run root) of the checkpoint taken before ``step``: its record and its objects."""
    return _step_dir(step)


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
    state: str | None = None
    """The ``state`` of version ``step``, the version it trained from (None: an unbound checkpoint)."""
    weights_digest: str | None = None
    """FORMAT.md §4.1 digest of the bf16 weights it would publish: those of version ``step``."""
    run: str | None = None
    """The run it belongs to."""


Binding = Callable[[int], "tuple[str, str] | None"]
"""``binding(version)``: the committed ``(state, weights_digest)`` of ``version``, None when it is
not committed (or its digest is unknown): what a checkpoint must match to count."""


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """A checkpoint's record as read and checked (its signature with the run's keys): what binds it."""

    step: int
    epoch: int
    state: str | None
    weights_digest: str | None
    run: str | None
    key_id: str | None
    """Who signed it (None: unsigned, or read without trust keys)."""

    @property
    def version(self) -> int:
        """The version it trained from (= ``step``)."""
        return self.step


def _aliases(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Names of tensors that share storage with an earlier name (a tied lm_head and embedding): stored once."""
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...], torch.dtype], str] = {}
    for name in sorted(tensors):
        t = tensors[name]
        ident = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(int(d) for d in t.shape), t.dtype)
        if t.numel() and ident in seen:
            aliases[name] = seen[ident]
        else:
            seen[ident] = name
    return aliases


def commit_checkpoint(
    store: Store,
    ck: Checkpoint,
    objects: list[ObjectEntry],
    layout: Mapping[str, Any],
    aliases: Mapping[str, str] | None = None,
    world: int = 1,
    signer: Signer | None = None,
) -> int:
    """Write the record that commits checkpoint ``ck`` (its tensors already written as ``objects``
    laid out as ``layout``), create-only; returns the bytes of the objects and the record.

    ``signer``: the run's key; the record (which holds every object's SHA-256) is signed
    over its canonical JSON, as manifests are (FORMAT.md §4.1).
    """
    record: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "step": ck.step,
        "epoch": ck.epoch,
        "world": world,
        "objects": [{"key": o.key, "bytes": o.bytes, "sha256": o.sha256} for o in objects],
        "tensors": dict(layout),
        "aliases": dict(aliases or {}),
        "meta": ck.meta,
    }
    # The binding (docs/FORMAT.md "Trainer checkpoints"): the version it trained from is the step.
    if ck.state is not None:
        record.update(version=ck.step, state=ck.state)
    if ck.weights_digest is not None:
        record["weights_digest"] = ck.weights_digest
    if ck.run is not None:
        record["run"] = ck.run
    if signer is not None:
        record = signer.sign_json(record)
    body = canonical_json(record)
    store.put(checkpoint_key(ck.step), body, mode="create")
    return sum(o.bytes for o in objects) + len(body)


def save_checkpoint(store: Store, ck: Checkpoint, shard_bytes: int = PART_BYTES, signer: Signer | None = None) -> int:
    """Write ``ck`` from one process, synchronously and create-only (objects first, the record last);
    returns the bytes written. The Trainer writes its own asynchronously and sharded
    (:mod:`~workers.trainer.ckpt_async`); both make the same kind of checkpoint."""
    import torch.distributed.checkpoint as dcp

    aliases = _aliases(ck.tensors)
    state = {n: t.detach() for n, t in ck.tensors.items() if n not in aliases}
    writer = StoreWriter(store, _step_dir(ck.step), new_attempt_id(), 0, shard_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=writer, no_dist=True)
    assert writer.layout is not None
    return commit_checkpoint(store, ck, writer.upload(), writer.layout, aliases, 1, signer)


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


def _record(store: Store, step: int, trust: TrustKeys | None = None) -> tuple[dict[str, Any], CheckpointRecord]:
    """The record of the checkpoint before ``step``, parsed and checked; with ``trust``, its signature too."""
    where = store.where(checkpoint_key(step))
    try:
        rec = json.loads(store.get_capped(checkpoint_key(step), MAX_MANIFEST_BYTES, "the limit on a checkpoint record"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(where, f"not JSON: {e}") from None
    if not isinstance(rec, dict) or rec.get("format") != CHECKPOINT_FORMAT:
        raise ManifestError(where, f"not a {CHECKPOINT_FORMAT} record")
    if rec.get("step") != step or not isinstance(rec.get("objects"), list) or not isinstance(rec.get("tensors"), dict):
        raise ManifestError(where, "step, objects or tensors missing or wrong")
    why = epoch_problem(rec.get("epoch"))
    if why is not None:
        raise ManifestError(where, why)
    if not isinstance(rec.get("meta"), dict):
        raise ManifestError(where, "meta must be an object")
    state, run = rec.get("state"), rec.get("run")
    if "version" in rec and (rec["version"] != step or isinstance(rec["version"], bool)):
        raise ManifestError(
            where, f"version {str(rec['version'])[:40]} is not the step {step} (a checkpoint binds the version it trained from)"
        )
    if state is not None and (not isinstance(state, str) or not _STATE.fullmatch(state) or "version" not in rec):
        raise ManifestError(where, "state is not 'sha256:' + 64 hex digits beside its version")
    if run is not None and not isinstance(run, str):
        raise ManifestError(where, "run is not a string")
    digest = manifest_weights_digest(rec, where)
    key_id = trust.check_json(rec, where, "checkpoint", step) if trust is not None else None
    return rec, CheckpointRecord(step, rec["epoch"], state, digest, run, key_id)


def read_checkpoint_record(store: Store, step: int, trust: TrustKeys | None = None) -> CheckpointRecord:
    """What binds the checkpoint before ``step`` (its record alone: no object is read).

    ``trust``: the run's keys; a record unsigned, signed by another key or
    altered is refused (:class:`~aurora_store.errors.SignatureError`).
    """
    return _record(store, step, trust)[1]


def read_checkpoint(store: Store, step: int, trust: TrustKeys | None = None) -> tuple[dict[str, Any], CheckpointRecord]:
    """The checked record of the checkpoint before ``step`` (as :func:`read_checkpoint_record`) and its
    whole body: what :func:`load_into` and :func:`checkpoint_shapes` read the objects with."""
    rec, head = _record(store, step, trust)
    _layout(store, step, rec)  # its layout checked before anyone reads an object
    return rec, head


def _layout(store: Store, step: int, rec: Mapping[str, Any]) -> tuple[StoreReader, dict[str, str]]:
    """A reader of the checkpoint's objects as its (checked) record lays them out, and its aliases."""
    where = store.where(checkpoint_key(step))
    objects: dict[str, ObjectEntry] = {}
    for obj in rec["objects"]:
        if not (isinstance(obj, dict) and isinstance(obj.get("key"), str) and isinstance(obj.get("sha256"), str)):
            raise ManifestError(where, f"bad object entry {obj!r:.80}")
        key = obj["key"]
        if key.startswith("/") or ".." in key.split("/"):
            raise ManifestError(where, f"object key {key!r:.80} leaves the checkpoint")
        size = obj.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ManifestError(where, f"object {key!r:.80} has no valid size")
        objects[key] = ObjectEntry(key, size, obj["sha256"])
    try:
        metadata, storage = parse_layout(rec.get("tensors"), objects)
    except ValueError as e:
        raise ManifestError(where, str(e)) from None
    aliases = rec.get("aliases") or {}
    if not isinstance(aliases, dict) or not all(isinstance(t, str) and t in metadata.state_dict_metadata for t in aliases.values()):
        raise ManifestError(where, "aliases must name tensors the checkpoint holds")
    return StoreReader(store, _step_dir(step), metadata, storage, objects), aliases


def checkpoint_shapes(store: Store, step: int, rec: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor a checked record holds (aliases included)."""
    reader, aliases = _layout(store, step, rec)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, md in reader.metadata.state_dict_metadata.items():
        assert isinstance(md, TensorStorageMetadata)
        out[name] = (tuple(md.size), md.properties.dtype)
    for name, target in aliases.items():
        out[name] = out[target]
    return out


def load_into(store: Store, step: int, rec: Mapping[str, Any], state: Mapping[str, torch.Tensor], sharded: bool = False) -> None:
    """Fill ``state`` (name -> tensor, plain or a DTensor shard) in place from the checkpoint before
    ``step`` whose checked record is ``rec``: each rank reads only the objects it needs, capped at
    their recorded sizes and checked against their SHA-256, whatever the world size that wrote them.

    ``sharded``: every rank of the process group calls this together (one DCP load).
    Aliases are filled from the tensor they name. Raises the store's error, or
    :class:`~aurora_store.errors.ManifestError` (a tensor missing or of another shape).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, aliases = _layout(store, step, rec)
    wanted = {aliases.get(n, n): t for n, t in state.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
            dcp.load(dict(wanted), storage_reader=reader, no_dist=not sharded)
    except CheckpointException as e:
        raise _cause(store, step, e) from None
    except (RuntimeError, ValueError) as e:  # DCP's planner: a tensor the checkpoint lacks, or of another size
        raise ManifestError(store.where(checkpoint_key(step)), f"does not fit: {str(e)[:200]}") from None
    for name, target in aliases.items():
        if name in state and state[name] is not wanted.get(target):
            state[name].detach().copy_(wanted[target].detach())


def _cause(store: Store, step: int, e: BaseException) -> Exception:
    """The first rank's own error out of DCP's :class:`CheckpointException` (an Aurora error as it is)."""
    failures = getattr(e, "failures", {}) or {}
    for _, failure in sorted(failures.items()):
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, (IntegrityError, ManifestError, ObjectNotFound, StoreError)):
            return inner
        return ManifestError(store.where(checkpoint_key(step)), f"does not fit: {str(inner)[:200]}")
    return ManifestError(store.where(checkpoint_key(step)), f"unreadable: {str(e)[:200]}")


def load_checkpoint(store: Store, step: int, trust: TrustKeys | None = None) -> Checkpoint:
    """Read and verify the whole checkpoint taken before ``step`` in this process (its record's
    signature with ``trust``, then the size and SHA-256 of every object), its tensors unsharded."""
    rec, head = _record(store, step, trust)
    shapes = checkpoint_shapes(store, step, rec)
    aliases = rec.get("aliases") or {}
    tensors = {n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in shapes.items() if n not in aliases}
    load_into(store, step, rec, tensors)
    for name, target in aliases.items():
        tensors[name] = tensors[target]
    return Checkpoint(
        step=step,
        epoch=head.epoch,
        tensors=tensors,
        meta=dict(rec["meta"]),
        state=head.state,
        weights_digest=head.weights_digest,
        run=head.run,
    )


def unbound_reason(rec: CheckpointRecord | Checkpoint, binding: Binding, run: str | None = None) -> str | None:
    """Why a checkpoint must not be used (resumed from, or counted by pruning), or None when it may.

    It must name the version it trained from, that version's state and the
    digest of its weights, and match what ``binding`` says was committed
    there; ``run``: the run it must belong to.
    """
    if run is not None and rec.run is not None and rec.run != run:
        return f"it belongs to run {rec.run[:80]!r}, not {run!r}"
    if rec.state is None or rec.weights_digest is None:
        return "its record names no version, state and weights_digest (not written by a Trainer of this release)"
    committed = binding(rec.step)
    if committed is None:
        return f"version {rec.step} is not committed (nor its weights digest known)"
    state, digest = committed
    if rec.state != state:
        return f"its state {rec.state[:19]}… is not the committed state {state[:19]}… of version {rec.step}"
    if rec.weights_digest != digest:
        return f"its weights_digest {rec.weights_digest[:19]}… is not the committed {digest[:19]}… of version {rec.step}"
    return None


_named: set[tuple[str, int]] = set()
"""Checkpoints already named as ignored (store URL, step): each is worth one line, not one per round."""


def _ignore(store: Store, step: int, why: str) -> None:
    if (store.url, step) not in _named:
        _named.add((store.url, step))
        log.warning("%s: checkpoint ignored: %s", store.where(checkpoint_key(step)), why)


def bound_checkpoints(store: Store, binding: Binding, trust: TrustKeys | None = None, run: str | None = None) -> list[CheckpointRecord]:
    """The checkpoints bound to a committed version, newest binding first (version, then step).

    A listed name is only a candidate: each record is read (not its shards),
    its signature checked with ``trust``, and matched with ``binding``; one
    that does not qualify is left out and named once in the log.
    """
    out = []
    for step in list_checkpoints(store):
        try:
            rec = read_checkpoint_record(store, step, trust)
        except (IntegrityError, ManifestError, ObjectNotFound) as e:
            _ignore(store, step, str(e))
            continue
        why = unbound_reason(rec, binding, run)
        if why is not None:
            _ignore(store, step, why)
            continue
        out.append(rec)
    return sorted(out, key=lambda r: (r.version, r.step), reverse=True)


def load_latest_checkpoint(
    store: Store,
    binding: Binding,
    trust: TrustKeys | None = None,
    run: str | None = None,
    accept: Callable[[Checkpoint], str | None] | None = None,
) -> Checkpoint | None:
    """The newest bound checkpoint (:func:`bound_checkpoints`) that reads back whole and that
    ``accept`` takes (it returns why not, e.g. its tensors are not the committed weights);
    older ones are tried after one that fails."""
    for rec in bound_checkpoints(store, binding, trust, run):
        try:
            ck = load_checkpoint(store, rec.step, trust)
            why = unbound_reason(ck, binding, run) or (accept(ck) if accept is not None else None)
        except (IntegrityError, ManifestError, ObjectNotFound) as e:
            why = str(e)
        if why is None:
            return ck
        log.warning("%s is unusable (%s); trying an older one", store.where(checkpoint_key(rec.step)), why)
    return None


def prune_checkpoints(store: Store, keep: int, binding: Binding, trust: TrustKeys | None = None, run: str | None = None) -> list[int]:
    """Delete all but the newest ``keep`` bound checkpoints, ordered by their binding, never by a name.

    A checkpoint that is not bound is neither kept as "newest" nor counted nor
    deleted: it is named once (someone else's objects are not this Trainer's to
    remove). The record goes first, so a half-deleted checkpoint is never "complete".
    """
    bound = bound_checkpoints(store, binding, trust, run)
    gone = sorted(r.step for r in bound[keep:]) if keep > 0 else []
    for step in gone:
        prefix = _step_dir(step)
        keys = store.list(prefix)
        store.delete(checkpoint_key(step))
        for key in keys:
            if key != checkpoint_key(step):
                store.delete(key)
    return gone
