"""The command-line options every worker takes, in one block.

``--store``, ``--redis``, ``--run`` and ``--storage-option`` mean the same
thing for the Trainer, Actor, Relay, demo and benchmarks; they are declared
here once and parsed into storage options by :func:`storage_options`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from aurora_store.errors import ConfigError

__all__ = ["add_store_args", "add_common_args", "storage_options"]


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


def add_store_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    """``--store URL`` and repeatable ``--storage-option KEY=VALUE``."""
    p.add_argument(
        "--store",
        required=required,
        metavar="URL",
        help="run root: s3://bucket/prefix/run, file:///path, or a path",
    )
    p.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000",
    )


def add_common_args(p: argparse.ArgumentParser, run_default: str | None = None) -> None:
    """The block shared by every worker: store, Redis and run name."""
    add_store_args(p)
    p.add_argument("--redis", required=True, metavar="URL", help="redis://[user:password@]host:port/db or rediss://…")
    p.add_argument(
        "--run",
        required=run_default is None,
        default=run_default,
        help="run name (keys and streams are namespaced by it)",
    )
