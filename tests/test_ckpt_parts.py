"""A checkpoint's tensors larger than a part are written as row pieces (issue 25's memory target), on a real S3 server.

What must hold: no object of a checkpoint is larger than a part when every
row fits in one (the upload's copies stay bounded by the part size while the
next steps train), a large tensor's chunk is listed as several chunks of
whole rows that cover it, and the checkpoint loads back bit for bit; a
tensor whose single row is larger than a part is one piece of its own.
"""

from __future__ import annotations

import json

import pytest
import torch

from aurora_store.storage import Store
from workers.trainer.checkpoint import Checkpoint, checkpoint_key, load_checkpoint, save_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("one_torch_thread")]

PART = 4096


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "model.embed": torch.randn(100, 24, generator=g),  # 9,600 bytes: three pieces of 42 rows at most
        "model.norm": torch.randn(24, generator=g),
        "opt.0.step": torch.tensor(3.0),
        "model.wide": torch.randn(2, 2048, generator=g),  # a row of 8,192 bytes: one piece per row
        "model.bf16": torch.randn(300, 5, generator=g).to(torch.bfloat16),
    }


def test_large_tensors_are_row_pieces_no_larger_than_a_part_and_load_bit_for_bit(s3_store: Store) -> None:
    tensors = _tensors()
    save_checkpoint(s3_store, Checkpoint(step=2, epoch=1, tensors=tensors, meta={}), shard_bytes=PART)
    rec = json.loads(s3_store.get(checkpoint_key(2)))
    layout = rec["tensors"]
    sizes = {o["key"]: o["bytes"] for o in rec["objects"]}
    chunks = layout["model.embed"]["chunks"]
    assert [c["offsets"] for c in chunks] == [[0, 0], [42, 0], [84, 0]]
    assert [c["sizes"] for c in chunks] == [[42, 24], [42, 24], [16, 24]]
    assert [c["sizes"] for c in layout["model.wide"]["chunks"]] == [[1, 2048], [1, 2048]]
    assert len(layout["model.norm"]["chunks"]) == 1 and len(layout["opt.0.step"]["chunks"]) == 1
    assert max(sizes.values()) <= 2048 * 4
    assert all(n <= PART for k, n in sizes.items() if not any(c["object"] == k for c in layout["model.wide"]["chunks"]))
    got = load_checkpoint(s3_store, 2)
    assert set(got.tensors) == set(tensors)
    for name, t in tensors.items():
        assert got.tensors[name].dtype == t.dtype and got.tensors[name].shape == t.shape, name
        assert torch.equal(got.tensors[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
