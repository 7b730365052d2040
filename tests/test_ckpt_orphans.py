"""Retention of Trainer checkpoint objects no record lists (issue 25 leftovers), on a real S3 server.

What must hold: the parts a Trainer killed mid-upload leaves are removed once
their attempt stopped writing a grace ago and can no longer commit (its
folder holds another attempt's record, or a later version is committed);
a committed checkpoint's objects are never touched, nor an attempt that may
still commit (its step is the head), nor a folder whose record cannot be
read; and the committed checkpoint still loads afterwards, bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from trainer_fixtures import FakeTrainer

from aurora_store.lineage.ckpt_orphans import checkpoint_orphans, listed_objects
from aurora_store.lineage.gc import retain
from aurora_store.storage import Store
from workers.trainer.checkpoint import Checkpoint, checkpoint_folder, checkpoint_key, load_latest_checkpoint, save_checkpoint
from workers.trainer.ckpt_store import StoreWriter

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_torch_thread")]

HEAD = 4


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.w": torch.randn(8, 8, generator=g), "opt.0.exp_avg": torch.randn(8, 8, generator=g)}


def _killed_attempt(store: Store, step: int, attempt: str) -> set[str]:
    """What a Trainer killed after uploading its parts, before its record, leaves in the checkpoint before ``step``."""
    import torch.distributed.checkpoint as dcp

    writer = StoreWriter(store, checkpoint_folder(step), attempt, 0, part_bytes=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(_tensors(step), storage_writer=writer, no_dist=True)
    return {f"{checkpoint_folder(step)}/{o.key}" for o in writer.upload()}


def _committed(store: Store, run: FakeTrainer, step: int) -> set[str]:
    ck = Checkpoint(step=step, epoch=1, tensors=_tensors(step), meta={}, state=run.states[step], weights_digest=run.digest(step), run="t")
    save_checkpoint(store, ck, shard_bytes=128)
    return {k for k in store.list(checkpoint_folder(step))}


def test_gc_removes_the_parts_of_killed_attempts_and_nothing_a_checkpoint_needs(s3_store: Store) -> None:
    run = FakeTrainer(s3_store)
    run.steps(HEAD)
    committed = _committed(s3_store, run, 2)
    dead_beside = _killed_attempt(s3_store, 2, "dead0")  # a retry's leftovers beside the committed record
    dead_alone = _killed_attempt(s3_store, 3, "dead1")  # version 4 is committed: step 3's Trainer moved on
    in_flight = _killed_attempt(s3_store, HEAD, "busy")  # the head's: its record may land after the next batch
    s3_store.put(checkpoint_key(1), b"{not json")
    unreadable = {checkpoint_key(1), *_killed_attempt(s3_store, 1, "x")}
    s3_store.put("checkpoints/notes.txt", b"not a Trainer's")
    assert len(dead_beside) > 1 and len(dead_alone) > 1  # several parts each

    young = retain(s3_store, 8, grace_s=3600, dry_run=True)
    assert young.checkpoint_orphans == [] and young.young_checkpoint_objects == len(dead_beside | dead_alone | in_flight)

    plan = retain(s3_store, 8, grace_s=0)
    assert set(plan.checkpoint_orphans) == dead_beside | dead_alone
    assert plan.young_checkpoint_objects == len(in_flight) and plan.unreadable_checkpoints == [checkpoint_folder(1)]
    left = set(s3_store.list("checkpoints/"))
    assert left == committed | in_flight | unreadable | {"checkpoints/notes.txt"}

    # Resume reads the committed checkpoint back whole, every object checked against its record.
    binding = {v: (run.states[v], run.digest(v)) for v in run.states}
    ck = load_latest_checkpoint(s3_store, binding.get)
    assert ck is not None and ck.step == 2
    assert all(torch.equal(ck.tensors[n], t) for n, t in _tensors(2).items())

    # --force: an attempt that could still commit goes too; a committed record's objects never do.
    forced = retain(s3_store, 8, grace_s=0, force=True)
    assert set(forced.checkpoint_orphans) == in_flight
    assert set(s3_store.list("checkpoints/")) == committed | unreadable | {"checkpoints/notes.txt"}


def test_an_attempt_that_wrote_within_the_grace_is_kept_whole(s3_store: Store) -> None:
    run = FakeTrainer(s3_store)
    run.steps(3)
    parts = sorted(_killed_attempt(s3_store, 1, "slow"))
    ages = {k: 10_000.0 for k in parts}
    ages[parts[-1]] = 5.0  # its last part was written a moment ago: the upload is still going
    sweep = checkpoint_orphans(s3_store, ages.get, 3600, head=3)
    assert sweep.remove == [] and sweep.young == len(parts)
    ages[parts[-1]] = 10_000.0
    assert sorted(checkpoint_orphans(s3_store, ages.get, 3600, head=3).remove) == parts
    # No committed chain to judge by: only --force removes a folder without a record.
    assert checkpoint_orphans(s3_store, ages.get, 3600, head=None).remove == []


@pytest.mark.parametrize(
    "record",
    [b"[]", b'{"objects": 3}', b'{"objects": [{"key": 1}]}', b'{"objects": [' + b"[" * 100_000 + b"]}", b"\xff\xfe"],
)
def test_a_record_that_is_not_one_lists_nothing(record: Any) -> None:
    assert listed_objects(record) is None


def test_a_record_lists_its_objects_keys() -> None:
    assert listed_objects(b'{"objects": [{"key": "a/rank-00000/part-00000.bin", "bytes": 1}]}') == {"a/rank-00000/part-00000.bin"}
