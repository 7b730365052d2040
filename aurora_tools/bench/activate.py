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

With ``--serve-dtype fp8-block128`` one more path runs in every rep:
``safe_point_s_fp8``, the same prepared apply on an engine that serves an
FP8 copy (:mod:`workers.engine.torch_fp8`), whose safe point also
requantizes the copy (``prepare_s_fp8``, ``fp8_over_bf16`` =
``safe_point_s_fp8 / safe_point_s``); ``exact`` then also asks that the
copy equal the from-scratch quantization of the new weights. Its load
quantizes the whole model, twice per rep (load, reset): minutes at 1 B.

``plain_safe_point_s`` is the path before preparation existed: ``apply`` of
the decoded delta (checks and splitting at the safe point) and a digest that
hashes every weight there (``plain_digest_s`` of it).

The model is Qwen3-shaped (:func:`aurora_tools.synthetic.shapes.shape_for_params`),
or a named shape (``--shape``, :data:`aurora_tools.synthetic.shapes.NAMED_SHAPES`):
with ``qwen3-30b-a3b-mini``, a Qwen3-MoE model of Qwen3-30B-A3B's structure
(48 layers of 128 experts, 8 active, its attention) at a quarter of its
hidden and expert sizes, whose experts the engine holds packed (FORMAT.md
§2's ``w13_weight`` / ``w2_weight``, two tensors per layer where a checkpoint
has 384: ``tensors_hf`` against ``tensors_engine``), so its safe point is
set by the changed elements, not by the tensor count. The model is built
without initialisation (meta device) around random bf16 weights; it never
generates. The delta is the synthetic workload's RL-regime step
(:func:`aurora_tools.synthetic.workload.sparse_update`: ``--density`` of the
elements move by one bf16 ulp), made in the engine's weights themselves,
extracted against a copy of the base and encoded by the publisher's code,
and decoded by the fetcher's, so the staged form is the one an Actor holds.
Each rep runs every path once, one after another (a shared machine then
slows them alike), after one untimed warm-up rep; each timing is the best
of ``--reps`` (``*_runs_s`` list them all). The weights are put back to the
base by a full load between paths, and every path's result is compared by
sha256 (the tree digest of every weight) with the Trainer's new weights,
hashed before the delta was cut (``exact``).

Memory: the engine's weights and the base (for the resets and the full
copy's source) are the two full copies held; the new weights are a digest,
not a third copy. ``swap`` needs a spare, a third: it is skipped (``swap_skipped``
says why, its keys are null) when three copies would pass
:data:`SWAP_MAX_BYTES`, as at the 2.2 B MoE shape (4.4 GB a copy).
``peak_rss_gb`` is the process's high-water mark (VmHWM).
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

__all__ = ["SWAP_MAX_BYTES", "add_arguments", "main", "measure"]

#: The swap path runs when three full copies of the weights (the engine's, the base, the spare) fit in this.
SWAP_MAX_BYTES = 10 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.synthetic.shapes import NAMED_SHAPES

    which = p.add_mutually_exclusive_group()
    which.add_argument("--params", type=float, default=None, help="model size in parameters, Qwen3-shaped (default 1e9)")
    which.add_argument(
        "--shape",
        choices=sorted(NAMED_SHAPES),
        default=None,
        help="a named model shape instead of --params (qwen3-30b-a3b-mini: Qwen3-30B-A3B's structure at 1/4 width, 2.2 B parameters)",
    )
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
    p.add_argument(
        "--serve-dtype",
        choices=("bf16", "fp8-block128"),
        default="bf16",
        help="fp8-block128: also time the safe point of an engine serving an FP8 copy (safe_point_s_fp8)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _bare_kernel(flat: Any, idx: Any, bits: Any, xor: Any) -> None:  # compiled by numba
    if xor:
        for k in range(idx.size):
            flat[idx[k]] ^= bits[k]
    else:
        for k in range(idx.size):
            flat[idx[k]] = bits[k]


def _model(shape: Any, base: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A Qwen3ForCausalLM (Qwen3MoeForCausalLM for a MoE shape) of ``shape`` whose parameters
    are ``base``'s tensors (no initialisation, no copy)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from aurora_tools.synthetic.shapes import Qwen3MoeShape

    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=256,
    )
    model: torch.nn.Module
    if isinstance(shape, Qwen3MoeShape):
        cfg: Any = Qwen3MoeConfig(
            **common,
            moe_intermediate_size=shape.moe_intermediate,
            intermediate_size=8 * shape.moe_intermediate,  # the dense MLP's (Qwen3-30B-A3B: 6144 = 8 x 768); no layer has one
            num_experts=shape.experts,
            num_experts_per_tok=shape.active,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(cfg)
    else:
        with torch.device("meta"):
            model = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=shape.intermediate))
    model.load_state_dict(dict(base), strict=False, assign=True)
    if shape.tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    for mod in model.modules():  # rotary tables: never used here, but nothing may stay on meta
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_meta:
                mod.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype), persistent=False)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:  # the shapes module and transformers disagree on a name: a bug here, not an input
        raise RuntimeError(f"bench activate: {len(missing)} parameters not built, first {missing[0]}")
    return model


def _peak_rss_gb() -> float | None:
    """The process's resident high-water mark (VmHWM), in GB; None where /proc does not tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None


class _Tokens:
    eos_id, pad_id = 2, 0

    def decode(self, ids: Any, skip_special: bool = True) -> str:
        return ""


def measure(
    params: float | None = None,
    density: float | None = None,
    reps: int = 3,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    shape: str | None = None,
    swap_max_bytes: int = SWAP_MAX_BYTES,
    serve_dtype: str = "bf16",
) -> dict[str, Any]:
    """Run the benchmark; the JSON object ``aurora bench activate --json`` prints.

    ``shape`` names a shape of :data:`~aurora_tools.synthetic.shapes.NAMED_SHAPES`;
    otherwise ``params`` (default 1e9) picks a Qwen3-shaped model of that size.
    The swap path is skipped when three copies of the weights pass ``swap_max_bytes``.
    """
    from aurora_store.apply.sink import tree_weights_digest, weights_digest
    from aurora_store.codec import kernels
    from aurora_store.codec.entries import EncodeOptions
    from aurora_store.codec.extract import bits_view, extract
    from aurora_store.codec.kernels.jit import compiled, use_jit
    from aurora_store.format.checkpoint import encode_segments, stage_segments
    from aurora_tools.synthetic.shapes import Qwen3MoeShape, make_weights, shape_for_params, shape_named
    from aurora_tools.synthetic.workload import DEFAULT_DENSITY, sparse_update
    from workers.engine.torch_engine import EngineConfig, TorchEngine
    from workers.model import hf_weights

    say = log or (lambda _m: None)
    dens = DEFAULT_DENSITY if density is None else float(density)
    if not 0 < dens < 1 or reps < 1:
        raise ValueError(f"--density must be in (0, 1) and --reps >= 1, got {dens}, {reps}")
    if shape is not None and params is not None:
        raise ValueError("give --params or --shape, not both")
    geometry = shape_named(shape) if shape is not None else shape_for_params(1e9 if params is None else params)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the generator's 1 MiB passes: a team of threads per pass spins more than it gains
    try:
        base = make_weights(geometry, seed)
    finally:
        torch.set_num_threads(threads)
    model = _model(geometry, base)  # the engine's weights: the first full copy
    del base
    engine = TorchEngine(_Tokens(), EngineConfig(activation="in-place"))
    engine.load(model, version=0)
    plan = engine.fusion_plan()
    sources = [b.source for p in plan for b in p.blocks]

    def held() -> dict[str, torch.Tensor]:  # the parameters' storage now (a swap moves it)
        w = hf_weights(model)
        return {n: w[n] for n in sources}

    weights = held()
    ref = {n: t.clone() for n, t in weights.items()}  # version 0 (the second copy): resets, the full copy's source
    # The Trainer's step, made in the engine's own weights (no third copy): hashed, cut against the base, undone.
    sparse_update(weights, dens, seed, 1)
    say(f"model of {geometry.params:,} parameters and its step built in {time.perf_counter() - t0:.1f}s")
    digest_new = weights_digest(weights, plan)
    tree_new = tree_weights_digest(weights, plan)  # what the Trainer records and the Actor verifies against
    t0 = time.perf_counter()
    segs = list(encode_segments(extract(plan, ref, weights), 1, EncodeOptions()))
    delta_bytes = sum(len(s.data) for s in segs)
    staged = stage_segments([(f"segment {s.index}", s.data) for s in segs], 1, plan.specs())
    del segs
    say(f"delta encoded and decoded: {staged.nnz:,} changed elements, {delta_bytes:,} bytes ({time.perf_counter() - t0:.1f}s)")
    kernels.warm_up()

    def exact() -> bool:  # every weight, by sha256, against the new version's
        return tree_weights_digest(held(), plan) == tree_new

    def reset() -> None:
        engine.load_weights(ref, version=0)
        gc.collect()

    reset()
    copy_bytes = sum(t.numel() * t.element_size() for t in ref.values())
    swap_skipped = None
    if 3 * copy_bytes > swap_max_bytes:
        swap_skipped = (
            f"three copies of the weights ({copy_bytes / 1e9:.1f} GB each: the engine's, the base, the swap spare) "
            f"would pass {swap_max_bytes / 1e9:.1f} GB; run a smaller shape for the swap option"
        )
    result: dict[str, Any] = {
        "shape": shape if shape is not None else "qwen3",
        "params": geometry.params,
        "changed": int(staged.nnz),
        "delta_bytes": delta_bytes,
        "density": dens,
        "tensors_hf": geometry.hf_tensors,
        "tensors_engine": len(sources),
        "tensors_format": len(plan.params),
    }
    if isinstance(geometry, Qwen3MoeShape):
        result.update(layers=geometry.layers, experts=geometry.experts, experts_active=geometry.active)
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
    swapper = None if swap_skipped else TorchEngine(_Tokens(), EngineConfig(activation="swap"))
    fp8 = None if serve_dtype == "bf16" else TorchEngine(_Tokens(), EngineConfig(serve_dtype=serve_dtype))
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
            "fp8_prep",
            "fp8",
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
        exact_all &= got == tree_new  # verify_digest hashes the held weights themselves
        # Before preparation: the decoded delta applied and every weight hashed at the safe point.
        reset()
        t0 = clock()
        engine.apply(staged)
        t1 = clock()
        got = engine.digest()
        t2 = clock()
        out.update(pl_apply=t1 - t0, pl_digest=t2 - t1, pl=t2 - t0)
        exact_all &= got == digest_new  # hashed: after a plain apply the engine holds no prediction
        # The floor: one sorted, compiled pass per tensor.
        reset()
        now = held()
        jobs = [(bits_view(now[s]).numpy().view(b.dtype), i, b, x) for s, i, b, x in floor]
        t0 = clock()
        bare(jobs)
        out["bare"] = clock() - t0
        exact_all &= exact()
        # The option: written into a spare copy while generating, swapped in at the safe point.
        if swapper is not None:
            engine = swapper
            prep, apply_s, _, got = prepared_path()
            out.update(sw_prep=prep, sw=apply_s)
            exact_all &= got == tree_new
        # FP8 serving: the same prepared apply, the copy requantized inside the safe point.
        if fp8 is not None:
            engine = fp8
            prep, apply_s, _, got = prepared_path()
            out.update(fp8_prep=prep, fp8=apply_s)
            exact_all &= got == tree_new and fp8.serving_digest() == _scratch_fp8(held())
            engine = inplace
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
    del swapper, fp8  # the spare's and the FP8 copy's memory back
    gc.collect()
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
        swap_safe_point_s=min(runs["sw"]) if runs["sw"] else None,
        swap_prepare_s=min(runs["sw_prep"]) if runs["sw_prep"] else None,
        swap_skipped=swap_skipped,
        safe_point_s_fp8=min(runs["fp8"]) if runs["fp8"] else None,
        prepare_s_fp8=min(runs["fp8_prep"]) if runs["fp8_prep"] else None,
        fp8_over_bf16=min(runs["fp8"]) / min(runs["sp"]) if runs["fp8"] and min(runs["sp"]) > 0 else None,
        full_copy_s=min(runs["copy"]),
        safe_point_runs_s=[round(x, 4) for x in runs["sp"]],
        safe_point_runs_s_fp8=[round(x, 4) for x in runs["fp8"]] or None,
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
    result["peak_rss_gb"] = _peak_rss_gb()
    for k, v in list(result.items()):
        if isinstance(v, float):
            result[k] = round(v, 5)
    return result


def _scratch_fp8(weights: Mapping[str, torch.Tensor]) -> str:
    """Digest of the from-scratch FP8 quantization of ``weights`` (what an FP8 engine's copy must equal)."""
    from aurora_store.quant.weights import Fp8Weights

    return Fp8Weights.of(weights).digest()


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
    if r.get("safe_point_s_fp8") is not None:
        rows += [("fp8 serving: safe point (apply + requantize)", r["safe_point_s_fp8"]), ("fp8 serving: prepare", r["prepare_s_fp8"])]
    out = [
        f"activation of one delta: {r['params']:,} parameters ({r['shape']}, {r['tensors_hf']:,} checkpoint tensors, "
        f"{r['tensors_engine']:,} held by the engine), {r['changed']:,} changed ({r['delta_bytes']:,} bytes), "
        f"best of {r['reps']}, kernels {r['kernels']}, exact {r['exact']}",
        f"{'path':44s} {'seconds':>9s} {'x bare':>7s}",
    ]
    for name, s in rows:
        out.append(f"{name:44s} {'skipped':>9s}" if s is None else f"{name:44s} {s:9.4f} {s / bare:7.2f}")
    if r.get("swap_skipped"):
        out.append(f"swap skipped: {r['swap_skipped']}")
    if r.get("peak_rss_gb") is not None:
        out.append(f"peak resident memory {r['peak_rss_gb']:.2f} GB")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    log = None if args.json else (lambda m: print(m, file=sys.stderr))
    r = measure(args.params, args.density, args.reps, args.seed, log, shape=args.shape, serve_dtype=args.serve_dtype)
    print(json.dumps(r) if args.json else _table(r))
    return 0 if r["exact"] else 1
