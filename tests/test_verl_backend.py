"""Aurora as verl's checkpoint engine, against verl itself (``.venv-verl``, made by ``make venv-verl``).

The system test runs verl's own code paths in real processes: each worker
builds its engine from a ``CheckpointEngineConfig`` whose
``custom_backend_module`` names ``aurora_store.integrations.verl``, looked
up in verl's registry by the name ``aurora`` (tests/verl_worker.py). A
trainer sends three versions of a tiny Qwen3 through ``send_weights``;
replica A receives all three from origin, replica B joins after the first
and reads through its region's mirror, kept by a real Relay process. Every
version must reach both bit for bit. The delta B takes from the mirror is
deleted at origin first, so the mirror is the only place B can have read it.

The Hugging Face names a replica yields come from the run's manifests
(:func:`~aurora_store.integrations.hf_layout.hf_layout`); that part needs no
verl and is tested here on its own.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.extract import plan_of
from aurora_store.errors import ConfigError
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.integrations.hf_layout import hf_layout
from aurora_store.lineage.fetch import read_manifest
from aurora_store.storage import open_store
from aurora_store.testing.servers import RedisServer, S3Server
from aurora_store.testing.wait import wait_until
from aurora_tools.synthetic.shapes import QWEN3_TINY, make_weights

REPO = Path(__file__).resolve().parents[1]
VERL_PYTHON = REPO / ".venv-verl" / "bin" / "python"
REPLY_TIMEOUT_S = 300.0
"""A verl worker's longest silence: importing verl, ray and torch on a busy two-core box takes a minute."""


# -- the Hugging Face names of a run, from its fused ones ---------------------------------


def test_hf_layout_inverts_the_fusion_of_a_tied_qwen3() -> None:
    w = make_weights(QWEN3_TINY)
    fused = plan_of(w, tied=False).specs()
    assert any(".qkv_proj." in n for n in fused) and any(".gate_up_proj." in n for n in fused)
    got = hf_layout(fused)
    assert {n: tuple(s.shape) for n, s in got.items()} == {n: tuple(t.shape) for n, t in w.items()}


def test_hf_layout_splits_a_qkv_bias_like_its_weight() -> None:
    specs = {
        "model.layers.0.self_attn.q_proj.weight": ParamSpec((64, 32), "bfloat16"),
        "model.layers.0.self_attn.k_proj.weight": ParamSpec((16, 32), "bfloat16"),
        "model.layers.0.self_attn.v_proj.weight": ParamSpec((16, 32), "bfloat16"),
        "model.layers.0.self_attn.q_proj.bias": ParamSpec((64,), "bfloat16"),
        "model.layers.0.self_attn.k_proj.bias": ParamSpec((16,), "bfloat16"),
        "model.layers.0.self_attn.v_proj.bias": ParamSpec((16,), "bfloat16"),
        "model.layers.0.self_attn.o_proj.weight": ParamSpec((32, 64), "bfloat16"),
    }
    fused = plan_of({n: _empty(s) for n, s in specs.items()}, tied=False).specs()
    assert set(fused) == {
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.qkv_proj.bias",
        "model.layers.0.self_attn.o_proj.weight",
    }
    assert hf_layout(fused) == specs


@pytest.mark.parametrize(
    ("fused", "says"),
    [
        ({"m.layers.0.self_attn.qkv_proj.weight": ParamSpec((96, 32), "bfloat16")}, "cannot split"),
        (
            {
                "m.layers.0.self_attn.qkv_proj.weight": ParamSpec((97, 32), "bfloat16"),
                "m.layers.0.self_attn.o_proj.weight": ParamSpec((32, 64), "bfloat16"),
            },
            "cannot split",
        ),
        ({"m.layers.0.mlp.gate_up_proj.weight": ParamSpec((33, 8), "bfloat16")}, "gate and up"),
        ({"m.layers.0.mlp.experts.w13_weight": ParamSpec((4, 16, 8), "bfloat16")}, "mixture-of-experts"),
        ({"m.norm.weight": ParamSpec((8,), "float32")}, "bfloat16"),
    ],
)
def test_hf_layout_refuses_what_a_manifest_cannot_mean(fused: dict[str, ParamSpec], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        hf_layout(fused, where="planted")


def _empty(spec: ParamSpec) -> Any:
    import torch

    return torch.empty(spec.shape, dtype=torch.bfloat16)


# -- verl itself, in processes -------------------------------------------------------------


class Worker:
    """One verl worker process (tests/verl_worker.py), one JSON line per command and reply."""

    def __init__(self, name: str, role: str, options: dict[str, Any], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.log = logs / f"{name}.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen(
                [str(VERL_PYTHON), str(REPO / "tests" / "verl_worker.py"), role, json.dumps(options)],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.proc.kill()
            pytest.fail(f"verl worker {self.name} said nothing (exit {self.proc.wait()}); its log:\n{self.log.read_text()[-4000:]}")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.reply()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="quit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _relay(store: str, mirror: str, redis_url: str, run: str, env: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "workers.relay", "--store", store, "--mirror", mirror, "--run", run, "--region", "eu"]
    argv += ["--block-ms", "100", "--heartbeat-s", "0.5"]
    with open(logs / "relay.log", "wb") as out:
        return subprocess.Popen(argv, cwd=REPO, env={**env, "AURORA_REDIS_URL": redis_url}, stdout=out, stderr=subprocess.STDOUT)


def _sync(step: int, trainer: Worker, replicas: list[Worker], group: list[Worker]) -> dict[str, dict[str, Any]]:
    """One ``CheckpointEngineManager.update_weights`` round: every worker of ``group`` prepares, ``replicas`` receive."""
    metadata = [w.ask(cmd="prepare")["metadata"] for w in group]
    rollout = [w for w in group if w is not trainer]
    for w in replicas:
        w.send(cmd="update", step=step, metadata=metadata, rank=rollout.index(w), rollout_world_size=len(rollout))
    trainer.send(cmd="update", step=step, metadata=metadata, rank=0, rollout_world_size=len(rollout))
    return {w.name: w.reply() for w in [trainer, *replicas]}


def _same_weights(sent: dict[str, Any], got: dict[str, Any]) -> None:
    """The replica's tensors are the trainer's, bf16 bit for bit; a tied head travels (and comes back) once."""
    want = dict(sent["digests"])
    assert want.pop("lm_head.weight") == want["model.embed_tokens.weight"]  # the tiny Qwen3 ties its head
    assert got["digests"] == want


@pytest.mark.server
@pytest.mark.slow
def test_a_trainer_reaches_two_replicas_bit_identical_one_late_through_a_relay_mirror(
    s3_server: S3Server, redis_server: RedisServer, run_name: str, tmp_path: Path
) -> None:
    if not VERL_PYTHON.exists():
        pytest.skip("no .venv-verl: `make venv-verl` makes it (`make test` does)")
    store = f"s3://{s3_server.new_bucket()}/runs/{run_name}"
    mirror = f"file://{tmp_path}/mirror-eu"
    logs = tmp_path / "logs"
    logs.mkdir()
    # Credentials reach every process through its environment, never verl's config.
    # Nothing of Aurora's from this shell's environment (a mirror variable there would send A to it).
    base = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    env = {**base, **s3_server.env_vars, "AURORA_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    options = {"store": store, "redis": redis_server.url, "poll_s": 0.2}
    trainer = Worker("trainer", "trainer", options, env, logs)
    # A's environment names a Redis with a password, which its config (with a Redis of its own) overrides.
    a = Worker("replica-a", "replica", options, {**env, "AURORA_REDIS_URL": "redis://:hunter2@127.0.0.1:9/0"}, logs)
    relay = _relay(store, mirror, redis_server.url, run_name, env, logs)
    b: Worker | None = None
    try:
        assert trainer.reply() == {"ready": "AuroraCheckpointEngine"}  # found in verl's registry under "aurora"
        assert a.reply() == {"ready": "AuroraCheckpointEngine"}
        assert a.ask(cmd="prepare")["metadata"] == {"store": store, "run": run_name, "redis": redis_server.url}
        for bad, says in (
            ({**options, "redis": "redis://:hunter2@127.0.0.1:1/0"}, "AURORA_REDIS_PASSWORD_FILE"),
            ({**options, "storage_options": {"client_kwargs": {"aws_secret_access_key": "hunter2"}}}, "credential"),
            ({**options, "stroe": "typo"}, "unknown option"),
            ({"redis": redis_server.url}, "store"),
        ):
            err = a.ask(cmd="try", options=bad)
            assert err["error"] == "ConfigError" and says in err["message"] and "hunter2" not in err["message"], err
        # No Redis in the config: the environment's, whose password never reaches what workers exchange.
        assert a.ask(cmd="try", options={"store": store})["metadata"]["redis"] == "redis://127.0.0.1:9/0"

        # Step 0: the replica asks before the trainer sends, and waits for the version.
        r0 = _sync(0, trainer, [a], [trainer, a])
        assert r0["trainer"]["metrics"]["aurora/version"] == 0
        assert (r0["replica-a"]["path"], r0["replica-a"]["version"]) == ("snapshot", 0)
        _same_weights(r0["trainer"], r0["replica-a"])

        # B joins after the first version, in the mirror's region: nothing to rebuild, a bigger "group".
        b = Worker("replica-b", "replica", {**options, "mirror": mirror}, env, logs)
        assert b.reply() == {"ready": "AuroraCheckpointEngine"}
        r1 = _sync(1, trainer, [a, b], [trainer, a, b])
        assert r1["trainer"]["metrics"]["aurora/version"] == 1
        assert 0 < r1["trainer"]["metrics"]["aurora/density"] < 0.2
        assert (r1["replica-a"]["path"], r1["replica-a"]["version"]) == ("deltas", 1)
        assert (r1["replica-b"]["path"], r1["replica-b"]["version"]) == ("snapshot", 1)  # caught up: v0's snapshot + delta 1
        _same_weights(r1["trainer"], r1["replica-a"])
        _same_weights(r1["trainer"], r1["replica-b"])

        # Step 2: A from origin; then delta 2's segments leave origin once the Relay has mirrored them,
        # and B, asked last, can only have read them from its mirror.
        r2 = _sync(2, trainer, [a], [trainer, a, b])
        _same_weights(r2["trainer"], r2["replica-a"])
        origin = open_store(store, s3_server.storage_options())
        here = open_store(mirror)
        wait_until(lambda: here.exists(manifest_key("delta", 2)), "the Relay mirrors delta 2", timeout=120)
        segments = [f"{version_dir('delta', 2)}/{s.key}" for s in read_manifest(origin, "delta", 2).segments]
        assert segments and all(here.exists(k) for k in segments)
        for k in segments:
            origin.delete(k)
        metadata = [w.ask(cmd="prepare")["metadata"] for w in (trainer, a, b)]
        got = b.ask(cmd="update", step=2, metadata=metadata, rank=1, rollout_world_size=2)
        assert (got["path"], got["version"]) == ("deltas", 2)
        _same_weights(r2["trainer"], got)
    finally:
        for w in (trainer, a, b):
            if w is not None:
                w.stop()
        relay.terminate()
        relay.wait(timeout=30)
