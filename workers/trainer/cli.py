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

RANK_GRACE_S = 10.0
"""After a rank of ``--nproc`` fails: how long the others get to end by themselves, then after SIGTERM."""
MMAP_THRESHOLD = 4 << 20
"""A sharded rank's host allocations of at least this many bytes are mapped on their own, and
unmapped when freed (:func:`_tune_rank_allocator`)."""


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
    "router_aux_loss_coef",
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
    from workers.trainer.fsdp import abandon, exit_process

    try:
        rc = main(args, storage_options)
    except BaseException as e:  # before the rank joined the group (main abandons a rank that failed in it)
        abandon(rank, e)
    exit_process(rc)


def main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    """``aurora trainer``: train until done, SIGTERM or SIGINT (130)."""
    from workers.trainer.fsdp import abandon, init_from_env, leave

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
            # A rank that fails exits at once (fsdp.abandon) and its peers' collectives fail with it; one
            # waiting outside a collective is stopped after RANK_GRACE_S (SIGTERM, then SIGKILL: ranks > 0
            # ignore SIGTERM, as only rank 0 stops a run cleanly).
            while not procs.join(grace_period=RANK_GRACE_S):
                pass
        except mp.ProcessExitedException as e:
            if e.error_index == 0 and e.exit_code == 130:
                return 130  # rank 0 was stopped (its own line said so)
            # The rank said why in its own line (above); here, which rank it was.
            log.error(
                "trainer rank %d ended with %s; the run stops",
                e.error_index,
                f"exit status {e.exit_code}" if e.exit_code is not None and e.exit_code >= 0 else f"signal {e.signal_name}",
            )
            return 1
        return 0
    ctx = init_from_env()
    if ctx.sharded:
        _tune_rank_allocator()
    try:
        rc = _run(args, storage_options, ctx)
    except BaseException as e:
        if not ctx.sharded:
            raise
        abandon(ctx.rank, e)  # no barrier: the other ranks may be inside a collective this one never joins
    leave(ctx)
    return rc


def _tune_rank_allocator() -> None:
    """Every rank of a sharded Trainer: the Trainer's allocator settings (:mod:`workers.trainer.malloc`,
    made once per process: the Trainer's own call on rank 0 then changes nothing), then glibc's mmap
    threshold pinned lower, at :data:`MMAP_THRESHOLD` (nothing where the C library has no ``mallopt``).

    Why lower on a rank: FSDP's per-layer buffers (a layer's gathered parameters, its gradients
    before the reduce-scatter, each a few tens of MB) under a high threshold come from the heap,
    which they fragment. Measured on a 0.2 B-parameter model (28 MB layers) over two gloo ranks,
    three GRPO updates, each rank's peak resident memory: 4.0-4.3 GB with glibc's defaults,
    4.5-4.7 GB with one arena and a 32 MB threshold, 2.8-3.1 GB at 16 MB, 2.7-2.8 GB at 1 or 4 MB
    (about 7 bytes per parameter less than the defaults). The price is a page fault per page of each
    mapped block: the update's CPU time went from 12-13 s to about 17 s on that machine's CPU (a GPU
    rank's tensors are not the C library's to place). A threshold the environment sets
    (``MALLOC_MMAP_THRESHOLD_``) is left as it is.
    """
    import ctypes

    from workers.trainer.malloc import tune_allocator

    if not tune_allocator() or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD (also keeps glibc from raising it)


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
