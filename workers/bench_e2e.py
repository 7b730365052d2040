"""``aurora bench e2e``: what the weight path adds to a step, with one-step asynchrony.

Runs the demo's workload twice in one invocation, on the same machine and
servers: with the weight path (every version published as a delta, staged
and activated by every Actor) and without it (the ideal baseline: versions
trained but never shipped, every batch generated on v0). The difference in
mean step time is what shipping weights costs end to end.

Reported per step: the Trainer's wait for rollouts (generation it could not
hide), training, extract + publish, and the Actors' stage and activation
times (off the critical path: they overlap generation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from typing import Any

from .demo import DemoConfig, DemoResult, run_system_demo

__all__ = ["add_arguments", "main", "summarize"]


def summarize(res: DemoResult, skip: int) -> dict[str, Any]:
    logs = res.logs[skip:] or res.logs
    acts = list(res.activations.values())

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else 0.0

    return {
        "steps_measured": len(logs),
        "step_s": mean([lg.step_s for lg in logs]),
        "wait_rollouts_s": mean([lg.wait_s for lg in logs]),
        "train_s": mean([lg.train_s for lg in logs]),
        "extract_publish_s": mean([lg.extract_publish_s for lg in logs]),
        "stage_s": mean([a["stage_s"] for a in acts]),
        "activate_s": mean([a["activate_s"] for a in acts]),
        "tokens_per_s": mean([lg.tokens_per_s for lg in logs]),
        "delta_bytes": mean([float(lg.delta_bytes) for lg in logs]),
        "reward_last": mean([lg.reward for lg in res.logs[-3:]]),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the means")
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    from aurora_store.testing.servers import RedisServer

    from .common import limit_torch_threads

    limit_torch_threads()
    out: dict[str, Any] = {}
    results = {}
    with RedisServer() as rs:
        for mode, transfer in (("aurora", True), ("ideal", False)):
            cfg = DemoConfig(
                steps=args.steps, batch=args.batch, actors_relay=2, actors_origin=2, kill_at=-1, join_at=-1,
                redis=rs.url, run=f"bench-{mode}", workdir=tempfile.mkdtemp(prefix=f"aurora-bench-{mode}-"),
                display=False, weight_transfer=transfer,
            )
            if not args.json:
                print(f"running {mode} ({'weights shipped as deltas' if transfer else 'no weight transfer'}), {args.steps} steps ...", flush=True)
            res = run_system_demo(cfg, say=lambda *a, **k: None)
            results[mode] = res
            out[mode] = summarize(res, args.skip)
    a, i = out["aurora"], out["ideal"]
    out["weight_path_overhead_fraction"] = (a["step_s"] - i["step_s"]) / i["step_s"] if i["step_s"] > 0 else None
    out["bit_identical"] = results["aurora"].bit_identical
    out["target"] = {"weight_path_overhead_fraction_max": 0.05, "met": out["weight_path_overhead_fraction"] is not None and out["weight_path_overhead_fraction"] < 0.05}
    if args.json:
        print(json.dumps(out))
        return 0
    rows = ("step_s", "wait_rollouts_s", "train_s", "extract_publish_s", "stage_s", "activate_s", "tokens_per_s", "delta_bytes", "reward_last")
    print(f"\n{'per step (mean)':<22} {'aurora':>12} {'ideal':>12}")
    for k in rows:
        print(f"{k:<22} {a[k]:>12.4f} {i[k]:>12.4f}")
    f = out["weight_path_overhead_fraction"]
    print(f"\nweight path overhead: {100 * f:+.1f}% of step time (target < 5%: {'met' if out['target']['met'] else 'NOT met'}); bit-identical: {out['bit_identical']}")
    return 0
