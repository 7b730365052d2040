"""``aurora demo``: the whole system on one machine.

Starts Redis and an S3-protocol server on loopback (or uses ``--store`` and
``--redis``), one Trainer (in this process), a Relay for region ``eu`` with
two Actors behind it and two Actors in region ``us`` reading from origin,
each Actor a separate process. Mid-run one Actor is killed with SIGKILL (a
spot preemption) and later a new one joins (it bootstraps from the newest
snapshot plus deltas). Ends with a table per step and a verdict: did every
Actor hold bit-identical weights to the Trainer at every version it
activated, was every prompt settled exactly once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aurora_store.coordination.records import RunRecords
from aurora_store.coordination.redisconn import connect, redis_child_env, resolve_redis_url
from aurora_store.credentials import REDIS_PASSWORD_FILE_ENV, REDIS_URL_ENV
from aurora_store.redact import install_redaction, redact_url, redacted_repr
from aurora_store.storage import Store, open_store
from workers.common import Endpoints
from workers.trainer import TrainerConfig
from workers.trainer.trainer import StepLog, Trainer

__all__ = ["DemoConfig", "DemoResult", "run_system_demo", "add_arguments", "main"]


@dataclass(frozen=True, slots=True)
class DemoConfig:
    steps: int = 120
    """Optimizer steps; at RL-regime density the reward climbs about 0.004 per pass over the
    problems, so it takes about a hundred steps to rise clearly above its noise (docs/BENCHMARKS.md,
    "The demo's regime")."""
    batch: int = 20
    """Prompts per step: five steps are one pass over the arithmetic task's 100 sums, so the
    reward of the first and of the last five steps are each measured on every sum once."""
    group: int = 8
    actors_relay: int = 2
    """Actors in region eu, behind a Relay."""
    actors_origin: int = 2
    """Actors in region us, reading from origin."""
    kill_at: int | None = None
    """Step at which one eu Actor is SIGKILLed (default steps // 3; -1: never)."""
    join_at: int | None = None
    """Step at which a new Actor joins (default 2 * steps // 3; -1: never)."""
    relay: bool = True
    stop_relay_at: int | None = None
    """Step at which the Relay is stopped (its Actors fall back to origin); None: never."""
    snapshot_every: int = 5
    digest_every: int = 1
    """Every version hashed (a tiny model: cheap), so each activation is compared bit for bit."""
    store: str | None = None
    redis: str | None = None
    run: str = "demo"
    workdir: str | None = None
    display: bool = True
    seed: int = 0
    tiny_hidden: int = 256
    """Width of the built-in model the demo trains (1.3 M parameters with ``tiny_intermediate`` 768:
    sparse deltas at a step that learns; docs/BENCHMARKS.md "The demo's regime"). Tests pass 64/192."""
    tiny_intermediate: int = 768
    weight_transfer: bool = True
    """False: the ideal baseline (versions never shipped; everything generated on v0)."""
    engine: str = "torch"
    """The Actors' engine: ``torch`` or ``vllm`` (the model then gets vLLM-CPU-sized heads)."""
    mirror_grace_s: float | None = None
    """The eu Actors' wait for the Relay's mirror before reading origin (None: the Actor's default)."""
    redis_password_file: str | None = None
    """The password of ``redis`` (a URL without one), handed to the children by name, never by value."""
    engines: tuple[str, ...] = ()
    """Per-Actor engines, in start order (eu Actors, then us); Actors past its end use ``engine``."""
    model: str | None = None
    """A local Hugging Face model directory for the Trainer (None: the built-in tiny Qwen3)."""
    task: str = "arithmetic"
    """The Trainer's task (:attr:`workers.trainer.TrainerConfig.task`)."""
    data: str | None = None
    """Training problems of ``task`` (a JSON-lines or Parquet file)."""
    eval_data: str | None = None
    """Held-out problems (None: the Trainer's default held-out set)."""
    eval_every: int | None = None
    """Score the held-out set every N versions (None: the Trainer's default; 0: never)."""
    trainer_extra: Mapping[str, Any] = field(default_factory=dict)
    """More :class:`~workers.trainer.TrainerConfig` fields (``max_lag``, ``eval_size``, ``lr`` ...)."""

    __repr__ = redacted_repr


@dataclass(slots=True)
class DemoResult:
    logs: list[StepLog]
    bit_identical: bool
    activations_compared: int
    mismatches: list[tuple[str, int]]
    actors_killed: int
    actors_joined: int
    prompts_lost: int
    accepted_twice: int
    accepted_wrong_version: int
    activations: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    wall_s: float = 0.0
    model_family: str = ""
    """``model_type`` of the policy's config (``qwen3`` for the built-in model)."""
    tokenizer_vocab_size: int = 0
    eval_accuracy: dict[int, float] = field(default_factory=dict)
    """Held-out accuracy by the version it was measured on."""
    stopped_hard: list[str] = field(default_factory=list)
    """Children that did not leave within the stop timeout after SIGTERM and were killed."""

    @property
    def density_mean(self) -> float:
        """Changed elements over all elements, mean over the deltas (0 with nothing shipped)."""
        d = [density(lg) for lg in self.logs if lg.elements and lg.delta_bytes]
        return sum(d) / len(d) if d else 0.0

    @property
    def delta_over_full(self) -> float:
        """Mean delta bytes over the full bf16 weights' bytes (the v0 snapshot)."""
        full = self.logs[0].full_bytes if self.logs else 0
        return sum(lg.delta_bytes for lg in self.logs) / len(self.logs) / full if full else 0.0

    def to_json(self) -> dict[str, Any]:
        first = [lg.reward for lg in self.logs[:5]]
        last = [lg.reward for lg in self.logs[-5:]]
        return {
            "steps": len(self.logs),
            "bit_identical": self.bit_identical,
            "activations_compared": self.activations_compared,
            "reward_first": sum(first) / max(1, len(first)),
            "reward_last": sum(last) / max(1, len(last)),
            "prompts_lost": self.prompts_lost,
            "accepted_twice": self.accepted_twice,
            "accepted_wrong_version": self.accepted_wrong_version,
            "actors_killed": self.actors_killed,
            "actors_joined": self.actors_joined,
            "delta_bytes_mean": sum(lg.delta_bytes for lg in self.logs) / max(1, len(self.logs)),
            "full_bytes": self.logs[0].full_bytes if self.logs else 0,
            "density_mean": self.density_mean,
            "delta_over_full": self.delta_over_full,
            "model_family": self.model_family,
            "tokenizer_vocab_size": self.tokenizer_vocab_size,
            "eval_accuracy_by_version": dict(sorted(self.eval_accuracy.items())),
            "wall_s": self.wall_s,
            "per_step": [
                {
                    "step": lg.step,
                    "version": lg.version,
                    "gen_version": lg.gen_version,
                    "reward": lg.reward,
                    "delta_bytes": lg.delta_bytes,
                    "changed": lg.changed,
                    "density": density(lg),
                    "publish_s": lg.extract_publish_s,
                    "train_s": lg.train_s,
                    "wait_s": lg.wait_s,
                    "step_s": lg.step_s,
                    "tokens_per_s": lg.tokens_per_s,
                    "by_actor": lg.by_actor,
                }
                for lg in self.logs
            ],
        }


def density(lg: StepLog) -> float:
    """Changed elements of a step's delta over the elements of the weights (0 when unknown)."""
    return lg.changed / lg.elements if lg.elements else 0.0


class _Procs:
    """Child processes of the demo, stopped however the demo ends."""

    def __init__(self, env: dict[str, str], logdir: str) -> None:
        self.env = env
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopped_hard: list[str] = []

    def start(self, name: str, args: list[str]) -> None:
        out = open(os.path.join(self.logdir, f"{name}.log"), "wb")  # noqa: SIM115 - owned by the child
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "aurora_tools.cli", *args], env=self.env, stdout=out, stderr=subprocess.STDOUT
        )

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop_all(self, timeout: float = 60.0) -> None:
        """SIGTERM to every child still running; SIGKILL to those not gone within ``timeout``.

        The timeout is generous: a loaded machine can take a while to finish the
        batch in hand, and a child killed here never leaves the ledger.
        """
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, p in self.procs.items():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.stopped_hard.append(name)
                p.kill()
                p.wait()


def run_system_demo(cfg: DemoConfig, say: Any = print) -> DemoResult:
    from aurora_store.testing.servers import RedisServer, S3Server

    t_start = time.perf_counter()
    workdir = cfg.workdir or tempfile.mkdtemp(prefix="aurora-demo-")
    os.makedirs(workdir, exist_ok=True)
    logdir = os.path.join(workdir, "logs")
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir)
    servers: list[Any] = []
    env = dict(os.environ, AURORA_TORCH_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        storage_options: dict[str, Any] = {}
        if cfg.redis is None:
            rs = RedisServer().start()
            servers.append(rs)
            redis_url = child_url = rs.url
        else:
            child_url = cfg.redis
            redis_url = resolve_redis_url(cfg.redis, cfg.redis_password_file)
        # The children get Redis through their environment: argv is world-readable (ps, /proc/*/cmdline).
        env.update(redis_child_env(child_url, cfg.redis_password_file))
        mirror_url = None
        if cfg.store is None:
            s3 = S3Server().start()
            servers.append(s3)
            origin_url = f"s3://{s3.new_bucket('origin')}/{cfg.run}"
            mirror_url = f"s3://{s3.new_bucket('mirror-eu')}/{cfg.run}"
            storage_options = s3.storage_options()
            env.update(
                AWS_ENDPOINT_URL=s3.endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1"
            )
            os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
        else:
            origin_url = cfg.store
            mirror_url = f"file://{os.path.abspath(os.path.join(workdir, 'mirror-eu'))}"
        say(f"store  {origin_url}\nredis  {redact_url(redis_url)}\nlogs   {logdir}")
        r = connect(redis_url)
        records = RunRecords(r, cfg.run)
        procs = _Procs(env, logdir)
        kill_at = cfg.steps // 3 if cfg.kill_at is None else cfg.kill_at
        join_at = 2 * cfg.steps // 3 if cfg.join_at is None else cfg.join_at
        common = ["--run", cfg.run]  # --redis: in the environment (AURORA_REDIS_URL)
        actors: list[tuple[str, str]] = [(f"eu-{i}", "eu") for i in range(cfg.actors_relay)] + [
            (f"us-{i}", "us") for i in range(cfg.actors_origin)
        ]
        events: list[str] = []
        killed = joined = 0

        def on_step(lg: StepLog) -> None:
            nonlocal killed, joined
            if cfg.display:
                say(
                    f"step {lg.step:>3} -> v{lg.version:<3} reward {lg.reward:5.3f}  delta {lg.delta_bytes / 1e3:7.1f} kB "
                    f"({100 * lg.delta_bytes / max(1, lg.full_bytes):4.1f}% of full, {100 * density(lg):4.2f}% changed)  publish {lg.extract_publish_s:5.2f}s  "
                    f"wait {lg.wait_s:5.2f}s  {lg.tokens_per_s:6.0f} tok/s  by {dict(sorted(lg.by_actor.items()))}"
                )
            if lg.step + 1 == kill_at and cfg.actors_relay > 0:
                procs.kill("eu-0")
                killed += 1
                events.append(f"step {lg.step}: eu-0 killed (SIGKILL)")
                say(f"  !! eu-0 killed with SIGKILL at step {lg.step} (spot preemption): its leases expire back to the pool")
            if cfg.stop_relay_at is not None and lg.step + 1 == cfg.stop_relay_at and "relay-eu" in procs.procs:
                procs.kill("relay-eu")
                events.append(f"step {lg.step}: relay-eu killed")
                say(f"  !! relay-eu killed at step {lg.step}: eu Actors fall back to origin when its heartbeat key expires")
            if lg.step + 1 == join_at:
                joined += 1
                events.append(f"step {lg.step}: us-late joined")
                say(f"  ++ us-late joins after step {lg.step}: bootstraps from the newest snapshot + deltas, then gets work")

        tcfg = TrainerConfig(
            steps=cfg.steps,
            batch=cfg.batch,
            group=cfg.group,
            snapshot_every=cfg.snapshot_every,
            digest_every=cfg.digest_every,
            seed=cfg.seed,
            weight_transfer=cfg.weight_transfer,
            model=cfg.model,
            task=cfg.task,
            data=cfg.data,
            eval_data=cfg.eval_data,
            tiny_hidden=cfg.tiny_hidden,
            tiny_intermediate=cfg.tiny_intermediate,
        )
        if cfg.eval_every is not None:
            tcfg = dataclasses.replace(tcfg, eval_every=cfg.eval_every)
        if cfg.engine == "vllm" or "vllm" in cfg.engines:
            tcfg = dataclasses.replace(tcfg, head_dim=32)  # vLLM's CPU attention needs heads of 32 or more
        if cfg.trainer_extra:
            tcfg = dataclasses.replace(tcfg, **dict(cfg.trainer_extra))
        if tcfg.min_actors == 0 and actors:
            # Every Actor the demo starts begins at v0: on a loaded machine the first one up
            # could otherwise run ahead alone, and a step only it was assigned (a version
            # the late starters bootstrapped past) would wait for its lease-holder forever.
            tcfg = dataclasses.replace(tcfg, min_actors=len(actors))
        trainer = Trainer(Endpoints(origin_url, redis_url, cfg.run, storage_options), tcfg, on_step=on_step)
        failure: list[BaseException] = []

        def train() -> None:
            try:
                trainer.run()
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                failure.append(e)

        t = threading.Thread(target=train, name="trainer")
        t.start()
        live = threading.Thread(target=_live_line, args=(cfg, r, t), name="live", daemon=True)
        if cfg.display and sys.stdout.isatty():
            live.start()
        while 0 not in trainer.states and t.is_alive():
            time.sleep(0.1)
        if cfg.relay and mirror_url is not None and cfg.actors_relay:
            procs.start("relay-eu", ["relay", "--store", origin_url, "--mirror", mirror_url, *common, "--region", "eu"])
        grace = ["--mirror-grace-s", str(cfg.mirror_grace_s)] if cfg.mirror_grace_s is not None else []
        for i, (name, region) in enumerate(actors):
            # The eu Actors are told their mirror; the Relay's key only says that it is alive.
            mirror = ["--mirror", mirror_url] if region == "eu" and mirror_url is not None else []
            engine = cfg.engines[i] if i < len(cfg.engines) else cfg.engine
            procs.start(
                name, ["actor", "--store", origin_url, *common, "--region", region, "--id", name, "--engine", engine, *grace, *mirror]
            )
        if 0 < join_at < cfg.steps:
            # Started now so its imports are done, it joins when the run reaches join_at.
            procs.start(
                "us-late",
                [
                    "actor",
                    "--store",
                    origin_url,
                    *common,
                    "--region",
                    "us",
                    "--id",
                    "us-late",
                    "--join-at-version",
                    str(join_at),
                    "--engine",
                    cfg.engine,
                ],
            )
        say(
            f"trainer ready at v0; {len(actors)} actors starting ({cfg.actors_relay} in eu behind a relay, {cfg.actors_origin} in us from origin)"
        )
        try:
            t.join()
        finally:
            trainer.stop.set()
            t.join()
            procs.stop_all()
        if failure:
            raise failure[0]
        if cfg.store is None:
            # The S3 server lives only as long as the demo: keep a copy of the run
            # for `aurora lineage`/`verify` and notebooks/lineage.ipynb.
            local = os.path.join(workdir, "store")
            shutil.rmtree(local, ignore_errors=True)
            _copy_run(trainer.store, open_store(f"file://{local}"))
            say(f"run copied to {local} (aurora lineage {local}; notebooks/lineage.ipynb)")
        tdig, adig = records.digests()
        mismatches = [(a, v) for (a, v), d in sorted(adig.items()) if tdig.get(v) != d]
        acts = records.activations()
        lost = sum(max(0, trainer.cfg.batch - sum(lg.by_actor.values()) - lg.rejected_payloads) for lg in trainer.logs)
        policy = trainer.grpo
        assert policy is not None  # the demo trains for real
        return DemoResult(
            logs=trainer.logs,
            bit_identical=not mismatches and bool(adig) and cfg.weight_transfer,
            activations_compared=len(adig),
            mismatches=mismatches,
            actors_killed=killed,
            actors_joined=joined,
            prompts_lost=lost,
            accepted_twice=trainer.accepted_twice,
            accepted_wrong_version=trainer.accepted_wrong_version,
            activations=acts,
            wall_s=time.perf_counter() - t_start,
            model_family=str(getattr(policy.model.config, "model_type", "")),
            tokenizer_vocab_size=int(policy.tokenizer.vocab_size),
            # The Trainer's held-out scores by version (an older Trainer has none).
            eval_accuracy=dict(trainer.eval_accuracy),
            stopped_hard=list(procs.stopped_hard),
        )
    finally:
        for s in reversed(servers):
            getattr(s, "close", s.stop)()


_TTY_LOCK = threading.Lock()


def _live_line(cfg: DemoConfig, redis: Any, trainer_thread: threading.Thread) -> None:
    """On a terminal: one status line, redrawn twice a second, under the step lines."""
    from aurora_store.coordination.ledger import Ledger, LedgerLost

    ledger = Ledger(redis, cfg.run)
    records = RunRecords(redis, cfg.run)
    while trainer_thread.is_alive():
        try:
            t = records.trainer()
            step, head = t.step, t.head
            parts = []
            if step is not None:
                try:
                    st = ledger.step_status(int(step))
                    parts.append(f"batch {int(step)}: {st.settled}/{st.total} settled, {st.leased} leased")
                except LedgerLost:
                    pass
            if head is not None:
                parts.append(f"head v{int(head)}")
            for a in ledger.actors():
                if a.status == "alive":
                    staged = f"+{a.staged - a.active}" if a.staged is not None and a.active is not None and a.staged > a.active else ""
                    parts.append(f"{a.actor} v{a.active}{staged}")
            with _TTY_LOCK:
                sys.stdout.write("\r\033[K  " + " | ".join(parts)[: shutil.get_terminal_size().columns - 3])
                sys.stdout.flush()
        except Exception:  # noqa: BLE001 - a display must never break the run
            pass
        time.sleep(0.5)
    with _TTY_LOCK:
        sys.stdout.write("\r\033[K")
        sys.stdout.flush()


def _copy_run(src: Store, dst: Store) -> None:
    """Every object of a run root, manifests last (so the copy is never half-visible)."""
    keys = src.list()
    for k in sorted(keys, key=lambda k: k.endswith("manifest.json")):
        dst.put(k, src.get(k))


def summary_table(res: DemoResult) -> str:
    lines = [
        f"{'step':>4} {'ver':>4} {'gen':>4} {'reward':>6} {'delta kB':>9} {'full kB':>8} {'% full':>6} {'density':>8} {'publish':>8} {'stage':>7} {'activate':>9} {'tok/s':>7}  actors (prompts)",
    ]
    for lg in res.logs:
        acts = [a for (who, v), a in res.activations.items() if v == lg.version]
        stage_s = f"{max(a['stage_s'] for a in acts):6.3f}s" if acts else "      -"
        act_s = f"{max(a['activate_s'] for a in acts):8.4f}s" if acts else "        -"
        lines.append(
            f"{lg.step:>4} {lg.version:>4} {lg.gen_version:>4} {lg.reward:6.3f} {lg.delta_bytes / 1e3:9.1f} {lg.full_bytes / 1e3:8.1f} "
            f"{100 * lg.delta_bytes / max(1, lg.full_bytes):6.1f} {100 * density(lg):7.2f}% "
            f"{lg.extract_publish_s:7.2f}s {stage_s} {act_s} {lg.tokens_per_s:7.0f}  "
            + ", ".join(f"{a}:{n}" for a, n in sorted(lg.by_actor.items()))
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DemoConfig()
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the model, the problems and every batch's sampling")
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="a local Hugging Face model directory for the Trainer (default: the built-in tiny Qwen3)",
    )
    p.add_argument("--task", default=d.task, metavar="NAME", help="arithmetic, gsm8k, math or package.module:factory")
    p.add_argument("--data", default=None, metavar="FILE", help="training problems of --task (JSON lines or Parquet)")
    p.add_argument("--eval-data", default=None, metavar="FILE", help="held-out problems (default: the Trainer's held-out set)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N", help="score the held-out set every N versions (0: never)")
    p.add_argument("--store", default=None, metavar="URL", help="use this run root instead of a local S3 server")
    p.add_argument(
        "--redis", default=None, metavar="URL", help="use this Redis instead of a local one (default: $AURORA_REDIS_URL, else a local one)"
    )
    p.add_argument(
        "--redis-password-file",
        default=None,
        metavar="FILE",
        help="first line: the password of --redis (default: $AURORA_REDIS_PASSWORD_FILE)",
    )
    p.add_argument("--run", default=d.run)
    p.add_argument("--dir", default="demo-run", help="work folder (logs, local mirror)")
    p.add_argument("--json", action="store_true", help="no live display; print one JSON object at the end")
    p.add_argument("--no-relay", action="store_true")
    p.add_argument("--kill-at", type=int, default=None, help="step at which an Actor is SIGKILLed (-1: never)")
    p.add_argument("--join-at", type=int, default=None, help="step at which a new Actor joins (-1: never)")
    p.add_argument("--codec", action="store_true", help="only the codec demonstration (no servers, no workers)")
    p.add_argument(
        "--engine", default="torch", choices=("torch", "vllm"), help="the Actors' engine (vllm: pip install 'aurora-store[vllm]')"
    )


def main(args: argparse.Namespace) -> int:
    from workers.process import limit_torch_threads

    if args.codec:
        from aurora_tools.demo.codec import run_demo

        return run_demo(args.dir, steps=min(args.steps, 10))
    # The Trainer runs in this process and is the demo's bottleneck (its Actors wait on it):
    # two threads here took a 40-step demo from 110 s to 90 s on two cores. The children
    # keep one each (run_system_demo), and AURORA_TORCH_THREADS still overrides.
    limit_torch_threads(default=min(2, os.cpu_count() or 1))
    if args.engine == "vllm":
        from workers.engine.vllm_engine import import_vllm

        import_vllm()  # before any server starts: a missing vLLM is one clear line
    cfg = DemoConfig(
        steps=args.steps,
        batch=args.batch,
        store=args.store,
        run=args.run,
        redis=args.redis or os.environ.get(REDIS_URL_ENV) or None,
        redis_password_file=args.redis_password_file or os.environ.get(REDIS_PASSWORD_FILE_ENV) or None,
        workdir=os.path.abspath(args.dir),
        display=not args.json,
        relay=not args.no_relay,
        kill_at=args.kill_at,
        join_at=args.join_at,
        engine=args.engine,
        seed=args.seed,
        model=args.model,
        task=args.task,
        data=args.data,
        eval_data=args.eval_data,
        eval_every=args.eval_every,
    )

    def say(*a: Any, **k: Any) -> None:
        if args.json:
            return
        with _TTY_LOCK:
            if sys.stdout.isatty():
                sys.stdout.write("\r\033[K")
            print(*a, **k, flush=True)

    if not args.json:
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    install_redaction()
    res = run_system_demo(cfg, say=say)
    ok = res.bit_identical and res.prompts_lost == 0 and res.accepted_twice == 0 and res.accepted_wrong_version == 0
    if args.json:
        print(json.dumps(res.to_json()))
        return 0 if ok else 1
    print()
    print(summary_table(res))
    j = res.to_json()
    print()
    print(
        f"reward {j['reward_first']:.3f} (first 5 steps) -> {j['reward_last']:.3f} (last 5 steps); mean delta {j['delta_bytes_mean'] / 1e3:.1f} kB vs {j['full_bytes'] / 1e3:.1f} kB full"
    )
    print(
        f"mean density {100 * res.density_mean:.2f}% of {res.logs[-1].elements if res.logs else 0} elements changed per version; deltas are {100 * res.delta_over_full:.1f}% of the full bf16 weights"
    )
    if res.eval_accuracy:
        print("held-out accuracy by version: " + ", ".join(f"v{v} {a:.3f}" for v, a in sorted(res.eval_accuracy.items())))
    print(
        f"actors killed {res.actors_killed}, joined {res.actors_joined}; prompts lost {res.prompts_lost}, accepted twice {res.accepted_twice}, on a wrong version {res.accepted_wrong_version}"
    )
    if res.bit_identical:
        print(
            f"every Actor's weights matched the Trainer's bit for bit at every version it activated ({res.activations_compared} activations compared)"
        )
    else:
        print(f"MISMATCH: {len(res.mismatches)} activation(s) differ from the Trainer's weights: {res.mismatches[:10]}")
    print(f"demo {'passed' if ok else 'FAILED'} in {res.wall_s:.0f}s; logs in {os.path.join(cfg.workdir or '', 'logs')}")
    return 0 if ok else 1
