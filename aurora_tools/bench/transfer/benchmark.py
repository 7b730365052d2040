"""Every measurement of ``aurora bench transfer``, interleaved, and the JSON-ready summary."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aurora_tools.bench.transfer.options import (
    DEFAULT_PARAMS,
    MIB,
    TARGET_OVER_RAW,
    TARGET_SPEEDUP,
    auto_size,
    encode_options,
)
from aurora_tools.bench.transfer.runs import (
    Run,
    delta_cpu_costs,
    full_cpu_costs,
    pipeline_delta,
    pipeline_full,
    raw_transfer,
)
from aurora_tools.bench.transfer.server import RedisCommits, rss_peak_mb, s3_server

__all__ = ["run_benchmark"]


def _best_run(runs: Sequence[Run]) -> Run:
    """The fastest run: on a shared machine, slower runs measure the neighbours.

    A whole run (not the best of each part) so that its parts add up.
    """
    return min(runs, key=lambda r: r.total_s)


def _lossless(runs: Sequence[Run]) -> bool:
    checked = [r.lossless for r in runs if r.lossless is not None]
    return bool(checked) and all(checked)


def _section(
    runs: Mapping[tuple[str, int], Sequence[Run]],
    streams: int,
    nbytes: int,
    cpu: Mapping[str, float],
) -> dict[str, Any]:
    """Summary of one payload: the best run of each variant, ratios, phases."""
    med = {k: _best_run(v) for k, v in runs.items()}
    pipe1, pipes = med[("pipeline", 1)], med[("pipeline", streams)]
    raw1, raws = med[("raw", 1)], med[("raw", streams)]
    mb = nbytes / 1e6
    out: dict[str, Any] = {
        "seconds_1_stream": round(pipe1.total_s, 4),
        "seconds_s_streams": round(pipes.total_s, 4),
        "speedup_streams": round(pipe1.total_s / pipes.total_s, 3),
        "pipeline_over_raw": round(pipes.total_s / raws.total_s, 3),
        "pipeline_over_raw_1_stream": round(pipe1.total_s / raw1.total_s, 3),
        # The same ratio in CPU seconds (client + server): what the pipeline
        # costs beyond moving the bytes, and far less sensitive than wall time
        # to other programs sharing the machine.
        "cpu_over_raw": round(pipes.cpu_s / max(1e-9, raws.cpu_s), 3),
        "cpu_s_pipeline_s": round(pipes.cpu_s, 3),
        "cpu_s_raw_s": round(raws.cpu_s, 3),
        "raw_seconds_1": round(raw1.total_s, 4),
        "raw_seconds_s": round(raws.total_s, 4),
        "raw_speedup_streams": round(raw1.total_s / raws.total_s, 3),
        "raw_mb_s_put_1": round(mb / raw1.publish_s, 1),
        "raw_mb_s_get_1": round(mb / raw1.fetch_s, 1),
        "raw_mb_s_put_s": round(mb / raws.publish_s, 1),
        "raw_mb_s_get_s": round(mb / raws.fetch_s, 1),
        "pipeline_mb_s_1": round(mb / pipe1.total_s, 1),
        "pipeline_mb_s_s": round(mb / pipes.total_s, 1),
        # Publishing alone (encode + upload + commit) and staging alone, over S connections.
        "publish_mb_s_s": round(mb / max(1e-9, pipes.publish_s), 1),
        "stage_mb_s_s": round(mb / max(1e-9, pipes.fetch_s), 1),
        # Where the S-connection pipeline's time goes. encode/verify/decode are
        # serial CPU costs measured alone; upload/fetch are wall seconds with at
        # least one segment transfer in flight during the run; publish/stage are
        # the two halves of the run's wall time.
        "phases": {
            "encode": round(cpu["encode"], 4),
            "upload": round(pipes.upload_s, 4),
            "commit": round(pipes.commit_s, 4),
            "publish": round(pipes.publish_s, 4),
            "fetch": round(pipes.get_s, 4),
            "manifest_get": round(pipes.manifest_get_s, 4),
            "verify": round(cpu["verify"], 4),
            "decode": round(cpu["decode"], 4),
            "stage": round(pipes.fetch_s, 4),
        },
        # Checked on the first run of each connection count (a check costs a
        # copy of the model, an apply and a digest of every weight).
        "lossless_1": _lossless(runs[("pipeline", 1)]),
        "lossless_s": _lossless(runs[("pipeline", streams)]),
        "runs": {f"{k}_{'1' if s == 1 else 's'}": r.summary() for (k, s), r in med.items()},
        "samples": {f"{k}_{'1' if s == 1 else 's'}": [round(r.total_s, 4) for r in rs] for (k, s), rs in runs.items()},
    }
    out["lossless"] = out["lossless_1"] and out["lossless_s"]
    if ("boto3", 1) in med:
        b1, bs = med[("boto3", 1)], med[("boto3", streams)]
        out.update(
            {
                "boto3_seconds_1": round(b1.total_s, 4),
                "boto3_seconds_s": round(bs.total_s, 4),
                "boto3_mb_s_put_1": round(mb / b1.publish_s, 1),
                "boto3_mb_s_get_1": round(mb / b1.fetch_s, 1),
                "boto3_mb_s_put_s": round(mb / bs.publish_s, 1),
                "boto3_mb_s_get_s": round(mb / bs.fetch_s, 1),
                "pipeline_over_boto3": round(pipes.total_s / bs.total_s, 3),
            }
        )
    return out


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run every measurement; returns the JSON-ready result."""
    from aurora_store.apply.sink import FusedWeights, apply_delta, weights_digest
    from aurora_store.codec.extract import extract, fuse_weights, plan_of
    from aurora_store.format.checkpoint import DEFAULT_SEGMENT_BYTES, encode_segments
    from aurora_store.lineage.publish import DEFAULT_SHARD_BYTES
    from aurora_tools.synthetic.shapes import MasterWeights, make_weights, shape_for_params

    streams = int(getattr(args, "streams", 8) or 8)
    if not 2 <= streams <= 256:
        raise ValueError(f"--streams must be 2..256 (it is compared with 1), got {streams}")
    seed = int(getattr(args, "seed", 0) or 0)
    lr = float(getattr(args, "lr", 2.5e-7))
    warmup = max(0, int(getattr(args, "warmup_steps", 1)))
    repeats = max(1, int(getattr(args, "repeats", 5)))
    full_repeats = max(1, int(getattr(args, "full_repeats", 1)))
    server_mode = str(getattr(args, "server", "process"))
    s3_kind = str(getattr(args, "s3", "moto") or "moto")
    rtt_ms = float(getattr(args, "rtt_ms", 0.0) or 0.0)
    rate_mbit = float(getattr(args, "rate_mbit", 0.0) or 0.0)
    do_full = not getattr(args, "no_full", False)
    do_boto3 = not getattr(args, "no_boto3", False)
    max_conc = int(getattr(args, "s3fs_max_concurrency", 0) or 0)
    options = encode_options(args)
    started = time.perf_counter()
    load_before = os.getloadavg()

    params = getattr(args, "params", None)
    shape = shape_for_params(DEFAULT_PARAMS if params is None else params)
    log(f"model: {shape.params / 1e6:.1f} M parameters ({shape}); making weights and one step")
    t0 = time.perf_counter()
    weights = make_weights(shape, seed=seed)
    master = MasterWeights(weights, seed=seed)
    for _ in range(warmup):
        weights = master.step(lr=lr)  # the base: the version before the measured step
    new = master.step(lr=lr)
    del master
    gen_s = time.perf_counter() - t0
    plan = plan_of(weights, tied=False)
    specs = plan.specs()
    numel = sum(p.spec.numel for p in plan)
    t0 = time.perf_counter()
    deltas = list(extract(plan, weights, new))
    extract_s = time.perf_counter() - t0
    nnz = sum(d.nnz for d in deltas)
    base_fused = fuse_weights(weights, plan)
    new_fused = fuse_weights(new, plan)
    del weights
    expect = weights_digest(new, plan)
    del new
    full_bytes = sum(t.numel() * t.element_size() for t in new_fused.values())

    def lossless(staged: Any) -> bool:
        sink = FusedWeights({n: t.clone() for n, t in base_fused.items()})
        apply_delta(staged, sink)
        return weights_digest(sink.tensors) == expect

    seg_mib = float(getattr(args, "segment_mib", 0.0) or 0.0)
    if seg_mib > 0:
        segment_bytes = int(seg_mib * MIB)
    else:
        dry = sum(len(s.data) for s in encode_segments(deltas, 1, options))
        segment_bytes = auto_size(dry, streams, 64 << 10, DEFAULT_SEGMENT_BYTES)
    shard_mib = float(getattr(args, "shard_mib", 0.0) or 0.0)
    shard_bytes = int(shard_mib * MIB) if shard_mib > 0 else auto_size(full_bytes, streams, MIB, DEFAULT_SHARD_BYTES)
    log(f"delta: {nnz} changed ({100 * nnz / numel:.2f} %), segments of {segment_bytes / MIB:.2f} MiB")
    raws = ("raw", "boto3") if do_boto3 else ("raw",)

    server_rss: float | None = None
    with contextlib.ExitStack() as stack:
        srv, pid = stack.enter_context(s3_server(server_mode, rtt_ms, rate_mbit, kind=s3_kind))
        # A server that ignores conditional writes: every version commits through Redis (docs/STORE.md).
        commits = stack.enter_context(RedisCommits()) if s3_kind == "rclone" else None
        bucket = srv.new_bucket("bench")
        druns: dict[tuple[str, int], list[Run]] = {}
        for rep in range(repeats):
            # Interleaved, so that a noisy neighbour hurts every variant alike.
            for s in (1, streams):
                p = pipeline_delta(
                    srv,
                    pid,
                    bucket,
                    deltas,
                    specs,
                    s,
                    segment_bytes,
                    options,
                    max_conc,
                    lossless if rep == 0 else None,
                    commits,
                )
                druns.setdefault(("pipeline", s), []).append(p)
                line = f"delta  rep {rep} x{s:<3} pipeline {p.total_s:.3f}s"
                for kind in raws:
                    r = raw_transfer(
                        srv,
                        pid,
                        bucket,
                        p.objects,
                        p.manifest,
                        s,
                        "boto3" if kind == "boto3" else "s3fs",
                    )
                    druns.setdefault((kind, s), []).append(r)
                    line += f" {kind} {r.total_s:.3f}s"
                log(line)
        first = druns[("pipeline", 1)][0]
        segs = first.objects
        delta_bytes = sum(len(o) for o in segs)
        delta = _section(
            druns,
            streams,
            delta_bytes,
            delta_cpu_costs(deltas, segs, specs, options, segment_bytes),
        )
        delta["phases"]["extract"] = round(extract_s, 4)
        delta.update(
            {
                "bytes": delta_bytes,
                "objects": len(segs),
                "object_bytes_max": max(len(o) for o in segs),
                "segment_bytes": segment_bytes,
                "manifest_bytes": len(first.manifest),
            }
        )
        for rs in druns.values():
            for r in rs:
                r.objects = []
        full: dict[str, Any] | None = None
        if do_full:
            fruns: dict[tuple[str, int], list[Run]] = {}
            shards: list[bytes] = []
            manifest = b""
            for rep in range(full_repeats):
                for s in (1, streams):
                    p = pipeline_full(srv, pid, bucket, new_fused, s, shard_bytes, expect, max_conc, commits)
                    fruns.setdefault(("pipeline", s), []).append(p)
                    # Keep one copy of the shards only.
                    shards, manifest, p.objects = p.objects, p.manifest, []
                    line = f"full   rep {rep} x{s:<3} pipeline {p.total_s:.3f}s"
                    for kind in raws:
                        r = raw_transfer(
                            srv,
                            pid,
                            bucket,
                            shards,
                            manifest,
                            s,
                            "boto3" if kind == "boto3" else "s3fs",
                        )
                        fruns.setdefault((kind, s), []).append(r)
                        line += f" {kind} {r.total_s:.3f}s"
                    log(line)
            full = _section(fruns, streams, full_bytes, full_cpu_costs(new_fused, shards))
            full.update(
                {
                    "bytes": sum(len(o) for o in shards),
                    "objects": len(shards),
                    "object_bytes_max": max(len(o) for o in shards),
                    "shard_bytes": shard_bytes,
                    "manifest_bytes": len(manifest),
                }
            )
            del shards
        endpoint = srv.endpoint
        server_rss = rss_peak_mb(pid)

    t: dict[str, Any] = {
        "speedup_streams_min": TARGET_SPEEDUP,
        "pipeline_over_raw_max": TARGET_OVER_RAW,
    }
    for name, sec in (("delta", delta), ("full", full)):
        t[f"{name}_speedup_met"] = None if sec is None else sec["speedup_streams"] >= TARGET_SPEEDUP
        t[f"{name}_pipeline_over_raw_met"] = None if sec is None else sec["pipeline_over_raw"] <= TARGET_OVER_RAW
    return {
        "benchmark": "transfer",
        "params": shape.params,
        "model": dataclasses.asdict(shape),
        "streams": streams,
        "seed": seed,
        "lr": lr,
        "warmup_steps": warmup,
        "repeats": repeats,
        "full_repeats": full_repeats,
        "server": (
            f"rclone serve s3 (child process, files on disk; commits through Redis) at {endpoint}"
            if s3_kind == "rclone"
            else f"moto S3 ({'child process' if server_mode == 'process' else 'thread of the client'}) at {endpoint}"
        )
        + (f" through the WAN proxy ({rtt_ms:g} ms RTT{f', {rate_mbit:g} Mbit/s' if rate_mbit else ''})" if rtt_ms or rate_mbit else ""),
        "s3": s3_kind,
        "commit_via": "redis" if s3_kind == "rclone" else "store",
        "server_rss_peak_mb": server_rss,
        "full_publish_mb_s": None if full is None else full.get("publish_mb_s_s"),
        "rtt_ms": rtt_ms,
        "rate_mbit": rate_mbit or None,
        "client": "s3fs (aiobotocore)" + (f", max_concurrency={max_conc}" if max_conc else ", s3fs defaults"),
        "encode_options": dataclasses.asdict(options),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "density": round(nnz / numel, 6),
        "nnz": nnz,
        "generate_s": round(gen_s, 2),
        # Headline numbers: the delta, the payload Aurora ships every step.
        "seconds_1_stream": delta["seconds_1_stream"],
        "seconds_s_streams": delta["seconds_s_streams"],
        "speedup_streams": delta["speedup_streams"],
        "pipeline_over_raw": delta["pipeline_over_raw"],
        "bytes_delta": delta["bytes"],
        "bytes_full": full["bytes"] if full else full_bytes,
        "phases": delta["phases"],
        "raw_mb_s_put_1": delta["raw_mb_s_put_1"],
        "raw_mb_s_get_1": delta["raw_mb_s_get_1"],
        "raw_mb_s_put_s": delta["raw_mb_s_put_s"],
        "raw_mb_s_get_s": delta["raw_mb_s_get_s"],
        "lossless": bool(delta["lossless"] and (full is None or full["lossless"])),
        "delta": delta,
        "full": full,
        "targets": t,
        "wall_s": round(time.perf_counter() - started, 1),
    }
