"""Snapshot shards are built straight from the weights: the bytes safetensors writes, without a fused copy."""

from __future__ import annotations

import gc
import json
import os
import struct

import pytest
import torch
from safetensors.torch import load, save

from aurora_store.codec.extract import fuse_weights
from aurora_store.codec.fusion import FusionPlan
from aurora_store.lineage.publish import PublishConfig, publish_snapshot
from aurora_store.lineage.shards import shard_file, shard_groups, snapshot_tensors
from aurora_store.storage import open_store

META = {"aurora.format": "1", "aurora.kind": "snapshot", "aurora.version": "7"}


def _weights(seed: int = 0, hidden: int = 16, layers: int = 2, vocab: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    w = {"model.embed_tokens.weight": r(vocab, hidden), "model.norm.weight": r(hidden, dtype=torch.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q", "k", "v"):
            w[p + f"self_attn.{n}_proj.weight"] = r(hidden, hidden)
        w[p + "self_attn.o_proj.weight"] = r(hidden, hidden)
        w[p + "mlp.gate_proj.weight"] = r(2 * hidden, hidden)
        w[p + "mlp.up_proj.weight"] = r(2 * hidden, hidden)
        w[p + "mlp.down_proj.weight"] = r(hidden, 2 * hidden)
        w[p + "input_layernorm.weight"] = r(hidden, dtype=torch.float16)
        w[p + "input_layernorm.bias"] = r(0, dtype=torch.float16)
    w["lm_head.weight"] = w["model.embed_tokens.weight"]
    return w


def _plan(w: dict[str, torch.Tensor]) -> FusionPlan:
    from aurora_store.codec.extract import spec_of

    return FusionPlan.from_specs({n: spec_of(t, n) for n, t in w.items()}, tied_lm_head=True)


def _in_our_metadata_order(data: bytes, meta: dict[str, str]) -> bytes:
    """safetensors' file with its ``__metadata__`` members in ``meta``'s order (safetensors' own order
    varies from call to call); everything else as it wrote it."""
    n = struct.unpack("<Q", data[:8])[0]
    text = data[8 : 8 + n]
    head = json.loads(text)
    assert head["__metadata__"] == meta
    head["__metadata__"] = dict(meta)
    again = json.dumps(head, separators=(",", ":")).encode()
    again += b" " * (n - len(again))
    assert len(again) == n
    return data[:8] + again + data[8 + n :]


def test_a_shard_file_is_the_file_safetensors_writes_byte_for_byte() -> None:
    w = _weights()
    plan = _plan(w)
    fused = fuse_weights(w, plan)
    ours = shard_file(snapshot_tensors(w, plan), META)
    assert ours == _in_our_metadata_order(save(fused, metadata=META), META)
    # With one metadata member safetensors' order cannot vary: no normalising at all.
    one = {"aurora.version": "7"}
    assert shard_file(snapshot_tensors(fused), one) == save(fused, metadata=one)
    back = load(ours)
    assert back.keys() == fused.keys()
    assert all(torch.equal(back[n].view(torch.uint8), fused[n].contiguous().view(torch.uint8)) for n in fused)


def test_the_metadata_order_is_the_one_given_so_a_retry_writes_equal_bytes() -> None:
    w = _weights(1)
    items = snapshot_tensors(w, _plan(w))
    assert shard_file(items, META) == shard_file(items, META)
    n = struct.unpack("<Q", shard_file(items, META)[:8])[0]
    assert shard_file(items, META)[8 : 8 + n].startswith(b'{"__metadata__":{"aurora.format":"1","aurora.kind":"snapshot"')


def test_non_contiguous_and_scalar_tensors_are_written_as_their_c_order_bytes() -> None:
    base = torch.randn(6, 4).to(torch.bfloat16)
    t = {"a.t": base.t(), "b.scalar": torch.tensor(3.5), "c.empty": torch.zeros(0, 3, dtype=torch.float16)}
    assert shard_file(snapshot_tensors(t), {"k": "v"}) == save({n: x.contiguous() for n, x in t.items()}, metadata={"k": "v"})


def test_shards_are_cut_where_they_were_before() -> None:
    w = _weights(2, hidden=32)
    items = snapshot_tensors(w, _plan(w))
    cap = 5000
    groups = list(shard_groups(items, cap))
    assert [it.name for g in groups for it in g] == sorted(it.name for it in items)
    for g in groups:
        assert len(g) == 1 or sum(it.nbytes for it in g) <= cap
    for a, b in zip(groups, groups[1:], strict=False):
        assert sum(it.nbytes for it in a) + b[0].nbytes > cap  # the next tensor did not fit
    assert list(shard_groups([], cap)) == [[]]


def test_publish_snapshot_from_source_names_writes_what_it_wrote_from_a_fused_copy(tmp_path: object) -> None:
    w = _weights(3, hidden=32, layers=3)
    plan = _plan(w)
    cfg = PublishConfig(streams=2, shard_bytes=1 << 20)
    a = open_store(f"file://{tmp_path}/a")
    b = open_store(f"file://{tmp_path}/b")
    kw = {"attempt": "att", "created_at": "2026-12-03T00:00:00Z"}
    ma = publish_snapshot(a, "r", 0, fuse_weights(w, plan), None, cfg, **kw)
    mb = publish_snapshot(b, "r", 0, w, None, cfg, plan=plan, **kw)
    assert ma.to_bytes() == mb.to_bytes()
    for ref in ma.segments:
        key = f"snapshots/v{0:010d}/{ref.key}"
        assert a.get(key) == b.get(key)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable high-water mark")
def test_a_snapshot_holds_about_its_shards_in_flight_never_a_copy_of_the_whole_version(tmp_path: object) -> None:
    """256 MiB of bf16 weights in 8 MiB shards over 2 streams: the writer's peak resident memory
    above its start stays near 2-3 shards; a fused copy (or safetensors' copies) would add 256 MiB
    or more. The kernel's high-water mark catches a peak however short."""
    mib = 1 << 20
    w = {f"model.layers.{i}.mlp.down_proj.weight": torch.ones(1024, 4 * 1024, dtype=torch.bfloat16) for i in range(16)}
    w.update({f"model.layers.{i}.mlp.gate_proj.weight": torch.ones(4 * 1024, 1024, dtype=torch.bfloat16) for i in range(8)})
    w.update({f"model.layers.{i}.mlp.up_proj.weight": torch.ones(4 * 1024, 1024, dtype=torch.bfloat16) for i in range(8)})
    plan = _plan(w)  # gate and up fused: 16 MiB tensors, each a shard of its own
    total = sum(t.numel() * t.element_size() for t in w.values())
    assert total == 256 * mib
    store = open_store(f"file://{tmp_path}/s")
    gc.collect()

    def status(field: str) -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    before = status("VmRSS")
    m = publish_snapshot(store, "r", 0, w, None, PublishConfig(streams=2, shard_bytes=8 * mib), plan=plan)
    grew = status("VmHWM") - before
    assert m.total_bytes > total
    assert grew < 96 * mib, f"the snapshot writer's peak grew {grew / mib:.0f} MiB for a {total / mib:.0f} MiB version"


def test_a_pause_waits_for_the_shard_being_built_and_holds_the_next() -> None:
    import threading

    from aurora_store.lineage.shards import ReadGate
    from aurora_store.testing.wait import wait_until

    gate = ReadGate()
    building, done_building, paused = threading.Event(), threading.Event(), threading.Event()
    resume = threading.Event()

    def build() -> None:
        with gate.reading():
            building.set()
            assert done_building.wait(30)

    def pause() -> None:
        with gate.paused():
            paused.set()
            assert resume.wait(30)

    a = threading.Thread(target=build)
    a.start()
    assert building.wait(30)
    b = threading.Thread(target=pause)
    b.start()
    wait_until(lambda: gate.state()[1] == 1, "the pause to be asked for", timeout=30)
    assert not paused.is_set()  # the shard in progress finishes first
    done_building.set()
    a.join(30)
    assert paused.wait(30)
    c = threading.Thread(target=build)
    done_building.clear()
    building.clear()
    c.start()
    wait_until(lambda: gate.state()[2] == 1, "the next shard to wait", timeout=30)
    assert not building.is_set()
    resume.set()
    b.join(30)
    assert building.wait(30)
    done_building.set()
    c.join(30)
    assert gate.state() == (0, 0, 0)
