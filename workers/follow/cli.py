"""``aurora follow``: the options, the configuration they give, and the process around the loop."""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Mapping
from typing import Any

from aurora_store.format.signing import trust_from_option
from aurora_store.options import (
    add_config_arg,
    add_debug_logger_arg,
    add_declared,
    add_redis_args,
    add_store_args,
    add_trust_key_arg,
    resolve,
    trust_key_paths,
)
from aurora_store.options import storage_options as parse_storage_options
from workers.follow.follow import ENV_PREFIX, FollowConfig, follow

__all__ = ["add_arguments", "config_from_args", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``aurora follow``, grouped by concern for ``--help``.

    The follower's own options are declared on :class:`FollowConfig`; their flags
    have no default, so the environment and a ``--config`` file are not overridden.
    """
    where = p.add_argument_group("where the run lives")
    add_store_args(where, store_help="run root to follow: s3://bucket/prefix/run, file:///path, or a path")
    add_redis_args(
        where,
        run_default="",
        redis_help="the run's Redis, to wake on its announcements (default: $AURORA_REDIS_URL; none: poll the store)",
        run_help="run name (default: the one the run's manifests name)",
    )
    for a in where._group_actions:
        if a.dest == "redis":
            a.required = False  # a follower may poll the store alone
    add_declared(where, FollowConfig, ENV_PREFIX, "mirror")
    where.add_argument("--mirror-option", action="append", metavar="KEY=VALUE", help="fsspec option of the mirror store (repeatable)")
    what = p.add_argument_group("what to keep")
    what.add_argument(
        "--out", required=True, metavar="DIR", help="symlink kept pointing at the newest complete version's Hugging Face directory"
    )
    add_declared(what, FollowConfig, ENV_PREFIX, "until", "poll_s", "quantize")
    checks = p.add_argument_group("checks and recovery")
    add_trust_key_arg(checks)
    add_declared(checks, FollowConfig, ENV_PREFIX, "outage_budget_s")
    conf = p.add_argument_group("config and logging")
    add_config_arg(conf)
    add_debug_logger_arg(conf)


def config_from_args(
    args: argparse.Namespace, storage_options: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> FollowConfig:
    """Defaults < ``AURORA_FOLLOW_*`` (and the shared variables) < the ``--config`` file < the flags."""
    env = os.environ if environ is None else environ
    return resolve(
        FollowConfig,
        ENV_PREFIX,
        args,
        env,
        store=args.store,
        out=args.out,
        redis=args.redis or None,
        run=args.run or None,
        storage_options=dict(storage_options if storage_options is not None else parse_storage_options(args.storage_option)),
        mirror_options=parse_storage_options(args.mirror_option, "--mirror-option"),
        trust=trust_from_option(trust_key_paths(args.trust_key, env)),
    )


def main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    """``aurora follow``: 0 at ``--until`` or after SIGTERM/SIGINT; errors propagate (one line, exit 1)."""
    from workers.process import install_stop_handlers, limit_torch_threads, setup_logging

    setup_logging("follow", debug_loggers=getattr(args, "debug_logger", None))
    limit_torch_threads()
    cfg = config_from_args(args, storage_options)
    stop = threading.Event()
    install_stop_handlers(stop)
    return follow(cfg, stop)
