"""``aurora trainer``: its arguments, and running the Trainer (one process, or FSDP ranks)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aurora_store.options import (
    add_config_arg,
    add_debug_logger_arg,
    add_declared,
    add_metrics_args,
    add_redis_args,
    add_store_args,
    resolve,
)
from workers.common import Endpoints
from workers.trainer.config import ENV_PREFIX, TrainerConfig, encode_options_from_env

if TYPE_CHECKING:
    from workers.trainer.fsdp import DistContext

__all__ = ["TASK_OPTIONS", "TRAINING_OPTIONS", "RECOVERY_OPTIONS", "add_arguments", "config_from_args", "main"]

log = logging.getLogger("aurora.trainer")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``aurora trainer`` (the GRPO run), grouped by concern for ``--help``.

    The Trainer's own options are declared on :class:`TrainerConfig`; their
    flags have no default, so the environment and a ``--config`` file are not overridden.
    """
    where = p.add_argument_group("where the run lives")
    add_store_args(where, store_help="run root (s3://bucket/prefix/run, file:///path)")
    add_redis_args(where, run_help="run name (Redis namespace)")
    task = p.add_argument_group("model and task")
    add_declared(task, TrainerConfig, ENV_PREFIX, *TASK_OPTIONS)
    train = p.add_argument_group("training")
    add_declared(train, TrainerConfig, ENV_PREFIX, *TRAINING_OPTIONS)
    pub = p.add_argument_group("publishing")
    add_declared(
        pub, TrainerConfig, ENV_PREFIX, "snapshot_every", "digest_every", "streams", "format", "commit_via", "sign_key", "sign_key_id"
    )
    rec = p.add_argument_group("recovery")
    add_declared(rec, TrainerConfig, ENV_PREFIX, *RECOVERY_OPTIONS)
    par = p.add_argument_group("parallelism")
    par.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="train with N processes sharding the weights with FSDP2 (one per GPU; gloo on CPU). "
        "Under torchrun (WORLD_SIZE set) this is ignored: torchrun made the processes",
    )
    conf = p.add_argument_group("config and logging")
    add_config_arg(conf)
    add_debug_logger_arg(conf)
    add_metrics_args(conf)


TASK_OPTIONS = ("model", "task", "data", "eval_data", "eval_every", "eval_size", "reward_timeout_s", "max_new_tokens")
"""The options of ``--help``'s "model and task" group, in order."""
TRAINING_OPTIONS = (
    "steps",
    "batch",
    "group",
    "optimizer",
    "lr",
    "kl_coef",
    "seed",
    "min_actors",
    "max_lag",
    "device",
    "micro_batch",
    "activation_checkpointing",
    "versions_on",
)
"""The options of the "training" group."""
RECOVERY_OPTIONS = (
    "resume",
    "checkpoint_every",
    "keep_checkpoints",
    "keep_snapshots",
    "outage_budget_s",
    "min_batch_fraction",
    "batch_deadline_s",
)
"""The options of the "recovery" group."""


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None, **fixed: Any) -> TrainerConfig:
    """Defaults < ``AURORA_TRAINER_*`` (and the shared variables) < the ``--config`` file < the flags < ``fixed``
    (what a command sets itself: the synthetic workload's transfer, scheduler…)."""
    env = os.environ if environ is None else environ
    return resolve(TrainerConfig, ENV_PREFIX, args, env, options=encode_options_from_env(env), **fixed)


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
        procs = mp.start_processes(_spawned_rank, args=(nproc, port, plain, dict(storage_options)), nprocs=nproc, join=False)
        # SIGTERM goes to rank 0, which stops the run between steps, tells the other ranks (they ignore
        # signals) and commits the checkpoint being written; a rank killed by it would stop nothing cleanly.
        signal.signal(
            signal.SIGTERM, lambda *_: os.kill(procs.processes[0].pid or 0, signal.SIGTERM) if procs.processes[0].is_alive() else None
        )
        try:
            while not procs.join():
                pass
        except mp.ProcessExitedException as e:
            if e.error_index == 0 and e.exit_code == 130:
                return 130  # rank 0 was stopped (its own line said so)
            # The rank said why in its own log lines (above); here, one line.
            log.error(
                "trainer rank %d ended with %s; the run stops",
                e.error_index,
                f"exit status {e.exit_code}" if e.exit_code is not None and e.exit_code >= 0 else f"signal {e.signal_name}",
            )
            return 1
        return 0
    ctx = init_from_env()
    try:
        return _run(args, storage_options, ctx)
    finally:
        leave(ctx)


def _run(args: argparse.Namespace, storage_options: Mapping[str, Any], ctx: DistContext) -> int:
    from aurora_store.metrics import serve_from_args
    from workers.process import install_stop_handlers, limit_torch_threads, setup_logging
    from workers.trainer.trainer import Trainer, follow

    setup_logging("trainer" if ctx.leader else f"trainer-rank{ctx.rank}", debug_loggers=getattr(args, "debug_logger", None))
    limit_torch_threads()
    if not ctx.leader:
        from aurora_store.storage import open_store

        # Rank 0 alone takes signals: it stops the run between steps and tells this rank (:mod:`workers.trainer.sharding`).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

        # The run root: each rank writes its own part of every checkpoint and reads its shard on resume.
        n = follow(config_from_args(args), ctx, open_store(args.store, dict(storage_options)))
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
