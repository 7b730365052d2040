"""``aurora relay``: its arguments, and running a Relay until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Mapping, Sequence

from aurora_store.errors import AuroraError
from aurora_store.format.signing import trust_from_option
from aurora_store.metrics import serve_from_args
from aurora_store.options import (
    add_config_arg,
    add_debug_logger_arg,
    add_declared,
    add_metrics_args,
    add_redis_args,
    add_store_args,
    add_trust_key_arg,
    resolve,
    storage_options,
    trust_key_paths,
)
from workers.relay.config import ENV_PREFIX, RelayConfig
from workers.relay.relay import run_relay

__all__ = ["add_arguments", "config_from_args", "run_from_args", "main"]

log = logging.getLogger("aurora.relay")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``aurora relay``, grouped by concern for ``--help``.

    The Relay's own options are declared on :class:`RelayConfig`; their flags
    have no default, so the environment and a ``--config`` file are not overridden.
    """
    where = p.add_argument_group("where the run lives")
    add_store_args(where, store_help="run root at origin", option_help="fsspec option of the origin store (repeatable)")
    add_redis_args(where, run_help="run name (Redis namespace)")
    region = p.add_argument_group("region and mirror")
    region.add_argument("--region", required=True, help="region this Relay serves")
    region.add_argument("--mirror", required=True, metavar="URL", help="run root of the region's mirror")
    region.add_argument("--mirror-option", action="append", metavar="KEY=VALUE", help="fsspec option of the mirror store (repeatable)")
    add_trust_key_arg(region)
    timing = p.add_argument_group("copying and heartbeats")
    add_declared(timing, RelayConfig, ENV_PREFIX, "heartbeat_s", "ttl_s", "block_ms", "streams", "fetch", "resync_s")
    rec = p.add_argument_group("recovery and retention")
    add_declared(rec, RelayConfig, ENV_PREFIX, "outage_budget_s", "keep_snapshots", "gc_every_s", "grace_s")
    conf = p.add_argument_group("config and logging")
    add_config_arg(conf)
    conf.add_argument(
        "-v", "--verbose", action="store_true", help="Aurora's own loggers at DEBUG (vendors' stay at INFO: see --debug-logger)"
    )
    add_debug_logger_arg(conf)
    add_metrics_args(conf)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> RelayConfig:
    """Defaults < ``AURORA_RELAY_*`` (and the shared variables) < the ``--config`` file < the flags."""
    return resolve(
        RelayConfig,
        ENV_PREFIX,
        args,
        environ,
        origin=args.store,
        mirror=args.mirror,
        redis=args.redis,
        run=args.run,
        region=args.region,
        origin_options=storage_options(args.storage_option),
        mirror_options=storage_options(args.mirror_option, "--mirror-option"),
        trust=trust_from_option(trust_key_paths(vars(args).get("trust_key"), environ)),
    )


def run_from_args(args: argparse.Namespace) -> int:
    """``aurora relay``: run until SIGTERM or SIGINT, then delete the heartbeat key and exit 0."""
    from workers.process import install_stop_handlers, setup_logging

    setup_logging(f"relay[{args.region}]", getattr(args, "verbose", False), getattr(args, "debug_logger", None))
    config = config_from_args(args)
    serve_from_args(args, "relay")
    stop = threading.Event()
    install_stop_handlers(stop)
    stats = run_relay(config, stop)
    log.info(
        "relay %s stopped: %d version(s) mirrored, %d bytes copied",
        config.region,
        stats.versions_mirrored,
        stats.bytes_copied,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aurora relay", description="Mirror a run into a region's store.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.config is not None:
        parser.error("--config is read by `aurora relay` (aurora_tools), not by this entry point")
    try:
        return run_from_args(args)
    except AuroraError as e:
        from aurora_store.redact import redact_text

        print(f"aurora relay: error: {redact_text(str(e))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
