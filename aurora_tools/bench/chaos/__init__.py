"""``aurora bench chaos``: the real workers on the tiny GRPO task under a fixed, seeded fault schedule.

The Trainer, a Relay with two Actors behind it and one Actor reading origin
run as separate processes against a ``redis-server`` (with an AOF) and an
S3 server in a child process. As the run publishes versions the harness
breaks things, one after another (docs/FAILURES.md describes each fault and
what should happen): Redis restarted from its AOF and without its data, the
S3 server paused, the Trainer SIGKILLed mid-publish and resumed, an
old-epoch Trainer woken, an Actor SIGKILLed and one SIGSTOPped past its
lease, the Relay killed, an origin object corrupted.

It prints a table of each fault, the phase it hit and what the run did,
and the run's guarantees computed from the evidence it left (logs, digest
files, the manifests in the store); ``--json`` prints one object instead.
docs/BENCHMARKS.md ("Chaos") defines every key. Exit status 0 when every
target is met. It ends on its own within ``--timeout-s`` (default 900).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from typing import Any

from aurora_tools.bench.chaos.config import FAULTS, ChaosConfig

__all__ = ["ChaosConfig", "FAULTS", "add_arguments", "main", "run_chaos"]


def run_chaos(cfg: ChaosConfig, workdir: str | None = None, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """One chaos run; returns the ``--json`` object. ``workdir`` keeps the logs (default: a temporary folder)."""
    from aurora_tools.bench.chaos.evidence import summarize
    from aurora_tools.bench.chaos.harness import ChaosRun

    run = ChaosRun(cfg, workdir, say)
    try:
        run.execute()
        return summarize(run)
    finally:
        run.close()


def _faults(text: str) -> tuple[str, ...]:
    if text.strip() in ("all", ""):
        return FAULTS
    if text.strip() == "none":
        return ()
    names = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in names if f not in FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULTS)}")
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ChaosConfig()
    p.add_argument("--steps", type=int, default=None, help=f"Trainer steps (default {d.steps})")
    p.add_argument("--batch", type=int, default=None, help=f"prompts per step (default {d.batch})")
    p.add_argument("--group", type=int, default=None, help=f"completions per prompt (default {d.group})")
    p.add_argument("--seed", type=int, default=None, help="seeds the Trainer and the schedule's choices (default 0)")
    p.add_argument(
        "--faults",
        type=_faults,
        default=None,
        metavar="LIST",
        help=f"comma-separated faults to inject, always in schedule order, or all / none (default all: {','.join(FAULTS)})",
    )
    p.add_argument(
        "--s3-pause-s", type=float, default=None, metavar="S", help=f"how long the S3 server stays paused (default {d.s3_pause_s:g})"
    )
    p.add_argument("--redis-down-s", type=float, default=None, metavar="S", help=f"Redis downtime per restart (default {d.redis_down_s:g})")
    p.add_argument(
        "--actor-stop-s",
        type=float,
        default=None,
        metavar="S",
        help=f"how long the stopped Actor stays stopped, at least past its lease (default {d.actor_stop_s:g})",
    )
    p.add_argument("--relay-down-s", type=float, default=None, metavar="S", help=f"Relay downtime (default {d.relay_down_s:g})")
    p.add_argument(
        "--outage-budget-s", type=float, default=None, metavar="S", help=f"every worker's --outage-budget-s (default {d.outage_budget_s:g})"
    )
    p.add_argument(
        "--actor-slowdown",
        type=float,
        default=None,
        metavar="X",
        help=f"the Actors' --slowdown: paces the run (default {d.actor_slowdown:g})",
    )
    p.add_argument(
        "--timeout-s", type=float, default=None, metavar="S", help=f"end everything after this long and report (default {d.timeout_s:g})"
    )
    p.add_argument(
        "--dir", default=None, help="work folder for logs and digest files (default: a temporary one, removed when every target is met)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def main(args: argparse.Namespace) -> int:
    from aurora_tools.bench import run_and_report
    from aurora_tools.bench.chaos.report import table

    cfg = ChaosConfig.from_env(
        steps=args.steps,
        batch=args.batch,
        group=args.group,
        seed=args.seed,
        faults=args.faults,
        s3_pause_s=args.s3_pause_s,
        redis_down_s=args.redis_down_s,
        actor_stop_s=args.actor_stop_s,
        relay_down_s=args.relay_down_s,
        outage_budget_s=args.outage_budget_s,
        actor_slowdown=args.actor_slowdown,
        timeout_s=args.timeout_s,
    )
    workdir = os.path.abspath(args.dir) if args.dir else None
    if workdir:
        os.makedirs(workdir, exist_ok=True)

    def run(_args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
        res = run_chaos(cfg, workdir or tempfile.mkdtemp(prefix="aurora-chaos-"), say)
        if workdir is None and res["targets"]["met"]:
            import shutil

            shutil.rmtree(res["workdir"], ignore_errors=True)
            res["workdir"] = None
        return res

    return run_and_report(args, run, table, lambda r: bool(r["targets"]["met"]))
