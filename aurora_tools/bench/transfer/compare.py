"""moto against ``rclone serve s3`` in one run: full-weight publishing and staging MB/s, server peak RSS.

``python -m aurora_tools.bench.transfer.compare [--params N] [--streams S] [--full-repeats R] [--json]``
runs :func:`~aurora_tools.bench.transfer.benchmark.run_benchmark` once per
server, same model, same step, same settings (delta runs once, the full
weights ``--full-repeats`` times per connection count, no boto3 reference), and
prints one table and one JSON object keyed by server: ``full_publish_mb_s``
(encode, upload and commit of the full weights over S connections),
``full_stage_mb_s``, ``delta_seconds_s`` and ``server_rss_peak_mb`` (the
server process's VmHWM). moto keeps every object in its memory; rclone
writes files (under a temporary folder) and commits through Redis.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from aurora_tools.bench.transfer.benchmark import run_benchmark
from aurora_tools.bench.transfer.options import add_arguments
from aurora_tools.bench.transfer.server import S3_KINDS

__all__ = ["compare", "main"]


def compare(args: argparse.Namespace, log: Any = lambda s: None) -> dict[str, Any]:
    out: dict[str, Any] = {"benchmark": "transfer-servers", "servers": {}}
    for kind in S3_KINDS:
        a = argparse.Namespace(**vars(args))
        a.s3, a.no_boto3, a.repeats, a.full_repeats = kind, True, 1, max(1, args.full_repeats)
        log(f"--- {kind}")
        r = run_benchmark(a, log)
        full = r["full"] or {}
        out["servers"][kind] = {
            "server": r["server"],
            "commit_via": r["commit_via"],
            "full_publish_mb_s": full.get("publish_mb_s_s"),
            "full_stage_mb_s": full.get("stage_mb_s_s"),
            "full_pipeline_mb_s": full.get("pipeline_mb_s_s"),
            "full_raw_put_mb_s": full.get("raw_mb_s_put_s"),
            "full_bytes": r["bytes_full"],
            "delta_seconds_s": r["seconds_s_streams"],
            "server_rss_peak_mb": r["server_rss_peak_mb"],
            "lossless": r["lossless"],
            "loadavg": [r["loadavg_before"][0], r["loadavg_after"][0]],
        }
        out.update(params=r["params"], streams=r["streams"], full_repeats=a.full_repeats)
    return out


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"S3 servers, {r['params'] / 1e6:.0f} M params, {r['streams']} connections, best of {r['full_repeats']} full-weight run(s)",
        f"{'server':<8} {'publish MB/s':>13} {'stage MB/s':>11} {'raw put MB/s':>13} {'delta s':>8} {'peak RSS MB':>12} {'commit':>7} lossless",
    ]
    for kind, s in r["servers"].items():
        lines.append(
            f"{kind:<8} {s['full_publish_mb_s'] or 0:>13.1f} {s['full_stage_mb_s'] or 0:>11.1f} {s['full_raw_put_mb_s'] or 0:>13.1f} "
            f"{s['delta_seconds_s']:>8.3f} {s['server_rss_peak_mb'] or 0:>12.0f} {s['commit_via']:>7} {'yes' if s['lossless'] else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aurora_tools.bench.transfer.compare", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    r = compare(args, (lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    if not args.json:
        print(format_table(r))
    print(json.dumps(r))
    return 0 if all(s["lossless"] for s in r["servers"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
