"""One ``aurora bench trainer`` run: a model directory, the testbed, the real ``aurora trainer``, the figures.

The Trainer is the ``aurora trainer`` command line in a child process
(:mod:`.child`), with its own defaults except what the benchmark must set:
the model (``--model``), AdamW at a learning rate typical of RL
fine-tuning, the synthetic task (:mod:`.task`), the batch's size, no
evaluation, and the number of steps the window needs (:mod:`.window`).
Redis and an S3 server are the testbed's (``rclone serve s3``: objects on
disk, so checkpoints of a large model do not sit in memory; the run commits
through Redis). A stand-in Actor (:mod:`.actor`) settles every batch.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aurora_store.errors import AuroraError
from aurora_tools.bench.trainer.memory import TreeMemory
from aurora_tools.bench.trainer.window import KEYS, Window, figures, window_for

__all__ = ["BenchError", "Options", "count_params", "disk_needed", "run_bench", "tokenizer_ids", "trainer_argv"]

RUN = "bench-trainer"
TASK = "aurora_tools.bench.trainer.task:synthetic_task"


class BenchError(AuroraError):
    """The benchmark could not run to the end (the Trainer failed, a record is missing)."""


@dataclass(frozen=True, slots=True)
class Options:
    """What ``aurora bench trainer`` was asked (see its ``--help``)."""

    params: float | None = 2e8
    model: str | None = None
    nproc: int = 1
    batch: int = 2
    group: int = 4
    completion_tokens: int = 16
    lr: float = 1e-6
    checkpoint_every: int | None = None
    snapshot_every: int | None = None
    trainer_args: tuple[str, ...] = field(default_factory=tuple)
    seed: int = 0
    timeout_s: float = 3600.0
    keep: str | None = None
    """A folder to run in and keep (the model, the testbed's data, the Trainer's log); None: a temporary one."""


def count_params(model_dir: str) -> int:
    """Parameters of a model directory's safetensors files, from their headers (nothing loaded)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise BenchError(f"--model {model_dir}: no *.safetensors file")
    n = 0
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                numel = 1
                for d in sf.get_slice(k).get_shape():
                    numel *= int(d)
                n += numel
    return n


def tokenizer_ids(model_dir: str) -> int:
    """Ids of the directory's tokenizer (the stand-in Actor draws completions from them)."""
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise BenchError(f"--model {model_dir}: no tokenizer.json")
    return int(Tokenizer.from_file(str(path)).get_vocab_size())


def trainer_argv(o: Options, model_dir: str, store: str, redis: str, commit_via: str, w: Window) -> list[str]:
    """The ``aurora trainer`` arguments of the run."""
    argv = [
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
        "--optimizer",
        "adamw",
        "--lr",
        repr(o.lr),
        "--steps",
        str(w.steps),
        "--batch",
        str(o.batch),
        "--group",
        str(o.group),
        "--max-new-tokens",
        str(o.completion_tokens),
        "--eval-every",
        "0",
        "--min-actors",
        "1",
        "--commit-via",
        commit_via,
        "--seed",
        str(o.seed),
        "--nproc",
        str(o.nproc),
    ]
    if o.checkpoint_every is not None:
        argv += ["--checkpoint-every", str(o.checkpoint_every)]
    if o.snapshot_every is not None:
        argv += ["--snapshot-every", str(o.snapshot_every)]
    return argv + list(o.trainer_args)


def _cadences(o: Options) -> tuple[int, int]:
    from workers.trainer.config import TrainerConfig

    d = TrainerConfig()
    return (
        d.checkpoint_every if o.checkpoint_every is None else o.checkpoint_every,
        d.snapshot_every if o.snapshot_every is None else o.snapshot_every,
    )


def _keep_checkpoints(o: Options) -> int:
    from workers.trainer.config import TrainerConfig

    keep = TrainerConfig().keep_checkpoints
    args = list(o.trainer_args)
    for a, after in zip(args, [*args[1:], ""], strict=False):
        text = after if a == "--keep-checkpoints" else a.partition("=")[2] if a.startswith("--keep-checkpoints=") else ""
        keep = int(text) if text.isdigit() else keep
    return keep


def disk_needed(params: float, w: Window, snapshot_every: int, keep_checkpoints: int) -> int:
    """Bytes of disk a run writes at its fullest, generously: the bf16 model directory; the kept
    checkpoints and the one being written (fp32 master 4, AdamW 8 and the bf16 version 2 bytes per
    parameter); the base and every snapshot (2 bytes per parameter each); the deltas and spools
    (taken as one more bf16 copy); a quarter more for what the S3 server stages, and 1 GiB."""
    snapshots = 1 + (w.steps // snapshot_every if snapshot_every > 0 else 0)
    per_param = 2 + 14 * (keep_checkpoints + 1) + 2 * snapshots + 2
    return int(1.25 * per_param * params) + (1 << 30)


def _check_disk(need: int, where: Path) -> None:
    import shutil

    free = shutil.disk_usage(where).free
    if free < need:
        raise BenchError(
            f"the run writes up to about {need / 1e9:.1f} GB (model, checkpoints, snapshots) under {where} "
            f"and {free / 1e9:.1f} GB is free there: free some space, or pass --keep DIR on a larger disk"
        )


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    keep = ("AURORA_TORCH_THREADS",)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_") or k in keep}
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


def _read_records(store: Any, steps: range) -> dict[int, dict[str, Any]]:
    from aurora_store.metrics import step_key

    out: dict[int, dict[str, Any]] = {}
    for b in steps:
        try:
            body = json.loads(store.get_capped(step_key(b), 1 << 16, "a step record"))
        except Exception:  # noqa: BLE001 - a missing or unreadable record is reported by figures()
            continue
        if isinstance(body, dict):
            out[b] = body
    return out


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def run_bench(o: Options, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Build (or take) the model, run the Trainer through the window, return the JSON object."""
    if o.nproc < 1 or o.batch < 1 or o.group < 2 or o.completion_tokens < 1 or not o.lr > 0:
        raise BenchError("--nproc and --batch must be >= 1, --group >= 2, --completion-tokens >= 1 and --lr > 0")
    ck, snap = _cadences(o)
    w = window_for(ck, snap)
    note = say or (lambda _m: None)
    with tempfile.TemporaryDirectory(prefix="aurora-bench-trainer-") as tmp:
        base = Path(o.keep) if o.keep else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        planned = count_params(o.model) if o.model else o.params
        assert planned is not None
        need = disk_needed(planned, w, snap, _keep_checkpoints(o))
        _check_disk(need, base)
        note(f"disk: this run writes up to about {need / 1e9:.1f} GB under {base}")
        t0 = time.perf_counter()
        shape: dict[str, Any] | None = None
        if o.model:
            model_dir = o.model
        else:
            from dataclasses import asdict

            from aurora_tools.bench.trainer.shape import build_model_dir, shape_for

            assert o.params is not None
            s = shape_for(o.params)
            shape = asdict(s)
            note(f"building a Qwen3-style model of {s.params():,} parameters: {shape}")
            model_dir = build_model_dir(base / "model", s, seed=o.seed)
        params = count_params(model_dir)
        got = _run_trainer(o, model_dir, params, w, base, note)
        # The keys first, then what explains them.
        result: dict[str, Any] = {"params": params} | {k: got.pop(k) for k in KEYS if k != "params"}
        result["overhead_fraction"] = got.pop("overhead_fraction")
        result.update(got)
        result.update(
            model=o.model or "built",
            shape=shape,
            nproc=o.nproc,
            batch=o.batch,
            group=o.group,
            completion_tokens=o.completion_tokens,
            lr=o.lr,
            checkpoint_every=ck,
            snapshot_every=snap,
            steps=w.periods,
            window=[w.first, w.last],
            memory_steps=[w.first, w.memory_end - 1],
            checkpoints_in_window=list(w.checkpoints),
            snapshots_in_window=list(w.snapshots),
            seconds=round(time.perf_counter() - t0, 1),
        )
        return result


def _baseline(path: Path) -> tuple[int, int]:
    """The child's resident bytes before the model (after the codec's kernels loaded), and what the
    kernels added to them (:mod:`.child`)."""
    lines = (path.read_text(encoding="ascii").split() + ["0", "0"])[:2]
    return int(lines[0]), int(lines[1])


def _run_trainer(o: Options, model_dir: str, params: int, w: Window, base: Path, note: Callable[[str], None]) -> dict[str, Any]:
    from aurora_store.coordination.records import RunRecords
    from aurora_store.coordination.redisconn import connect
    from aurora_store.storage import open_store
    from aurora_tools.bench.trainer.actor import synthetic_actor
    from aurora_tools.testbed import Testbed

    log_path = base / "trainer.log"
    baseline_path = base / "baseline-rss"
    with Testbed(base / "testbed", s3="rclone", run=RUN) as tb:
        argv = trainer_argv(o, model_dir, tb.urls["store"], tb.urls["redis"], tb.commit_via, w)
        cmd = [sys.executable, "-m", "aurora_tools.bench.trainer.child", str(baseline_path), "--", *argv]
        note(f"aurora trainer {shlex.join(argv)}")
        client = connect(tb.urls["redis"])
        records = RunRecords(client, RUN)
        mem: TreeMemory | None = None
        peaks: dict[int, int] = {}
        deadline = time.monotonic() + o.timeout_s
        with (
            synthetic_actor(tb.urls["redis"], RUN, tokenizer_ids(model_dir), o.completion_tokens, o.seed) as actor,
            open(log_path, "wb") as out,
        ):
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env(tb.env), start_new_session=True)
            try:
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        raise BenchError(f"the Trainer did not finish within {o.timeout_s:g}s (log: {log_path})")
                    _, commit = records.head_and_commit()
                    if mem is None and commit is not None and commit >= w.first:
                        mem = TreeMemory(proc.pid)
                        mem.start()
                        note(f"version {commit} committed: the window starts")
                    if mem is not None and not peaks and commit is not None and commit >= w.memory_end:
                        peaks = mem.stop()
                        note(f"version {commit} committed: the memory window ends")
                    time.sleep(0.05)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, 15)
                    try:
                        proc.wait(30)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, 9)
                        proc.wait()
                if mem is not None and not peaks:
                    peaks = mem.stop()
                client.close()
        if proc.returncode != 0:
            raise BenchError(f"aurora trainer exited with status {proc.returncode}; its last lines:\n{_tail(log_path)}")
        if mem is None or not peaks:
            raise BenchError(f"the window's versions were never committed (log: {log_path})")
        store = open_store(tb.urls["store"], tb.storage_options())
        recs = _read_records(store, range(w.first - 1, w.last + 1))
        try:
            got = figures(recs, w)
        except ValueError as e:
            raise BenchError(str(e)) from None
    baseline, kernels = _baseline(baseline_path)
    # Each process against its own baseline: rank 0 loads the codec's kernels as the child did before
    # its baseline; ranks > 0 never do (they neither extract nor encode), so theirs is less by them.
    pid = max(peaks, key=lambda p: peaks[p] - (baseline if mem.kernels.get(p, True) else baseline - kernels))
    peak, own = peaks[pid], baseline if mem.kernels.get(pid, True) else baseline - kernels
    got.update(
        peak_bytes_per_param=(peak - own) / params,
        peak_bytes=peak,
        baseline_bytes=own,
        kernels_bytes=kernels,
        processes=len(peaks),
        process_peaks=sorted(([peaks[p], mem.kernels.get(p, True)] for p in peaks), reverse=True),
        peak_exact=mem.exact,
        settled=actor["settled"],
    )
    return got
