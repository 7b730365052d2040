"""``aurora bench activate``: what the Actor's safe point costs against the memory traffic it must cause.

One process, one model, one delta, three ways of landing it, timed in the
same run on the same tensors:

- ``safe_point_s``: the Actor's real safe-point path on the torch engine
  (:class:`~workers.engine.torch_engine.TorchEngine`): ``engine.apply`` of
  the delta the stager prepared (``engine.prepare``: checks, grouping,
  sorting and the predicted digest, done while generating, timed apart as
  ``prepare_s``): what ``SafePoint.activate`` runs under its weights lock
  before the Actor generates again. No digest: the weights are verified
  afterwards, outside the safe point;
- ``verify_s``: that verification, timed apart: ``engine.verify_digest``
  of the tree digest (FORMAT.md §4.1) the Trainer records, what the Actor's
  verify thread runs while the engine generates (``safe_point_with_verify_s``
  is the sum: what generation would stop for if it ran in the safe point);
- ``bare_scatter_s``: the floor: the same values written at the same
  indices of the same tensors by one compiled pass over indices sorted
  beforehand (int64, per source tensor), no checks, no digest;
- ``swap_safe_point_s``: the same with ``EngineConfig.activation = "swap"``
  (:mod:`workers.engine.spare`): the stager writes the delta into a spare
  copy of the weights and hashes it (``swap_prepare_s``, here always from a
  full copy: the first version after a load), the safe point swaps it in
  (no digest either);
- ``full_copy_s``: every weight copied (``copy_`` tensor by tensor, from a
  second copy in memory), what a full-weight reload costs in memory traffic
  alone.

``plain_safe_point_s`` is the path before preparation existed: ``apply`` of
the decoded delta (checks and splitting at the safe point) and a digest that
hashes every weight there (``plain_digest_s`` of it).

The model is Qwen3-shaped (:func:`aurora_tools.synthetic.shapes.shape_for_params`),
built without initialisation (meta device) around random bf16 weights; it
never generates. The delta is the synthetic workload's RL-regime step
(:func:`aurora_tools.synthetic.workload.sparse_update`: ``--density`` of the
elements move by one bf16 ulp), extracted and encoded by the publisher's
code and decoded by the fetcher's, so the staged form is the one an Actor
holds. Each rep runs every path once, one after another (a shared machine
then slows them alike), after one untimed warm-up rep; each timing is the
best of ``--reps`` (``*_runs_s`` list them all). The weights are put back
to the base by a full load between paths, and every path's result is
compared bit for bit, and by digest, with the Trainer's new weights
(``exact``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["add_arguments", "main", "measure"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, default=1e9, help="model size in parameters (default 1e9)")
    p.add_argument(
        "--density",
        type=float,
        default=None,
        help="fraction of elements one step changes (default: the synthetic workload's, 1.07%%)",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=3,
        help="timed runs of each path; the best is reported (default 3)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _bare_kernel(flat: Any, idx: Any, bits: Any, xor: Any) -> None:  # compiled by numba
    if xor:
        for k in range(idx.size):
            flat[idx[k]] ^= bits[k]
    else:
        for k in range(idx.size):
            flat[idx[k]] = bits[k]


def _model(shape: Any, base: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A Qwen3ForCausalLM of ``shape`` whose parameters are ``base``'s tensors (no initialisation, no copy)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=256,
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model.load_state_dict(dict(base), strict=False, assign=True)
    if shape.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    for mod in model.modules():  # rotary tables: never used here, but nothing may stay on meta
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_meta:
                mod.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype), persistent=False)
    return model


class _Tokens:
    eos_id, pad_id = 2, 0

    def decode(self, ids: Any, skip_special: bool = True) -> str:
        return ""


def measure(
    params: float = 1e9,
    density: float | None = None,
    reps: int = 3,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; the JSON object ``aurora bench activate --json`` prints."""
    from aurora_store.apply.sink import tree_weights_digest, weights_digest
    from aurora_store.codec import kernels
    from aurora_store.codec.entries import EncodeOptions
    from aurora_store.codec.extract import bits_view, extract
    from aurora_store.codec.kernels.jit import compiled, use_jit
    from aurora_store.format.checkpoint import encode_segments, stage_segments
    from aurora_tools.synthetic.shapes import make_weights, shape_for_params
    from aurora_tools.synthetic.workload import DEFAULT_DENSITY, sparse_update
    from workers.engine.torch_engine import EngineConfig, TorchEngine
    from workers.model import hf_weights

    say = log or (lambda _m: None)
    dens = DEFAULT_DENSITY if density is None else float(density)
    if not 0 < dens < 1 or reps < 1:
        raise ValueError(f"--density must be in (0, 1) and --reps >= 1, got {dens}, {reps}")
    shape = shape_for_params(params)
    t0 = time.perf_counter()
    base = make_weights(shape, seed)
    model = _model(shape, base)
    del base
    engine = TorchEngine(_Tokens(), EngineConfig(activation="in-place"))
    engine.load(model, version=0)
    plan = engine.fusion_plan()
    sources = [b.source for p in plan for b in p.blocks]

    def held() -> dict[str, torch.Tensor]:  # the parameters' storage now (a swap moves it)
        w = hf_weights(model)
        return {n: w[n] for n in sources}

    weights = held()
    ref = {n: t.clone() for n, t in weights.items()}  # version 0, for putting the weights back
    new = {n: t.clone() for n, t in ref.items()}
    sparse_update(new, dens, seed, 1)
    say(f"model of {shape.params:,} parameters and its step built in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    segs = list(encode_segments(extract(plan, ref, new), 1, EncodeOptions()))
    delta_bytes = sum(len(s.data) for s in segs)
    staged = stage_segments([(f"segment {s.index}", s.data) for s in segs], 1, plan.specs())
    del segs
    say(f"delta encoded and decoded: {staged.nnz:,} changed elements, {delta_bytes:,} bytes ({time.perf_counter() - t0:.1f}s)")
    kernels.warm_up()
    digest_new = weights_digest(new, plan)
    tree_new = tree_weights_digest(new, plan)  # what the Trainer records and the Actor verifies against

    def exact() -> bool:
        now = held()
        return all(torch.equal(bits_view(now[n]), bits_view(new[n])) for n in now)

    def reset() -> None:
        engine.load_weights(ref, version=0)
        gc.collect()

    result: dict[str, Any] = {
        "params": shape.params,
        "changed": int(staged.nnz),
        "delta_bytes": delta_bytes,
        "density": dens,
    }
    exact_all = True

    # The floor's arrays: per source tensor, int64 indices and values laid out beforehand.
    floor: list[tuple[str, np.ndarray, np.ndarray, bool]] = []
    for e in staged.entries:
        assert e.indices is not None, "the RL-regime delta has no dense entries"
        bits = np.ascontiguousarray(e.bits.view(np.uint16 if e.bits.dtype.itemsize == 2 else np.uint32))
        for b in plan.params[e.param].blocks:
            lo, hi = np.searchsorted(e.indices, [b.offset, b.offset + b.numel])
            if hi > lo:
                idx = np.ascontiguousarray(e.indices[lo:hi] - b.offset, dtype=np.int64)
                floor.append((b.source, idx, bits[lo:hi].copy(), e.values == "xor"))
    kernel = compiled(_bare_kernel) if use_jit(None) else None
    inplace = engine
    swapper = TorchEngine(_Tokens(), EngineConfig(activation="swap"))
    runs: dict[str, list[float]] = {
        k: []
        for k in (
            "prepare",
            "sp",
            "verify",
            "pl_apply",
            "pl_digest",
            "pl",
            "bare",
            "sw_prep",
            "sw",
            "copy",
        )
    }

    def bare(jobs: list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]]) -> None:
        for flat, idx, bits, xor in jobs:
            if kernel is not None:
                kernel(flat, idx, bits, xor)
            elif xor:
                flat[idx] ^= bits
            else:
                flat[idx] = bits

    clock = time.perf_counter

    def prepared_path() -> tuple[float, float, float, str | None]:
        """``engine`` loads v0, prepares the delta (while generating), applies it (the safe point),
        then verifies it (the verify thread): (prepare, apply, verify) seconds and the digest verified."""
        engine.load(model, version=0)
        reset()
        t0 = clock()
        prepared = engine.prepare(staged)
        t1 = clock()
        engine.apply(prepared)
        t2 = clock()
        got = engine.verify_digest(tree_new)
        return t1 - t0, t2 - t1, clock() - t2, got

    # Every rep runs every path once, one after the other: a machine shared with others
    # slows them alike, not one path's whole series.
    for rep in range(reps + 1):  # rep 0 warms up (kernels compiled or loaded), untimed
        out: dict[str, float] = {}
        # The Actor's path: prepared while generating, the write at the safe point, verified after it.
        engine = inplace
        prep, apply_s, verify_s, got = prepared_path()
        out.update(prepare=prep, sp=apply_s, verify=verify_s)
        exact_all &= got == tree_new and exact()
        # Before preparation: the decoded delta applied and every weight hashed at the safe point.
        reset()
        t0 = clock()
        engine.apply(staged)
        t1 = clock()
        got = engine.digest()
        t2 = clock()
        out.update(pl_apply=t1 - t0, pl_digest=t2 - t1, pl=t2 - t0)
        exact_all &= got == digest_new and exact()
        # The floor: one sorted, compiled pass per tensor.
        reset()
        now = held()
        jobs = [(bits_view(now[s]).numpy().view(b.dtype), i, b, x) for s, i, b, x in floor]
        t0 = clock()
        bare(jobs)
        out["bare"] = clock() - t0
        exact_all &= exact()
        # The option: written into a spare copy while generating, swapped in at the safe point.
        engine = swapper
        prep, apply_s, _, got = prepared_path()
        out.update(sw_prep=prep, sw=apply_s)
        exact_all &= got == tree_new and exact()
        # A full copy of the weights (both sides' pages touched already: traffic, not page faults).
        now = held()
        t0 = clock()
        for n, t in now.items():
            t.copy_(ref[n])
        out["copy"] = clock() - t0
        if rep:
            for k, v in out.items():
                runs[k].append(v)
    engine = inplace
    del swapper  # the spare's memory back
    gc.collect()
    new.clear()
    weights = held()
    result.update(
        safe_point_s=min(runs["sp"]),
        verify_s=min(runs["verify"]),
        safe_point_with_verify_s=min(a + b for a, b in zip(runs["sp"], runs["verify"], strict=True)),
        prepare_s=min(runs["prepare"]),
        plain_safe_point_s=min(runs["pl"]),
        plain_apply_s=min(runs["pl_apply"]),
        plain_digest_s=min(runs["pl_digest"]),
        bare_scatter_s=min(runs["bare"]),
        swap_safe_point_s=min(runs["sw"]),
        swap_prepare_s=min(runs["sw_prep"]),
        full_copy_s=min(runs["copy"]),
        safe_point_runs_s=[round(x, 4) for x in runs["sp"]],
        verify_runs_s=[round(x, 4) for x in runs["verify"]],
        bare_scatter_runs_s=[round(x, 4) for x in runs["bare"]],
    )
    sp_total = runs["sp"]
    t0 = time.perf_counter()
    weights_digest(weights, plan)
    result["digest_s"] = time.perf_counter() - t0
    result["exact"] = bool(exact_all)
    result["safe_point_over_bare"] = result["safe_point_s"] / result["bare_scatter_s"] if result["bare_scatter_s"] > 0 else None
    result["reps"] = reps
    result["kernels"] = kernels.path()
    result["torch_threads"] = torch.get_num_threads()
    result["median_safe_point_s"] = statistics.median(sp_total)
    for k, v in list(result.items()):
        if isinstance(v, float):
            result[k] = round(v, 5)
    return result


def _table(r: Mapping[str, Any]) -> str:
    bare = r["bare_scatter_s"] or float("nan")
    rows = [
        ("safe point (prepared apply, no digest)", r["safe_point_s"]),
        ("verify (tree digest, outside the safe point)", r["verify_s"]),
        ("safe point + verify, were it inside", r["safe_point_with_verify_s"]),
        ("bare scatter (sorted, compiled)", r["bare_scatter_s"]),
        ("full copy of the weights", r["full_copy_s"]),
        ("before: apply + digest at the safe point", r["plain_safe_point_s"]),
        ("  of which apply", r["plain_apply_s"]),
        ("  of which digest", r["plain_digest_s"]),
        ("prepare (stager, while generating)", r["prepare_s"]),
        ("option swap: safe point (swap)", r["swap_safe_point_s"]),
        ("option swap: prepare (copy, write, hash)", r["swap_prepare_s"]),
    ]
    out = [
        f"activation of one delta: {r['params']:,} parameters, {r['changed']:,} changed ({r['delta_bytes']:,} bytes), "
        f"best of {r['reps']}, kernels {r['kernels']}, exact {r['exact']}",
        f"{'path':44s} {'seconds':>9s} {'x bare':>7s}",
    ]
    for name, s in rows:
        out.append(f"{name:44s} {s:9.4f} {s / bare:7.2f}")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    log = None if args.json else (lambda m: print(m, file=sys.stderr))
    r = measure(args.params, args.density, args.reps, args.seed, log)
    print(json.dumps(r) if args.json else _table(r))
    return 0 if r["exact"] else 1
