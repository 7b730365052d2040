"""``aurora bench ledger``: the Redis job ledger under a simulated fleet of Actors.

What is measured, against a ``redis-server`` this program starts on
127.0.0.1 (a free port) and stops when it ends, or with ``--cluster`` a Redis
Cluster of three masters with one replica each
(:class:`aurora_store.testing.cluster.RedisCluster`; the run's keys share one
hash tag, so the run lives on one master):

- N simulated Actors (``--actors``, a sweep such as 8 32 128 256 1000) in
  ``--regions`` regions, interleaved over ``--workers`` processes (processes,
  not threads: threads would measure the GIL), each process with its own
  connection and server-clock :class:`~aurora_store.coordination.ledger.Ledger`,
  so what is timed is the ledger's real scripts, not a mock.
- A Trainer (this process) runs ``--steps`` steps (default: enough for
  ``--prompts`` in all, at least 3) of ``--step-prompts`` prompts each
  (default: ``claim`` per Actor, at least 2,000), split by the scheduler over
  the Actors alive at creation, one step ahead of the Actors; every Actor
  heartbeats, claims and settles in every step. Some leases are left to
  expire (``--expire``) and some Actors leave and are replaced by new ones
  (``--churn``) every step: see :mod:`.sim`.
- ``--settle many`` settles a claimed batch with one ``settle_many`` (one
  script per batch); ``--settle single`` settles each lease on its own.

Reported per configuration: settled prompts per second (wall clock from the
first step's start to the last settlement), p50/p99 latency of a settle
request (ms), Redis round trips and commands per settled prompt as the
Actors sent them (:mod:`.counting`), commands per prompt as the server
executed them, the ones inside Lua scripts included (``INFO
commandstats``), and the server's CPU time per settled prompt (``INFO cpu``
around the measured window). Every step is checked: each prompt accepted
exactly once, nothing refused but settlements later than their lease
(``late_settles``, when the box starves a process for longer than ``--lease-ms``).

On one machine nothing waits on the network: the worker processes, the
Trainer and the single-threaded Redis server share the cores, so these are
CPU-bound numbers (client-side Python is usually the limit, not Redis).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any

import redis

from aurora_store.lineage.results import DEFAULT_INLINE_MAX_BYTES
from aurora_tools.bench.ledger.counting import (
    CallCounter,
    CountingConnection,
    counting_client,
    counting_cluster_client,
)
from aurora_tools.bench.ledger.results import through_store
from aurora_tools.bench.ledger.sim import SimConfig, run_config

__all__ = [
    "add_arguments",
    "main",
    "run_benchmark",
    "run_config",
    "SimConfig",
    "CallCounter",
    "CountingConnection",
    "counting_client",
    "counting_cluster_client",
]

#: Targets reported (not asserted).
TARGET_SETTLED_PER_S = 5_000.0
TARGET_ROUND_TRIPS_PER_PROMPT = 10.0
TARGET_P99_SETTLE_MS = 20.0
DEFAULT_ACTORS = (8, 32, 128, 256, 1000)
_PENDING_STORE = "pending:"
"""A results store still to be made (a temporary directory): no ``--results-store`` was given."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--actors",
        type=int,
        nargs="+",
        default=list(DEFAULT_ACTORS),
        help="simulated Actor counts to sweep (default: 8 32 128 256 1000); the largest is the headline",
    )
    parser.add_argument("--regions", type=int, default=3, help="regions the Actors are spread over (default 3)")
    parser.add_argument(
        "--prompts",
        type=int,
        default=40_000,
        help="prompts per configuration, in all (sets --steps)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="steps per configuration (0: prompts / step prompts, at least 3)",
    )
    parser.add_argument(
        "--step-prompts",
        type=int,
        default=0,
        help="prompts per step (0: claim x actors, at least 2000)",
    )
    parser.add_argument("--claim", type=int, default=8, help="leases an Actor asks for per claim")
    parser.add_argument(
        "--workers",
        type=int,
        default=max(1, os.cpu_count() or 1),
        help="processes the Actors are interleaved over (default: one per CPU)",
    )
    parser.add_argument(
        "--settle",
        choices=("single", "many"),
        default="many",
        help="one settle_many per claimed batch (many: what Actors do, the default) or one settle call per lease (single)",
    )
    parser.add_argument(
        "--payload-bytes",
        type=int,
        default=256,
        help="size of each result payload; above --inline-max-bytes it goes through the store and the ledger carries a reference",
    )
    parser.add_argument(
        "--inline-max-bytes",
        type=int,
        default=DEFAULT_INLINE_MAX_BYTES,
        help=f"largest payload settled through Redis as it is, as the Actor's --result-inline-max-bytes (default {DEFAULT_INLINE_MAX_BYTES})",
    )
    parser.add_argument(
        "--results-store",
        default="",
        metavar="URL",
        help="run root large results are written to and read from (default: a fresh local directory, removed at the end)",
    )
    parser.add_argument(
        "--lease-ms",
        type=int,
        default=200,
        help="lease length of every step (ms; short, so that the leases left to expire do so within the step)",
    )
    parser.add_argument(
        "--expire",
        type=float,
        default=0.002,
        help="fraction of leases left to expire (default 0.002)",
    )
    parser.add_argument(
        "--churn",
        type=float,
        default=0.01,
        help="fraction of Actors that leave, and are replaced, per step",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of who leaves and which leases expire")
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="run on a Redis Cluster (3 masters, 1 replica each) instead of one Redis",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _configs(args: argparse.Namespace) -> list[SimConfig]:
    actors = getattr(args, "actors", None) or list(DEFAULT_ACTORS)
    if isinstance(actors, int):
        actors = [actors]
    prompts = int(getattr(args, "prompts", 40_000) or 40_000)
    claim = int(getattr(args, "claim", 8) or 8)
    payload = int(getattr(args, "payload_bytes", 256) or 0)
    inline = getattr(args, "inline_max_bytes", None)
    inline = DEFAULT_INLINE_MAX_BYTES if inline is None else int(inline)
    given_store = str(getattr(args, "results_store", "") or "")
    out = []
    for n in (int(a) for a in actors):
        base = SimConfig(
            actors=n,
            regions=int(getattr(args, "regions", 3) or 3),
            step_prompts=int(getattr(args, "step_prompts", 0) or 0),
            claim=claim,
            workers=int(getattr(args, "workers", 0) or max(1, os.cpu_count() or 1)),
            settle_mode=str(getattr(args, "settle", "many") or "many"),
            payload_bytes=payload,
            lease_ms=int(getattr(args, "lease_ms", 200) or 200),
            expire=float(getattr(args, "expire", 0.002) if getattr(args, "expire", None) is not None else 0.002),
            churn=float(getattr(args, "churn", 0.01) if getattr(args, "churn", None) is not None else 0.01),
            seed=int(getattr(args, "seed", 0) or 0),
            inline_max_bytes=inline,
            results_store=given_store or (_PENDING_STORE if through_store(payload, inline) else ""),
        )
        steps = int(getattr(args, "steps", 0) or 0) or max(3, math.ceil(prompts / base.prompts_per_step()))
        cfg = SimConfig(**{**base.__dict__, "steps": steps})
        cfg.check()
        out.append(cfg)
    return out


class _Target:
    """Where the bench runs: one redis-server, or a Redis Cluster."""

    def __init__(self, cluster: bool) -> None:
        self.cluster = cluster
        self.server: Any = None
        self.url = ""

    def __enter__(self) -> _Target:
        if self.cluster:
            try:
                from aurora_store.testing.cluster import RedisCluster
            except ImportError as e:
                raise RuntimeError(f"--cluster needs aurora_store.testing.cluster ({e})") from e
            self.server = RedisCluster().start()
        else:
            from aurora_store.testing.servers import RedisServer

            self.server = RedisServer().start()
        self.url = self.server.url
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            if self.cluster:
                self.server.close()
            else:
                self.server.stop()

    def trainer_client(self) -> Any:
        """The Trainer's client, made as every Aurora process makes it from a URL."""
        from aurora_store.coordination.redisconn import connect

        return connect(self.url)

    def stats_for(self, key: str) -> Any:
        """A plain client of the server that holds ``key`` (INFO is per server)."""
        if self.cluster:
            return self.server.master_of(key).client(timeout_s=10.0)
        return redis.Redis.from_url(self.url, health_check_interval=0)


def _opening(target: _Target, opened: list[Any], key: str) -> Any:
    client = target.stats_for(key)
    opened.append(client)
    return client


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    configs = _configs(args)
    cluster = bool(getattr(args, "cluster", False))
    sweep: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if any(c.results_store == _PENDING_STORE for c in configs):
            # No store given: a fresh local directory, gone at the end (the results are read and deleted anyway).
            root = stack.enter_context(tempfile.TemporaryDirectory(prefix="aurora-bench-results-"))
            configs = [
                dataclasses.replace(c, results_store=f"file://{root}/run") if c.results_store == _PENDING_STORE else c for c in configs
            ]
        redis_version = _sweep(configs, cluster, sweep, log)
    return _result(configs, cluster, sweep, redis_version)


def _sweep(configs: list[SimConfig], cluster: bool, sweep: list[dict[str, Any]], log: Callable[[str], None]) -> str:
    """Run every configuration into ``sweep``; returns the server's version."""
    with _Target(cluster) as target:
        probe = target.stats_for("aurora:{probe}:x")
        redis_version = str(probe.info("server").get("redis_version", "?"))
        probe.close()
        for cfg in configs:
            log(
                f"ledger bench: {cfg.actors} actors in {cfg.regions} regions, {cfg.steps} steps of {cfg.prompts_per_step()} prompts, "
                f"settle={cfg.settle_mode}{' on a Redis Cluster' if cluster else ''}, {cfg.payload_bytes}-byte payloads"
                f"{' through the store' if cfg.through_store() else ''} ..."
            )
            trainer = target.trainer_client()
            opened: list[Any] = []
            try:
                sweep.append(run_config(target.url, cfg, partial(_opening, target, opened), trainer))
            finally:
                trainer.close()
                for c in opened:
                    c.close()
    return redis_version


def _result(configs: list[SimConfig], cluster: bool, sweep: list[dict[str, Any]], redis_version: str) -> dict[str, Any]:
    head = max(sweep, key=lambda r: (r["actors"], -r["settled_per_s"]))
    first = configs[0]
    return {
        "benchmark": "ledger",
        "actors": head["actors"],
        "prompts": head["prompts"],
        "settle_mode": first.settle_mode,
        "claim": first.claim,
        "workers": head["workers"],
        "settled_per_s": head["settled_per_s"],
        "p50_settle_ms": head["p50_settle_ms"],
        "p99_settle_ms": head["p99_settle_ms"],
        "round_trips_per_prompt": head["round_trips_per_prompt"],
        "commands_per_prompt": head["commands_per_prompt"],
        "server_commands_per_prompt": head["server_commands_per_prompt"],
        "round_trips_per_s": head["round_trips_per_s"],
        "redis_capacity_per_s": head["redis_capacity_per_s"],
        "redis_cpu_us_per_settle": head["redis_cpu_us_per_settle"],
        "redis_cpu_share": head["redis_cpu_share"],
        "cpu_us_per_settle": head["cpu_us_per_settle"],
        "load_avg_1m": head["load_avg_1m"],
        "regions": head["regions"],
        "steps": head["steps"],
        "cluster": cluster,
        "min_settled_per_s": min(r["settled_per_s"] for r in sweep),
        "max_round_trips_per_prompt": max(r["round_trips_per_prompt"] for r in sweep),
        "max_p99_settle_ms": max(r["p99_settle_ms"] for r in sweep),
        "targets": {
            "settled_per_s": TARGET_SETTLED_PER_S,
            "round_trips_per_prompt": TARGET_ROUND_TRIPS_PER_PROMPT,
            "p99_settle_ms": TARGET_P99_SETTLE_MS,
        },
        "targets_met": {
            "settled_per_s": all(r["settled_per_s"] >= TARGET_SETTLED_PER_S for r in sweep),
            "round_trips_per_prompt": all(r["round_trips_per_prompt"] <= TARGET_ROUND_TRIPS_PER_PROMPT for r in sweep),
            "p99_settle_ms": all(r["p99_settle_ms"] <= TARGET_P99_SETTLE_MS for r in sweep),
        },
        "ok": all(r["ok"] for r in sweep),
        "redis_version": redis_version,
        "cpus": os.cpu_count(),
        "payload_bytes": first.payload_bytes,
        "inline_max_bytes": first.inline_max_bytes,
        "through_store": head["through_store"],
        "redis_payload_bytes_per_prompt": head["redis_payload_bytes_per_prompt"],
        "store_payload_bytes_per_prompt": head["store_payload_bytes_per_prompt"],
        "store_mb_per_s": head["store_mb_per_s"],
        "p50_result_write_ms": head["p50_result_write_ms"],
        "p99_result_write_ms": head["p99_result_write_ms"],
        "trainer_read_s": head.get("trainer_read_s", 0.0),
        "trainer_read_mb_per_s": head.get("trainer_read_mb_per_s", 0.0),
        "sweep": sweep,
    }


def _fmt_table(result: dict[str, Any]) -> str:
    head = (
        f"{'actors':>6} {'steps':>5} {'wrk':>3} {'settled/s':>10} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'RT/prompt':>9} {'cmd/prompt':>10} {'srv cmd/prompt':>14} {'redis us/settle':>15} {'redis cpu':>9} "
        f"{'exp':>4} {'l/j':>7} {'ok':>3}"
    )
    lines = [
        f"ledger bench: redis {result['redis_version']}{' cluster' if result.get('cluster') else ''}, {result['cpus']} cpus, "
        f"settle={result['settle_mode']}, claim={result['claim']}, regions={result['regions']}",
        head,
        "-" * len(head),
    ]
    for r in result["sweep"]:
        lines.append(
            f"{r['actors']:>6} {r['steps']:>5} {r['workers']:>3} {r['settled_per_s']:>10.0f} {r['p50_settle_ms']:>7.3f} "
            f"{r['p99_settle_ms']:>7.3f} {r['round_trips_per_prompt']:>9.3f} {r['commands_per_prompt']:>10.3f} "
            f"{r['server_commands_per_prompt']:>14.2f} {r['redis_cpu_us_per_settle']:>15.1f} {100 * r['redis_cpu_share']:>8.0f}% "
            f"{r['expired']:>4} {str(r['leaves']) + '/' + str(r['joins']):>7} {'yes' if r['ok'] else 'NO':>3}"
        )
    if result.get("through_store"):
        lines.append(
            f"results of {result['payload_bytes']} bytes through the store (inline up to {result['inline_max_bytes']}): "
            f"{result['redis_payload_bytes_per_prompt']:.0f} bytes/prompt through Redis, "
            f"{result['store_payload_bytes_per_prompt']:.0f} through the store ({result['store_mb_per_s']:.0f} MB/s written); "
            f"write p50 {result['p50_result_write_ms']:.1f} ms, p99 {result['p99_result_write_ms']:.1f} ms; "
            f"the Trainer read them at {result['trainer_read_mb_per_s']:.0f} MB/s"
        )
    else:
        lines.append(f"results of {result['payload_bytes']} bytes through Redis (inline up to {result['inline_max_bytes']})")
    t, met = result["targets"], result["targets_met"]
    lines.append(
        f"targets: >= {t['settled_per_s']:.0f} settled/s: {'met' if met['settled_per_s'] else 'NOT met'} "
        f"(min {result['min_settled_per_s']:.0f}); p99 settle <= {t['p99_settle_ms']:.0f} ms: "
        f"{'met' if met['p99_settle_ms'] else 'NOT met'} (max {result['max_p99_settle_ms']:.2f}); "
        f"<= {t['round_trips_per_prompt']:.0f} round trips/prompt: "
        f"{'met' if met['round_trips_per_prompt'] else 'NOT met'} (max {result['max_round_trips_per_prompt']:.2f})"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from aurora_tools.bench import run_and_report

    return run_and_report(args, run_benchmark, _fmt_table, lambda result: bool(result["ok"]))
