"""``aurora bench ledger``: lease-and-settle throughput of the Redis job ledger.

What is measured, against a ``redis-server`` this program starts on
127.0.0.1 (a free port) and stops when it ends:

- N simulated Actors (``--actors``, a sweep such as 8 32 128 256), each
  registered and on the step's version, share one step of ``--prompts``
  prompts. The scheduler splits 90% of them in proportion to made-up
  throughput estimates (:func:`~aurora_store.coordination.scheduler.split`); the rest go
  to the shared pool, which fast Actors drain.
- The Actors are interleaved over ``--workers`` processes (an Actor is a
  loop: claim up to ``--claim`` leases, then settle each one), each process
  with its own connection and server-clock :class:`~aurora_store.coordination.ledger.Ledger`,
  so what is timed is the ledger's real scripts, not a mock. Processes, not
  threads: threads would measure the GIL.
- ``--settle single`` settles each lease with its own ``settle`` call (an
  Actor reporting each rollout as it completes); ``--settle many`` settles a
  claimed batch with one ``settle_many``.

Reported per configuration: settled prompts per second (wall clock from the
first claim to the last settlement), p50/p99 latency of a settle request
(ms), Redis round trips per settled prompt and commands per settled prompt
as the client sent them (counted by a connection class that wraps the
socket writes: a pipeline is one round trip carrying many commands), and
commands per prompt as the server executed them, the commands inside the
Lua scripts included (``INFO commandstats`` before and after). Every run
checks the ledger afterwards: each prompt accepted exactly once.

On one machine nothing waits on the network: the benchmark's worker
processes and the single-threaded Redis server share the cores, so these are
CPU-bound numbers (client-side Python is usually the limit, not Redis).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis

from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.scheduler import split
from aurora_store.testing.servers import RedisServer

__all__ = ["add_arguments", "main", "run_benchmark", "CallCounter", "CountingConnection", "counting_client"]

#: Targets reported (not asserted).
TARGET_SETTLED_PER_S = 5_000.0
TARGET_ROUND_TRIPS_PER_PROMPT = 10.0
DEFAULT_ACTORS = (8, 32, 128, 256)
VERSION = 1
STATE = "sha256:" + "ab" * 32


class CallCounter:
    """Round trips (socket writes of requests) and commands a client sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.round_trips = 0
        self.commands = 0

    def add(self, round_trips: int, commands: int) -> None:
        with self._lock:
            self.round_trips += round_trips
            self.commands += commands

    def reset(self) -> None:
        with self._lock:
            self.round_trips = 0
            self.commands = 0

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.round_trips, self.commands


class CountingConnection(redis.connection.Connection):
    """A redis-py connection that counts what it sends.

    Every request reaches the socket through ``send_packed_command`` once (a
    pipeline packs all its commands into that one write and then reads all
    replies), so counting those calls counts round trips; commands are
    counted where they are packed.
    """

    def __init__(self, *args: Any, counter: CallCounter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counter = counter

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self.counter.add(0, 1)
        super().send_command(*args, **kwargs)

    def pack_commands(self, commands: Any) -> Any:
        commands = list(commands)
        self.counter.add(0, len(commands))
        return super().pack_commands(commands)

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self.counter.add(1, 0)
        super().send_packed_command(command, check_health)


def counting_client(url: str, counter: CallCounter, max_connections: int | None = None) -> Any:
    """A redis-py client of ``url`` whose traffic ``counter`` counts (no health-check PINGs)."""
    pool = redis.ConnectionPool.from_url(
        url,
        connection_class=CountingConnection,
        counter=counter,
        max_connections=max_connections,
        socket_timeout=30.0,
        socket_connect_timeout=5.0,
        health_check_interval=0,
    )
    return redis.Redis(connection_pool=pool)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--actors",
        type=int,
        nargs="+",
        default=list(DEFAULT_ACTORS),
        help="simulated Actor counts to sweep (default: 8 32 128 256); the largest is the headline",
    )
    parser.add_argument("--prompts", type=int, default=20_000, help="prompts in the step of each configuration")
    parser.add_argument("--claim", type=int, default=8, help="leases an Actor asks for per claim")
    parser.add_argument(
        "--workers", type=int, default=max(1, os.cpu_count() or 1), help="processes the Actors are interleaved over (default: one per CPU)"
    )
    parser.add_argument(
        "--settle",
        choices=("single", "many"),
        default="many",
        help="one settle_many per claimed batch (many: what Actors do, the default) or one settle call per lease (single)",
    )
    parser.add_argument("--payload-bytes", type=int, default=256, help="size of each result payload")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


def _server_cpu_s(client: Any) -> float:
    """CPU seconds the Redis server has used (user + system)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _server_commands(client: Any) -> int:
    """Commands the server executed so far, minus the INFO calls that ask."""
    stats = client.info("commandstats")
    total = 0
    for name, v in stats.items():
        if str(name).endswith("info"):
            continue
        total += int(v["calls"])
    return total


def _drive_actors(
    url: str,
    run: str,
    names: Sequence[str],
    claim: int,
    settle_mode: str,
    payload_bytes: int,
    start: Any,
    out: Any,
) -> None:
    """One worker process: its Actors interleaved round-robin on one connection.

    Sends back (latencies_ms, refused, round_trips, commands, t_start, t_end, error).
    """
    counter = CallCounter()
    client = counting_client(url, counter, max_connections=2)
    ledger = Ledger(client, run)
    payload = b"r" * payload_bytes
    lat: list[float] = []
    refused = 0
    error = ""
    client.ping()  # connect before the clock starts
    start.wait()
    counter.reset()
    t_start = time.monotonic()
    try:
        mine = list(names)
        while mine:
            still = []
            for a in mine:
                status, leases = ledger.claim(a, VERSION, claim)
                if status != "ok":
                    raise RuntimeError(f"{a}: claim answered {status}")
                if not leases:
                    continue
                still.append(a)
                if settle_mode == "many":
                    t0 = time.perf_counter()
                    res = ledger.settle_many(a, [(lease, VERSION, STATE, payload) for lease in leases])
                    dt = (time.perf_counter() - t0) * 1e3
                    lat.extend([dt] * len(res))
                    refused += sum(1 for s in res if not s.accepted)
                else:
                    for lease in leases:
                        t0 = time.perf_counter()
                        s = ledger.settle(a, lease, VERSION, STATE, payload)
                        lat.append((time.perf_counter() - t0) * 1e3)
                        refused += 0 if s.accepted else 1
            mine = still
    except Exception as e:  # reported by the parent
        error = f"{type(e).__name__}: {e}"
    t_end = time.monotonic()
    rt, cmds = counter.snapshot()
    client.close()
    out.send((lat, refused, rt, cmds, t_start, t_end, error))
    out.close()


def run_config(
    url: str,
    actors: int,
    prompts: int,
    claim: int = 8,
    workers: int = 2,
    settle_mode: str = "single",
    payload_bytes: int = 256,
) -> dict[str, Any]:
    """One configuration on a running server: returns its measurements.

    The Actors are spread over ``workers`` processes (threads would measure
    the GIL, not the ledger); each process interleaves its Actors on one
    connection, as a handful of Actor hosts would.
    """
    if actors <= 0 or prompts <= 0 or claim <= 0 or workers <= 0:
        raise ValueError("actors, prompts, claim and workers must be positive")
    workers = min(workers, actors)
    client = redis.Redis.from_url(url, health_check_interval=0)
    run = f"bench-{uuid.uuid4().hex[:8]}"
    ledger = Ledger(client, run)

    # -- setup (not timed) -------------------------------------------------------
    names = [f"actor-{i:04d}" for i in range(actors)]
    for i, a in enumerate(names):
        ledger.register(a, region=f"r{i % 3}", engine="bench")
        ledger.heartbeat(a, active=VERSION, staged=VERSION, active_state=STATE)
    # Throughputs that differ by up to 4x, as in a mixed H100/A100/L40 pool.
    taus = {a: 1000.0 * (1 + i % 4) for i, a in enumerate(names)}
    quotas = split(int(prompts * 0.9), taus)
    jobs = [(f"p{i:07d}", b"prompt %d" % i) for i in range(prompts)]
    ledger.create_step(VERSION, STATE, jobs, quotas, group=8, lease_ms=600_000)
    for script in (Ledger.CLAIM, Ledger.SETTLE):  # loaded once, as any long-running Actor has them
        client.script_load(script)

    ctx = mp.get_context("spawn")
    start = ctx.Event()
    pipes, procs = [], []
    for w in range(workers):
        rx, tx = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_drive_actors,
            args=(url, run, names[w::workers], claim, settle_mode, payload_bytes, start, tx),
            name=f"bench-actors-{w}",
            daemon=True,
        )
        p.start()
        tx.close()
        pipes.append(rx)
        procs.append(p)
    # Every worker is connected and waiting on `start` once the server has seen
    # its PING; give them a moment to get there (untimed), then go.
    deadline = time.monotonic() + 30
    while int(client.info("clients")["connected_clients"]) < workers + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    server_before = _server_commands(client)
    cpu_before = _server_cpu_s(client)

    # -- timed ---------------------------------------------------------------------
    start.set()
    got = [rx.recv() for rx in pipes]
    for p in procs:
        p.join(timeout=30)
    cpu_after = _server_cpu_s(client)
    server_after = _server_commands(client)
    errors = [g[6] for g in got if g[6]]
    if errors:
        raise RuntimeError(f"ledger bench worker failed: {errors[0]}")
    wall = max(g[5] for g in got) - min(g[4] for g in got)
    all_lat = [x for g in got for x in g[0]]
    refused = sum(g[1] for g in got)
    round_trips = sum(g[2] for g in got)
    commands = sum(g[3] for g in got)

    # -- check -----------------------------------------------------------------------
    results = ledger.collect(VERSION)
    ids = [r.prompt for r in results]
    status = ledger.step_status(VERSION)
    ok = len(ids) == prompts and len(set(ids)) == prompts and status.settled == prompts and refused == 0
    ledger.close_step(VERSION)
    client.close()

    settled = len(set(ids))
    return {
        "actors": actors,
        "prompts": prompts,
        "workers": workers,
        "claim": claim,
        "settle_mode": settle_mode,
        "wall_s": wall,
        "settled": settled,
        "settled_per_s": settled / wall if wall > 0 else float("inf"),
        "p50_settle_ms": _percentile(all_lat, 50),
        "p99_settle_ms": _percentile(all_lat, 99),
        "mean_settle_ms": statistics.fmean(all_lat) if all_lat else float("nan"),
        "round_trips": round_trips,
        "round_trips_per_prompt": round_trips / max(1, settled),
        "round_trips_per_s": round_trips / wall if wall > 0 else float("inf"),
        "commands_per_prompt": commands / max(1, settled),
        "server_commands_per_prompt": (server_after - server_before) / max(1, settled),
        "redis_cpu_s": cpu_after - cpu_before,
        # what one Redis core could sustain if the Actors' CPU were elsewhere
        "redis_capacity_per_s": settled / (cpu_after - cpu_before) if cpu_after > cpu_before else float("inf"),
        "refused": refused,
        "ok": ok,
    }


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    actors = getattr(args, "actors", None) or list(DEFAULT_ACTORS)
    if isinstance(actors, int):
        actors = [actors]
    actors = [int(a) for a in actors]
    prompts = int(getattr(args, "prompts", 20_000) or 20_000)
    claim = int(getattr(args, "claim", 8) or 8)
    workers = int(getattr(args, "workers", 0) or max(1, os.cpu_count() or 1))
    settle_mode = str(getattr(args, "settle", "single") or "single")
    payload_bytes = int(getattr(args, "payload_bytes", 256) or 0)

    sweep = []
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        redis_version = str(client.info("server").get("redis_version", "?"))
        client.close()
        for n in actors:
            log(f"ledger bench: {n} actors, {prompts} prompts, settle={settle_mode} ...")
            sweep.append(run_config(server.url, n, prompts, claim, workers, settle_mode, payload_bytes))
    head = max(sweep, key=lambda r: (r["actors"], -r["settled_per_s"]))
    return {
        "benchmark": "ledger",
        "actors": head["actors"],
        "prompts": prompts,
        "settle_mode": settle_mode,
        "claim": claim,
        "workers": head["workers"],
        "settled_per_s": head["settled_per_s"],
        "p50_settle_ms": head["p50_settle_ms"],
        "p99_settle_ms": head["p99_settle_ms"],
        "round_trips_per_prompt": head["round_trips_per_prompt"],
        "commands_per_prompt": head["commands_per_prompt"],
        "server_commands_per_prompt": head["server_commands_per_prompt"],
        "round_trips_per_s": head["round_trips_per_s"],
        "redis_capacity_per_s": head["redis_capacity_per_s"],
        "min_settled_per_s": min(r["settled_per_s"] for r in sweep),
        "max_round_trips_per_prompt": max(r["round_trips_per_prompt"] for r in sweep),
        "targets": {"settled_per_s": TARGET_SETTLED_PER_S, "round_trips_per_prompt": TARGET_ROUND_TRIPS_PER_PROMPT},
        "targets_met": {
            "settled_per_s": all(r["settled_per_s"] >= TARGET_SETTLED_PER_S for r in sweep),
            "round_trips_per_prompt": all(r["round_trips_per_prompt"] <= TARGET_ROUND_TRIPS_PER_PROMPT for r in sweep),
        },
        "ok": all(r["ok"] for r in sweep),
        "redis_version": redis_version,
        "cpus": os.cpu_count(),
        "sweep": sweep,
    }


def _fmt_table(result: dict[str, Any]) -> str:
    head = (
        f"{'actors':>6} {'prompts':>7} {'wrk':>3} {'settled/s':>10} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'RT/prompt':>9} {'cmd/prompt':>10} {'srv cmd/prompt':>14} {'RT/s':>8} {'redis cap/s':>11} {'ok':>3}"
    )
    lines = [
        f"ledger bench: redis {result['redis_version']}, {result['cpus']} cpus, settle={result['settle_mode']}, "
        f"claim={result['claim']}",
        head,
        "-" * len(head),
    ]
    for r in result["sweep"]:
        lines.append(
            f"{r['actors']:>6} {r['prompts']:>7} {r['workers']:>3} {r['settled_per_s']:>10.0f} {r['p50_settle_ms']:>7.3f} "
            f"{r['p99_settle_ms']:>7.3f} {r['round_trips_per_prompt']:>9.3f} {r['commands_per_prompt']:>10.3f} "
            f"{r['server_commands_per_prompt']:>14.2f} {r['round_trips_per_s']:>8.0f} {r['redis_capacity_per_s']:>11.0f} "
            f"{'yes' if r['ok'] else 'NO':>3}"
        )
    t, met = result["targets"], result["targets_met"]
    lines.append(
        f"targets: >= {t['settled_per_s']:.0f} settled/s: {'met' if met['settled_per_s'] else 'NOT met'} "
        f"(min {result['min_settled_per_s']:.0f}); <= {t['round_trips_per_prompt']:.0f} round trips/prompt: "
        f"{'met' if met['round_trips_per_prompt'] else 'NOT met'} (max {result['max_round_trips_per_prompt']:.2f})"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from aurora_tools.bench import run_and_report

    return run_and_report(args, run_benchmark, _fmt_table, lambda result: bool(result["ok"]))


if __name__ == "__main__":  # pragma: no cover - `aurora bench ledger` is the entry point
    ap = argparse.ArgumentParser(prog="aurora bench ledger")
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
