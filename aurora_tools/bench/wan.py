"""``aurora bench wan``: the paper's comparisons over an emulated WAN, with the real workers.

Each configuration runs the Trainer, a Relay and Actors as processes (the
synthetic workload of :mod:`aurora_tools.synthetic`: simulated compute, real
weights, store, ledger and bus) with the Actors in a network namespace behind
a rate-limited veth and an impairing proxy (``aurora_tools.wan``). Modes
(``wan_sweep.MODES``): ``ideal``, ``full``, ``full-async2``, ``full-async4``,
``full-multistream``, ``delta-1stream``, ``delta``. Experiments: modes on the
headline link, transfer time against bandwidth, one against S streams on a
60 ms link with stalls, cross-region bytes with and without a Relay for 2, 4
and 8 Actors, uniform against proportional split with a 2x speed spread,
churn (an Actor killed, another joining) and scaling with Actor count.

Progress goes to stderr; stdout gets the table, or one JSON object with
``--json``. See docs/BENCHMARKS.md, "WAN (issue 7)".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from aurora_tools.bench.wan_sweep import (
    MODES,
    SweepOptions,
    attach_ideal,
    build_sweep,
    delta_over_wire_floor,
    finite,
    headline,
    targets,
)

__all__ = ["add_arguments", "run_benchmark", "format_table", "main"]

EXPERIMENTS = ("modes", "bandwidth", "streams", "relay", "hetero", "churn", "scaling", "regions", "fetch")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="reduced sweep (1e8 parameters, fewer steps): under 10 minutes here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--plot", metavar="DIR", default=None, help="write PNG plots into DIR")
    p.add_argument("--params", type=float, default=None, help="synthetic model size (default 1e9; 1e8 with --quick)")
    p.add_argument("--streams", type=int, default=4, help="S of the multi-stream modes (default 4)")
    p.add_argument(
        "--measure",
        type=int,
        default=0,
        help="steps measured per run (0: 2 quick, 1 for full weights; 4, or 3 for full weights, otherwise)",
    )
    p.add_argument("--warmup", type=int, default=-1, help="steps before them left out (default K + 1 for lag bound K)")
    p.add_argument("--experiments", default=",".join(EXPERIMENTS), help=f"comma list of {','.join(EXPERIMENTS)}")
    p.add_argument(
        "--net", choices=("auto", "netns", "loopback"), default="auto", help="auto: namespaces where permitted, else loopback proxies"
    )
    p.add_argument(
        "--s3",
        choices=("moto", "rclone"),
        default="moto",
        help="S3 server: moto (objects in memory) or rclone (files under the work folder; the Trainer commits through Redis)",
    )
    p.add_argument("--gen-window-s", type=float, default=0.0, help="simulated generation time per step (0: 45 s x params / 8.2e9)")
    p.add_argument("--train-s", type=float, default=-1.0, help="simulated training time per step (< 0: 0.3 x the generation window)")
    p.add_argument("--prompts-per-actor", type=int, default=16)
    p.add_argument(
        "--max-gbps", type=float, default=None, help="top of the bandwidth sweep (default: unshaped, as fast as this machine goes)"
    )
    p.add_argument("--workdir", default=None, help="logs of every process (default: a temporary folder)")
    p.add_argument("--modes", default=",".join(MODES), help="modes to run, in every experiment (default: all)")
    p.add_argument("--actors", type=int, default=2, help="Actors of the modes experiment (default 2)")
    p.add_argument("--digests", action="store_true", help="digest every version on both sides and report whether they match")
    p.add_argument("--save", metavar="PATH", default=None, help="also write the JSON object to PATH")
    p.add_argument("--config-timeout", type=float, default=900.0, help="give up on one configuration after this many seconds")


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from aurora_tools.bench.wan_run import Workload, run_config, servers

    t0 = time.perf_counter()
    exps = tuple(e for e in args.experiments.split(",") if e)
    bad = [e for e in exps if e not in EXPERIMENTS]
    if bad:
        raise SystemExit(f"unknown experiment(s) {bad}; choose from {EXPERIMENTS}")
    params = args.params if args.params is not None else (1e8 if args.quick else 1e9)
    modes = tuple(m for m in args.modes.split(",") if m)
    if any(m not in MODES for m in modes):
        raise SystemExit(f"unknown mode(s) in {modes}; choose from {tuple(MODES)}")
    opts = SweepOptions(
        quick=args.quick,
        streams=args.streams,
        measure=args.measure,
        warmup=args.warmup,
        max_gbps=args.max_gbps,
        experiments=exps,
        modes=modes,
        actors=args.actors,
    )
    configs = build_sweep(opts)
    wl = Workload(
        params=params, prompts_per_actor=args.prompts_per_actor, gen_window_s=args.gen_window_s, train_s=args.train_s, digests=args.digests
    )
    net = args.net
    if net == "auto":
        from aurora_tools.wan.host import wan_unavailable_reason

        reason = wan_unavailable_reason()
        net = "netns" if reason is None else "loopback"
        if reason is not None:
            log(f"network namespaces unavailable ({reason}): loopback proxies only, rate limits in userspace")
    load0 = os.getloadavg()[0]
    log(f"aurora bench wan: {len(configs)} runs, {params:.3g} parameters, net {net}")
    results: list[dict[str, Any]] = []
    s3_kind = getattr(args, "s3", "moto") or "moto"
    with servers(args.workdir, s3=s3_kind) as srv:
        log(f"S3 ({s3_kind}) {srv.s3_endpoint}, redis {srv.redis_url}, commits via {srv.commit_via}, logs {srv.workdir}/logs")
        for i, cfg in enumerate(configs):
            log(f"[{i + 1}/{len(configs)}] {cfg.name} ({', '.join(cfg.experiments)})")
            res = run_config(cfg, wl, srv, net, i, log, timeout_s=args.config_timeout)
            results.append(res)
            if res["error"]:
                log(f"    FAILED: {res['error']} (logs {res['logs']})")
            else:
                log(
                    f"    step {_f(res['step_s'])} s, transfer {_f(res['transfer_s'])} s, {_f(res['tokens_per_s'], 0)} tok/s, wall {res['wall_s']:.0f} s"
                )
    attach_ideal(configs, results)
    first = results[0] if results else {}
    out: dict[str, Any] = {
        "benchmark": "wan",
        "quick": bool(args.quick),
        "net_mode": net,
        "s3": s3_kind,
        "params": first.get("params"),
        "model_bytes": first.get("model_bytes"),
        "workload": {
            "gen_window_s": first.get("gen_window_s"),
            "train_s": first.get("train_s"),
            "prompts_per_actor": wl.prompts_per_actor,
            "group": wl.group,
            "tokens_per_completion": wl.tokens,
            "density": wl.density,
            "gen_window_rule": "45 s x params / 8.2e9 (the paper's Qwen3-8B window, scaled)" if not args.gen_window_s else "given",
        },
        "streams": args.streams,
        "configs": results,
        **headline(results),
        "delta_over_wire_floor": delta_over_wire_floor(results),
        "targets": targets(results),
        "measured_max_gbps": _max_rate(results),
        "cpus": os.cpu_count(),
        "load_average": [load0, os.getloadavg()[0]],
        "failed": sum(1 for r in results if r["error"]),
        "wall_s": time.perf_counter() - t0,
    }
    out = finite(out)
    if args.save:
        import json

        with open(args.save, "w") as f:
            json.dump(out, f)
    if args.plot:
        from aurora_tools.bench.wan_plot import write_plots

        written = write_plots(out, args.plot)
        out["plots"] = written
        log(f"plots: {', '.join(written)}")
    return out


def _max_rate(results: list[dict[str, Any]]) -> float | None:
    """Fastest fetch of a full version by an Actor over an unshaped link (Gbit/s): what this machine pushes."""
    best = None
    for r in results:
        if r.get("link_gbps") is None and r.get("transfer") == "full" and r.get("version_bytes") and r.get("fetch_s"):
            rate = r["version_bytes"] * 8 / 1e9 / r["fetch_s"]
            best = rate if best is None else max(best, rate)
    return best


def _f(x: Any, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _mb(x: Any) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"Aurora WAN benchmark ({'quick' if r['quick'] else 'full'} sweep): {r['params'] / 1e9:.3f} B parameters "
        f"({r['model_bytes'] / 1e9:.2f} GB bf16), network {r['net_mode']}",
        f"  workload: generation window {r['workload']['gen_window_s']:.2f} s/step ({r['workload']['gen_window_rule']}), "
        f"train {r['workload']['train_s']:.2f} s/step, {r['workload']['prompts_per_actor']} prompts per Actor, density {r['workload']['density']:.4f}",
        "",
        f"  {'run':<52} {'step s':>7} {'xfer s':>7} {'tok/s':>8} {'vs ideal':>8} {'MB/ver':>7} {'x-region MB/ver':>15} {'/ver':>5} {'exps'}",
    ]
    for c in r["configs"]:
        if c.get("error"):
            lines.append(f"  {c['name']:<52} FAILED: {c['error']}")
            continue
        lines.append(
            f"  {c['name']:<52} {_f(c['step_s']):>7} {_f(c['transfer_s']):>7} {_f(c['tokens_per_s'], 0):>8} {_f(c['throughput_vs_ideal'], 2):>8} "
            f"{_mb(c['version_bytes']):>7} {_mb(c['cross_region_bytes_per_version']):>15} {_f(c['cross_over_version'], 2):>5} {','.join(c['experiments'])}"
        )
    multi = [c for c in r["configs"] if not c.get("error") and c.get("cross_over_version_by_region") and len(c.get("regions") or ()) > 1]
    if multi:
        lines.append("")
        lines.append("  object bytes into each region per version, in deltas")
        for c in multi:
            per = ", ".join(
                f"{reg} ({link}): {x:.2f}"
                for (reg, x), link in zip(sorted(c["cross_over_version_by_region"].items()), c["regions"], strict=False)
            )
            lines.append(f"    {c['name']:<50} {per}")
    lines.append("")
    lines.append("  headline (modes, 1 Gbit/s, 20 ms RTT, 2 Actors): throughput relative to ideal")
    lines.append("    " + "  ".join(f"{m} {_f(r.get(m.replace('-', '_') + '_vs_ideal'), 2)}" for m in MODES if m != "ideal"))
    if r.get("delta_measured_batches_unassigned"):
        lines.append(
            f"    note: {r['delta_measured_batches_unassigned']} measured batch(es) of the delta run were assigned to no Actor when made "
            "(one Actor ran the whole batch): delta_vs_ideal is then about half; measure more steps (--measure)"
        )
    table = r.get("delta_over_wire_floor") or {}
    if table:
        lines.append("")
        lines.append("  delta fetch (first segment announced -> staged) over its wire floor, 1 Actor, clean link")
        lines.append(
            f"    {'Gbit/s':>6} {'floor s':>8} {'announced s':>12} {'x floor':>8} {'manifest-first s':>17} {'x floor':>8}   "
            "Trainer's first -> last segment s (announced, manifest-first)"
        )
        for g, row in table.items():
            lines.append(
                f"    {g:>6} {_f(row['wire_floor_s']):>8} {_f(row['announced_s']):>12} {_f(row['announced'], 2):>8} "
                f"{_f(row['manifest_first_s']):>17} {_f(row['manifest_first'], 2):>8}   "
                f"{_f(row.get('announced_span_s'))}, {_f(row.get('manifest_first_span_s'))}"
            )
    lines.append("")
    lines.append("  targets")
    for name, t in r["targets"].items():
        met = {True: "met", False: "NOT met", None: "n/a"}[t["met"]]
        v = t["value"]
        shown = ", ".join(f"{k}: {x:.3f}" for k, x in v.items()) if isinstance(v, dict) else f"{v:.3f}"
        lines.append(f"    {name:<32} {shown:<40} goal {t['goal']}: {met}")
    if r.get("measured_max_gbps"):
        lines.append(
            f"  this machine pushed at most {r['measured_max_gbps']:.2f} Gbit/s of objects into a region (unshaped link, full weights)"
        )
    lines.append(
        f"  {r['failed']} failed run(s); wall {r['wall_s']:.0f} s; {r['cpus']} CPUs, load average {r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from aurora_tools.bench import run_and_report

    return run_and_report(args, run_benchmark, format_table, lambda res: res["failed"] == 0)


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser(prog="python -m aurora_tools.bench.wan", description=__doc__.splitlines()[0])
    add_arguments(ap)
    sys.exit(main(ap.parse_args()))
