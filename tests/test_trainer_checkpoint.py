"""Trainer checkpoints (workers.trainer.checkpoint): safetensors + JSON, create-only, verified
on read, tied tensors stored once, damaged ones skipped, old ones pruned by their binding to a
committed version (tests/test_checkpoint_binding.py attacks that binding). File store only."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from aurora_store.errors import IntegrityError, VersionConflict
from aurora_store.storage import open_store
from workers.trainer.checkpoint import (
    Checkpoint,
    checkpoint_key,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    load_optimizer,
    optimizer_tensors,
    prune_checkpoints,
    save_checkpoint,
)


def _state(v: int) -> str:
    return "sha256:" + hashlib.sha256(f"state {v}".encode()).hexdigest()


def _digest(v: int) -> str:
    return "sha256:" + hashlib.sha256(f"weights {v}".encode()).hexdigest()


def _committed(v: int) -> tuple[str, str] | None:
    """Every version up to 100 is committed, with its state and digest."""
    return (_state(v), _digest(v)) if v <= 100 else None


def _ck(step: int) -> Checkpoint:
    emb = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
    return Checkpoint(
        step=step,
        epoch=1,
        tensors={"model.embed": emb, "model.head": emb, "rng": torch.get_rng_state()},
        meta={"tau": {"a": 1.5}},
        state=_state(step),
        weights_digest=_digest(step),
        run="r",
    )


def test_round_trip_keeps_aliases_and_meta(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    save_checkpoint(store, _ck(4), shard_bytes=64)  # several shards
    got = load_checkpoint(store, 4)
    assert got.step == 4 and got.epoch == 1 and got.meta == {"tau": {"a": 1.5}}
    assert (got.state, got.weights_digest, got.run) == (_state(4), _digest(4), "r")
    assert torch.equal(got.tensors["model.embed"], _ck(4).tensors["model.embed"])
    assert got.tensors["model.head"] is got.tensors["model.embed"]  # stored once, shared again
    rec = json.loads(store.get(checkpoint_key(4)))
    assert rec["aliases"] == {"model.head": "model.embed"} and len(rec["objects"]) >= 2
    with pytest.raises(VersionConflict):  # create-only: a different checkpoint at the same step is refused
        save_checkpoint(store, Checkpoint(step=4, epoch=2, tensors={"x": torch.zeros(1)}, meta={}))


def test_a_damaged_newest_checkpoint_falls_back_to_an_older_one(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    for s in (2, 4):
        save_checkpoint(store, _ck(s))
    rec = json.loads(store.get(checkpoint_key(4)))
    shard = tmp_path / "checkpoints" / "step-00000004" / rec["objects"][0]["key"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        load_checkpoint(store, 4)
    assert load_latest_checkpoint(store, _committed).step == 2  # type: ignore[union-attr]
    # A checkpoint whose record was never written (the Trainer died) does not count.
    store.put("checkpoints/step-00000006/abc/shard-00000.safetensors", b"partial")
    assert list_checkpoints(store) == [2, 4]


def test_prune_keeps_the_newest(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    for s in (0, 2, 4, 6):
        save_checkpoint(store, _ck(s))
    assert prune_checkpoints(store, 2, _committed) == [0, 2]
    assert list_checkpoints(store) == [4, 6]
    assert not store.list("checkpoints/step-00000000")


def test_optimizer_state_round_trips() -> None:
    w = torch.nn.Parameter(torch.randn(3, 3))
    opt = torch.optim.AdamW([w], lr=0.01)
    for _ in range(3):
        opt.zero_grad()
        (w**2).sum().backward()
        opt.step()
    tensors, meta = optimizer_tensors(opt)
    meta = json.loads(json.dumps(meta))  # the non-tensor part is plain JSON, as stored
    w2 = torch.nn.Parameter(w.detach().clone())
    opt2 = torch.optim.AdamW([w2], lr=0.5)
    load_optimizer(opt2, {k: v.clone() for k, v in tensors.items()}, meta)  # as read back: new tensors
    for o in (opt, opt2):
        o.zero_grad()
    (w**2).sum().backward()
    (w2**2).sum().backward()
    opt.step()
    opt2.step()
    assert torch.equal(w, w2)
