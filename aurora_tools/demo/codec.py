"""``aurora demo``: create, inspect, apply and verify deltas on a tiny model.

Runs on a local ``file://`` store. A Qwen3-shaped model takes Adam-sized
steps; each step is published as a sparse delta; an "Actor" then rebuilds
the newest version from the snapshot plus the delta chain and checks it is
bit-identical to the Trainer's weights, and a corrupted segment is refused
without touching a weight.
"""

from __future__ import annotations

import os
import shutil
import time

from aurora_store.apply.sink import FusedWeights, SplitWeights, apply_delta, weights_digest
from aurora_store.codec.extract import extract, fuse_weights, plan_of
from aurora_store.errors import AuroraError
from aurora_store.format.manifest import version_dir
from aurora_store.lineage.fetch import fetch_delta
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.storage import open_store
from aurora_tools.synthetic.shapes import MasterWeights, Qwen3Shape, make_weights

__all__ = ["DEMO_SHAPE", "run_demo"]

DEMO_SHAPE = Qwen3Shape(vocab=8192, hidden=256, layers=4, intermediate=768, heads=4, kv_heads=2, head_dim=64)


def run_demo(folder: str, steps: int = 5) -> int:
    print(f"Aurora demo: a Qwen3-shaped model of {DEMO_SHAPE.params / 1e6:.1f} M parameters, {steps} RL-like steps")
    root = os.path.abspath(os.path.join(folder, "store"))
    shutil.rmtree(root, ignore_errors=True)
    store = open_store(f"file://{root}")
    cfg = PublishConfig(streams=4, segment_bytes=256 << 10)

    weights = make_weights(DEMO_SHAPE, seed=0)
    plan = plan_of(weights, tied=False)
    full_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"  {len(weights)} Hugging Face tensors -> {len(plan)} fused parameters (qkv_proj, gate_up_proj)")
    snap = publish_snapshot(store, "demo", 0, fuse_weights(weights, plan), None, cfg)
    print(f"  snapshot v0: {snap.total_bytes / 1e6:.2f} MB, state {snap.state[:23]}…")

    master = MasterWeights(weights, seed=0)
    state = snap.state
    current = weights
    print(f"  {'version':>7} {'changed':>9} {'density':>8} {'bytes':>10} {'B/changed':>9} {'vs full':>8} {'time':>7}")
    for v in range(1, steps + 1):
        new = master.step(lr=2.5e-7)
        t0 = time.perf_counter()
        m = publish_delta(store, "demo", v, extract(plan, current, new), state, cfg)
        dt = time.perf_counter() - t0
        numel = sum(p.spec.numel for p in plan)
        print(
            f"  {v:>7} {m.nnz:>9} {100 * m.nnz / numel:>7.3f}% {m.total_bytes:>10} "
            f"{m.total_bytes / max(1, m.nnz):>9.2f} {full_bytes / max(1, m.total_bytes):>7.0f}x {dt:>6.2f}s"
        )
        state, current = m.state, new

    print(f"  Actor: materialize v{steps} from snapshot v0 + deltas 1..{steps}")
    rebuilt, got_state = materialize(store, steps)
    trainer_digest = weights_digest(current, plan)
    actor_digest = weights_digest(rebuilt)
    ok = got_state == state and trainer_digest == actor_digest
    print(f"    state  {got_state[:23]}… {'==' if got_state == state else '!='} trainer's")
    print(f"    weights digest {actor_digest[:23]}… {'== (bit-identical)' if trainer_digest == actor_digest else '!= MISMATCH'}")

    # Split weights (Hugging Face layout) reach the same bits through the reverse map.
    split = {n: t.clone() for n, t in weights.items()}
    sink = SplitWeights(split, plan)
    for v in range(1, steps + 1):
        apply_delta(fetch_delta(store, v, plan.specs())[1], sink)
    split_ok = weights_digest(split, plan) == trainer_digest
    print(f"    split-weight Actor (q/k/v, gate/up kept apart): {'bit-identical' if split_ok else 'MISMATCH'}")

    # A corrupted segment is refused before any weight changes.
    seg_key = next(k for k in store.list(version_dir("delta", 1)) if k.endswith(".safetensors"))
    original = store.get(seg_key)
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    store.put(seg_key, bytes(data), mode="overwrite")
    victim = FusedWeights(fuse_weights(weights, plan))
    before = weights_digest(victim.tensors)
    try:
        apply_delta(fetch_delta(store, 1, plan.specs())[1], victim)
        refused = False
    except AuroraError as e:
        refused = True
        print(f"    corrupted segment refused: {e}")
    untouched = weights_digest(victim.tensors) == before
    store.put(seg_key, original, mode="overwrite")  # leave a clean store for `aurora lineage/verify`
    print(f"    weights after the refusal: {'unchanged' if untouched else 'CHANGED'}")
    ok = ok and split_ok and refused and untouched
    print("demo " + ("passed" if ok else "FAILED") + f"; store left in {root}")
    return 0 if ok else 1
