"""``aurora actor``: the options, the configuration they give, and the run loop."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

from aurora_store.errors import ConfigError
from aurora_store.format.signing import trust_from_option
from aurora_store.lineage.prefetch import FETCH_MODES
from aurora_store.metrics import serve_from_args
from aurora_store.options import (
    add_config_arg,
    add_debug_logger_arg,
    add_metrics_args,
    add_outage_budget_arg,
    add_redis_args,
    add_store_args,
    add_trust_key_arg,
    trust_key_paths,
)
from aurora_store.options import storage_options as parse_storage_options
from aurora_store.outage import outage_budget_s
from workers.actor.actor import Actor
from workers.actor.config import ActorConfig
from workers.common import Endpoints

__all__ = ["MIRROR_OPTIONS_ENV", "add_arguments", "config_from_args", "main", "mirror_options", "run_until_stopped"]

MIRROR_OPTIONS_ENV = "AURORA_ACTOR_MIRROR_OPTIONS"
"""Storage options of the mirror as a JSON object (credentials off the command line)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``aurora actor`` (the GRPO Actor), grouped by concern for ``--help``."""
    d = ActorConfig.__dataclass_fields__
    where = p.add_argument_group("where the run lives")
    add_store_args(where, store_help="run root at origin")
    add_redis_args(where)
    region = p.add_argument_group("region and mirror")
    region.add_argument("--region", default=d["region"].default, help="region name; the Actor uses its Relay's mirror (--mirror) while it is alive")
    region.add_argument(
        "--mirror", default=None, metavar="URL",
        help="run root of the region's mirror, the only one this Actor reads (default $AURORA_ACTOR_MIRROR; none: origin only)",
    )
    region.add_argument(
        "--mirror-option", action="append", metavar="KEY=VALUE",
        help=f"fsspec option of the mirror store (repeatable; or ${MIRROR_OPTIONS_ENV}, a JSON object)",
    )
    region.add_argument(
        "--mirror-grace-s", type=float, default=d["mirror_grace_s"].default, metavar="S",
        help="with the region's Relay alive, wait this long for its mirror to have a version before reading origin (default %(default)s)",
    )
    region.add_argument(
        "--relay-wait-s", type=float, default=d["relay_wait_s"].default, metavar="S",
        help="at start, wait up to S seconds for the region's Relay before staging from origin (default %(default)s: do not wait)",
    )
    gen = p.add_argument_group("engine and generation")
    gen.add_argument("--id", dest="actor_id", default=None, help="Actor id (default: random)")
    gen.add_argument("--engine", default=d["engine"].default, choices=("torch", "vllm"), help="vllm: pip install 'aurora-store[vllm]' (docs/WORKERS.md)")
    gen.add_argument("--device", default=None, metavar="DEV", help="torch engine only: cpu, cuda or cuda:N (default $AURORA_ENGINE_DEVICE, else cpu)")
    gen.add_argument("--claim", type=int, default=d["claim"].default, help="prompts per generation batch")
    gen.add_argument("--slowdown", type=float, default=d["slowdown"].default, help="run N times slower (experiments)")
    gen.add_argument("--seed", type=int, default=d["seed"].default)
    gen.add_argument("--join-at-version", type=int, default=None, metavar="V", help="wait until the run's head reaches V before joining")
    fetch = p.add_argument_group("fetching and recovery")
    add_trust_key_arg(fetch)
    fetch.add_argument(
        "--streams", type=int, default=None, metavar="S",
        help=f"parallel connections per fetched version (default: $AURORA_STREAMS, else {d['streams'].default})",
    )
    fetch.add_argument(
        "--fetch", choices=FETCH_MODES, default=None,
        help="announced (default, $AURORA_ACTOR_FETCH): fetch each segment from its announcement, before the manifest "
        "(held until the manifest lists it); manifest-first: read the manifest, then its segments",
    )
    fetch.add_argument(
        "--max-staged-mib", type=float, default=None, metavar="MIB",
        help=f"most staged data held beside the active weights (default $AURORA_ACTOR_MAX_STAGED_MIB, else {ActorConfig().max_staged_bytes >> 20})",
    )
    add_outage_budget_arg(fetch, "Redis or the store")
    conf = p.add_argument_group("config and logging")
    add_config_arg(conf)
    add_debug_logger_arg(conf)
    add_metrics_args(conf)


def config_from_args(args: argparse.Namespace, engine: str | None = None) -> ActorConfig:
    """The flags (and ``--config`` file) over ``AURORA_ACTOR_*`` (and ``AURORA_STREAMS``) over the
    defaults; ``engine`` overrides ``--engine`` (the synthetic workload's own engine)."""
    staged_mib = getattr(args, "max_staged_mib", None)
    device = getattr(args, "device", None) or None
    chosen = engine or args.engine
    if device is not None and chosen != "torch":
        raise ConfigError(f"--device {device}: only the torch engine takes it (--engine {chosen} places itself)")
    return ActorConfig.from_env(
        actor_id=args.actor_id or None, region=args.region, engine=chosen, claim=args.claim,
        mirror=getattr(args, "mirror", None) or None, mirror_options=mirror_options(getattr(args, "mirror_option", None)) or None,
        slowdown=args.slowdown, seed=args.seed, mirror_grace_s=args.mirror_grace_s, relay_wait_s=args.relay_wait_s,
        streams=args.streams, outage_budget_s=outage_budget_s(getattr(args, "outage_budget_s", None)),
        max_staged_bytes=None if staged_mib is None else max(1, int(staged_mib * (1 << 20))),
        trust=trust_from_option(trust_key_paths(getattr(args, "trust_key", None))),
        device=device, fetch=getattr(args, "fetch", None),
    )


def mirror_options(pairs: list[str] | None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``--mirror-option`` pairs over ``AURORA_ACTOR_MIRROR_OPTIONS`` (a JSON object)."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    raw = env.get(MIRROR_OPTIONS_ENV)
    if raw:
        try:
            got = json.loads(raw)
        except ValueError:
            got = None
        if not isinstance(got, dict):
            raise ConfigError(f"{MIRROR_OPTIONS_ENV} must be a JSON object of storage options") from None
        out.update(got)
    out.update(parse_storage_options(pairs, "--mirror-option"))
    return out


def main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    """``aurora actor``: run until SIGTERM or SIGINT (a graceful leave)."""
    from workers.common import limit_torch_threads, setup_logging

    setup_logging(f"actor[{args.actor_id or ''}]", debug_loggers=getattr(args, "debug_logger", None))
    limit_torch_threads()
    cfg = config_from_args(args)
    serve_from_args(args, "actor")
    return run_until_stopped(Actor(Endpoints(args.store, args.redis, args.run, storage_options), cfg), args.join_at_version)


def run_until_stopped(actor: Actor, join_at_version: int | None = None) -> int:
    """Run an Actor in this process until SIGTERM/SIGINT, joining once the run reaches ``join_at_version``.

    0 after a graceful leave. An outage past the budget
    (:class:`~aurora_store.errors.OutageTooLong`) or a permanent error
    (bad credentials, a missing bucket) propagates: ``aurora``'s entry
    point prints it on one line and exits 1.
    """
    from workers.common import install_stop_handlers

    install_stop_handlers(actor.stop)
    if join_at_version is not None:
        actor.prepare()
        actor.wait_for_version(join_at_version)
        if actor.stop.is_set():
            return 0
    actor.run()
    return 0


