"""``aurora trainer``: its arguments, and running the Trainer (one process, or FSDP ranks)."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aurora_store.options import (
    add_config_arg,
    add_debug_logger_arg,
    add_metrics_args,
    add_outage_budget_arg,
    add_redis_args,
    add_sign_key_args,
    add_store_args,
)
from workers.common import Endpoints
from workers.trainer.config import OPTIMIZERS, TrainerConfig

if TYPE_CHECKING:
    from workers.trainer.fsdp import DistContext

__all__ = ["add_arguments", "config_from_args", "main"]

log = logging.getLogger("aurora.trainer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``aurora trainer`` (the GRPO run), grouped by concern for ``--help``.

    Flags that default to None leave the value to ``AURORA_TRAINER_*`` (or the
    shared variable named in their help), then to :class:`TrainerConfig`'s default.
    """
    d = TrainerConfig()
    where = p.add_argument_group("where the run lives")
    add_store_args(where, store_help="run root (s3://bucket/prefix/run, file:///path)")
    add_redis_args(where, run_help="run name (Redis namespace)")

    task = p.add_argument_group("model and task")
    task.add_argument("--model", default=None, metavar="DIR", help="local Hugging Face causal-LM directory: version 0 is that checkpoint (default: the built-in tiny model)")
    task.add_argument("--task", default=None, metavar="NAME", help=f"arithmetic, gsm8k, math or package.module:factory (default {d.task})")
    task.add_argument("--data", default=None, metavar="FILE", help="training problems: JSON lines or Parquet, local or s3:// (gsm8k and math need it)")
    task.add_argument("--eval-data", default=None, metavar="FILE", help="held-out problems (default: a held-out slice of --data)")
    task.add_argument("--eval-every", type=int, default=None, metavar="N", help=f"score the held-out set every N versions, 0 never (default {d.eval_every})")
    task.add_argument("--eval-size", type=int, default=None, metavar="N", help=f"held-out problems per evaluation (default {d.eval_size})")
    task.add_argument("--reward-timeout-s", type=float, default=None, metavar="S", help=f"bound on one reward call; slower answers score 0 (default {d.reward_timeout_s:g})")
    task.add_argument("--max-new-tokens", type=int, default=None, metavar="N", help=f"longest completion an Actor may return (default {d.max_new_tokens})")

    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=d.steps, metavar="N", help="optimizer steps: versions published after v0 (default %(default)s)")
    train.add_argument("--batch", type=int, default=d.batch, metavar="N", help="prompts per step (default %(default)s)")
    train.add_argument("--group", type=int, default=d.group, metavar="N", help="completions per prompt, the GRPO group (default %(default)s)")
    train.add_argument("--optimizer", default=None, choices=OPTIMIZERS, help=f"sgd (with momentum) or adamw (default {d.optimizer})")
    train.add_argument("--lr", type=float, default=d.lr, metavar="LR", help="learning rate of --optimizer (default %(default)s)")
    train.add_argument("--kl-coef", type=float, default=d.kl_coef, metavar="C", help="weight of the KL to the reference model, 0: none kept (default %(default)s)")
    train.add_argument("--seed", type=int, default=d.seed, metavar="N", help="seeds the model, the problems and every batch's sampling (default %(default)s)")
    train.add_argument("--min-actors", type=int, default=None, metavar="N",
                       help="hold the first batch until N Actors are alive (default 0: start at once)")
    train.add_argument("--device", default=None, metavar="DEV", help=f"cpu, cuda or cuda:N, single-process Trainer (default $AURORA_TRAINER_DEVICE, else {d.device})")

    pub = p.add_argument_group("publishing")
    pub.add_argument("--snapshot-every", type=int, default=d.snapshot_every, metavar="N", help="a full snapshot every N versions, for late joiners (default %(default)s)")
    pub.add_argument("--streams", type=int, default=d.streams, metavar="S", help="concurrent uploads per published version (default %(default)s)")
    pub.add_argument(
        "--commit-via", choices=("store", "redis"), default=None,
        help="store (default): commit each version by its create-only manifest write, after checking that the "
        "store honours create-only writes; redis: commit by a Redis record (FORMAT.md §1), for S3-compatible "
        "servers that ignore conditional writes (Redis must persist its data: appendonly or save rules)",
    )
    add_sign_key_args(pub)

    rec = p.add_argument_group("recovery")
    rec.add_argument(
        "--resume", action="store_true",
        help="continue the run in --store from its newest checkpoint (a fresh run if it holds no version yet); "
        "the resumed Trainer takes a new epoch and fences out any older one",
    )
    rec.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help=f"save a Trainer checkpoint every N steps, 0 never (default {d.checkpoint_every})")
    rec.add_argument("--keep-checkpoints", type=int, default=None, metavar="N", help=f"checkpoints kept (default {d.keep_checkpoints})")
    rec.add_argument(
        "--keep-snapshots", type=int, default=None, metavar="K",
        help=f"retention: keep the newest K snapshots and what follows them, 0 keeps everything (default {d.keep_snapshots})",
    )
    add_outage_budget_arg(rec, "Redis or the store")
    rec.add_argument(
        "--min-batch-fraction", type=float, default=None, metavar="F",
        help="close a batch with this fraction of its prompts in once --batch-deadline-s passed (default 1.0: every prompt)",
    )
    rec.add_argument("--batch-deadline-s", type=float, default=None, metavar="S", help="seconds after which a batch may close short (default: none)")

    par = p.add_argument_group("parallelism")
    par.add_argument(
        "--nproc", type=int, default=1, metavar="N",
        help="train with N processes sharding the weights with FSDP2 (one per GPU; gloo on CPU). "
        "Under torchrun (WORLD_SIZE set) this is ignored: torchrun made the processes",
    )

    conf = p.add_argument_group("config and logging")
    add_config_arg(conf)
    add_debug_logger_arg(conf)
    add_metrics_args(conf)


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    """The flags (and ``--config`` file) over ``AURORA_TRAINER_*`` over the defaults."""
    return TrainerConfig.from_env(
        steps=args.steps, batch=args.batch, group=args.group, lr=args.lr, kl_coef=args.kl_coef, optimizer=getattr(args, "optimizer", None),
        snapshot_every=args.snapshot_every, streams=args.streams, seed=args.seed,
        resume=getattr(args, "resume", False) or None, checkpoint_every=getattr(args, "checkpoint_every", None),
        keep_checkpoints=getattr(args, "keep_checkpoints", None), keep_snapshots=getattr(args, "keep_snapshots", None),
        outage_budget_s=getattr(args, "outage_budget_s", None), min_batch_fraction=getattr(args, "min_batch_fraction", None),
        batch_deadline_s=getattr(args, "batch_deadline_s", None),
        commit_via=getattr(args, "commit_via", None),
        sign_key=getattr(args, "sign_key", None), sign_key_id=getattr(args, "key_id", None),
        model=getattr(args, "model", None), task=getattr(args, "task", None), data=getattr(args, "data", None),
        eval_data=getattr(args, "eval_data", None), eval_every=getattr(args, "eval_every", None),
        eval_size=getattr(args, "eval_size", None), reward_timeout_s=getattr(args, "reward_timeout_s", None),
        device=getattr(args, "device", None), max_new_tokens=getattr(args, "max_new_tokens", None),
        min_actors=getattr(args, "min_actors", None), max_lag=getattr(args, "max_lag", None),
    )


def _spawned_rank(rank: int, world: int, port: int, args: argparse.Namespace, storage_options: Mapping[str, Any]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from workers.trainer.fsdp import exit_process

    try:
        rc = main(args, storage_options)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()  # mp.spawn reports the rank's failure; the traceback is its record
        rc = 1
    exit_process(rc)


def main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    """``aurora trainer``: train until done, SIGTERM or SIGINT (130)."""
    from workers.trainer.fsdp import init_from_env, leave

    nproc = getattr(args, "nproc", 1)
    if nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {nproc}")
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        import torch.multiprocessing as mp

        from aurora_store.config import free_port

        port = free_port()  # torch.distributed's rendezvous cannot bind port 0 and report it
        # The parsed arguments travel to the new processes: only plain values pickle.
        plain = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})
        try:
            mp.spawn(_spawned_rank, args=(nproc, port, plain, dict(storage_options)), nprocs=nproc)
        except mp.ProcessExitedException as e:
            # The rank said why in its own log lines (above); here, one line.
            log.error("trainer rank %d ended with %s; the run stops", e.error_index, f"exit status {e.exit_code}" if e.exit_code is not None and e.exit_code >= 0 else f"signal {e.signal_name}")
            return 1
        return 0
    ctx = init_from_env()
    try:
        return _run(args, storage_options, ctx)
    finally:
        leave(ctx)


def _run(args: argparse.Namespace, storage_options: Mapping[str, Any], ctx: DistContext) -> int:
    from aurora_store.metrics import serve_from_args
    from workers.common import install_stop_handlers, limit_torch_threads, setup_logging
    from workers.trainer.trainer import Trainer, follow

    setup_logging("trainer" if ctx.leader else f"trainer-rank{ctx.rank}", debug_loggers=getattr(args, "debug_logger", None))
    limit_torch_threads()
    if not ctx.leader:
        n = follow(config_from_args(args), ctx)
        log.info("rank %d: %d updates, done", ctx.rank, n)
        return 0
    serve_from_args(args, "trainer")  # rank 0 only: it alone records what the run does
    tr = Trainer(Endpoints(args.store, args.redis, args.run, storage_options), config_from_args(args), ctx=ctx)
    install_stop_handlers(tr.stop)
    try:
        logs = tr.run()
    except KeyboardInterrupt:
        log.info("stopped")
        return 130
    if logs:
        log.info("done: reward %.3f -> %.3f over %d steps", logs[0].reward, logs[-1].reward, len(logs))
    return 0
