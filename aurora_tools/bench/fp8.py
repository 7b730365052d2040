"""``aurora bench fp8``: how much of an FP8 serving copy one RL step changes, and what keeping it current costs.

Issue 27: the chain stays bf16; an Actor serving ``fp8-block128`` keeps an
FP8 copy (:class:`~aurora_store.quant.weights.Fp8Weights`) and requantizes
it after each delta. Per step of two workloads, in one run:

- ``demo``: the demo model's real training steps: ``aurora demo``'s Trainer
  (GRPO on the arithmetic task, the built-in Qwen3 at hidden 256) run for
  ``--demo-steps`` steps with one Actor, into a run root on local disk; or
  the versions of an earlier run given with ``--demo-store`` (for example
  ``aurora demo --store file:///tmp/demo-run``). Each version is
  materialized from the store and split into its Hugging Face tensors.
- ``synthetic``: the synthetic workload (:func:`aurora_tools.synthetic.workload.sparse_update`,
  ``--density`` of the elements move by one bf16 ulp) on a Qwen3-shaped model
  of ``--params`` parameters (default 1 B).

Per step (keys of ``--json``, each an object of per-step lists keyed by
workload, the demo first): ``bf16_density`` (changed bf16 elements over all),
``fp8_element_density`` (changed FP8 bytes over the quantized elements),
``fp8_block_density`` (blocks with an FP8 byte or their scale changed, over
all blocks), ``scale_change_density``, ``bytes_bf16_delta`` (our delta,
default encoding, whole model), ``bytes_bf16_delta_quantized`` (its entries
for the quantized weights alone), ``bytes_fp8_delta`` (what shipping the
quantized weights as FP8 deltas would take: the changed FP8 bytes through the
codec's own streams, the smallest of rice / LEB128 / bitmask indices and
raw / planes / zstd values, new or XOR, as its encoder picks for bf16; the
changed scales through the codec itself, as float32 entries), ``requant_s``
(the incremental requantization of every quantized weight), ``full_quant_s``
(quantizing them all from scratch, into arrays already allocated: the pass
itself, no page faults), ``work_fraction`` (changed elements
outside the blocks redone whole, plus every element of those, over the
quantized elements), ``target_s`` (``2 x work_fraction x full_quant_s + 5
ms``), ``floor_s`` and ``floor_moved_s`` (the requantization's memory
traffic with no arithmetic, on the same arrays, threads and cold caches:
:mod:`aurora_tools.bench.fp8_floor`; the target is out of reach where
``floor_s`` passes it), ``requant_cpu_s`` / ``full_quant_cpu_s`` (the same in CPU time,
every thread's: the machine is shared) and ``exact`` (the incremental copy equals
the from-scratch one, bit for bit). Top level: ``threads``, the threads
both the requantization and the from-scratch quantization ran on
(``--threads``; default: the CPUs the process may use, as an Actor's safe
point uses them), the workloads' parameters and ``kernels_jit``. Exit
status 1 if any step is not exact.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from aurora_store.codec import encodings as enc
from aurora_store.codec import kernels, v2
from aurora_store.codec.encode import encode_entry
from aurora_store.codec.entries import EncodeOptions, ParamSpec
from aurora_store.codec.extract import extract, plan_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.format.checkpoint import encode_segments
from aurora_store.quant import BlockFP8, Requant, is_quantized
from aurora_store.quant.kernels import warm_up
from aurora_store.quant.weights import Change, Fp8Weights, bf16_bits, default_threads
from aurora_tools.bench import run_and_report
from aurora_tools.bench.fp8_floor import Traffic, floors

__all__ = ["add_arguments", "main", "run", "fp8_delta_bytes", "KEYS"]

#: Per-step keys, in the order of the table.
KEYS = (
    "bf16_density",
    "fp8_element_density",
    "fp8_block_density",
    "scale_change_density",
    "bytes_bf16_delta",
    "bytes_bf16_delta_quantized",
    "bytes_fp8_delta",
    "requant_s",
    "full_quant_s",
    "work_fraction",
    "target_s",
    "floor_s",
    "floor_moved_s",
    "requant_cpu_s",
    "full_quant_cpu_s",
    "exact",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, default=1e9, help="size of the synthetic workload's model in parameters (default 1e9)")
    p.add_argument(
        "--density", type=float, default=None, help="fraction of elements a synthetic step changes (default: the workload's, 1.07%%)"
    )
    p.add_argument("--steps", type=int, default=3, help="synthetic steps (default 3; 0: no synthetic workload)")
    p.add_argument("--demo-steps", type=int, default=6, help="demo training steps to run (default 6; 0: no demo workload)")
    p.add_argument(
        "--demo-store", default=None, metavar="URL", help="read the demo's versions from this run root instead of running the demo"
    )
    p.add_argument(
        "--reps", type=int, default=3, help="timed runs of each weight's requantization and quantization; the best is kept (default 3)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads quantizing and requantizing the weights, both timed alike (default: the CPUs this process may use)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


# ---------------------------------------------------------------------------
# Sizes


def _smallest_values(a: np.ndarray, cctx: Any, level: int) -> int:
    """Smallest value stream of one-byte values: raw, planes (width 1) or zstd."""
    if a.size == 0:
        return 0
    return min(a.size, v2.plan_planes(a, 1).nbytes, len(enc.zstd_compress(a, level, cctx)))


def fp8_delta_bytes(idx: np.ndarray, new: np.ndarray, old: np.ndarray, numel: int, whole: np.ndarray | None = None) -> int:
    """Bytes of an entry carrying the FP8 bytes ``new`` (were ``old``) at sorted ``idx`` of a weight of ``numel``.

    The codec's streams at width 1: the smallest index stream (rice, LEB128
    raw or zstd, bitmask, u32) plus the smallest value stream (``new`` or
    ``xor``; raw, planes or zstd); or, when ``whole`` (every new byte) is
    given and most elements changed, a dense entry of it.
    """
    n = int(idx.size)
    if n == 0:
        return 0
    level = EncodeOptions().zstd_level
    cctx = enc.zstd_compressor(level)
    leb = enc.encode_indices("leb128", idx, 0, numel)
    cands = [len(v2.encode_rice(idx, 0)), len(leb), len(enc.zstd_compress(leb, level, cctx)), enc.indices_size("bitmask", idx, 0, numel)]
    if numel <= 1 << 32:
        cands.append(4 * n)
    sparse = min(cands) + min(_smallest_values(new, cctx, level), _smallest_values(new ^ old, cctx, level))
    if whole is not None and 4 * n > numel:
        return min(sparse, _smallest_values(whole.reshape(-1), cctx, level))
    return sparse


def _scale_bytes(name: str, old: np.ndarray, new: np.ndarray, opts: EncodeOptions) -> int:
    """The codec's own float32 entry for the changed scales of one weight."""
    o, n = old.reshape(-1).view(np.uint32), new.reshape(-1).view(np.uint32)
    idx = np.flatnonzero(o != n)
    if idx.size == 0:
        return 0
    e = encode_entry(name, ParamSpec(tuple(new.shape), "float32"), 0, n.size, idx, n[idx], o[idx], opts, lambda a, b: n[a:b])
    return e.nbytes


def _bf16_bytes(plan: FusionPlan, base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], version: int) -> tuple[int, int, int]:
    """(changed elements, bytes of the whole delta, bytes of its entries for quantized weights), default encoding."""
    deltas = list(extract(plan, base, new))
    quantized = {p.name for p in plan if all(is_quantized(b.source, b.spec.shape) for b in p.blocks)}
    total = inq = 0
    for seg in encode_segments(deltas, version, EncodeOptions()):
        for e in seg.entries:
            total += e.nbytes
            inq += e.nbytes if e.param in quantized else 0
    return sum(d.nnz for d in deltas), total, inq


# ---------------------------------------------------------------------------
# One step


def _restore(blk: BlockFP8, saved: BlockFP8) -> None:
    for a, b in ((blk.q, saved.q), (blk.scale_inv, saved.scale_inv), (blk.peak, saved.peak), (blk.ties, saved.ties)):
        np.copyto(a, b)


def _best(reps: int, fn: Callable[[int], Any]) -> tuple[float, float, Any]:
    """(best wall seconds, best CPU seconds of the process's threads, the last result) of ``fn(rep)`` over ``reps`` runs."""
    best = best_cpu = float("inf")
    got = None
    for rep in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        got = fn(rep)
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
    return best, best_cpu, got


def _step(
    plan: FusionPlan,
    base: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    copy: Fp8Weights,
    version: int,
    reps: int,
    threads: int,
) -> dict[str, Any]:
    """Measure one step: ``copy`` is current for ``base`` on entry and for ``new`` on return.

    The whole model's requantization (the copy put back before each rep) and
    its from-scratch quantization (into a copy's existing arrays) are each
    timed ``reps`` times on ``threads`` threads, the best kept: the same
    threads for both, as an Actor's safe point would use them.
    """
    elements = sum(p.spec.numel for p in plan)
    changed, bytes_bf16, bytes_bf16_q = _bf16_bytes(plan, base, new, version)
    opts = EncodeOptions()
    changes: list[Change] = []
    streams: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # each weight's (indices, old bits, new bits)
    for name in copy:
        old_bits, new_bits = bf16_bits(base[name], name).reshape(-1), bf16_bits(new[name], name).reshape(-1)
        idx, new_at, old_at = kernels.scan_changes(old_bits, new_bits)
        if copy.blocks[name].numel < 1 << 31:
            idx = idx.astype(np.int32)  # as a prepared delta holds them
        changes.append((name, new[name], idx, old_at, new_at))
        streams.append((idx, old_at, new_at))
    before = {name: blk.copy() for name, blk in copy.blocks.items()}

    def requant(rep: int) -> Requant:
        if rep:
            for name, blk in copy.blocks.items():
                _restore(blk, before[name])
        return copy.requantize_all(changes, threads=threads)

    req_s, req_cpu, stats = _best(reps, requant)
    # From scratch into arrays already there (their pages already touched): the pass itself, as an
    # engine serving from them would redo it, with no allocation or first-touch page faults in it.
    fresh = Fp8Weights({n: b.copy() for n, b in before.items()}, copy.format)
    full_s, full_cpu, _ = _best(reps, lambda _: fresh.refresh(new, threads=threads))
    fp8_changed = blocks_changed = scales_changed = bytes_fp8 = 0
    exact = True
    floor_weights: list[Traffic] = []
    for name, (idx, old_at, new_at) in zip(copy, streams, strict=True):
        blk, q0, s0 = copy.blocks[name], before[name].q, before[name].scale_inv
        got = fresh.blocks[name]
        exact = exact and np.array_equal(got.q, blk.q) and np.array_equal(got.scale_inv.view(np.uint32), blk.scale_inv.view(np.uint32))
        # What changed in FP8 space: bytes, blocks (a byte or the scale), scales.
        moved = q0 != blk.q
        fidx = np.flatnonzero(moved)
        fp8_changed += int(fidx.size)
        rescaled = s0.view(np.uint32) != blk.scale_inv.view(np.uint32)
        scales_changed += int(np.count_nonzero(rescaled))
        e, r, c = (1, *blk.shape) if len(blk.shape) == 2 else blk.shape
        nbr, nbc = blk.scale_inv.shape[-2:]
        pad = np.zeros((e, nbr * 128, nbc * 128), bool)
        pad[:, :r, :c] = moved.reshape(e, r, c)
        per_block = pad.reshape(e, nbr, 128, nbc, 128).any(axis=(2, 4)).reshape(rescaled.shape)
        blocks_changed += int(np.count_nonzero(per_block | rescaled))
        qn = blk.q.reshape(-1)
        bytes_fp8 += fp8_delta_bytes(fidx, qn[fidx], q0.reshape(-1)[fidx], blk.numel, qn)
        bytes_fp8 += _scale_bytes(name, s0, blk.scale_inv, opts)
        listed = fidx.astype(np.int32) if idx.dtype == np.int32 else fidx  # as narrow as the changes' indices
        floor_weights.append((got.q.reshape(-1), idx, old_at, new_at, listed, qn[fidx]))

    def put_back() -> None:  # the from-scratch copy as it was before the change (the floor passes rewrite the moved bytes)
        for name, blk in fresh.blocks.items():
            np.copyto(blk.q, before[name].q)

    floor = floors(floor_weights, put_back, reps, threads)
    numel = copy.numel
    nblocks = sum(b.blocks for b in copy.blocks.values())
    work_fraction = stats.work / numel
    return {
        "bf16_density": changed / elements,
        "fp8_element_density": fp8_changed / numel,
        "fp8_block_density": blocks_changed / nblocks,
        "scale_change_density": scales_changed / nblocks,
        "bytes_bf16_delta": bytes_bf16,
        "bytes_bf16_delta_quantized": bytes_bf16_q,
        "bytes_fp8_delta": bytes_fp8,
        "requant_s": req_s,
        "full_quant_s": full_s,
        "work_fraction": work_fraction,
        "target_s": 2 * work_fraction * full_s + 0.005,
        **floor,
        "requant_cpu_s": req_cpu,
        "full_quant_cpu_s": full_cpu,
        "exact": bool(exact),
    }


# ---------------------------------------------------------------------------
# Workloads


def _split(plan: FusionPlan, fused: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of fused weights (views, no copies)."""
    out: dict[str, torch.Tensor] = {}
    for p in plan:
        flat = fused[p.name].reshape(-1)
        for b in p.blocks:
            out[b.source] = flat[b.offset : b.offset + b.numel].view(b.spec.shape)
    return out


def _run_demo(args: argparse.Namespace, log: Callable[[str], None], workdir: str) -> str:
    """Run ``aurora demo``'s system for ``--demo-steps`` steps (one Actor, no Relay) in ``workdir``; the run root's URL."""
    from aurora_tools.demo.system import DemoConfig, run_system_demo

    url = f"file://{os.path.join(workdir, 'store')}"
    log(f"demo: {args.demo_steps} training steps of aurora demo's Trainer with one Actor, into {url}")
    cfg = DemoConfig(
        steps=args.demo_steps,
        actors_relay=0,
        actors_origin=1,
        relay=False,
        kill_at=-1,
        join_at=-1,
        store=url,
        workdir=workdir,
        display=False,
        seed=args.seed,
        eval_every=0,
    )
    run_system_demo(cfg, say=lambda *a, **k: None)
    return url


def _demo(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[list[dict[str, Any]], int]:
    """(per-step results, parameters) over the demo's versions 0..``--demo-steps`` (a demo run here: in a
    temporary folder, removed after)."""
    if args.demo_store:
        return _demo_steps(args, log, args.demo_store)
    with tempfile.TemporaryDirectory(prefix="aurora-bench-fp8-", ignore_cleanup_errors=True) as workdir:
        return _demo_steps(args, log, _run_demo(args, log, workdir))


def _demo_steps(args: argparse.Namespace, log: Callable[[str], None], url: str) -> tuple[list[dict[str, Any]], int]:
    from aurora_store.lineage.materialize import materialize
    from aurora_store.storage import open_store
    from workers.common import read_model_description
    from workers.model import fusion_plan_for

    store = open_store(url)
    model, _ = read_model_description(store)
    plan = fusion_plan_for(model)
    del model
    fused, _ = materialize(store, 0)
    base = _split(plan, fused)
    copy = Fp8Weights.of(base)
    log(f"demo: {sum(p.spec.numel for p in plan):,} parameters, {copy.numel:,} quantized ({len(copy)} weights), from {url}")
    steps: list[dict[str, Any]] = []
    for v in range(1, args.demo_steps + 1):
        new = _split(plan, materialize(store, v)[0])
        steps.append(_step(plan, base, new, copy, v, args.reps, args.threads))
        log(f"demo v{v}: {_line(steps[-1])}")
        base = new
    return steps, sum(p.spec.numel for p in plan)


def _synthetic(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[list[dict[str, Any]], int]:
    """(per-step results, parameters) of ``--steps`` synthetic steps on a model of ``--params``."""
    from aurora_tools.synthetic.shapes import shape_for_params
    from aurora_tools.synthetic.workload import DEFAULT_DENSITY, base_weights, sparse_update

    shape = shape_for_params(args.params)
    density = DEFAULT_DENSITY if args.density is None else args.density
    base = base_weights(shape, args.seed, cache=False)  # no file: a predictable peak (2 copies of the weights)
    plan = plan_of(base, tied=shape.tied)
    t0 = time.perf_counter()
    copy = Fp8Weights.of(base)
    log(
        f"synthetic: {shape.params:,} parameters, {copy.numel:,} quantized ({len(copy)} weights, "
        f"first quantization {time.perf_counter() - t0:.2f}s), density {density:g}"
    )
    new = {n: t.clone() for n, t in base.items()}
    steps: list[dict[str, Any]] = []
    for v in range(1, args.steps + 1):
        sparse_update(new, density, args.seed, v)
        steps.append(_step(plan, base, new, copy, v, args.reps, args.threads))
        log(f"synthetic v{v}: {_line(steps[-1])}")
        base, new = new, base
        for n, t in new.items():
            t.copy_(base[n])
    return steps, shape.params


# ---------------------------------------------------------------------------
# Report


def _line(r: Mapping[str, Any]) -> str:
    return (
        f"bf16 {100 * r['bf16_density']:.3f}%  fp8 {100 * r['fp8_element_density']:.3f}%  blocks {100 * r['fp8_block_density']:.1f}%  "
        f"scales {100 * r['scale_change_density']:.2f}%  bytes bf16 {r['bytes_bf16_delta_quantized']:,} fp8 {r['bytes_fp8_delta']:,}  "
        f"requant {r['requant_s']:.4f}s full {r['full_quant_s']:.4f}s work {100 * r['work_fraction']:.2f}%  exact {r['exact']}"
    )


def run(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Both workloads, demo first; one JSON-able object (see the module docstring)."""
    warm_up()  # compiled before anything is timed
    args.threads = args.threads if args.threads is not None else default_threads()
    if args.threads < 1:
        raise ValueError(f"--threads: {args.threads}; at least 1")
    workloads: dict[str, list[dict[str, Any]]] = {}
    out: dict[str, Any] = {}
    if args.demo_steps > 0:
        workloads["demo"], out["demo_params"] = _demo(args, log)
    if args.steps > 0:
        workloads["synthetic"], out["synthetic_params"] = _synthetic(args, log)
    for key in KEYS:
        out[key] = {w: [s[key] for s in steps] for w, steps in workloads.items()}
    out["kernels_jit"] = int(kernels.jit_enabled())
    out["threads"] = args.threads
    return out


def _ok(r: Mapping[str, Any]) -> bool:
    return all(all(v) for v in r["exact"].values())


def table(r: Mapping[str, Any]) -> str:
    """One row per step of each workload."""
    head = (
        f"{'workload':10s} {'step':>4s} {'bf16 %':>7s} {'fp8 %':>7s} {'blocks %':>8s} {'scales %':>8s} {'bf16 B (q)':>11s} "
        f"{'fp8 B':>11s} {'fp8/bf16':>8s} {'requant s':>9s} {'full s':>8s} {'work %':>7s} {'target s':>8s} {'floor s':>8s} {'met':>4s} {'exact':>5s}"
    )
    out = [head]
    for w in r["exact"]:
        for i in range(len(r["exact"][w])):
            g = {k: r[k][w][i] for k in KEYS}
            ratio = g["bytes_fp8_delta"] / g["bytes_bf16_delta_quantized"] if g["bytes_bf16_delta_quantized"] else float("nan")
            out.append(
                f"{w:10s} {i + 1:4d} {100 * g['bf16_density']:7.3f} {100 * g['fp8_element_density']:7.3f} {100 * g['fp8_block_density']:8.2f} "
                f"{100 * g['scale_change_density']:8.3f} {g['bytes_bf16_delta_quantized']:11,d} {g['bytes_fp8_delta']:11,d} {ratio:8.2f} "
                f"{g['requant_s']:9.4f} {g['full_quant_s']:8.4f} {100 * g['work_fraction']:7.3f} {g['target_s']:8.4f} {g['floor_s']:8.4f} "
                f"{'yes' if g['requant_s'] <= g['target_s'] else 'no':>4s} {str(g['exact']):>5s}"
            )
    out.append("bf16 B (q): our delta's entries for the quantized weights; fp8 B: the same weights shipped as FP8 values and scales")
    out.append("floor s: the requantization's memory traffic alone (the changes read once, the moved FP8 bytes written in place)")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    return run_and_report(args, run, table, _ok)
