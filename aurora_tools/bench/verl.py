"""``aurora bench verl``: Aurora as verl's checkpoint engine, one trainer and one replica across an emulated WAN link.

The trainer is this process: verl's registry makes the ``aurora`` engine
(:mod:`aurora_store.integrations.verl`) and ``send_weights`` gets a
generator of a Qwen3-shaped model's tensors (Hugging Face names, bf16, the
synthetic workload's, :mod:`aurora_tools.synthetic`). The replica is a
child process in a region behind the link the WAN benchmark's headline
runs use (1 Gbit/s, 20 ms RTT: ``aurora_tools.wan``, network namespaces
with tc where permitted, else loopback proxies), and reaches the object
store (``rclone serve s3``: files on disk, so the server holds no model in
memory) and Redis through it. After version 0, each measured step moves
``--density`` of the elements by one bf16 ulp (RL density,
``DEFAULT_DENSITY``) and reports:

- ``send_s``: time in ``send_weights`` (copy, extract, encode, upload, commit, announce);
- ``receive_s``: from ``send_weights`` returning to the replica's last yielded tensor
  (woken by Redis, fetch over the link, validate, apply);
- ``full_transfer_s``: the same weights sent whole over the same path: a fresh run root,
  where they are version 0 (a snapshot), from ``send_weights`` to the replica's last tensor;
- ``bit_identical``: every version the replica yielded equals the trainer's bf16 tensors.

``--shape`` takes a named shape instead of ``--params``; a mixture-of-experts
one (``qwen3-moe-tiny``, ``qwen3-30b-a3b-mini``) is sent one tensor per
expert, as verl's FSDP engine yields it, and the replica must yield the same
names back.

Of several measured steps the fastest (send + receive) is reported: on a
shared machine, slower ones measure the neighbours. Needs verl: run it in
``.venv-verl`` (``make venv-verl``): ``.venv-verl/bin/python -m aurora_tools.cli
bench verl --json``. Progress goes to stderr, the table or JSON to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import resource
import select
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import ExitStack
from typing import Any

import torch

__all__ = ["add_arguments", "main", "run_benchmark"]

DEFAULT_PARAMS = 5e8
REPLY_TIMEOUT_S = 1800.0
"""The replica's longest silence: version 0 of a large model over a slow link."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from aurora_tools.synthetic.shapes import NAMED_SHAPES
    from aurora_tools.synthetic.workload import DEFAULT_DENSITY

    p.add_argument("--params", type=float, default=DEFAULT_PARAMS, help=f"model size in parameters (default {DEFAULT_PARAMS:g})")
    p.add_argument(
        "--shape", choices=sorted(NAMED_SHAPES), default=None, help="a named shape instead of --params (MoE ones: experts sent one by one)"
    )
    p.add_argument("--density", type=float, default=DEFAULT_DENSITY, help=f"elements one step changes (default {DEFAULT_DENSITY})")
    p.add_argument("--measure", type=int, default=2, help="steps measured after version 0 (default 2; the fastest is reported)")
    p.add_argument("--gbps", type=float, default=1.0, help="the link's rate in Gbit/s (default 1, the WAN benchmark's headline)")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="the link's round-trip time (default 20 ms)")
    p.add_argument("--net", choices=("auto", "netns", "loopback"), default="auto", help="auto: namespaces where permitted")
    p.add_argument("--workdir", default=None, help="logs and the S3 server's files (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


# -- both sides ------------------------------------------------------------------------------


def _engine(options: Mapping[str, Any], is_master: bool | None = None) -> Any:
    """The ``aurora`` engine as verl makes it: the plugin module imported by verl, the class found by name."""
    try:
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs
    except ImportError as e:
        raise SystemExit(
            f"aurora bench verl needs verl: `make venv-verl`, then .venv-verl/bin/python -m aurora_tools.cli bench verl ({e})"
        ) from None
    import_external_libs("aurora_store.integrations.verl")
    extra = {} if is_master is None else {"is_master": is_master}
    return CheckpointEngineRegistry.new("aurora", bucket_size=2048 << 20, **extra, **options)


def _digest(pairs: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, shape, bf16 bytes) in name order: what "bit-identical" compares."""
    h = hashlib.sha256()
    for name, t in sorted(pairs, key=lambda p: p[0]):
        b = t.detach().to(torch.bfloat16).contiguous().cpu()
        h.update(f"{name}{tuple(b.shape)}".encode())
        h.update(b.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def _rss_peak_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


# -- the replica (a child process in the region) -----------------------------------------------


def receiver_main() -> int:
    """Commands on stdin, one JSON line each; one JSON reply per command on stdout."""
    engine: Any = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "open":  # a run root of its own for each path measured
            if engine is not None:
                engine.close()
                engine = None
                gc.collect()
            engine = _engine(cmd["options"])
            reply: dict[str, Any] = {"ok": True}
        elif cmd["cmd"] == "recv":
            pairs: list[tuple[str, torch.Tensor]] = []
            last = asyncio.run(_take(engine.receive_weights(global_steps=cmd["step"]), pairs))
            u = engine.last
            reply = {"t_last": last, "digest": _digest(pairs), "path": u.path, "bytes": u.bytes, "version": u.version}
            pairs.clear()
        else:
            break
        print(json.dumps({**reply, "rss_peak_mb": _rss_peak_mb()}), flush=True)
    if engine is not None:
        engine.close()
    return 0


async def _take(weights: AsyncIterator[tuple[str, torch.Tensor]], into: list[tuple[str, torch.Tensor]]) -> float:
    """Take every pair (the engine's own tensors, as a server adapter would copy them); the time of the last."""
    last = time.time()
    async for item in weights:
        into.append(item)
        last = time.time()
    return last


class _Replica:
    def __init__(self, proc: subprocess.Popen[str], log_path: str) -> None:
        self.proc, self.log_path = proc, log_path

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            with open(self.log_path, errors="replace") as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"the replica said nothing (exit {self.proc.poll()}); its log {self.log_path}:\n{tail}")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.reply()


# -- the trainer (this process) ----------------------------------------------------------------


def _send(engine: Any, weights: Mapping[str, torch.Tensor], step: int) -> tuple[float, float, dict[str, Any]]:
    """(start, end, metrics) of one ``send_weights`` of ``weights`` as verl's per-tensor generator."""
    t0 = time.time()
    metrics = asyncio.run(engine.send_weights(iter(weights.items()), global_steps=step))
    return t0, time.time(), metrics


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from aurora_store.testing.servers import RcloneS3Server, RedisServer
    from aurora_tools.synthetic.shapes import Qwen3MoeShape, make_weights, shape_for_params, shape_named
    from aurora_tools.synthetic.workload import base_weights, sparse_update
    from aurora_tools.wan.netns import WanTestbed
    from aurora_tools.wan.profile import LinkProfile

    if args.measure < 1 or not 0 < args.density < 1:
        raise SystemExit(f"aurora bench verl: --measure {args.measure} must be >= 1 and --density {args.density} in (0, 1)")
    t_start = time.perf_counter()
    _engine({"store": "file:///nonexistent/verl-check"}).close()  # fail here, not after the servers, when verl is missing
    shape = shape_named(args.shape) if args.shape else shape_for_params(args.params)
    with ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="aurora-bench-verl-"))
        os.makedirs(workdir, exist_ok=True)
        redis = RedisServer(appendonly=True).start()  # the run commits through Redis (rclone ignores If-None-Match)
        stack.callback(redis.stop)
        s3 = RcloneS3Server(root=os.path.join(workdir, "s3")).start()
        stack.callback(s3.stop)
        bucket = s3.new_bucket()
        os.environ.update(s3.env_vars)  # this process is the trainer: credentials from the environment, as in production
        link = LinkProfile(rate_mbit=args.gbps * 1000.0, delay_ms=args.rtt_ms / 2)
        tb = stack.enter_context(WanTestbed({"r1": link}, mode=args.net))
        s3_host, s3_port = tb.expose("r1", ("127.0.0.1", s3.port))
        far_s3, far_redis = f"http://{s3_host}:{s3_port}", tb.expose_url("r1", redis.url)
        log(
            f"aurora bench verl: {shape.params:.3g} parameters, link {args.gbps:g} Gbit/s {args.rtt_ms:g} ms RTT ({tb.mode}), logs {workdir}"
        )

        def options(run: str, here: bool) -> dict[str, Any]:
            return {
                "store": f"s3://{bucket}/runs/{run}",
                "redis": redis.url if here else far_redis,
                "commit_via": "redis",
                "storage_options": {"client_kwargs": {"endpoint_url": s3.endpoint if here else far_s3}},
            }

        log_path = os.path.join(workdir, "replica.log")
        err = stack.enter_context(open(log_path, "w"))  # noqa: SIM115 - closed by the stack
        env = {**os.environ, **s3.env_vars, "PYTHONUNBUFFERED": "1", "AURORA_TORCH_THREADS": "1"}  # credentials: environment only
        argv = [sys.executable, "-m", "aurora_tools.bench.verl", "--receiver"]
        proc = tb.popen("r1", argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        replica = _Replica(proc, log_path)
        # A mixture-of-experts model as verl's FSDP engine yields it: one tensor per expert and projection.
        weights = make_weights(shape, packed=False) if isinstance(shape, Qwen3MoeShape) else base_weights(shape)
        runs = {"delta": f"verl-{uuid.uuid4().hex[:8]}", "full": f"verl-full-{uuid.uuid4().hex[:8]}"}

        # Version 0 (a snapshot: the replica's first fetch of the whole model), then the measured deltas.
        trainer = _engine(options(runs["delta"], True), is_master=True)
        replica.ask(cmd="open", options=options(runs["delta"], False))
        replica.send(cmd="recv", step=0)
        _send(trainer, weights, 0)
        r0 = replica.reply()
        checks = [r0["digest"] == _digest(weights.items())]
        log(f"  v0 reached the replica by {r0['path']}: {r0['bytes'] / 1e6:.0f} MB")
        steps: list[dict[str, Any]] = []
        for step in range(1, args.measure + 1):
            sparse_update(weights, args.density, seed=0, version=step)
            replica.send(cmd="recv", step=step)
            t0, t1, metrics = _send(trainer, weights, step)
            r = replica.reply()
            checks.append(r["digest"] == _digest(weights.items()))
            steps.append(
                {
                    "send_s": round(t1 - t0, 3),
                    "receive_s": round(r["t_last"] - t1, 3),
                    "bytes": metrics["aurora/bytes"],
                    "density": round(metrics["aurora/density"], 5),
                    "path": r["path"],
                }
            )
            log(f"  v{step}: send {t1 - t0:.2f} s, receive {r['t_last'] - t1:.2f} s, {metrics['aurora/bytes'] / 1e6:.1f} MB")
        trainer_rss = _rss_peak_mb()
        trainer.close()
        del trainer
        gc.collect()

        # The same weights whole: version 0 of a fresh run root, over the same store, link and engine.
        trainer = _engine(options(runs["full"], True), is_master=True)
        replica.ask(cmd="open", options=options(runs["full"], False))
        replica.send(cmd="recv", step=0)
        t0, t1, metrics = _send(trainer, weights, 0)
        rf = replica.reply()
        checks.append(rf["digest"] == _digest(weights.items()))
        full_s = rf["t_last"] - t0
        log(f"  whole: {full_s:.2f} s for {metrics['aurora/bytes'] / 1e6:.0f} MB (send {t1 - t0:.2f} s)")
        trainer.close()
        replica.send(cmd="quit")
        proc.wait(timeout=60)
        best = min(steps, key=lambda s: s["send_s"] + s["receive_s"])
        return {
            "params": shape.params,
            "send_s": best["send_s"],
            "receive_s": best["receive_s"],
            "full_transfer_s": round(full_s, 3),
            "bit_identical": all(checks),
            "delta_bytes": best["bytes"],
            "full_bytes": metrics["aurora/bytes"],
            "density": best["density"],
            "delta_over_full": round((best["send_s"] + best["receive_s"]) / full_s, 4),
            "steps": steps,
            "link": {"gbps": args.gbps, "rtt_ms": args.rtt_ms, "net": tb.mode},
            "rss_peak_mb": {"trainer": max(trainer_rss, _rss_peak_mb()), "replica": rf["rss_peak_mb"]},
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "wall_s": round(time.perf_counter() - t_start, 1),
        }


def _table(r: Mapping[str, Any]) -> str:
    rows = [
        ("parameters", f"{r['params']:.3g}"),
        ("link", f"{r['link']['gbps']:g} Gbit/s, {r['link']['rtt_ms']:g} ms RTT ({r['link']['net']})"),
        ("delta per step", f"{r['delta_bytes'] / 1e6:.1f} MB ({100 * r['density']:.2f}% changed)"),
        ("send_weights", f"{r['send_s']:.2f} s"),
        ("to the replica's last tensor", f"{r['receive_s']:.2f} s"),
        ("the same weights whole", f"{r['full_transfer_s']:.2f} s ({r['full_bytes'] / 1e6:.0f} MB)"),
        ("delta / whole", f"{r['delta_over_full']:.3f}"),
        ("bit-identical", str(r["bit_identical"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(args: argparse.Namespace) -> int:
    r = run_benchmark(args, lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(r) if args.json else _table(r))
    return 0 if r["bit_identical"] else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--receiver"]:
        sys.exit(receiver_main())
    parser = argparse.ArgumentParser(prog="python -m aurora_tools.bench.verl", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
