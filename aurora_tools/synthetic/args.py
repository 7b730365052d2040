"""The options of ``aurora bench synthetic-trainer|synthetic-actor``: the real workers' options plus the synthetic workload's.

The production commands (``aurora trainer``, ``aurora actor``) carry none
of these: the synthetic workload is a benchmark's (``aurora bench wan``),
with its own commands built from the same declarations
(:func:`workers.trainer.add_arguments`, :func:`workers.actor.add_arguments`)
plus the options below.
"""

from __future__ import annotations

import argparse

from aurora_tools.synthetic.workload import DEFAULT_DENSITY
from workers.trainer.config import TrainerConfig

__all__ = ["add_trainer_arguments", "add_actor_arguments", "synthetic_trainer_config"]

TRANSFERS = ("delta", "full", "none")


def add_trainer_arguments(p: argparse.ArgumentParser) -> None:
    """The synthetic Trainer's own options (beside the Trainer's)."""
    g = p.add_argument_group("synthetic workload (aurora bench wan)")
    g.add_argument("--transfer", choices=TRANSFERS, default="delta", help="how versions are shipped (default delta)")
    g.add_argument("--split", choices=("proportional", "uniform"), default="proportional", help="how a batch is split over Actors")
    g.add_argument("--params", type=float, default=1e8, help="synthetic model size (default 1e8)")
    g.add_argument(
        "--density", type=float, default=DEFAULT_DENSITY, help=f"fraction of elements one step changes (default {DEFAULT_DENSITY})"
    )
    g.add_argument(
        "--gen-s-per-prompt",
        type=float,
        default=None,
        help="simulated generation seconds per prompt (default: 45 s x params/8.2e9 over 16 prompts)",
    )
    g.add_argument(
        "--train-s", type=float, default=None, help="simulated training seconds per step (default: 0.3 x the scaled 45 s window)"
    )
    g.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    g.add_argument("--segment-bytes", type=int, default=1 << 20)
    g.add_argument("--shard-bytes", type=int, default=64 << 20)
    g.add_argument("--heartbeat-timeout", type=float, default=8.0)
    g.add_argument("--min-lease-s", type=float, default=2.0, help="floor of a lease: longer than one claim's simulated generation")
    # --keep-snapshots is the Trainer's own flag; with --transfer full it bounds the versions
    # kept in the store (the memory of an in-memory S3 server), 6 unless given.
    g.add_argument("--digests", action="store_true", help="record the weights digest of every version")


def add_actor_arguments(p: argparse.ArgumentParser) -> None:
    """The synthetic Actor's own options (beside the Actor's)."""
    g = p.add_argument_group("synthetic workload (aurora bench wan)")
    g.add_argument("--transfer", choices=TRANSFERS, default="delta", help="what the Trainer ships (must match it)")
    g.add_argument(
        "--hold-weights",
        choices=("yes", "no"),
        default="yes",
        help="keep real weights and apply every version (no: fetch, verify, decode, drop)",
    )
    g.add_argument("--digests", action="store_true", help="digest the weights after every activation (needs --hold-weights yes)")


def synthetic_trainer_config(args: argparse.Namespace) -> TrainerConfig:
    """The synthetic Trainer's config: the Trainer's options resolved as ``aurora trainer`` resolves them
    (defaults < environment < flags), then what the workload fixes (no evaluation, no snapshots
    nor checkpoints, its segment size, transfer and scheduler)."""
    from aurora_store.coordination.scheduler import SchedulerConfig
    from workers.trainer.cli import config_from_args

    return config_from_args(
        args,
        snapshot_every=0,
        checkpoint_every=0,
        eval_every=0,
        segment_bytes=args.segment_bytes,
        heartbeat_timeout_s=args.heartbeat_timeout,
        transfer=args.transfer,
        scheduler=SchedulerConfig(split=args.split, min_lease_ms=int(1000 * args.min_lease_s)),
    )
