"""The table of ``aurora bench transfer``, and its entry point."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from aurora_tools.bench.transfer.benchmark import run_benchmark
from aurora_tools.bench.transfer.options import MIB, TARGET_OVER_RAW, TARGET_SPEEDUP

__all__ = ["format_table", "main"]


def format_table(r: Mapping[str, Any]) -> str:
    s = r["streams"]
    m = r["model"]
    d, f = r["delta"], r["full"]
    out = [
        f"Aurora transfer benchmark: publish-to-staged vs raw S3, 1 vs {s} connections",
        f"  model   Qwen3-shaped, {r['params'] / 1e6:.1f} M params (hidden {m['hidden']}, {m['layers']} layers, "
        f"vocab {m['vocab']}), bf16 {r['bytes_full'] / 1e6:.1f} MB; step {r['warmup_steps'] + 1} at lr {r['lr']:g}: "
        f"density {100 * r['density']:.2f} % ({r['nnz']} changed)",
        f"  server  {r['server']}; client {r['client']}; {r['cpus']} CPUs, load average "
        f"{r['loadavg_before'][0]:.1f} before, {r['loadavg_after'][0]:.1f} after"
        + (f"; server peak RSS {r['server_rss_peak_mb']:.0f} MB" if r.get("server_rss_peak_mb") is not None else ""),
        f"  delta   {d['bytes'] / 1e6:.2f} MB in {d['objects']} segments (<= {d['segment_bytes'] / MIB:.2f} MiB) + "
        f"{d['manifest_bytes']} B manifest, {r['bytes_full'] / max(1, d['bytes']):.0f}x smaller than full; "
        f"best of {r['repeats']} runs",
    ]
    if f:
        out.append(
            f"  full    {f['bytes'] / 1e6:.1f} MB in {f['objects']} shards (target {f['shard_bytes'] / MIB:.0f} MiB, "
            f"largest {f['object_bytes_max'] / 1e6:.1f} MB: a shard holds whole tensors); "
            f"best of {r['full_repeats']} run(s)"
        )
    out.append("")
    hdr = (
        f"  {'payload':<7} {'conns':>5} {'publish':>8} {'stage':>7} {'total':>7} │ {'raw put':>8} {'raw get':>8} "
        f"{'raw':>7} {'pipe/raw':>8} │ {'MB/s pipe':>9} {'raw put/get':>11} {'boto3 put/get':>13} │ {'cpu c+s':>8} {'lossless':>8}"
    )
    out.append(hdr)
    out.append("  " + "-" * (len(hdr) - 2))
    for name, sec in (("delta", d), ("full", f)):
        if not sec:
            continue
        for key, conns in (("1", 1), ("s", s)):
            p = sec["runs"][f"pipeline_{key}"]
            w = sec["runs"][f"raw_{key}"]
            cpu = p["cpu_client_s"] + (p["cpu_server_s"] or 0.0)
            boto = (
                f"{sec[f'boto3_mb_s_put_{key}']:>6.0f}/{sec[f'boto3_mb_s_get_{key}']:<6.0f}"
                if f"boto3_mb_s_put_{key}" in sec
                else f"{'-':>13}"
            )
            ok = "yes" if sec[f"lossless_{key}"] else "NO"
            out.append(
                f"  {name:<7} {conns:>5} {p['publish_s']:>7.3f}s {p['fetch_s']:>6.3f}s {p['seconds']:>6.3f}s │ "
                f"{w['publish_s']:>7.3f}s {w['fetch_s']:>7.3f}s {w['seconds']:>6.3f}s {p['seconds'] / w['seconds']:>7.2f}x │ "
                f"{sec[f'pipeline_mb_s_{key}']:>9.1f} {sec[f'raw_mb_s_put_{key}']:>5.0f}/{sec[f'raw_mb_s_get_{key}']:<5.0f} "
                f"{boto} │ {cpu:>7.2f}s {ok:>8}"
            )
    out.append("")
    out.append(
        f"  phases at {s} connections, seconds (encode, verify, decode: serial CPU measured alone; "
        "upload, fetch: wall time with a transfer in flight)"
    )
    for name, sec in (("delta", d), ("full", f)):
        if not sec:
            continue
        ph = sec["phases"]
        extra = f"extract {ph['extract']:.3f} (not timed above)  " if "extract" in ph else ""
        out.append(
            f"    {name:<6} {extra}encode {ph['encode']:.3f}  upload {ph['upload']:.3f}  commit {ph['commit']:.3f}"
            f"  | fetch {ph['fetch']:.3f}  verify {ph['verify']:.3f}  decode {ph['decode']:.3f}"
        )
    out.append("")
    t = r["targets"]
    for name, sec in (("delta", d), ("full", f)):
        if not sec:
            continue
        sp_ok, ov_ok = t[f"{name}_speedup_met"], t[f"{name}_pipeline_over_raw_met"]
        out.append(
            f"  {name:<6} {s} vs 1 connection {sec['speedup_streams']:.2f}x (target >= {TARGET_SPEEDUP}x: "
            f"{'met' if sp_ok else 'missed'}; raw transfer itself {sec['raw_speedup_streams']:.2f}x); "
            f"pipeline/raw at {s}: {sec['pipeline_over_raw']:.2f}x (target <= {TARGET_OVER_RAW}x: "
            f"{'met' if ov_ok else 'missed'}; in CPU seconds {sec['cpu_over_raw']:.2f}x)"
        )
    out.append(
        f"  lossless: {'yes' if r['lossless'] else 'NO'} (staged delta applied to the base == new weights, "
        "bit for bit; fetched snapshot == the weights)"
    )
    out.append(f"  wall {r['wall_s']:.0f}s, of which {r['generate_s']:.0f}s making the synthetic model and its update")
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    """``aurora bench transfer``: exit status 0 when everything staged was lossless."""
    from aurora_tools.bench import run_and_report

    return run_and_report(args, run_benchmark, format_table, lambda result: bool(result["lossless"]))
