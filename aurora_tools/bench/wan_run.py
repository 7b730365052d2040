"""``aurora bench wan``: running one configuration of the real workers over an emulated WAN.

The trainer region is this machine's root namespace: moto's S3 server (a
child process, objects in memory) and ``redis-server``, both on 127.0.0.1,
and the Trainer (``aurora bench synthetic-trainer``, a child process).
The Actor region ``r1`` is a network namespace of :class:`~aurora_tools.wan.netns.WanTestbed`
(or, where namespaces are not permitted, loopback with the same proxies):
its Relay and Actors (``aurora relay``, ``aurora bench synthetic-actor``)
reach S3 and Redis only through the testbed's proxies (delay, stalls) and
the htb rate limit on the veth pair. The Relay's mirror is a directory
(``file://``): intra-region reads cost no link.

Bytes crossing the region boundary are the proxies' counters (and the
veth's), read each time a Trainer step log appears.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aurora_store.testing.servers import RcloneS3Server, RedisServer, S3Server
from aurora_tools.bench.wan_sweep import RunConfig, summarize

__all__ = ["Servers", "Workload", "servers", "run_config"]


@dataclass(frozen=True, slots=True)
class Workload:
    """The synthetic workload every run of a sweep shares."""

    params: float
    prompts_per_actor: int = 16
    group: int = 4
    tokens: int = 32
    gen_window_s: float = 0.0
    """Simulated generation time of one Actor's share of a step (0: the paper's 45 s x params / 8.2e9)."""
    train_s: float = -1.0
    """Simulated training time per step (< 0: 0.3 x the generation window: rollouts are most of
    an RL step; with one-step asynchrony training is hidden, and the rest of the window is
    what extraction and transfer may take)."""
    density: float = 0.0107
    hold_weights_budget: float = 6e9
    """Actors keep real weights while Actors x model bytes stay under this; above, fetch + verify + decode only."""
    heartbeat_timeout_s: float = 4.0
    digests: bool = False
    """Trainer and (weight-holding) Actors digest every version; the run reports whether they match."""

    def window(self, params: int) -> float:
        return self.gen_window_s if self.gen_window_s > 0 else 45.0 * params / 8.2e9

    def train(self, params: int) -> float:
        return self.train_s if self.train_s >= 0 else 0.3 * self.window(params)


@dataclass(slots=True)
class Servers:
    s3: S3Server | RcloneS3Server
    redis_url: str
    redis_port: int
    workdir: str
    client: Any = None
    commit_via: str = "store"
    """``redis`` on a server that ignores conditional writes (rclone): the Trainer commits through Redis."""

    @property
    def s3_endpoint(self) -> str:
        return self.s3.endpoint

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """The environment of a worker process: unbuffered, one torch thread, S3 at ``endpoint`` (default: the server)."""
        e = dict(os.environ, PYTHONUNBUFFERED="1", AURORA_TORCH_THREADS="1", **self.s3.env_vars)
        e["AWS_ENDPOINT_URL"] = endpoint or self.s3_endpoint
        e.pop("AWS_ENDPOINT_URL_S3", None)
        return e


@contextlib.contextmanager
def servers(workdir: str | None = None, s3: str = "moto") -> Iterator[Servers]:
    """An S3 server and redis-server on loopback, for a whole sweep.

    ``s3="moto"``: moto in a child process, objects held in memory. ``"rclone"``: ``rclone serve
    s3`` over ``WORKDIR/s3`` (objects in files), which ignores conditional writes: Redis then
    persists (AOF) and the Trainer commits through it (``--commit-via redis``).
    """
    wd = workdir or tempfile.mkdtemp(prefix="aurora-wan-")
    os.makedirs(wd, exist_ok=True)
    server: S3Server | RcloneS3Server
    if s3 == "rclone":
        server = RcloneS3Server(root=os.path.join(wd, "s3"))
    elif s3 == "moto":
        # Objects of one version are large: moto's default buffer spills them to disk.
        server = S3Server(process=True, env={"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(1 << 40)})
    else:
        raise ValueError(f"--s3 {s3!r}: expected moto or rclone")
    via = "redis" if s3 == "rclone" else "store"
    with server, RedisServer(appendonly=via == "redis") as rs:
        yield Servers(server, rs.url, rs.port, wd, server.client(), commit_via=via)


def _drop_bucket(srv: Servers, bucket: str) -> None:
    """Free the S3 server's memory: every object of the run, then the bucket."""
    c = srv.client
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=bucket, Delete={"Objects": keys})
    c.delete_bucket(Bucket=bucket)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "aurora_tools.cli", *args]


def _stats(tb: Any, s3_port: int) -> dict[str, int]:
    """Cumulative bytes across the region boundaries: all proxies, the S3 one alone, and the veth.

    Summed over the Actor regions, and the S3 bytes of each region alone (``s3_down@r1``, ...).
    """
    out = {"down": 0, "up": 0, "veth_down": 0, "s3_down": 0, "redis_down": 0}
    for region in tb.regions:
        s = tb.stats(region)
        out["down"] += s.proxy.bytes_down
        out["up"] += s.proxy.bytes_up
        out["veth_down"] += s.veth_bytes_down or 0
        mine = 0
        for (_host, port), proxy in tb.proxies(region).items():
            n = proxy.stats().bytes_down
            if port == s3_port:
                mine += n
            else:
                out["redis_down"] += n
        out["s3_down"] += mine
        out[f"s3_down@{region}"] = mine
    return out


def run_config(
    cfg: RunConfig,
    wl: Workload,
    srv: Servers,
    net_mode: str,
    index: int,
    say: Callable[[str], None],
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """Run ``cfg`` end to end and return :func:`~.wan_sweep.summarize`'s figures (plus ``error`` on failure)."""
    import redis

    from aurora_tools.synthetic.shapes import shape_for_params
    from aurora_tools.wan.netns import WanTestbed
    from aurora_tools.wan.profile import LinkProfile

    shape = shape_for_params(wl.params)
    params = shape.params
    full_bytes = 2 * params  # bf16
    run = f"wan{index}"
    bucket = f"wan{index}-{os.getpid()}-{int(time.time())}"
    srv.client.create_bucket(Bucket=bucket)
    origin = f"s3://{bucket}/{run}"
    logdir = os.path.join(srv.workdir, "logs", f"{index:02d}-{cfg.mode}-x{cfg.actors}")
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir)
    mirror_dir = os.path.join(srv.workdir, "mirror", run)
    shutil.rmtree(mirror_dir, ignore_errors=True)
    r = redis.Redis.from_url(srv.redis_url)
    spec = cfg.spec
    S = cfg.conns
    batch = wl.prompts_per_actor * cfg.actors
    per_prompt = wl.window(params) / wl.prompts_per_actor
    delta_est = params * wl.density * 1.7
    seg = int(min(16 << 20, max(64 << 10, delta_est / 8)))
    shard = int(min(1 << 30, max(1 << 20, full_bytes / 8)))
    # A full-transfer Actor holds its weights and one staged copy.
    hold = cfg.actors * full_bytes * (2 if spec.transfer == "full" else 1) <= wl.hold_weights_budget
    profiles = {
        f"r{k + 1}": LinkProfile(
            rate_mbit=None if link.gbps is None else link.gbps * 1000.0,
            delay_ms=link.rtt_ms / 2,
            jitter_ms=link.jitter_ms,
            stall_prob=link.stall_prob,
            stall_ms=link.stall_ms or 500.0,
            seed=100 * index + k,
        )
        for k, link in enumerate(cfg.links)
    }
    if spec.transfer == "full":
        # The S3 server holds K + 1 versions in memory and the Trainer two more copies: skip a run
        # that would push this machine (and its other users) into the OOM killer.
        need = (spec.max_lag + 3) * full_bytes + 1e9
        avail = _mem_available()
        if avail is not None and avail < need:
            _drop_bucket(srv, bucket)
            res = summarize(cfg, [], {}, {}, {}, full_bytes)
            res.update(
                params=params,
                model_bytes=full_bytes,
                net_mode=net_mode,
                error=f"skipped: needs about {need / 1e9:.1f} GB of memory, {avail / 1e9:.1f} GB available",
                logs=logdir,
            )
            return res
    procs: dict[str, subprocess.Popen[bytes]] = {}
    files: list[Any] = []
    bytes_at: dict[int, dict[str, int]] = {}
    error = None
    t_start = time.perf_counter()

    def out(name: str) -> Any:
        f = open(os.path.join(logdir, f"{name}.log"), "wb")  # noqa: SIM115 - closed at the end of the run
        files.append(f)
        return f

    from aurora_store.coordination.keys import RunKeys
    from aurora_store.coordination.records import RunRecords
    from aurora_store.coordination.redisconn import redis_child_env

    rk = RunKeys(run)
    steps_key = rk.wan("steps")
    tb = WanTestbed(profiles, mode=net_mode)  # type: ignore[arg-type]
    try:
        tb.start()
        s3_up_port = int(srv.s3_endpoint.rsplit(":", 1)[1])
        region_env: dict[str, dict[str, str]] = {}
        region_redis: dict[str, str] = {}
        for reg in profiles:
            s3_host, s3_port = tb.expose(reg, ("127.0.0.1", s3_up_port))
            rd_host, rd_port = tb.expose(reg, ("127.0.0.1", srv.redis_port))
            region_env[reg] = srv.env(f"http://{s3_host}:{s3_port}")
            region_redis[reg] = f"redis://{rd_host}:{rd_port}/0"
            # Redis reaches the workers through their environment, never their argv (which ps shows).
            region_env[reg].update(redis_child_env(region_redis[reg]))
        start_counters = _stats(tb, s3_up_port)
        trainer_args = [
            "bench",
            "synthetic-trainer",
            "--store",
            origin,
            "--run",
            run,
            "--steps",
            str(cfg.steps),
            "--batch",
            str(batch),
            "--group",
            str(wl.group),
            "--streams",
            str(S),
            "--transfer",
            spec.transfer,
            "--max-lag",
            str(spec.max_lag),
            "--split",
            cfg.split,
            "--params",
            str(wl.params),
            "--density",
            str(wl.density),
            "--gen-s-per-prompt",
            f"{per_prompt:.6f}",
            "--train-s",
            f"{wl.train(params):.6f}",
            "--tokens",
            str(wl.tokens),
            "--segment-bytes",
            str(seg),
            "--shard-bytes",
            str(shard),
            "--heartbeat-timeout",
            str(wl.heartbeat_timeout_s),
            "--keep-snapshots",
            str(spec.max_lag + 1),
            # A lease must outlive one claim's generation (before any completion time is measured).
            "--min-lease-s",
            f"{max(2.0, 3 * per_prompt * 2 * wl.prompts_per_actor * max(cfg.slowdowns)):.1f}",
            *(["--digests"] if wl.digests else []),
            *(["--commit-via", "redis"] if srv.commit_via == "redis" else []),
        ]
        # Everything starts at once (imports overlap); Actors wait for the run's description.
        procs["trainer"] = subprocess.Popen(
            _cli(*trainer_args), env={**srv.env(), **redis_child_env(srv.redis_url)}, stdout=out("trainer"), stderr=subprocess.STDOUT
        )
        if cfg.uses_relay:
            for reg in profiles:
                procs[f"relay-{reg}"] = tb.popen(
                    reg,
                    _cli(
                        "relay",
                        "--store",
                        origin,
                        "--mirror",
                        f"file://{mirror_dir}/{reg}",
                        "--run",
                        run,
                        "--region",
                        reg,
                        "--streams",
                        str(S),
                        "--fetch",
                        cfg.fetch,
                    ),
                    env=region_env[reg],
                    stdout=out(f"relay-{reg}" if len(profiles) > 1 else "relay"),
                    stderr=subprocess.STDOUT,
                )

        def actor_argv(name: str, reg: str, slow: float, join: int | None = None) -> list[str]:
            a = [
                "bench",
                "synthetic-actor",
                "--store",
                origin,
                "--run",
                run,
                "--region",
                reg,
                "--id",
                name,
                "--transfer",
                spec.transfer,
                "--streams",
                str(S),
                "--claim",
                str(2 * wl.prompts_per_actor),
                "--slowdown",
                f"{slow:g}",
                "--hold-weights",
                "yes" if hold else "no",
                "--fetch",
                cfg.fetch,
                *(["--digests"] if wl.digests and hold else []),
            ]
            if cfg.uses_relay:
                # The region is deployed with a Relay: its Actors stage through it from the first version.
                a += ["--relay-wait-s", "300", "--mirror", f"file://{mirror_dir}/{reg}"]
            if join is not None:
                a += ["--join-at-version", str(join)]
            return _cli(*a)

        for i, slow in enumerate(cfg.slowdowns):
            name, reg = f"a{i}", cfg.region_of(i)
            procs[name] = tb.popen(reg, actor_argv(name, reg, slow), env=region_env[reg], stdout=out(name), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        records = RunRecords(r, run)
        while records.head() is None:
            if procs["trainer"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"trainer did not publish version 0 (see {logdir}/trainer.log)")
            time.sleep(0.1)
        bytes_at[-1] = _stats(tb, s3_up_port)
        seen = 0
        deadline = time.monotonic() + timeout_s
        while True:
            n = int(r.llen(steps_key))
            while seen < n:
                bytes_at[seen] = _stats(tb, s3_up_port)
                if cfg.kill_at is not None and seen == cfg.kill_at:
                    procs["a0"].send_signal(signal.SIGKILL)
                    say(f"    churn: a0 killed (SIGKILL) after step {seen}")
                if cfg.join_at is not None and seen == cfg.join_at:
                    name, reg = f"a{cfg.actors}", cfg.region_of(cfg.actors)
                    procs[name] = tb.popen(
                        reg, actor_argv(name, reg, 1.0, None), env=region_env[reg], stdout=out(name), stderr=subprocess.STDOUT
                    )
                    say(f"    churn: {name} joins after step {seen}")
                seen += 1
                say(f"    step {seen}/{cfg.steps}")
            if seen >= cfg.steps or procs["trainer"].poll() is not None:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cfg.name}: {seen}/{cfg.steps} steps after {timeout_s:.0f}s")
            time.sleep(0.05)
        if procs["trainer"].wait(timeout=60) != 0:
            raise RuntimeError(f"trainer exited with status {procs['trainer'].returncode} (see {logdir}/trainer.log)")
        totals = None
        if spec.transfer == "delta":
            # Every live Actor stages every version it can (deltas are small): wait for the last
            # one so the run's byte count covers whole versions.
            live = [n for n, p in procs.items() if n.startswith("a") and p.poll() is None]
            staged_key = rk.wan("staged")
            until = time.monotonic() + 30
            while time.monotonic() < until and not all(r.hexists(staged_key, f"{a}|{cfg.steps}") for a in live):
                time.sleep(0.1)
            totals = (start_counters, _stats(tb, s3_up_port))
        steps = [json.loads(x) for x in r.lrange(steps_key, 0, -1)]
        published = {int(k): json.loads(v) for k, v in r.hgetall(rk.wan("published")).items()}
        staged: dict[tuple[str, int], Any] = {}
        for k, v in r.hgetall(rk.wan("staged")).items():
            who, _, ver = _s(k).rpartition("|")
            staged[(who, int(ver))] = json.loads(v)
        late = frozenset(n for n in procs if n.startswith("a") and int(n[1:]) >= cfg.actors)
        res = summarize(cfg, steps, published, staged, bytes_at, full_bytes, totals, late, _announcements(r, rk))
        if wl.digests and hold and spec.transfer != "none":
            tdig, adig = records.digests()
            pairs = [(d, tdig.get(v)) for (_, v), d in adig.items()]
            res["digests_compared"] = len(pairs)
            res["digests_match"] = bool(pairs) and all(a == b for a, b in pairs)
    except Exception as e:  # noqa: BLE001 - one failed configuration must not end the sweep
        error = f"{type(e).__name__}: {e}"
        res = summarize(cfg, [], {}, {}, {}, full_bytes)
    finally:
        p = procs.get("trainer")
        if p is not None and p.poll() is None:
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=20)
            if p.poll() is None:
                p.kill()
        tb.close()
        for f in files:
            f.close()
        with contextlib.suppress(Exception):
            _drop_bucket(srv, bucket)
        shutil.rmtree(mirror_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            keys = list(r.scan_iter(rk.pattern, count=1000))
            for i in range(0, len(keys), 500):
                r.delete(*keys[i : i + 500])
        r.close()
    res.update(
        params=params,
        model_bytes=full_bytes,
        net_mode=tb.mode,
        hold_weights=hold,
        segment_bytes=seg,
        shard_bytes=shard,
        gen_window_s=wl.window(params),
        train_s=wl.train(params),
        batch=batch,
        wall_s=time.perf_counter() - t_start,
        logs=logdir,
        error=error,
    )
    return res


def _announcements(r: Any, rk: Any) -> dict[int, dict[str, float]]:
    """Version -> when (ms) its first and last segments and the version itself were announced on the
    origin stream: the entry ids' milliseconds, Redis's clock (the same host's as the workers')."""
    out: dict[int, dict[str, float]] = {}
    for eid, body in r.xrange(rk.events(None)):
        f = {_s(k): _s(v) for k, v in body.items()}
        try:
            v = int(f.get("version", ""))
        except ValueError:
            continue
        t = float(_s(eid).partition("-")[0])
        if f.get("type") == "segment":
            out.setdefault(v, {}).setdefault("first_segment_ms", t)
            out[v]["last_segment_ms"] = t
        elif f.get("type") == "version":
            out.setdefault(v, {}).setdefault("version_ms", t)
    return out


def _mem_available() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
