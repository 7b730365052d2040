"""One configuration of ``aurora bench ledger``: a Trainer and N simulated Actors over several steps.

The Trainer (this process) creates each step with the scheduler's quotas
over the Actors alive at that moment (every Actor gets at least one prompt;
90% of the step is assigned, the rest is the shared pool), creates the next
step while the Actors work on this one, and once every prompt of a step is
accepted tells the Actors to move on, then closes the step (seal, collect,
drop: every prompt accepted exactly once is checked here) and reaps.

The Actors are interleaved over ``workers`` processes, each with its own
connection and :class:`~aurora_store.coordination.ledger.Ledger`. At the
start of a step an Actor heartbeats the step's version; then it claims up to
``claim`` leases and settles them, and claims again while its claims come
back full. Per step and Actor, with a small probability:

- *expiry*: of the first claim, some leases are never settled (a generation
  that crashed); they expire after ``lease_ms`` and go back to the pool inside
  a later claim (only Actors early in their process's round do this, so the
  lease runs out while the step is still busy);
- *leave and join*: the Actor settles half of its first claim and leaves
  gracefully (its other leases and assignments go back to the pool), and a
  new Actor registers in its place, heartbeats and claims in the same step.

A process whose Actors are all done keeps claiming, one Actor at a time,
every 20 ms, for what expiries and leaves put back, until the
Trainer says the step is complete.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import statistics
import time
import uuid
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aurora_store.coordination.ledger import Lease, Ledger
from aurora_store.coordination.ledger import scripts as lua
from aurora_store.coordination.redisconn import is_cluster_url
from aurora_store.coordination.scheduler import split
from aurora_store.lineage.results import DEFAULT_INLINE_MAX_BYTES
from aurora_tools.bench.ledger.counting import CallCounter, counting_client, counting_cluster_client
from aurora_tools.bench.ledger.results import ActorWrites, TrainerReads, through_store, write_summary

__all__ = ["SimConfig", "run_config", "STATE"]

STATE = "sha256:" + "ab" * 32
HEARTBEAT_TIMEOUT_MS = 60_000
_IDLE_CLAIM_S = 0.02
_STEP_TIMEOUT_S = 300.0
_HEARTBEAT_AGAIN_S = HEARTBEAT_TIMEOUT_MS / 1000 / 4


@dataclass(frozen=True)
class SimConfig:
    actors: int
    regions: int = 3
    steps: int = 3
    step_prompts: int = 0
    """Prompts per step; 0: ``max(actors * claim, 2000)``."""
    claim: int = 8
    workers: int = 2
    settle_mode: str = "many"
    payload_bytes: int = 256
    lease_ms: int = 200
    expire: float = 0.002
    """Fraction of leased prompts left to expire."""
    churn: float = 0.01
    """Fraction of Actors that leave (and are replaced by a new one) per step."""
    seed: int = 0
    inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES
    """Payloads larger than this go through the store (``results_store``), as the Actor's ``--result-inline-max-bytes``."""
    results_store: str = ""
    """Run root the Actors write large results to and the Trainer reads them from."""

    def through_store(self) -> bool:
        return through_store(self.payload_bytes, self.inline_max_bytes)

    def prompts_per_step(self) -> int:
        return self.step_prompts if self.step_prompts > 0 else max(self.actors * self.claim, 2000)

    def check(self) -> None:
        if min(self.actors, self.regions, self.steps, self.claim, self.workers, self.lease_ms) <= 0:
            raise ValueError("actors, regions, steps, claim, workers and lease_ms must be positive")
        if not (0.0 <= self.expire < 0.3 and 0.0 <= self.churn <= 0.5):
            raise ValueError("--expire must be in [0, 0.3) and --churn in [0, 0.5]")
        if self.settle_mode not in ("many", "single"):
            raise ValueError(f"settle mode {self.settle_mode!r}")
        if self.through_store() and not self.results_store:
            raise ValueError("payloads above the inline threshold need a results store")


def _client(url: str, counter: CallCounter) -> Any:
    if is_cluster_url(url):
        return counting_cluster_client(url, counter)
    return counting_client(url, counter, max_connections=2)


def _tau(actor: str) -> float:
    """Made-up throughputs that differ up to 4x, as in a mixed H100/A100/L40 pool."""
    return 1000.0 * (1 + zlib.crc32(actor.encode()) % 4)


class _Actors:
    """What one worker process does: its Actors, step after step, on one connection."""

    def __init__(
        self,
        url: str,
        run: str,
        names: Sequence[str],
        regions: dict[str, str],
        cfg: SimConfig,
        index: int,
    ) -> None:
        self.cfg = cfg
        self.index = index
        self.counter = CallCounter()
        self.client = _client(url, self.counter)
        self.ledger = Ledger(self.client, run)
        self.rng = random.Random(cfg.seed * 1000 + index)
        self.payload = b"r" * cfg.payload_bytes
        self.writes = ActorWrites(cfg.results_store, cfg.payload_bytes) if cfg.through_store() else None
        self.redis_payload_bytes = 0
        self.beat_at: dict[str, float] = dict.fromkeys(names, time.monotonic())  # the Trainer's setup heartbeat them
        self.looked_at = 0.0
        """When each Actor last heartbeat: a step longer than the reaper's timeout (results written
        to a slow store) has them heartbeat again, as a real Actor's heartbeat thread does."""
        self.mine = list(names)
        self.regions = dict(regions)
        self.lat: list[float] = []
        self.claim_lat: list[float] = []
        self.stats = {
            "heartbeats": 0,
            "claims": 0,
            "empty_claims": 0,
            "accepted": 0,
            "abandoned": 0,
            "leaves": 0,
            "joins": 0,
            "late_claims": 0,
            "late": 0,
        }
        self.refused: dict[str, int] = {}
        self.last_settle = 0.0
        self.joined = 0

    def claim(self, a: str, v: int) -> list[Lease] | None:
        """Up to ``claim`` leases of step ``v``; None once the step is closed (complete)."""
        t0 = time.perf_counter()
        status, leases = self.ledger.claim(a, v, self.cfg.claim)
        self.claim_lat.append((time.perf_counter() - t0) * 1e3)
        self.stats["claims"] += 1
        if status in ("closed", "no_step"):
            # Every prompt was accepted and the Trainer closed the step while this
            # process was still going round (its next message says so).
            self.stats["late_claims"] += 1
            return None
        if status != "ok":
            raise RuntimeError(f"{a}: claim of step {v} answered {status}")
        if not leases:
            self.stats["empty_claims"] += 1
        return leases

    def settle(self, a: str, leases: Sequence[Lease]) -> None:
        if not leases:
            return
        # Written before the settle, as the Actor does; the settle latency is the ledger's alone.
        w = self.writes
        payloads = [w.payload(a, le.step_id, le.token) for le in leases] if w is not None else [self.payload] * len(leases)
        self.redis_payload_bytes += sum(map(len, payloads))
        if self.cfg.settle_mode == "many":
            t0 = time.perf_counter()
            res = self.ledger.settle_many(a, [(le, le.version, STATE, p) for le, p in zip(leases, payloads, strict=True)])
            dt = (time.perf_counter() - t0) * 1e3
            self.lat.extend([dt] * len(res))
        else:
            res = []
            for le, p in zip(leases, payloads, strict=True):
                t0 = time.perf_counter()
                res.append(self.ledger.settle(a, le, le.version, STATE, p))
                self.lat.append((time.perf_counter() - t0) * 1e3)
        for le, s in zip(leases, res, strict=True):
            if s.accepted:
                self.stats["accepted"] += 1
            elif s.now_ms > le.expiry_ms:
                # Settled after its lease ran out (this process was starved of CPU for longer
                # than lease_ms): refused, and the prompt is done again, which is correct.
                self.stats["late"] += 1
            else:
                self.refused[s.reason] = self.refused.get(s.reason, 0) + 1
        self.last_settle = time.monotonic()

    def heartbeat(self, a: str, v: int) -> None:
        if not self.ledger.heartbeat(a, active=v, staged=v, active_state=STATE):
            raise RuntimeError(f"{a}: heartbeat refused")
        self.stats["heartbeats"] += 1
        self.beat_at[a] = time.monotonic()

    def still_alive(self, v: int) -> None:
        """Every Actor of this process whose last heartbeat is older than :data:`_HEARTBEAT_AGAIN_S` heartbeats
        (looked at once a second): what each real Actor's heartbeat thread does while it generates."""
        now = time.monotonic()
        if now - self.looked_at < 1.0:
            return
        self.looked_at = now
        for a in self.mine:
            if now - self.beat_at.get(a, now) > _HEARTBEAT_AGAIN_S:
                self.heartbeat(a, v)

    def replace(self, a: str, v: int) -> str:
        """``a`` leaves gracefully; a new Actor joins in its region and reports the step's version."""
        self.ledger.leave(a)
        self.stats["leaves"] += 1
        self.mine.remove(a)
        self.joined += 1
        new = f"join-w{self.index}-{self.joined:05d}"
        self.regions[new] = self.regions.pop(a)
        self.ledger.register(new, region=self.regions[new], engine="bench")
        self.heartbeat(new, v)
        self.stats["joins"] += 1
        self.mine.append(new)
        return new

    def step(self, v: int) -> None:
        cfg = self.cfg
        leavers = {a for a in self.mine if self.rng.random() < cfg.churn}
        early = set(self.mine[: max(1, len(self.mine) // 3)]) - leavers
        p_abandon = min(0.9, cfg.expire * 3)
        order = deque(self.mine)
        beat = set(self.mine)
        claimed: set[str] = set()
        while order:
            a = order.popleft()
            if a in beat:
                self.heartbeat(a, v)
                beat.discard(a)
            self.still_alive(v)
            leases = self.claim(a, v)
            if leases is None:
                return
            if not leases:
                continue
            first = a not in claimed
            claimed.add(a)
            if first and a in leavers:
                self.settle(a, leases[: len(leases) // 2])
                order.append(self.replace(a, v))
                continue
            keep = leases
            if first and a in early and p_abandon > 0:
                keep = [le for le in leases if self.rng.random() >= p_abandon]
                self.stats["abandoned"] += len(leases) - len(keep)
            self.settle(a, keep)
            if len(leases) == cfg.claim:
                order.append(a)

    def sweep(self, v: int, turn: int) -> int:
        """One claim for leftovers (expired leases, released work) by the next Actor in turn."""
        a = self.mine[turn % len(self.mine)]
        self.still_alive(v)
        leases = self.claim(a, v)
        if leases is None:
            return -1
        self.settle(a, leases)
        return turn + 1

    def idle(self, v: int, rx: Any) -> None:
        """Sweep for leftovers of step ``v`` until the Trainer sends the next message."""
        turn = 0
        while turn >= 0 and not rx.poll(_IDLE_CLAIM_S):
            turn = self.sweep(v, turn)


def _drive(
    url: str,
    run: str,
    names: Sequence[str],
    regions: dict[str, str],
    cfg: SimConfig,
    index: int,
    rx: Any,
    tx: Any,
) -> None:
    """One worker process. Sends ("ready",), then at "stop" its report (or ("error", text) at any time)."""
    try:
        me = _Actors(url, run, names, regions, cfg, index)
        me.client.ping()  # connected before the clock starts
    except Exception as e:  # reported by the parent
        tx.send(("error", f"{type(e).__name__}: {e}"))
        return
    tx.send(("ready",))
    cpu0 = time.process_time()
    started = False
    try:
        while True:
            msg = rx.recv()
            if msg[0] == "stop":
                break
            if not started:
                me.counter.reset()
                cpu0 = time.process_time()
                started = True
            v = int(msg[1])
            me.step(v)
            me.idle(v, rx)
    except Exception as e:
        tx.send(("error", f"{type(e).__name__}: {e}"))
        return
    rt, cmds = me.counter.snapshot()
    cpu = time.process_time() - cpu0
    me.client.close()
    store = (me.writes.write_ms, me.writes.bytes) if me.writes is not None else ([], 0)
    tx.send(("report", me.lat, me.claim_lat, me.stats, me.refused, rt, cmds, me.last_settle, cpu, me.redis_payload_bytes, *store))


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
    total = 0
    for name, v in client.info("commandstats").items():
        if not str(name).endswith("info"):
            total += int(v["calls"])
    return total


class _Workers:
    def __init__(self, url: str, run: str, cfg: SimConfig, names: list[str], regions: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.cmd: list[Any] = []
        self.out: list[Any] = []
        n = min(cfg.workers, len(names))
        for w in range(n):
            mine = names[w::n]
            crx, ctx_ = ctx.Pipe(duplex=False)
            orx, otx = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_drive,
                args=(url, run, mine, {a: regions[a] for a in mine}, cfg, w, crx, otx),
                name=f"bench-actors-{w}",
                daemon=True,
            )
            p.start()
            crx.close()
            otx.close()
            self.procs.append(p)
            self.cmd.append(ctx_)
            self.out.append(orx)

    def expect(self, kind: str, timeout_s: float = 120.0) -> list[tuple[Any, ...]]:
        got = []
        for rx in self.out:
            if not rx.poll(timeout_s):
                raise RuntimeError(f"ledger bench: a worker sent no {kind!r} within {timeout_s:.0f}s")
            msg = rx.recv()
            if msg[0] == "error":
                raise RuntimeError(f"ledger bench worker failed: {msg[1]}")
            if msg[0] != kind:
                raise RuntimeError(f"ledger bench: worker sent {msg[0]!r}, expected {kind!r}")
            got.append(msg)
        return got

    def check_errors(self) -> None:
        for rx in self.out:
            if rx.poll(0):
                msg = rx.recv()
                raise RuntimeError(f"ledger bench worker failed: {msg[1] if msg[0] == 'error' else msg[0]}")

    def send(self, *msg: Any) -> None:
        for tx in self.cmd:
            tx.send(msg)

    def close(self) -> None:
        for tx in self.cmd:
            with contextlib.suppress(OSError):  # a worker still waiting for the next step ends
                tx.send(("stop",))
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def run_config(url: str, cfg: SimConfig, stats_for: Callable[[str], Any], trainer_client: Any) -> dict[str, Any]:
    """One configuration: ``url`` the Actors connect to, ``stats_for(key)`` a client of the
    server holding ``key`` (the run's master; its INFO is read), ``trainer_client`` the Trainer's
    connection. Returns its measurements."""
    cfg.check()
    run = f"bench-{uuid.uuid4().hex[:8]}"
    ledger = Ledger(trainer_client, run)
    stats_client = stats_for(ledger.k_fence)
    per_step = cfg.prompts_per_step()

    # -- setup (not timed) -------------------------------------------------------
    names = [f"actor-{i:04d}" for i in range(cfg.actors)]
    regions = {a: f"r{i % cfg.regions}" for i, a in enumerate(names)}
    for a in names:
        ledger.register(a, region=regions[a], engine="bench")
        ledger.heartbeat(a, active=0, staged=0, active_state=STATE)
    for script in (
        lua.CLAIM,
        lua.SETTLE,
        lua.SETTLE_MANY,
        lua.HEARTBEAT,
        lua.REGISTER,
        lua.MARK_ACTOR,
        lua.RELEASE,
    ):
        stats_client.script_load(script)  # loaded once, as any long-running Actor has them

    expected: dict[int, set[str]] = {}
    expired: dict[int, int] = {}

    def create(v: int) -> None:
        alive = [r.actor for r in ledger.actors() if r.status == "alive"]
        quotas = split(int(per_step * 0.9), {a: _tau(a) for a in alive}, min_each=1)
        jobs = [(f"s{v}-p{i:06d}", b"prompt %d of step %d" % (i, v)) for i in range(per_step)]
        expected[v] = {p for p, _ in jobs}
        ledger.create_step(v, STATE, jobs, quotas, group=8, lease_ms=cfg.lease_ms, version=v)

    create(1)
    reads = TrainerReads(cfg.results_store, cfg.payload_bytes) if cfg.through_store() else None
    workers = _Workers(url, run, cfg, names, regions)
    ok = True
    try:
        workers.expect("ready")
        server_before = _server_commands(stats_client)
        cpu_before = _server_cpu_s(stats_client)
        trainer_cpu0 = time.process_time()

        # -- timed ---------------------------------------------------------------------
        t_go = time.monotonic()
        workers.send("go", 1)
        step_s: list[float] = []
        t_step = t_go
        cpu_after = server_after = 0.0
        for v in range(1, cfg.steps + 1):
            if v < cfg.steps:
                create(v + 1)  # while the Actors work on step v, as a Trainer one step ahead does
            deadline = time.monotonic() + _STEP_TIMEOUT_S
            while (left := ledger.unsettled(v)) != 0:
                workers.check_errors()
                if left is None or time.monotonic() > deadline:
                    raise RuntimeError(f"ledger bench: step {v} {'vanished' if left is None else 'did not complete'}")
                time.sleep(0.005)
            now = time.monotonic()
            step_s.append(now - t_step)
            t_step = now
            if v < cfg.steps:
                workers.send("go", v + 1)
            else:
                cpu_after = _server_cpu_s(stats_client)
                server_after = _server_commands(stats_client)
                workers.send("stop")
            expired[v] = int(trainer_client.hget(ledger.k_step(v), "expired") or 0)
            closed = ledger.close_step(v)
            got = [r.prompt for r in closed.results]
            ok = ok and closed.total == closed.settled == len(got) == len(set(got)) and set(got) == expected[v]
            if reads is not None:  # the Trainer reads the step's results from the store, as it does at a batch's close
                ok = reads.resolve(v, closed.results) and ok
            ledger.reap(HEARTBEAT_TIMEOUT_MS)
        trainer_cpu = time.process_time() - trainer_cpu0
        reports = workers.expect("report")
    finally:
        workers.close()
        read_report = reads.close() if reads is not None else {}

    lat = [x for r in reports for x in r[1]]
    claim_lat = [x for r in reports for x in r[2]]
    stats: dict[str, int] = {}
    refused: dict[str, int] = {}
    for r in reports:
        for k, n in r[3].items():
            stats[k] = stats.get(k, 0) + n
        for k, n in r[4].items():
            refused[k] = refused.get(k, 0) + n
    round_trips = sum(r[5] for r in reports)
    commands = sum(r[6] for r in reports)
    wall = max(r[7] for r in reports) - t_go
    actors_cpu = sum(r[8] for r in reports)
    settled = sum(len(e) for e in expected.values())
    # Only a refusal of a lease that had not run out is wrong.
    n_refused = sum(refused.values())
    ok = ok and n_refused == 0 and stats["accepted"] == settled
    redis_cpu = cpu_after - cpu_before
    cpus = mp.cpu_count()
    redis_payload = sum(r[9] for r in reports)
    store_bytes = sum(r[11] for r in reports)
    moved = {
        "payload_bytes": cfg.payload_bytes,
        "inline_max_bytes": cfg.inline_max_bytes,
        "through_store": cfg.through_store(),
        "redis_payload_bytes": redis_payload,
        "store_payload_bytes": store_bytes,
        "redis_payload_bytes_per_prompt": redis_payload / max(1, settled),
        "store_payload_bytes_per_prompt": store_bytes / max(1, settled),
        "store_mb_per_s": store_bytes / 1e6 / wall if wall > 0 else 0.0,
        **write_summary([x for r in reports for x in r[10]]),
        **read_report,
    }
    return {
        "actors": cfg.actors,
        "prompts": settled,
        "workers": len(reports),
        "claim": cfg.claim,
        "settle_mode": cfg.settle_mode,
        "wall_s": wall,
        "settled": settled,
        "settled_per_s": settled / wall if wall > 0 else float("inf"),
        "p50_settle_ms": _percentile(lat, 50),
        "p99_settle_ms": _percentile(lat, 99),
        "mean_settle_ms": statistics.fmean(lat) if lat else float("nan"),
        "round_trips": round_trips,
        "round_trips_per_prompt": round_trips / max(1, settled),
        "round_trips_per_s": round_trips / wall if wall > 0 else float("inf"),
        "commands_per_prompt": commands / max(1, settled),
        "server_commands_per_prompt": (server_after - server_before) / max(1, settled),
        "redis_cpu_s": redis_cpu,
        # what one Redis core could sustain if the Actors' CPU were elsewhere
        "redis_capacity_per_s": settled / redis_cpu if redis_cpu > 0 else float("inf"),
        "redis_cpu_us_per_settle": redis_cpu * 1e6 / max(1, settled),
        "redis_cpu_cores": redis_cpu / wall if wall > 0 else 0.0,
        "redis_cpu_share": redis_cpu / (wall * cpus) if wall > 0 else 0.0,
        "actors_cpu_s": actors_cpu,
        "trainer_cpu_s": trainer_cpu,
        # CPU of everything in the simulation per settled prompt: what bounds settled/s on this box
        "cpu_us_per_settle": (actors_cpu + trainer_cpu + redis_cpu) * 1e6 / max(1, settled),
        "load_avg_1m": os.getloadavg()[0],
        "p50_claim_ms": _percentile(claim_lat, 50),
        "p99_claim_ms": _percentile(claim_lat, 99),
        "regions": cfg.regions,
        "steps": cfg.steps,
        "step_prompts": per_step,
        "step_s": step_s,
        "lease_ms": cfg.lease_ms,
        "heartbeats": stats["heartbeats"],
        "claims": stats["claims"],
        "empty_claims": stats["empty_claims"],
        "abandoned": stats["abandoned"],
        "expired": sum(expired.values()),
        "leaves": stats["leaves"],
        "late_claims": stats["late_claims"],
        "joins": stats["joins"],
        "refused": n_refused,
        "late_settles": stats["late"],
        "refused_by_reason": refused,
        **moved,
        "ok": ok,
    }
