"""The synthetic workload's options of ``aurora trainer`` and ``aurora actor`` (``--workload synthetic``)."""

from __future__ import annotations

import argparse

from aurora_tools.synthetic.workload import DEFAULT_DENSITY

__all__ = ["add_trainer_arguments", "add_actor_arguments"]


def add_trainer_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("synthetic workload (aurora bench wan)")
    g.add_argument("--workload", choices=("grpo", "synthetic"), default="grpo", help="grpo: the real GRPO run; synthetic: simulated compute on a large model")
    g.add_argument("--transfer", choices=("delta", "full", "none"), default="delta", help="how versions are shipped (default delta)")
    g.add_argument("--max-lag", type=int, default=1, metavar="K", help="batch b is generated on version b-K, 0: synchronous training (both workloads; default 1)")
    g.add_argument("--split", choices=("proportional", "uniform"), default="proportional", help="how a batch is split over Actors")
    g.add_argument("--params", type=float, default=1e8, help="synthetic model size (default 1e8)")
    g.add_argument("--density", type=float, default=DEFAULT_DENSITY)
    g.add_argument("--gen-s-per-prompt", type=float, default=None, help="simulated generation seconds per prompt (default: 45 s x params/8.2e9 over 16 prompts)")
    g.add_argument("--train-s", type=float, default=None, help="simulated training seconds per step (default: 0.3 x the scaled 45 s window)")
    g.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    g.add_argument("--segment-bytes", type=int, default=1 << 20)
    g.add_argument("--shard-bytes", type=int, default=64 << 20)
    g.add_argument("--heartbeat-timeout", type=float, default=8.0)
    g.add_argument("--min-lease-s", type=float, default=2.0, help="floor of a lease: longer than one claim's simulated generation")
    # --keep-snapshots is the Trainer's own flag; with --transfer full it bounds the versions
    # kept in the store (the memory of an in-memory S3 server), 6 unless given.
    g.add_argument("--digests", action="store_true", help="record the weights digest of every version")


def add_actor_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("synthetic workload (aurora bench wan)")
    g.add_argument("--workload", choices=("grpo", "synthetic"), default="grpo")
    g.add_argument("--transfer", choices=("delta", "full", "none"), default="delta", help="what the Trainer ships (must match it)")
    g.add_argument("--hold-weights", choices=("yes", "no"), default="yes", help="keep real weights and apply every version (no: fetch, verify, decode, drop)")
    g.add_argument("--digests", action="store_true", help="digest the weights after every activation (needs --hold-weights yes)")

