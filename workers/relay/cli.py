"""``aurora relay``: its arguments, and running a Relay until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from collections.abc import Sequence

from aurora_store.errors import AuroraError
from aurora_store.format.signing import trust_from_option
from aurora_store.metrics import serve_from_args
from aurora_store.options import (
    add_config_arg,
    add_debug_logger_arg,
    add_metrics_args,
    add_outage_budget_arg,
    add_redis_args,
    add_store_args,
    add_trust_key_arg,
    storage_options,
    trust_key_paths,
)
from aurora_store.outage import outage_budget_s
from workers.relay.config import RelayConfig, relay_config_from_env
from workers.relay.relay import run_relay

__all__ = ["add_arguments", "config_from_args", "run_from_args", "main"]

log = logging.getLogger("aurora.relay")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``aurora relay``, grouped by concern for ``--help``."""
    d = RelayConfig.__dataclass_fields__
    where = p.add_argument_group("where the run lives")
    add_store_args(where, store_help="run root at origin", option_help="fsspec option of the origin store (repeatable)")
    add_redis_args(where, run_help="run name (Redis namespace)")
    region = p.add_argument_group("region and mirror")
    region.add_argument("--region", required=True, help="region this Relay serves")
    region.add_argument("--mirror", required=True, metavar="URL", help="run root of the region's mirror")
    region.add_argument("--mirror-option", action="append", metavar="KEY=VALUE", help="fsspec option of the mirror store (repeatable)")
    add_trust_key_arg(region)
    timing = p.add_argument_group("copying and heartbeats")
    timing.add_argument("--heartbeat-s", type=float, default=d["heartbeat_s"].default, help="heartbeat period (default %(default)s)")
    timing.add_argument("--ttl-s", type=float, default=d["ttl_s"].default, help="heartbeat key TTL (default %(default)s)")
    timing.add_argument("--block-ms", type=int, default=d["block_ms"].default, help="longest blocking stream read (default %(default)s)")
    timing.add_argument(
        "--streams", type=int, default=None,
        help=f"concurrent copies (default: AURORA_STREAMS or {d['streams'].default})",
    )
    timing.add_argument(
        "--fetch", choices=("announced", "manifest-first"), default=None,
        help="announced (default): copy each segment when origin announces it, before its manifest; "
        "manifest-first: copy only what a manifest lists, once it is read",
    )
    timing.add_argument("--resync-s", type=float, default=d["resync_s"].default, help="list origin this often even without a gap; 0: never (default %(default)s)")
    rec = p.add_argument_group("recovery and retention")
    add_outage_budget_arg(rec, "Redis, origin or the mirror")
    rec.add_argument(
        "--keep-snapshots", type=int, default=d["keep_snapshots"].default, metavar="K",
        help="mirror retention: keep the newest K snapshots and everything after the oldest, plus what the region's live Actors hold; 0: keep everything (default %(default)s)",
    )
    rec.add_argument("--gc-every-s", type=float, default=d["gc_every_s"].default, metavar="S", help="clean the mirror this often; 0: never (default %(default)s)")
    rec.add_argument("--grace-s", type=float, default=d["grace_s"].default, metavar="S", help="spare mirror orphans and temporary files younger than this (default %(default)s)")
    conf = p.add_argument_group("config and logging")
    add_config_arg(conf)
    conf.add_argument("-v", "--verbose", action="store_true", help="Aurora's own loggers at DEBUG (vendors' stay at INFO: see --debug-logger)")
    add_debug_logger_arg(conf)
    add_metrics_args(conf)


def config_from_args(args: argparse.Namespace) -> RelayConfig:
    """The Relay's config: the flags, then ``AURORA_STREAMS`` (and ``AURORA_RELAY_*``) for what they leave out."""
    return relay_config_from_env(
        origin=args.store,
        mirror=args.mirror,
        redis=args.redis,
        run=args.run,
        region=args.region,
        origin_options=storage_options(args.storage_option),
        mirror_options=storage_options(args.mirror_option, "--mirror-option"),
        heartbeat_s=args.heartbeat_s,
        ttl_s=args.ttl_s,
        block_ms=args.block_ms,
        streams=args.streams,
        resync_s=args.resync_s,
        outage_budget_s=outage_budget_s(args.outage_budget_s),
        keep_snapshots=args.keep_snapshots,
        gc_every_s=args.gc_every_s,
        grace_s=args.grace_s,
        trust=trust_from_option(trust_key_paths(getattr(args, "trust_key", None))),
        fetch=getattr(args, "fetch", None),
    )


def run_from_args(args: argparse.Namespace) -> int:
    """``aurora relay``: run until SIGTERM or SIGINT, then delete the heartbeat key and exit 0."""
    from workers.common import install_stop_handlers, setup_logging

    setup_logging(f"relay[{args.region}]", getattr(args, "verbose", False), getattr(args, "debug_logger", None))
    config = config_from_args(args)
    serve_from_args(args, "relay")
    stop = threading.Event()
    install_stop_handlers(stop)
    stats = run_relay(config, stop)
    log.info(
        "relay %s stopped: %d version(s) mirrored, %d bytes copied",
        config.region, stats.versions_mirrored, stats.bytes_copied,
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
