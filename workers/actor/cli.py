"""``aurora actor``: the options, the configuration they give, and the run loop."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

from aurora_store.errors import ConfigError
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
    trust_key_paths,
)
from aurora_store.options import storage_options as parse_storage_options
from workers.actor.actor import Actor
from workers.actor.config import ENV_PREFIX, ActorConfig
from workers.common import Endpoints

__all__ = ["MIRROR_OPTIONS_ENV", "add_arguments", "config_from_args", "main", "mirror_options", "run_until_stopped"]

MIRROR_OPTIONS_ENV = "AURORA_ACTOR_MIRROR_OPTIONS"
"""Storage options of the mirror as a JSON object (credentials off the command line)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``aurora actor`` (the GRPO Actor), grouped by concern for ``--help``.

    The Actor's own options are declared on :class:`ActorConfig`; their flags
    have no default, so the environment and a ``--config`` file are not overridden.
    """
    where = p.add_argument_group("where the run lives")
    add_store_args(where, store_help="run root at origin")
    add_redis_args(where)
    region = p.add_argument_group("region and mirror")
    add_declared(region, ActorConfig, ENV_PREFIX, "region", "mirror")
    region.add_argument(
        "--mirror-option",
        action="append",
        metavar="KEY=VALUE",
        help=f"fsspec option of the mirror store (repeatable; or ${MIRROR_OPTIONS_ENV}, a JSON object)",
    )
    add_declared(region, ActorConfig, ENV_PREFIX, "mirror_grace_s", "mirror_timeout_s", "relay_wait_s")
    gen = p.add_argument_group("engine and generation")
    add_declared(
        gen, ActorConfig, ENV_PREFIX, "actor_id", "engine", "device", "serve_dtype", "claim", "slowdown", "seed", "result_inline_max_bytes"
    )
    gen.add_argument("--join-at-version", type=int, default=None, metavar="V", help="wait until the run's head reaches V before joining")
    fetch = p.add_argument_group("fetching and recovery")
    add_trust_key_arg(fetch)
    add_declared(fetch, ActorConfig, ENV_PREFIX, "streams", "fetch", "max_staged_bytes", "outage_budget_s", "verify_every")
    conf = p.add_argument_group("config and logging")
    add_config_arg(conf)
    add_debug_logger_arg(conf)
    add_metrics_args(conf)


def config_from_args(args: argparse.Namespace, engine: str | None = None, environ: Mapping[str, str] | None = None) -> ActorConfig:
    """Defaults < ``AURORA_ACTOR_*`` (and the shared variables) < the ``--config`` file < the flags;
    ``engine`` overrides them all (the synthetic workload's own engine)."""
    env = os.environ if environ is None else environ
    cfg = resolve(
        ActorConfig,
        ENV_PREFIX,
        args,
        env,
        engine=engine,
        mirror_options=mirror_options(vars(args).get("mirror_option"), env) or None,
        trust=trust_from_option(trust_key_paths(vars(args).get("trust_key"), env)),
    )
    if cfg.device is not None and cfg.engine != "torch":
        raise ConfigError(f"--device {cfg.device}: only the torch engine takes it (--engine {cfg.engine} places itself)")
    if cfg.serve_dtype != "bf16" and cfg.engine != "torch":
        from workers.engine.vllm_config import fp8_refusal

        raise ConfigError(fp8_refusal(cfg.serve_dtype))  # now, not once the run's model has been read
    return cfg


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
    from workers.process import limit_torch_threads, setup_logging

    setup_logging(f"actor[{args.actor_id or ''}]", debug_loggers=getattr(args, "debug_logger", None))
    limit_torch_threads()
    cfg = config_from_args(args)
    serve_from_args(args, "actor")
    return run_until_stopped(Actor.from_endpoints(Endpoints(args.store, args.redis, args.run, storage_options), cfg), args.join_at_version)


def run_until_stopped(actor: Actor, join_at_version: int | None = None) -> int:
    """Run an Actor in this process until SIGTERM/SIGINT, joining once the run reaches ``join_at_version``.

    0 after a graceful leave. An outage past the budget
    (:class:`~aurora_store.errors.OutageTooLong`) or a permanent error
    (bad credentials, a missing bucket) propagates: ``aurora``'s entry
    point prints it on one line and exits 1.
    """
    from workers.process import install_stop_handlers

    install_stop_handlers(actor.stop)
    if join_at_version is not None:
        actor.prepare()
        actor.wait_for_version(join_at_version)
        if actor.stop.is_set():
            return 0
    actor.run()  # what ends it otherwise propagates: ``aurora``'s entry point prints one line
    return 0
