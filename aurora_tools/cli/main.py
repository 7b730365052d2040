"""The ``aurora`` parser and entry point.

Every failure is one line on stderr naming the file or object, the version
and the reason, with exit status 1 (2 for usage errors).

Building the parser imports nothing heavy. Subcommands whose options are
declared by the workers, the demo or a benchmark (modules that import torch
or the workers) get those options only when they are the subcommand being
parsed: ``aurora status``, ``lineage``, ``verify`` and ``gc`` never import
torch, vLLM or the workers. ``build_parser()`` without an argument list
declares everything (for tests and documentation).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from aurora_store import __version__
from aurora_store.errors import AuroraError
from aurora_store.options import (
    add_redis_args,
    add_sign_key_args,
    add_storage_option,
    add_store_args,
    add_trust_key_arg,
)
from aurora_tools.cli import bench_cmds, codec_cmds, config_file, run_cmds, store_cmds

__all__ = ["build_parser", "main"]

#: Declares a subcommand's options on its parser.
Fill = Callable[[argparse.ArgumentParser], None]


class _Deferred:
    """Subparsers whose options are declared only when their subcommand is the one given."""

    def __init__(self, argv: Sequence[str] | None) -> None:
        # The subcommand path argv names: its first words (the top level takes no option with a value).
        self.words = None if argv is None else [a for a in argv if not a.startswith("-")][:2]

    def fill(self, path: tuple[str, ...], parser: argparse.ArgumentParser, fill: Fill) -> None:
        if self.words is None or tuple(self.words[: len(path)]) == path:
            fill(parser)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``aurora`` parser; with ``argv``, heavy subcommands' options only for the one ``argv`` runs."""
    later = _Deferred(argv)
    ap = argparse.ArgumentParser(prog="aurora", description="Versioned sparse delta checkpoints for RL policy updates.")
    ap.add_argument("--version", action="version", version=f"aurora {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    snap = sub.add_parser("snapshot", help="full-weight snapshots").add_subparsers(dest="action", required=True)
    sc = snap.add_parser("create", help="write WEIGHTS as snapshot V (fused names)")
    sc.add_argument("weights", metavar="WEIGHTS", help="a .safetensors file, or a model directory (its shards and config.json)")
    sc.add_argument("--version", type=int, required=True)
    sc.add_argument("--run", default=None, help="run name (default: run; required with --commit-via redis)")
    sc.add_argument(
        "--tied-lm-head",
        action="store_true",
        help="lm_head.weight is the embedding: do not carry it",
    )
    add_store_args(sc)
    codec_cmds.add_encode_args(sc)
    add_sign_key_args(sc)
    codec_cmds.add_commit_args(sc)
    sc.set_defaults(func=codec_cmds.cmd_snapshot_create)

    delta = sub.add_parser("delta", help="sparse delta versions").add_subparsers(dest="action", required=True)
    dc = delta.add_parser("create", help="write delta V = NEW - BASE on top of version V-1")
    dc.add_argument("base", metavar="BASE", help="a .safetensors file, or a model directory")
    dc.add_argument("new", metavar="NEW", help="a .safetensors file, or a model directory")
    dc.add_argument("--version", type=int, required=True)
    dc.add_argument("--run", default=None, help="run name (default: run; required with --commit-via redis)")
    dc.add_argument("--tied-lm-head", action="store_true")
    add_store_args(dc)
    codec_cmds.add_encode_args(dc)
    add_sign_key_args(dc)
    codec_cmds.add_commit_args(dc)
    dc.set_defaults(func=codec_cmds.cmd_delta_create)
    da = delta.add_parser("apply", help="materialize version V: newest snapshot <= V, then deltas")
    da.add_argument("--version", type=int, required=True)
    da.add_argument("--out", required=True, metavar="FILE.safetensors")
    add_store_args(da)
    add_trust_key_arg(da)
    store_cmds.add_commit_check_args(da)
    da.set_defaults(func=codec_cmds.cmd_delta_apply)

    ln = sub.add_parser("lineage", help="one row per version; orphans and gaps called out")
    ln.add_argument("url", metavar="URL")
    ln.add_argument("--json", action="store_true")
    add_storage_option(ln, help=None)
    add_trust_key_arg(ln)
    store_cmds.add_commit_check_args(ln)
    ln.set_defaults(func=store_cmds.cmd_lineage)

    vf = sub.add_parser("verify", help="re-hash every object, check chain continuity and state digests")
    vf.add_argument("url", metavar="URL")
    vf.add_argument("--from", dest="from_version", type=int, default=None, metavar="V")
    vf.add_argument("--to", dest="to_version", type=int, default=None, metavar="V")
    vf.add_argument("--deep", action="store_true", help="also decode and validate every segment")
    vf.add_argument("-v", "--verbose", action="store_true")
    add_storage_option(vf, help=None)
    add_trust_key_arg(vf)
    store_cmds.add_commit_check_args(vf)
    vf.set_defaults(func=store_cmds.cmd_verify)

    kg = sub.add_parser("keygen", help="a new Ed25519 signing key: DIR/signing-key.pem (private, 0600) and DIR/signing-key.pub.pem")
    kg.add_argument("--out", required=True, metavar="DIR", help="folder to write the two PEM files into (created if missing)")
    kg.add_argument("--force", action="store_true", help="replace existing key files (a run signed with them can no longer be extended)")
    kg.set_defaults(func=store_cmds.cmd_keygen)

    gc = sub.add_parser("gc", help="remove orphans and versions no retained chain needs (dry run by default)")
    store_cmds.add_gc_arguments(gc)
    gc.set_defaults(func=store_cmds.cmd_gc)

    tp = sub.add_parser("trainer", help="run the GRPO Trainer: publishes every step as a delta, schedules Actors")
    later.fill(("trainer",), tp, run_cmds.add_trainer_arguments)
    tp.set_defaults(func=run_cmds.cmd_trainer)
    ap_ = sub.add_parser("actor", help="run an Actor: bootstrap, stage, activate, generate, settle")
    later.fill(("actor",), ap_, run_cmds.add_actor_arguments)
    ap_.set_defaults(func=run_cmds.cmd_actor)

    rl = sub.add_parser("relay", help="run a regional Relay: mirror versions near a region's Actors")
    later.fill(("relay",), rl, run_cmds.add_relay_arguments)
    rl.set_defaults(func=run_cmds.cmd_relay)

    fo = sub.add_parser(
        "follow", help="keep a local directory holding the run's newest version as a Hugging Face checkpoint (any inference server)"
    )
    later.fill(("follow",), fo, run_cmds.add_follow_arguments)
    fo.set_defaults(func=run_cmds.cmd_follow)

    tbp = sub.add_parser("testbed", help="local Redis and S3-protocol server on loopback for trying a run").add_subparsers(
        dest="action", required=True
    )
    tbu = tbp.add_parser("up", help="start Redis and an S3 server (minio if on PATH, else moto); run until Ctrl-C")
    tbu.add_argument("--dir", default=".aurora-testbed", help="state, logs and data (default ./.aurora-testbed)")
    tbu.add_argument("--s3-port", type=int, default=0, metavar="N", help="S3 server port (default: a free one)")
    tbu.add_argument("--redis-port", type=int, default=0, metavar="N", help="Redis port (default: a free one)")
    tbu.add_argument("--bucket", default="aurora", help="bucket to create (default aurora)")
    tbu.add_argument(
        "--s3",
        choices=("auto", "minio", "moto", "rclone"),
        default="auto",
        help="S3 server: auto (minio if on PATH, else moto, in memory), or rclone (files under DIR/rclone; "
        "no conditional writes: Redis persists and the Trainer runs with --commit-via redis)",
    )
    tbu.add_argument("--background", action="store_true", help="detach, write DIR/testbed.json and return")
    tbu.set_defaults(func=run_cmds.cmd_testbed)
    tbd = tbp.add_parser("down", help="stop the testbed started with --background (SIGTERM, then SIGKILL)")
    tbd.add_argument("--dir", default=".aurora-testbed", help="its folder (default ./.aurora-testbed)")
    tbd.set_defaults(func=run_cmds.cmd_testbed)

    stp = sub.add_parser("status", help="a run at a glance: Trainer head, Relays, Actors, open steps")
    add_redis_args(stp)
    stp.add_argument(
        "--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS", help="refresh every SECONDS (default 2) until Ctrl-C"
    )
    stp.add_argument("--json", action="store_true", help="one JSON object (one per refresh with --watch)")
    stp.set_defaults(func=run_cmds.cmd_status)

    tm = sub.add_parser(
        "tiny-model",
        help="write a tiny Hugging Face model directory (Qwen3, Qwen2, Llama, Mistral, Qwen3-MoE, Qwen2-MoE, Mixtral or GLM-4-MoE, BPE tokenizer, chat template) and GSM8K/MATH-format data to try --model with",
    )
    tm.add_argument("--out", required=True, metavar="DIR", help="the model directory to write (must not exist)")
    tm.add_argument(
        "--family", default="qwen3", choices=("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe")
    )
    tm.add_argument("--seed", type=int, default=0)
    tm.add_argument("--data-dir", metavar="DIR", default=None, help="also write gsm8k.jsonl and math.jsonl here (200 rows each)")
    tm.add_argument(
        "--supervise-steps",
        type=int,
        default=0,
        metavar="N",
        help="fine-tune on those rows for N steps first, so sampling earns some reward (needs --data-dir; 120 is enough)",
    )
    tm.set_defaults(func=run_cmds.cmd_tiny_model)

    dm = sub.add_parser("demo", help="the whole system on one machine: Redis, S3 server, Trainer, Relay, Actors (--codec: codec only)")
    later.fill(("demo",), dm, run_cmds.add_demo_arguments)
    dm.set_defaults(func=run_cmds.cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="action", required=True)
    bc = bench.add_parser("codec", help="delta size, extraction and apply rates vs baselines")
    bench_cmds.add_codec_arguments(bc)
    bc.set_defaults(func=bench_cmds.cmd_bench_codec)
    bt = bench.add_parser("transfer", help="publish-to-staged time, 1 vs S connections, vs raw S3 throughput (local S3 server)")
    later.fill(("bench", "transfer"), bt, bench_cmds.add_transfer_arguments)
    bt.set_defaults(func=bench_cmds.cmd_bench_transfer)
    bl = bench.add_parser("ledger", help="lease-and-settle rate of the Redis ledger with N simulated Actors (local redis-server)")
    later.fill(("bench", "ledger"), bl, bench_cmds.add_ledger_arguments)
    bl.set_defaults(func=bench_cmds.cmd_bench_ledger)
    be = bench.add_parser("e2e", help="what the weight path adds to step time: the demo's workload with and without weight transfer")
    later.fill(("bench", "e2e"), be, bench_cmds.add_e2e_arguments)
    be.set_defaults(func=bench_cmds.cmd_bench_e2e)
    bw = bench.add_parser(
        "wan", help="the paper's comparisons over an emulated WAN: delta vs full broadcast, lag bounds, streams, Relays, split, churn"
    )
    later.fill(("bench", "wan"), bw, bench_cmds.add_wan_arguments)
    bw.set_defaults(func=bench_cmds.cmd_bench_wan)
    bx = bench.add_parser(
        "chaos", help="the real workers under a seeded fault schedule (Redis, S3, Trainer, Actor, Relay faults): what is guaranteed"
    )
    later.fill(("bench", "chaos"), bx, bench_cmds.add_chaos_arguments)
    bx.set_defaults(func=bench_cmds.cmd_bench_chaos)
    bh = bench.add_parser(
        "hostile", help="every attack of issue 13 against the real CLI: refused, nothing applied, no traceback; valid controls accepted"
    )
    later.fill(("bench", "hostile"), bh, bench_cmds.add_hostile_arguments)
    bh.set_defaults(func=bench_cmds.cmd_bench_hostile)
    bst = bench.add_parser(
        "synthetic-trainer",
        help="the Trainer of aurora bench wan's synthetic workload: the real Trainer, simulated training on a large model",
    )
    later.fill(("bench", "synthetic-trainer"), bst, run_cmds.add_synthetic_trainer_arguments)
    bst.set_defaults(func=run_cmds.cmd_synthetic_trainer)
    bsa = bench.add_parser(
        "synthetic-actor", help="an Actor of aurora bench wan's synthetic workload: the real Actor, simulated generation"
    )
    later.fill(("bench", "synthetic-actor"), bsa, run_cmds.add_synthetic_actor_arguments)
    bsa.set_defaults(func=run_cmds.cmd_synthetic_actor)
    ba = bench.add_parser("activate", help="the Actor's safe point against a bare scatter of the same delta and a full copy of the weights")
    later.fill(("bench", "activate"), ba, bench_cmds.add_activate_arguments)
    ba.set_defaults(func=bench_cmds.cmd_bench_activate)
    btr = bench.add_parser(
        "trainer", help="the real Trainer's step on a model of --params N: peak memory per parameter, publish, digest and checkpoint time"
    )
    later.fill(("bench", "trainer"), btr, bench_cmds.add_trainer_arguments)
    btr.set_defaults(func=bench_cmds.cmd_bench_trainer)
    bv = bench.add_parser("verl", help="Aurora as verl's checkpoint engine across an emulated WAN link (run it with .venv-verl's python)")
    later.fill(("bench", "verl"), bv, bench_cmds.add_verl_arguments)
    bv.set_defaults(func=bench_cmds.cmd_bench_verl)
    bf8 = bench.add_parser("fp8", help="FP8 serving copies of a bf16 chain: what a step changes, what requantizing costs")
    later.fill(("bench", "fp8"), bf8, bench_cmds.add_fp8_arguments)
    bf8.set_defaults(func=bench_cmds.cmd_bench_fp8)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else list(argv)
    # ``aurora trainer|actor|relay|follow --config FILE.toml``: the file's values are the defaults flags override.
    fills = {
        "trainer": run_cmds.add_trainer_arguments,
        "actor": run_cmds.add_actor_arguments,
        "relay": run_cmds.add_relay_arguments,
        "follow": run_cmds.add_follow_arguments,
    }
    args = config_file.parse_worker_args(build_parser(args_list), args_list, fills)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (AuroraError, OSError, ValueError) as e:
        from aurora_store.redact import redact_text

        print(f"aurora: error: {redact_text(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("aurora: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, not a fault or a bad input: one line; the traceback at debug level (-v)
        import logging

        from aurora_store.redact import redact_text

        logging.getLogger("aurora").debug("aurora %s ended with an unexpected error", " ".join(args_list[:1]), exc_info=e)
        print(
            f"aurora: error: unexpected {type(e).__name__}: {redact_text(str(e))} (a bug: with -v, its traceback is logged)",
            file=sys.stderr,
        )
        return 1
