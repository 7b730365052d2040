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
A second process (tests/verl_moe_worker.py) does the same, without the
mirror, for a tiny Qwen3-MoE and Mixtral sent as verl's FSDP engine yields
them (one tensor per expert), and sends updates that must publish nothing.

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
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ConfigError
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.integrations.hf_layout import checkpoint_module, hf_layout
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.plan import scan_versions
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


def _experts(
    w13: tuple[int, ...] = (4, 16, 8), w2: tuple[int, ...] | None = (4, 8, 8), router: tuple[int, ...] = (4, 8)
) -> dict[str, ParamSpec]:
    """One Qwen-style experts layer under the format's names (E=4, I=8, H=8 unless told)."""
    out = {"m.layers.0.mlp.gate.weight": ParamSpec(router, "bfloat16"), "m.layers.0.mlp.experts.w13_weight": ParamSpec(w13, "bfloat16")}
    if w2 is not None:
        out["m.layers.0.mlp.experts.w2_weight"] = ParamSpec(w2, "bfloat16")
    return out


def _per_expert(mod: str, names: tuple[str, str, str], e_: int = 3, i_: int = 8, h_: int = 16) -> dict[str, ParamSpec]:
    """A checkpoint's experts layer: one tensor per expert and projection, and the router."""
    gate, up, down = names
    out = {f"model.layers.0.{mod}.gate.weight": ParamSpec((e_, h_), "bfloat16")}
    for e in range(e_):
        out[f"model.layers.0.{mod}.experts.{e}.{gate}.weight"] = ParamSpec((i_, h_), "bfloat16")
        out[f"model.layers.0.{mod}.experts.{e}.{up}.weight"] = ParamSpec((i_, h_), "bfloat16")
        out[f"model.layers.0.{mod}.experts.{e}.{down}.weight"] = ParamSpec((h_, i_), "bfloat16")
    return out


@pytest.mark.parametrize(
    ("family", "mod", "names"),
    [("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")), ("mixtral", "block_sparse_moe", ("w1", "w3", "w2"))],
)
def test_hf_layout_gives_experts_back_per_expert_under_the_checkpoint_names(family: str, mod: str, names: tuple[str, str, str]) -> None:
    ckpt = _per_expert(mod, names)
    fused = FusionPlan.from_specs(ckpt, family=family).specs()
    assert fused[f"model.layers.0.{mod}.experts.w13_weight"] == ParamSpec((3, 16, 16), "bfloat16")
    assert fused[f"model.layers.0.{mod}.experts.w2_weight"] == ParamSpec((3, 16, 8), "bfloat16")
    assert hf_layout(fused) == ckpt
    # transformers 5 holds Mixtral's experts (packed) and router under mlp: the same format names, the same names back.
    packed = {
        "model.layers.0.mlp.gate.weight": ParamSpec((3, 16), "bfloat16"),
        "model.layers.0.mlp.experts.gate_up_proj": ParamSpec((3, 16, 16), "bfloat16"),
        "model.layers.0.mlp.experts.down_proj": ParamSpec((3, 16, 8), "bfloat16"),
    }
    assert hf_layout(FusionPlan.from_specs(packed, family=family).specs()) == ckpt


def test_hf_layout_gives_a_qwen2_moe_shared_expert_back_beside_the_routed_ones() -> None:
    ckpt = _per_expert("mlp", ("gate_proj", "up_proj", "down_proj"))
    ckpt |= {f"model.layers.0.mlp.shared_expert.{p}_proj.weight": ParamSpec((24, 16), "bfloat16") for p in ("gate", "up")}
    ckpt |= {"model.layers.0.mlp.shared_expert.down_proj.weight": ParamSpec((16, 24), "bfloat16")}
    ckpt |= {"model.layers.0.mlp.shared_expert_gate.weight": ParamSpec((1, 16), "bfloat16")}
    fused = FusionPlan.from_specs(ckpt, family="qwen2_moe").specs()
    assert fused["model.layers.0.mlp.shared_expert.gate_up_proj.weight"] == ParamSpec((48, 16), "bfloat16")
    assert hf_layout(fused) == ckpt


def test_checkpoint_module_moves_mixtrals_experts_out_of_mlp_and_nothing_else() -> None:
    in_memory = ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.down_proj"]
    in_memory += ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.block_sparse_moe.gate.weight"]
    assert checkpoint_module(in_memory, "mixtral") == {
        "model.layers.0.mlp.experts.3.gate_proj.weight": "model.layers.0.block_sparse_moe.experts.3.gate_proj.weight",
        "model.layers.0.mlp.gate.weight": "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.mlp.experts.down_proj": "model.layers.0.block_sparse_moe.experts.down_proj",
    }
    assert checkpoint_module(in_memory, "qwen3_moe") == {} and checkpoint_module(in_memory, None) == {}


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
        ({"m.layers.0.mlp.experts.w13_weight": ParamSpec((4, 16), "bfloat16")}, "into its experts"),
        ({"m.layers.0.mlp.experts.w13_weight": ParamSpec((1 << 20, 16, 8), "bfloat16")}, "into its experts"),
        (_experts(w13=(4, 15, 8)), "do not map back"),
        (_experts(w2=(4, 8, 6)), "do not map back"),
        (_experts(router=(5, 8)), "do not map back"),
        (_experts(w13=(4, 16, 8), w2=None), "do not map back"),
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


@pytest.mark.server
@pytest.mark.slow
def test_moe_models_reach_replicas_per_expert_bit_identical_and_a_bad_layer_publishes_nothing(
    redis_server: RedisServer, run_name: str, tmp_path: Path
) -> None:
    """Qwen3-MoE and Mixtral through verl's registry (tests/verl_moe_worker.py): the trainer yields what verl's FSDP
    engine does (transformers 5's packed experts unpacked per expert by verl's own code), replicas yield checkpoint names."""
    if not VERL_PYTHON.exists():
        pytest.skip("no .venv-verl: `make venv-verl` makes it (`make test` does)")
    root = f"file://{tmp_path}/runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")} | {"AURORA_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1"}
    argv = [
        str(VERL_PYTHON),
        str(REPO / "tests" / "verl_moe_worker.py"),
        json.dumps({"root": root, "run": run_name, "redis": redis_server.url}),
    ]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=REPLY_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result) == {"qwen3_moe", "mixtral"}
    expert0 = {
        "qwen3_moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
        "mixtral": "model.layers.1.block_sparse_moe.experts.0.w1.weight",
    }
    for family, r in result.items():
        assert r["packed"], family  # the trainer's model holds its experts packed: verl's unpacking ran
        paths = [s["paths"] for s in r["steps"]]
        assert paths == [{"a": ["snapshot", 0]}, {"a": ["deltas", 1], "b": ["snapshot", 1]}, {"a": ["deltas", 2], "b": ["deltas", 2]}]
        for step, s in enumerate(r["steps"]):
            assert s["metrics"]["aurora/version"] == step
            assert expert0[family] in s["sent"] and "model.layers.1.mlp.experts.gate_up_proj" not in s["sent"]
            for replica, got in s["got"].items():
                assert got == s["sent"], (family, step, replica)  # names, shapes and bf16 bits: the trainer's, per expert
        assert 0 < r["steps"][1]["metrics"]["aurora/density"] < 0.2
    missing, mixed = result["qwen3_moe"]["errors"]
    (both,) = result["mixtral"]["errors"]
    for err, says in (
        (missing, "expert 1 of 4 has no down projection"),
        (mixed, "more than one form"),
        (both, "model.layers.0.block_sparse_moe.gate.weight is also named under mlp"),
    ):
        assert err["error"] == "ModelMismatchError" and says in err["message"] and "nothing was published" in err["message"], err
        assert "\n" not in err["message"]
    assert scan_versions(open_store(f"{root}/qwen3_moe")).latest == 2 and scan_versions(open_store(f"{root}/mixtral")).latest == 2
