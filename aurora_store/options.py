"""The command-line options every Aurora process takes, in one block.

The library ships it (argparse only, no heavy import) so that the workers,
the ``aurora`` CLI and a user's own processes declare these flags the same
way, and so that light commands (``aurora lineage``, ``verify``, ``gc``,
``status``) need nothing from the workers.

``--store``, ``--redis``, ``--run`` and ``--storage-option`` mean the same
thing for the Trainer, Actor, Relay, demo and benchmarks; they are declared
here once and parsed into storage options by :func:`storage_options`. A
worker may word a flag's help for its own case (the Relay's ``--store`` is
the origin); the flag itself stays the same everywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from aurora_store.errors import ConfigError
from aurora_store.outage import DEFAULT_OUTAGE_BUDGET_S, OUTAGE_BUDGET_ENV

__all__ = ["add_store_args", "add_storage_option", "add_redis_args", "add_common_args", "add_outage_budget_arg", "storage_options"]

STORE_HELP = "run root: s3://bucket/prefix/run, file:///path, or a path"
STORAGE_OPTION_HELP = "fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000"
REDIS_HELP = "redis://[user:password@]host:port/db or rediss://…"
RUN_HELP = "run name (keys and streams are namespaced by it)"


def storage_options(pairs: Sequence[str] | None, flag: str = "--storage-option") -> dict[str, Any]:
    """``key=value`` pairs; values ``true``/``false``/integers are typed."""
    out: dict[str, Any] = {}
    for p in pairs or ():
        if "=" not in p:
            raise ConfigError(f"{flag} {p!r}: expected key=value")
        k, v = p.split("=", 1)
        val: Any = v
        if v.lower() in ("true", "false"):
            val = v.lower() == "true"
        elif v.isdigit():
            val = int(v)
        if k == "endpoint_url":
            out.setdefault("client_kwargs", {})["endpoint_url"] = v
        else:
            out[k] = val
    return out


def add_store_args(
    p: argparse.ArgumentParser,
    required: bool = True,
    *,
    store_help: str = STORE_HELP,
    option_help: str = STORAGE_OPTION_HELP,
) -> None:
    """``--store URL`` and repeatable ``--storage-option KEY=VALUE``."""
    p.add_argument("--store", required=required, metavar="URL", help=store_help)
    add_storage_option(p, option_help)


def add_storage_option(p: argparse.ArgumentParser, help: str | None = STORAGE_OPTION_HELP) -> None:
    """Repeatable ``--storage-option KEY=VALUE`` alone, for commands that take the
    run root as a positional URL (``aurora lineage URL``)."""
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help=help)


def add_redis_args(
    p: argparse.ArgumentParser,
    run_default: str | None = None,
    *,
    redis_help: str = REDIS_HELP,
    run_help: str = RUN_HELP,
) -> None:
    """``--redis URL`` and ``--run NAME`` (required unless ``run_default`` is given)."""
    p.add_argument("--redis", required=True, metavar="URL", help=redis_help)
    p.add_argument("--run", required=run_default is None, default=run_default, metavar="NAME", help=run_help)


def add_common_args(
    p: argparse.ArgumentParser,
    run_default: str | None = None,
    *,
    store_help: str = STORE_HELP,
    run_help: str = RUN_HELP,
) -> None:
    """The block shared by every worker: store, Redis and run name."""
    add_store_args(p, store_help=store_help)
    add_redis_args(p, run_default, run_help=run_help)


def add_outage_budget_arg(p: argparse.ArgumentParser, what: str = "Redis or the store") -> None:
    """``--outage-budget-s S``, the same for every worker (:mod:`aurora_store.outage`)."""
    p.add_argument(
        "--outage-budget-s", type=float, default=None, metavar="S",
        help=f"give up (exit 1, one line) once {what} has been unreachable this long "
        f"(default: ${OUTAGE_BUDGET_ENV}, else {DEFAULT_OUTAGE_BUDGET_S:.0f})",
    )
