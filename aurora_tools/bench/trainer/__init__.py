"""``aurora bench trainer``: the real Trainer's step on a model of a given size, its memory per parameter and its overheads.

``--params N`` builds a Qwen3-style model of about N parameters
(:mod:`.shape`: a 32,768-row vocabulary, untied, proportions of the
family); ``--model DIR`` takes a local Hugging Face directory instead. The
real ``aurora trainer`` (GRPO loss, backward, AdamW, publishing to an S3
server, checkpoints, snapshots; ``--nproc K`` ranks) runs on synthetic
rollouts for the window :mod:`.window` chooses (at least
``checkpoint_every + 1`` steps after warm-up, holding a checkpoint and a
snapshot) while :mod:`.memory` follows the resident memory of its
processes. One JSON object (``--json``) or a table:

- ``params``; ``peak_bytes_per_param``: (peak resident bytes in the window
  minus the resident bytes before the model is built) / params, the largest
  process's with ``--nproc``. "Before the model" is after the imports *and*
  after the codec's compiled kernels are loaded
  (:func:`aurora_store.codec.kernels.warm_up`), which the Trainer does at its
  start, before it builds the model (rank 0 with ``--nproc``): a fixed cost
  per process, not per parameter. Until 2026-12-03 the baseline was taken
  before the kernels, which the Trainer then loaded at its first publish,
  inside the figure (about 0.6 bytes per parameter at 0.2 B); figures from
  before that date are higher by ``kernels_bytes`` / params;
- ``kernels_bytes``: the resident bytes loading those kernels added (numba,
  llvmlite, the compiled code), measured in the benchmark's child process
  right before its baseline. Ranks > 0 never load them (they neither extract
  nor encode): a process without them when the window ends is measured
  against the baseline less ``kernels_bytes``; ``baseline_bytes``: the
  baseline the reported process was measured against; ``process_peaks``: each
  process's peak resident bytes and whether it had the kernels, largest first;
- ``step_s``, ``publish_s``, ``digest_s``, ``checkpoint_wait_s``: means over
  the timed steps (:func:`.window.figures` says what each is);
- ``overhead_fraction``: (publish + digest + checkpoint wait) / step.

``--params`` is this benchmark's alone: ``aurora trainer`` takes ``--model``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from typing import Any

__all__ = ["add_arguments", "main", "parse_params"]


def parse_params(text: str) -> float:
    """``2e8``, ``500e6``, ``200000000``: a parameter count (at least 1e6)."""
    try:
        n = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of parameters (forms like 2e8)") from None
    if not n >= 1e6 or n != n or n == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1e6 parameters")
    return n


def add_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--params", type=parse_params, default=None, metavar="N", help="build a Qwen3-style model of about N parameters (default 2e8)"
    )
    what.add_argument("--model", default=None, metavar="DIR", help="a local Hugging Face model directory instead")
    p.add_argument("--nproc", type=int, default=1, metavar="K", help="Trainer ranks sharding the model (aurora trainer --nproc)")
    p.add_argument("--batch", type=int, default=2, metavar="N", help="prompts per step (default 2)")
    p.add_argument("--group", type=int, default=4, metavar="N", help="completions per prompt (default 4)")
    p.add_argument("--completion-tokens", type=int, default=16, metavar="N", help="tokens of every synthetic completion (default 16)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate (default 1e-6, typical of RL fine-tuning)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="default: aurora trainer's")
    p.add_argument("--snapshot-every", type=int, default=None, metavar="N", help="default: aurora trainer's")
    p.add_argument("--trainer-args", default="", metavar="ARGS", help="more aurora trainer arguments, one string (e.g. '--micro-batch 2')")
    p.add_argument("--keep", default=None, metavar="DIR", help="run in DIR and keep it (model, store, the Trainer's log)")
    p.add_argument("--timeout-s", type=float, default=3600.0, metavar="S", help="give up after S seconds (default 3600)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _table(r: dict[str, Any]) -> str:
    rows = [
        ("parameters", f"{r['params']:,}"),
        ("ranks", str(r["nproc"])),
        ("peak bytes / parameter", f"{r['peak_bytes_per_param']:.2f}"),
        ("  peak resident (largest process)", f"{r['peak_bytes'] / 2**30:.2f} GiB"),
        ("  before the model (codec kernels loaded)", f"{r['baseline_bytes'] / 2**30:.2f} GiB"),
        ("  of which the codec kernels", f"{r['kernels_bytes'] / 2**20:.0f} MiB"),
        (f"step (mean of {r['steps']})", f"{r['step_s']:.2f} s"),
        ("  waiting for the batch", f"{r['wait_s']:.2f} s"),
        ("  training (optimizer.step may wait for a checkpoint)", f"{r['train_s']:.2f} s"),
        ("  publishing", f"{r['publish_s']:.2f} s"),
        ("  hashing", f"{r['digest_s']:.2f} s"),
        ("  checkpoint wait", f"{r['checkpoint_wait_s']:.2f} s"),
        ("(publish + digest + checkpoint) / step", f"{100 * r['overhead_fraction']:.1f} %"),
    ]
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)


def main(args: argparse.Namespace) -> int:
    from aurora_tools.bench.trainer.run import Options, run_bench

    o = Options(
        params=args.params if args.params is not None or args.model else 2e8,
        model=args.model,
        nproc=args.nproc,
        batch=args.batch,
        group=args.group,
        completion_tokens=args.completion_tokens,
        lr=args.lr,
        checkpoint_every=args.checkpoint_every,
        snapshot_every=args.snapshot_every,
        trainer_args=tuple(shlex.split(args.trainer_args)),
        seed=args.seed,
        timeout_s=args.timeout_s,
        keep=args.keep,
    )

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds: the Trainer's processes and the servers are stopped on the way out

    signal.signal(signal.SIGTERM, stop)
    r = run_bench(o, say=None if args.json else (lambda m: print(m, file=sys.stderr, flush=True)))
    print(json.dumps(r) if args.json else _table(r))
    return 0
