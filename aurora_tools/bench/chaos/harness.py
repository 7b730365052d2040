"""One chaos run: servers, the real workers, the fault schedule, and the teardown (:class:`ChaosRun`).

The fleet is issue 12's: the Trainer, a Relay for region ``eu`` with two
Actors behind it, one Actor in region ``us`` reading origin, each a
``python -m aurora_tools.cli`` process; ``redis-server`` with an AOF and
moto's S3 server in a child process (it can be SIGSTOPped; it is never
restarted, since it keeps its objects in memory).

The harness adapts to the workers it finds: it asks each command's
``--help`` which flags it has (``--resume``, ``--checkpoint-every``,
``--outage-budget-s`` …) and passes only those, so a run against workers
that lack a feature reports what happened instead of failing to start.
Actors and the Relay start together with the Trainer when they take
``--outage-budget-s`` (workers that wait for a run that is not there yet),
else after the Trainer's v0.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger, LedgerLost
from aurora_store.testing.servers import S3Server
from aurora_tools.bench.chaos.config import ChaosConfig
from aurora_tools.bench.chaos.faults import INJECTORS, FaultRecord
from aurora_tools.bench.chaos.fleet import AofRedis, Expired, Fleet, Incarnation
from aurora_tools.bench.chaos.manifests import ManifestLog, fast_client

__all__ = ["ChaosRun", "RUN_NAME"]

RUN_NAME = "chaos"
"""The run's name (its Redis namespace, its prefix in the origin bucket)."""

_FLAG_RE = re.compile(r"--[a-z][a-z0-9-]*")


def _teardown_reserve_s(timeout_s: float) -> float:
    """Time kept at the end of the global timeout to stop the workers and read the evidence."""
    return min(120.0, 0.15 * timeout_s)


class ChaosRun:
    """One run of the benchmark; :meth:`execute` does it all and leaves what it saw on the object.

    ``say`` receives progress lines (the CLI sends them to stderr, or nowhere with ``--json``).
    """

    def __init__(self, cfg: ChaosConfig, workdir: str | None = None, say: Callable[[str], None] = lambda s: None) -> None:
        self.cfg = cfg
        self.say = say
        self.run = RUN_NAME
        self.keys = RunKeys(RUN_NAME)
        self.rng = random.Random(cfg.seed)
        self.workdir = workdir or tempfile.mkdtemp(prefix="aurora-chaos-")
        self.t0 = time.monotonic()
        self.deadline = self.t0 + cfg.timeout_s - _teardown_reserve_s(cfg.timeout_s)
        self.relay_name = "relay-eu"
        self.relay_actors = [f"eu-{i}" for i in range(cfg.actors_relay)]
        self.origin_actors = [f"us-{i}" for i in range(cfg.actors_origin)]
        self.records: list[FaultRecord] = []
        self.flags: dict[str, set[str]] = {}
        self.timed_out = False
        self.aborted: str | None = None
        self.keys_before: tuple[int, int] | None = None
        self.keys_after: tuple[int, int] | None = None
        self.fenced: list[Incarnation] = []
        """Old-epoch Trainers that were woken (expected to be fenced out and exit)."""
        self.open_prompts: dict[int, set[str]] = {}
        """Prompts still leasable at the end: open step -> prompt ids not settled."""
        self.wall_s = 0.0
        self._timers: list[threading.Timer] = []
        self._s3_paused = False
        self._s3_client: Any = None
        self._redis_clients: dict[float, Any] = {}
        self.manifests: ManifestLog | None = None
        self.redis = AofRedis()
        self.s3 = S3Server(process=True)
        self.fleet = Fleet(self.workdir, {}, self.deadline, cfg.poll_s)

    # -- servers ---------------------------------------------------------------------------
    def _start_servers(self) -> None:
        self.redis.start()
        self.s3.start()
        self.bucket = self.s3.new_bucket("origin")
        self.mirror_bucket = self.s3.new_bucket("mirror-eu")
        self.origin_url = f"s3://{self.bucket}/{self.run}"
        self.mirror_url = f"s3://{self.mirror_bucket}/{self.run}"
        self.manifests = ManifestLog(self.s3, self.bucket, self.run, lambda: self.fleet.head)
        self.manifests.start()
        self.fleet.env = dict(
            os.environ,
            **self.s3.env_vars,
            AURORA_TORCH_THREADS="1",
            PYTHONUNBUFFERED="1",
            AURORA_OUTAGE_BUDGET_S=str(self.cfg.outage_budget_s),
            # A stalled run ends with every worker's threads dumped into its log (SIGABRT, :meth:`_dump_stalled`).
            PYTHONFAULTHANDLER="1",
        )

    def pause_s3(self) -> None:
        if self.s3.pid is not None:
            os.kill(self.s3.pid, signal.SIGSTOP)
            self._s3_paused = True

    def resume_s3(self) -> None:
        if self.s3.pid is not None and self._s3_paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.s3.pid, signal.SIGCONT)
            self._s3_paused = False

    def s3_exists(self, key: str) -> bool:
        resp = self.s3_client().list_objects_v2(Bucket=self.bucket, Prefix=key, MaxKeys=1)
        return any(o["Key"] == key for o in resp.get("Contents", []))

    def s3_count(self, prefix: str) -> int:
        n = 0
        for page in self.s3_client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            n += len(page.get("Contents", []))
        return n

    def s3_client(self) -> Any:
        """A boto3 client of the S3 server that gives up within seconds."""
        if self._s3_client is None:
            self._s3_client = fast_client(self.s3)
        return self._s3_client

    def storage_options(self) -> dict[str, Any]:
        return self.s3.storage_options()

    # -- Redis, as the harness reads it -------------------------------------------------------
    def redis_client(self, block_s: float | None = None) -> Any:
        """A client of the run's Redis with short timeouts (one per blocking read length, kept)."""
        import redis

        timeout = 2.0 + (block_s or 0.0)
        client = self._redis_clients.get(timeout)
        if client is None:
            client = redis.Redis(host="127.0.0.1", port=self.redis.port, socket_timeout=timeout, socket_connect_timeout=2.0)
            self._redis_clients[timeout] = client
        return client

    def count_keys(self) -> tuple[int, int]:
        """(keys of the run, bytes of memory Redis uses); (-1, -1) when Redis does not answer."""
        try:
            r = self.redis_client()
            n = sum(1 for _ in r.scan_iter(match=self.keys.pattern, count=1000))
            return n, int(r.info("memory").get("used_memory", -1))
        except Exception:  # noqa: BLE001 - a reading for the report, never a reason to stop
            return -1, -1

    def leases_of(self, actor: str) -> int | None:
        try:
            return Ledger(self.redis_client(), self.run).lease_counts().get(actor, 0)
        except Exception:  # noqa: BLE001 - unknown is an answer here
            return None

    def lease_expiry(self, actor: str) -> tuple[int, float]:
        """(leases ``actor`` holds, milliseconds until the last of them expires)."""
        try:
            r = self.redis_client()
            ledger = Ledger(r, self.run)
            now = ledger.server_time_ms()
            n, last = 0, now
            for v in ledger.open_steps():
                for raw in r.hvals(self.keys.step(v, "lease")):
                    who, _, exp = raw.decode().split("|")[:3]  # actor|token|expiry|leased[|claim hash]
                    if who == actor:
                        n += 1
                        last = max(last, int(exp))
            return n, float(last - now)
        except Exception:  # noqa: BLE001 - unknown is an answer here
            return 0, 0.0

    def phase(self) -> str:
        """What the run is doing: the newest version out, and the batch the Trainer waits for."""
        head = self.fleet.head
        if head >= self.cfg.steps:
            return f"v{head} out: the last step"
        try:
            ledger = Ledger(self.redis_client(), self.run)
            open_steps = ledger.open_steps()
            if not open_steps:
                return f"v{head} out; no batch open in Redis"
            b = min(open_steps)
            st = ledger.step_status(b)
            return f"v{head} out; batch {b}: {st.settled}/{st.total} settled, {st.leased} leased"
        except LedgerLost:
            return f"v{head} out; its batch vanished from Redis"
        except Exception:  # noqa: BLE001 - the phase is a description
            return f"v{head} out; Redis unreadable"

    def _read_open_prompts(self) -> None:
        try:
            r = self.redis_client()
            ledger = Ledger(r, self.run)
            for v in ledger.open_steps():
                prompts = {k.decode() for k in r.hkeys(self.keys.step(v, "prompts"))}
                done_key = self.keys.step(v, "done")
                kind = r.type(done_key)
                done = r.hkeys(done_key) if kind == b"hash" else r.smembers(done_key) if kind == b"set" else []
                self.open_prompts[v] = prompts - {k.decode() for k in done}
        except Exception:  # noqa: BLE001 - unknown leaves open_prompts empty
            pass

    # -- workers -------------------------------------------------------------------------------
    def _detect_flags(self) -> None:
        """Which flags each worker command takes (its ``--help``), asked of all three at once."""
        procs = {
            role: subprocess.Popen(
                [sys.executable, "-m", "aurora_tools.cli", role, "--help"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=dict(os.environ, AURORA_TORCH_THREADS="1"),
            )
            for role in ("trainer", "actor", "relay")
        }
        for role, p in procs.items():
            out, _ = p.communicate(timeout=120)
            self.flags[role] = set(_FLAG_RE.findall(out.decode("utf-8", "replace")))

    def _has(self, role: str, flag: str) -> bool:
        return flag in self.flags.get(role, set())

    def _outage(self, role: str) -> list[str]:
        return ["--outage-budget-s", f"{self.cfg.outage_budget_s:g}"] if self._has(role, "--outage-budget-s") else []

    def _redis_env(self) -> dict[str, str]:
        """Redis reaches the workers through their environment, never their argv (which ``ps`` shows)."""
        from aurora_store.coordination.redisconn import redis_child_env

        return redis_child_env(self.redis.url)

    def start_trainer(self, resume: bool = False) -> Incarnation:
        c = self.cfg
        args = [
            "trainer",
            "--store",
            self.origin_url,
            "--run",
            self.run,
            "--steps",
            str(c.steps),
            "--batch",
            str(c.batch),
            "--group",
            str(c.group),
            "--snapshot-every",
            str(c.snapshot_every),
            "--seed",
            str(c.seed),
            "--streams",
            str(c.trainer_streams),
            *self._outage("trainer"),
        ]
        if self._has("trainer", "--checkpoint-every"):
            args += ["--checkpoint-every", str(c.checkpoint_every)]
        if self._has("trainer", "--digest-every"):
            # Every version carries its weights digest: Actors verify (and log the digest of) only versions
            # that carry one, and ``bit_identical`` needs an Actor digest per activation to compare.
            args += ["--digest-every", "1"]
        if resume:
            args.append("--resume")  # passed even when missing: the report then says the resume failed
        env = {"AURORA_SEGMENT_MIB": repr(c.trainer_segment_kib / 1024), **self._redis_env()}
        inc = self.fleet.start("trainer", "trainer", args, env, resumed=resume)
        self.say(f"  started {inc.label}{' (--resume)' if resume else ''}")
        return inc

    def start_actor(self, name: str) -> Incarnation:
        c = self.cfg
        region = "eu" if name in self.relay_actors else "us"
        args = [
            "actor",
            "--store",
            self.origin_url,
            "--run",
            self.run,
            "--region",
            region,
            "--id",
            name,
            "--slowdown",
            f"{c.actor_slowdown:g}",
            "--seed",
            str(c.seed),
            *self._outage("actor"),
        ]
        if region == "eu":
            args += ["--mirror-grace-s", f"{c.mirror_grace_s:g}"]
            if self._has("actor", "--mirror"):  # an Actor reads only the mirror it is told (older code took Redis's word)
                args += ["--mirror", self.mirror_url]
        inc = self.fleet.start(name, "actor", args, self._redis_env())
        if inc.n:
            self.say(f"  started {inc.label}")
        return inc

    def start_relay(self) -> Incarnation:
        args = [
            "relay",
            "--store",
            self.origin_url,
            "--mirror",
            self.mirror_url,
            "--run",
            self.run,
            "--region",
            "eu",
            *self._outage("relay"),
        ]
        inc = self.fleet.start(self.relay_name, "relay", args, self._redis_env())
        if inc.n:
            self.say(f"  started {inc.label}")
        return inc

    def watch_fenced(self, old: Incarnation, rec: FaultRecord) -> None:
        """The woken old-epoch Trainer gets ``fence_wait_s`` to exit by itself; then it is stopped."""
        self.fenced.append(old)

        def expire() -> None:
            if old.alive and old.proc.poll() is None:
                rec.notes.append(f"the woken Trainer was still running {self.cfg.fence_wait_s:g}s after waking; the harness stopped it")
                self.fleet.terminate(old)

        t = threading.Timer(self.cfg.fence_wait_s, expire)
        t.daemon = True
        t.start()
        self._timers.append(t)

    # -- the run ---------------------------------------------------------------------------------
    def execute(self) -> None:
        """Start everything, inject the schedule, let the run finish, stop everything.

        Never raises for what the run does: a fault the workers do not survive
        ends up in the records and the report. Raises only for a harness that
        cannot start its own servers.
        """
        c = self.cfg
        hard = threading.Timer(c.timeout_s, self._hard_stop)
        hard.daemon = True
        hard.start()
        try:
            self.say(f"chaos: {c.steps} steps, faults {', '.join(f for f, _ in c.schedule) or 'none'}; logs in {self.fleet.logdir}")
            flags = threading.Thread(target=self._detect_flags, name="chaos-flags", daemon=True)
            flags.start()
            self._start_servers()
            flags.join()
            missing = [
                f"{r} {f}"
                for r, f in (
                    ("trainer", "--resume"),
                    ("trainer", "--checkpoint-every"),
                    ("actor", "--outage-budget-s"),
                    ("relay", "--outage-budget-s"),
                )
                if not self._has(r, f)
            ]
            if missing:
                self.say(f"  workers lack: {', '.join(missing)}")
            self.fleet.watch()
            self.start_trainer()
            if not self._has("actor", "--outage-budget-s"):
                # Workers that cannot wait for a run exit if they start before its v0.
                self.fleet.wait_for(lambda: self.fleet.head >= 0 or self.fleet.trainer_done())
            self.start_relay()
            for name in self.relay_actors + self.origin_actors:
                self.start_actor(name)
            self._schedule()
            if not self.aborted:
                self.fleet.wait_for(lambda: self.fleet.head >= c.steps or self.fleet.trainer_done())
                t = self.fleet.trainer()
                if t is not None:
                    self.fleet.wait_for(lambda: not t.alive, timeout_s=30.0)
        except Expired:
            self.timed_out = True
            self.say(f"  global timeout ({c.timeout_s:g}s): stopping everything")
        finally:
            self._teardown()
            hard.cancel()
            self.wall_s = time.monotonic() - self.t0

    def _schedule(self) -> None:
        c = self.cfg
        f = self.fleet
        if not c.schedule:
            # No fault: "before" is the run in its stride, half way.
            f.wait_for(lambda: f.head >= c.steps // 2 or f.trainer_done())
            self.keys_before = self.count_keys()
        for name, trigger in c.schedule:
            rec = FaultRecord(name, trigger)
            self.records.append(rec)
            if self.aborted:
                rec.error = f"not injected: {self.aborted}"
                continue
            f.wait_for(lambda trig=trigger: f.head >= trig or f.trainer_done())  # type: ignore[misc]
            if f.head >= c.steps:
                rec.error = f"not injected: the run finished (v{f.head}) first"
                continue
            if f.trainer_done():
                t = f.trainer()
                self.aborted = f"the Trainer exited (rc {t.rc if t else '?'}) at v{f.head}"
                rec.error = f"not injected: {self.aborted}"
                continue
            if self.keys_before is None:
                self.keys_before = self.count_keys()
            self.say(f"fault {len(self.records)}/{len(c.schedule)} at v{f.head}: {rec.title}")
            INJECTORS[name](self, rec)
            if rec.error:
                self.say(f"  not injected: {rec.error}")
                continue
            recovered = f.wait_for(
                lambda r=rec: f.head > r.head_lifted or f.head >= c.steps or f.trainer_done(),  # type: ignore[misc]
                timeout_s=c.recover_timeout_s,
            )
            if f.head >= c.steps:
                continue
            if f.trainer_done():
                t = f.trainer()
                self.aborted = f"the Trainer exited (rc {t.rc if t else '?'}) after {name}"
            elif not recovered:
                self.aborted = f"no version within {c.recover_timeout_s:g}s after {name}"
            if self.aborted:
                self.say(f"  {self.aborted}: the rest of the schedule is skipped")

    def _dump_stalled(self) -> None:
        """A run that stopped publishing: SIGABRT every live worker, whose faulthandler then
        writes each thread's stack into its log (the only way to see where it hangs)."""
        for inc in list(self.fleet.all):
            if inc.ended is None and inc.proc.poll() is None:
                inc.ended_by = "SIGABRT (stack dump: the run stalled)"
                if inc.stopped_since is not None:
                    self.fleet.signal(inc, signal.SIGCONT)
                self.fleet.signal(inc, signal.SIGABRT)
        for inc in list(self.fleet.all):
            with contextlib.suppress(subprocess.TimeoutExpired):
                inc.proc.wait(10)
        self.fleet.poll()

    def _teardown(self) -> None:
        for t in self._timers:
            t.cancel()
        if self.fleet.head < self.cfg.steps and (self.timed_out or (self.aborted or "").startswith("no version")):
            self._dump_stalled()
        self.resume_s3()
        if self.redis.proc is None and self.redis.port:
            with contextlib.suppress(Exception):
                self.redis.start()
        self.fleet.stop_watch.set()
        self.keys_after = self.count_keys()
        self.fleet.close()
        self._read_open_prompts()
        if self.manifests is not None:
            self.manifests.stop.set()
            self.manifests.scan()

    def _hard_stop(self) -> None:
        """The global timeout, reached with the harness stuck: kill every child so that it comes unstuck."""
        self.timed_out = True
        for inc in list(self.fleet.all):
            if inc.ended is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(inc.proc.pid, signal.SIGKILL)
        self.resume_s3()

    def close(self) -> None:
        """Stop the servers (after the evidence was read: the S3 server holds the run)."""
        self.resume_s3()
        with contextlib.suppress(Exception):
            self.s3.stop()
        self.redis.close()

    def remove_workdir(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)
