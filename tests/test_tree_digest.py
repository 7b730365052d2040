"""FORMAT.md §4.1's tree digest: computed as the text says, accepted by readers, binding snapshots."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from aurora_store.apply.sink import TREE_PREFIX, digest_as, tree_weights_digest, weights_digest
from aurora_store.codec.extract import bits_view, extract, fuse_weights, plan_of, spec_of
from aurora_store.errors import IntegrityError
from aurora_store.format.manifest import manifest_key
from aurora_store.lineage.fetch import fetch_snapshot, read_manifest
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.lineage.trusted import committed_versions
from aurora_store.storage import LocalStore
from aurora_tools.synthetic.shapes import QWEN3_TINY, make_weights

CFG = PublishConfig(streams=2, segment_bytes=16 << 10)


def _by_the_text(fused: dict[str, torch.Tensor]) -> str:
    """The tree digest written from FORMAT.md §4.1 alone, over fused tensors."""
    top = hashlib.sha256()
    for name in sorted(fused):
        t = fused[name].contiguous()
        raw = bits_view(t).numpy().astype(bits_view(t).numpy().dtype.newbyteorder("<")).tobytes()
        leaf = hashlib.sha256(raw).hexdigest()
        shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
        top.update(f"{name}|{shape}|{spec_of(t, name).dtype}|{leaf}\n".encode())
    return "tree-sha256:" + top.hexdigest()


def test_tree_digest_is_the_formats_for_fused_and_split_holders_and_any_width() -> None:
    w = make_weights(QWEN3_TINY, seed=3)
    plan = plan_of(w, tied=False)
    fused = fuse_weights(w, plan)
    want = _by_the_text(fused)
    assert tree_weights_digest(w, plan) == want  # split holder (q, k, v apart), fused view
    assert tree_weights_digest(fused) == want
    assert tree_weights_digest(w, plan, workers=1) == tree_weights_digest(w, plan, workers=4) == want
    assert digest_as(want, w, plan) == want and digest_as("sha256:" + "0" * 64, w, plan) == weights_digest(w, plan)
    one = dict(w)
    name = next(iter(one))
    one[name] = one[name].clone()
    one[name].view(-1)[0] += 1
    assert tree_weights_digest(one, plan) != want


def test_readers_accept_a_tree_digest_and_refuse_a_wrong_one(tmp_path: Path) -> None:
    store = LocalStore(f"file://{tmp_path / 'run'}")
    w0 = make_weights(QWEN3_TINY, seed=0)
    plan = plan_of(w0, tied=False)
    s0 = publish_snapshot(store, "t", 0, fuse_weights(w0, plan), None, CFG, tree_digest=True)
    assert str(s0.extra["weights_digest"]).startswith(TREE_PREFIX)
    _, tensors = fetch_snapshot(store, 0)  # the reader computes the form the manifest names
    assert tree_weights_digest(tensors) == s0.extra["weights_digest"]
    # A delta and a snapshot at v1 carrying the identical tree string: the snapshot is bound.
    w1 = {n: t.clone() for n, t in w0.items()}
    for t in list(w1.values())[:3]:
        t.view(-1)[:7] += 1
    d1 = publish_delta(store, "t", 1, extract(plan, w0, w1), s0.state, CFG, weights_digest=tree_weights_digest(w1, plan))
    publish_snapshot(store, "t", 1, fuse_weights(w1, plan), d1.state, CFG, tree_digest=True)
    assert committed_versions(store).index.snapshots == frozenset({0, 1})
    got, state = materialize(store, 1)
    assert state == d1.state and tree_weights_digest(got) == d1.extra["weights_digest"]
    # A wrong tree digest (well formed) is refused once the shards are read.
    key = manifest_key("snapshot", 0)
    d = json.loads(store.get(key))
    d["weights_digest"] = TREE_PREFIX + "ab" * 32
    store.put(key, json.dumps(d).encode(), mode="overwrite")
    assert read_manifest(store, "snapshot", 0).extra["weights_digest"] == TREE_PREFIX + "ab" * 32
    with pytest.raises(IntegrityError, match="digest"):
        fetch_snapshot(store, 0)


def test_little_endian_bytes_even_for_bf16() -> None:
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    raw = bits_view(t).numpy().astype(np.dtype("<u2")).tobytes()
    leaf = hashlib.sha256(raw).hexdigest()
    want = "tree-sha256:" + hashlib.sha256(f"x|[2]|bfloat16|{leaf}\n".encode()).hexdigest()
    assert tree_weights_digest({"x": t}) == want
