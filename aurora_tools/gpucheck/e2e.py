"""The end-to-end part of the GPU check: the real ``aurora trainer`` and a real Actor, through Redis and an S3 server.

Nothing here re-implements a worker: the Trainer is the ``aurora trainer``
command line (:mod:`.trainer_child` runs it and reads its peak device
memory), the Actor the ``aurora actor`` command line with the vLLM engine
(the torch engine on the same device where vLLM cannot run: ``vllm`` then
says why), both child processes of this one, against the testbed's Redis
and S3 server (:class:`aurora_tools.testbed.Testbed`). The model is a small
Qwen3 built on the spot (:func:`aurora_tools.tinymodel.make_model_dir`).

Checks: every step published and committed (``trainer_steps_ok``), and
the Actor's weights at every version it verified hash to the Trainer's
digest of that version (``bit_identical``, from the run's digest records).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RUN", "Plan", "actor_argv", "compare_digests", "run_e2e", "trainer_argv", "vllm_missing"]

RUN = "gpucheck"
TASK = "aurora_tools.bench.trainer.task:synthetic_task"
"""Rewards that give every group a signal (a random model never earns a task's 0/1 reward)."""
ACTOR_ID = "gpucheck-actor"
VLLM_START_S = 240.0
"""A vLLM Actor whose first batch is not in by then is given up on (a CUDA build that hangs at start)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What the run does: ``steps`` versions, a digest-bound (checkpoint and snapshot) one every ``every``."""

    device: str
    engine: str
    """``vllm`` or ``torch``: the Actor's engine."""
    steps: int = 4
    every: int = 2
    batch: int = 4
    group: int = 2
    max_new_tokens: int = 8


def trainer_argv(p: Plan, store: str, redis: str, model_dir: str, commit_via: str) -> list[str]:
    """The ``aurora trainer`` arguments of the check's run."""
    return [
        "--store",
        store,
        "--redis",
        redis,
        "--run",
        RUN,
        "--model",
        model_dir,
        "--task",
        TASK,
        "--device",
        p.device,
        "--steps",
        str(p.steps),
        "--batch",
        str(p.batch),
        "--group",
        str(p.group),
        "--max-new-tokens",
        str(p.max_new_tokens),
        "--optimizer",
        "adamw",
        "--lr",
        "1e-5",
        "--eval-every",
        "0",
        "--min-actors",
        "1",
        "--checkpoint-every",
        str(p.every),
        "--snapshot-every",
        str(p.every),
        "--commit-via",
        commit_via,
    ]


def actor_argv(p: Plan, store: str, redis: str, engine: str) -> list[str]:
    """The ``aurora actor`` arguments (``--device`` is the torch engine's; vLLM picks the GPU itself)."""
    argv = ["actor", "--store", store, "--redis", redis, "--run", RUN, "--id", ACTOR_ID, "--engine", engine, "--claim", str(p.batch)]
    return argv + (["--device", p.device] if engine == "torch" else [])


def vllm_missing() -> str | None:
    """Why vLLM cannot be this machine's engine (looked up, not imported), or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed for this Python (pip install vllm: a CUDA build matching this torch)"
    return None


def compare_digests(trainer: Mapping[int, str], actors: Mapping[tuple[str, int], str]) -> tuple[bool, int, list[int]]:
    """(every Actor digest equals the Trainer's at its version and there is one, how many compared, versions that differ)."""
    bad = sorted({v for (_a, v), d in actors.items() if trainer.get(v) != d})
    return bool(actors) and not bad, len(actors), bad


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[-1][-300:]


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_e2e(plan: Plan, workdir: str | os.PathLike[str], timeout_s: float = 420.0, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the check's training run; returns the report's end-to-end keys (see the module docstring)."""
    from transformers.utils import logging as hf_logging

    from aurora_store.coordination.records import RunRecords
    from aurora_store.coordination.redisconn import connect
    from aurora_tools.bench.trainer.run import count_params
    from aurora_tools.testbed import Testbed
    from aurora_tools.tinymodel import TinySpec, make_model_dir

    hf_logging.disable_progress_bar()
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    small = plan.device == "cpu"
    spec = TinySpec() if small else TinySpec(hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, intermediate=1536, vocab=2048)
    model_dir = make_model_dir(work / "model", "qwen3", seed=0, spec=spec)
    params = count_params(model_dir)
    vllm_reason = vllm_missing() if plan.engine == "vllm" else "not asked (--engine torch)"
    engine = "vllm" if vllm_reason is None else "torch"
    t0 = time.perf_counter()
    with Testbed(work / "testbed", s3="moto", run=RUN) as tb:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_") or k == "AURORA_TORCH_THREADS"}
        # vLLM shares the device with the Trainer: a third of it is plenty for this model; no CUDA graphs (start-up time).
        env.update(tb.env, PYTHONUNBUFFERED="1", AURORA_VLLM_GPU_MEMORY_UTILIZATION="0.3", AURORA_VLLM_ENFORCE_EAGER="1")
        store, redis = tb.urls["store"], tb.urls["redis"]
        peak_file = work / "trainer-peak.json"
        t_argv = [sys.executable, "-m", "aurora_tools.gpucheck.trainer_child", str(peak_file), "--"]
        t_argv += trainer_argv(plan, store, redis, model_dir, tb.commit_via)
        logs: dict[str, Path] = {"trainer": work / "trainer.log", "actor": work / f"actor-{engine}.log"}
        say(f"aurora trainer --device {plan.device} and aurora actor --engine {engine} on {params:,} parameters")
        with open(logs["trainer"], "wb") as tlog, open(logs["actor"], "wb") as alog:
            trainer = subprocess.Popen(t_argv, stdout=tlog, stderr=subprocess.STDOUT, env=env)
            a_argv = [sys.executable, "-m", "aurora_tools.cli", *actor_argv(plan, store, redis, engine)]
            actor: subprocess.Popen[bytes] | None = subprocess.Popen(a_argv, stdout=alog, stderr=subprocess.STDOUT, env=env)
            fallback_log = None
            client = connect(redis)
            records = RunRecords(client, RUN)
            try:
                started = time.monotonic()
                deadline = started + timeout_s
                while trainer.poll() is None and time.monotonic() < deadline:
                    why = None
                    if engine == "vllm" and fallback_log is None and actor is not None:
                        if actor.poll() is not None:
                            why = f"the vLLM Actor exited with status {actor.returncode}: {_last_line(logs['actor'])}"
                        elif time.monotonic() - started > VLLM_START_S and (records.head_and_commit()[1] or 0) < 1:
                            why = f"the vLLM Actor had served no batch after {VLLM_START_S:.0f}s: {_last_line(logs['actor'])}"
                    if why is not None:
                        vllm_reason = why
                        say(f"{why}; the torch engine takes its place")
                        _stop(actor)
                        engine = "torch"
                        logs["actor-torch"] = work / "actor-torch.log"
                        fallback_log = open(logs["actor-torch"], "wb")  # noqa: SIM115 - closed below
                        actor = subprocess.Popen(
                            [sys.executable, "-m", "aurora_tools.cli", *actor_argv(plan, store, redis, "torch")],
                            stdout=fallback_log,
                            stderr=subprocess.STDOUT,
                            env=env,
                        )
                    time.sleep(0.5)
                timed_out = trainer.poll() is None
            finally:
                _stop(trainer)
                _stop(actor)
                if fallback_log is not None:
                    fallback_log.close()
            try:
                _head, commit = records.head_and_commit()
                tdig, adig = records.digests()
            finally:
                client.close()
    identical, compared, differ = compare_digests(tdig, adig)
    peak: dict[str, Any] = {}
    if peak_file.exists():
        try:
            peak = json.loads(peak_file.read_text())
        except ValueError:
            peak = {}
    peak_bytes = peak.get("peak_device_bytes") if isinstance(peak, dict) else None
    steps_ok = trainer.returncode == 0 and not timed_out and commit == plan.steps
    if engine == "vllm" and vllm_reason is None:
        vllm = "ok" if identical else "the vLLM Actor ran, but its weights were never verified equal to the Trainer's"
    else:
        vllm = vllm_reason or "not run"
    return {
        "trainer_steps_ok": steps_ok,
        "bit_identical": identical,
        "digests_compared": compared,
        "digests_differ": differ,
        "peak_device_bytes_per_param": round(peak_bytes / params, 2) if isinstance(peak_bytes, int) else None,
        "vllm": vllm,
        "actor_engine": engine,
        "e2e_params": params,
        "trainer_exit": trainer.returncode if not timed_out else "timed out",
        "trainer_log_tail": "" if steps_ok else _last_line(logs["trainer"]),
        "e2e_s": round(time.perf_counter() - t0, 1),
    }
