"""The command-line options every Aurora process takes, in one block.

The library ships it (argparse only, no heavy import) so that the workers,
the ``aurora`` CLI and a user's own processes declare these flags the same
way, and so that light commands (``aurora lineage``, ``verify``, ``gc``,
``status``) need nothing from the workers.

A worker's own options are declared once, on its config dataclass
(:func:`aurora_store.config.option`); :func:`add_declared` generates their
flags, with no default of their own, and :func:`resolve` gives the config:
defaults < environment < config file < flags (a ``--config`` file's values
are the parser's defaults, so argparse already puts a flag over the file).

``--store``, ``--redis``, ``--run`` and ``--storage-option`` mean the same
thing for the Trainer, Actor, Relay, demo and benchmarks; they are declared
here once and parsed into storage options by :func:`storage_options`. A
worker may word a flag's help for its own case (the Relay's ``--store`` is
the origin); the flag itself stays the same everywhere.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from aurora_store.config import Declared, declared, from_env
from aurora_store.credentials import REDIS_PASSWORD_FILE_ENV, REDIS_URL_ENV
from aurora_store.errors import ConfigError
from aurora_store.outage import DEFAULT_OUTAGE_BUDGET_S, OUTAGE_BUDGET_ENV

__all__ = [
    "Options",
    "add_declared",
    "given",
    "resolve",
    "SHARED",
    "DEBUG_LOGGERS_ENV",
    "debug_logger_names",
    "add_config_arg",
    "add_store_args",
    "add_storage_option",
    "add_redis_args",
    "add_common_args",
    "add_outage_budget_arg",
    "add_metrics_args",
    "storage_options",
    "SIGN_KEY_ENV",
    "TRUST_KEYS_ENV",
    "add_sign_key_args",
    "add_trust_key_arg",
    "sign_key_path",
    "trust_key_paths",
]

T = TypeVar("T")

SIGN_KEY_ENV = "AURORA_SIGN_KEY"
"""File of the key writers sign manifests with (``--sign-key``)."""
TRUST_KEYS_ENV = "AURORA_TRUST_KEYS"
"""Comma-separated files of the keys readers accept signatures from (``--trust-key``)."""

Options = argparse._ActionsContainer
"""What the ``add_*`` functions declare options on: a parser, or one of its argument groups
(``--help`` lists a worker's options by concern)."""

STORE_HELP = "run root: s3://bucket/prefix/run, file:///path, or a path"
STORAGE_OPTION_HELP = "fsspec storage option (repeatable), e.g. endpoint_url=http://127.0.0.1:9000"
REDIS_HELP = "redis://[user@]host:port/db, rediss://… or a Redis Cluster: redis+cluster://host:port,host:port,… (default: $AURORA_REDIS_URL; a password belongs in --redis-password-file, not here)"
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
    p: Options,
    required: bool = True,
    *,
    store_help: str = STORE_HELP,
    option_help: str = STORAGE_OPTION_HELP,
) -> None:
    """``--store URL`` and repeatable ``--storage-option KEY=VALUE``."""
    p.add_argument("--store", required=required, metavar="URL", help=store_help)
    add_storage_option(p, option_help)


def add_storage_option(p: Options, help: str | None = STORAGE_OPTION_HELP) -> None:
    """Repeatable ``--storage-option KEY=VALUE`` alone, for commands that take the
    run root as a positional URL (``aurora lineage URL``)."""
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help=help)


def add_redis_args(
    p: Options,
    run_default: str | None = None,
    *,
    redis_help: str = REDIS_HELP,
    run_help: str = RUN_HELP,
) -> None:
    """``--redis URL``, ``--redis-password-file FILE`` and ``--run NAME`` (required unless ``run_default`` is given).

    ``--redis`` defaults to ``$AURORA_REDIS_URL`` (required only when that is
    unset), so a URL with a password need never be on a command line, which
    every user of the machine can read (``ps``). A URL without a password
    takes the one in ``--redis-password-file`` or ``$AURORA_REDIS_PASSWORD_FILE``
    (its first line); ``args.redis`` then holds the URL with the password
    folded in, for this process only (reprs and logs mask it).
    """
    env_url = os.environ.get(REDIS_URL_ENV) or None
    p.add_argument(
        "--redis",
        required=env_url is None,
        default=env_url,
        metavar="URL",
        action=_RedisUrlAction,
        help=redis_help,
    )
    p.add_argument(
        "--redis-password-file",
        default=None,
        metavar="FILE",
        action=_RedisUrlAction,
        help=f"file whose first line is the Redis password (default: ${REDIS_PASSWORD_FILE_ENV})",
    )
    p.add_argument("--run", required=run_default is None, default=run_default, metavar="NAME", help=run_help)


class _RedisUrlAction(argparse.Action):
    """``--redis`` and ``--redis-password-file``, in either order: ``namespace.redis`` ends as the URL
    with the file's password folded in (:func:`~aurora_store.coordination.redisconn.resolve_redis_url`)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        setattr(namespace, self.dest, values)
        url = getattr(namespace, "redis", None)
        pfile = getattr(namespace, "redis_password_file", None)
        if not url or not pfile:
            return
        from aurora_store.credentials import resolve_redis_url

        try:
            namespace.redis = resolve_redis_url(url, pfile)
        except ConfigError as e:
            raise argparse.ArgumentError(self, str(e)) from None


def add_common_args(
    p: Options,
    run_default: str | None = None,
    *,
    store_help: str = STORE_HELP,
    run_help: str = RUN_HELP,
) -> None:
    """The block shared by every worker: store, Redis, run name and ``--debug-logger``."""
    add_store_args(p, store_help=store_help)
    add_redis_args(p, run_default, run_help=run_help)
    add_debug_logger_arg(p)


DEBUG_LOGGERS_ENV = "AURORA_DEBUG_LOGGERS"


def debug_logger_names(flags: Sequence[str] | None, environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The vendor loggers to turn to DEBUG: ``--debug-logger`` values and ``AURORA_DEBUG_LOGGERS`` (comma-separated), together."""
    env = os.environ if environ is None else environ
    listed = [*(flags or ()), *env.get(DEBUG_LOGGERS_ENV, "").split(",")]
    return frozenset(n.strip() for n in listed if n.strip())


def add_debug_logger_arg(p: Options) -> None:
    """Repeatable ``--debug-logger NAME``: a vendor logger (``botocore``, ``s3fs``…) to turn to DEBUG.

    ``-v`` turns Aurora's own loggers to DEBUG, never the vendors': botocore's
    debug lines carry request headers, session tokens among them. Asking for
    one by name is a choice made knowingly (its lines are still masked).
    """
    p.add_argument(
        "--debug-logger",
        action="append",
        default=None,
        metavar="NAME",
        help=f"also log this vendor logger at DEBUG, e.g. botocore (repeatable; default: ${DEBUG_LOGGERS_ENV}, comma-separated)",
    )


def add_outage_budget_arg(p: Options, what: str = "Redis or the store") -> None:
    """``--outage-budget-s S``, the same for every worker (:mod:`aurora_store.outage`)."""
    p.add_argument(
        "--outage-budget-s",
        type=float,
        default=None,
        metavar="S",
        help=f"give up (exit 1, one line) once {what} has been unreachable this long "
        f"(default: ${OUTAGE_BUDGET_ENV}, else {DEFAULT_OUTAGE_BUDGET_S:.0f})",
    )


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a TCP port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def add_metrics_args(p: Options) -> None:
    """``--metrics-port N`` and ``--metrics-host HOST``: serve Prometheus metrics (:mod:`aurora_store.metrics`).

    Loopback by default: the endpoint has neither authentication nor TLS and
    tells anyone who reads it the run's Actors, regions, rewards and lag. A
    Prometheus on another host needs ``--metrics-host 0.0.0.0`` (or the
    address it scrapes), behind a firewall or network policy.
    """
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=None,
        metavar="N",
        help='serve Prometheus metrics at http://HOST:N/metrics (default: off; docs/WORKERS.md, "Metrics")',
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        metavar="HOST",
        help="address the metrics endpoint listens on (default 127.0.0.1: it has no authentication; "
        "0.0.0.0 for a Prometheus on another host, behind a firewall)",
    )


def add_sign_key_args(p: Options) -> None:
    """``--sign-key FILE`` and ``--key-id NAME``: sign every manifest written (FORMAT.md §4.1).

    FILE is an Ed25519 private key (``aurora keygen``) or an hmac-sha256
    secret file of at least 32 bytes; ``--key-id`` names an HMAC key.
    """
    p.add_argument(
        "--sign-key",
        default=None,
        metavar="FILE",
        help=f"sign every manifest with this key: Ed25519 private key PEM (aurora keygen) or an "
        f"hmac-sha256 secret file of >= 32 bytes (default: ${SIGN_KEY_ENV}; none: unsigned)",
    )
    p.add_argument(
        "--key-id",
        default=None,
        metavar="NAME",
        help="key id of an hmac-sha256 --sign-key (default: first 16 hex digits of the secret's sha256)",
    )


def add_trust_key_arg(p: Options) -> None:
    """Repeatable ``--trust-key [KEY_ID=]FILE``: accept only versions signed by these keys."""
    p.add_argument(
        "--trust-key",
        action="append",
        default=None,
        metavar="[KEY_ID=]FILE",
        help=f"accept only versions signed by this key (repeatable, for a key rotation): an Ed25519 "
        f"public key PEM, or an hmac-sha256 secret file, named by KEY_ID= "
        f"(default: ${TRUST_KEYS_ENV}, comma-separated; none: signatures are not checked)",
    )


def add_config_arg(p: Options) -> None:
    """``--config FILE.toml``: the worker's options from a TOML file, flags winning over it.

    Declared here so each worker lists it with its own options; the file is read by
    the ``aurora`` entry point (``aurora_tools.cli.config_file``) before the flags.
    """
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="read options from this TOML file: keys are long option names (kl-coef = 0.01); "
        "[trainer], [actor], [relay] and [follow] tables hold one worker's keys; flags override the file, "
        'the file overrides environment variables (docs/WORKERS.md, "Configuration files")',
    )


def sign_key_path(arg: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The ``--sign-key`` value, else ``AURORA_SIGN_KEY``; None: write unsigned."""
    env = os.environ if environ is None else environ
    return arg or env.get(SIGN_KEY_ENV) or None


def trust_key_paths(args: Sequence[str] | None, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The ``--trust-key`` values, else ``AURORA_TRUST_KEYS`` (comma-separated); None: no check."""
    if args:
        return list(args)
    env = os.environ if environ is None else environ
    listed = [s.strip() for s in env.get(TRUST_KEYS_ENV, "").split(",") if s.strip()]
    return listed or None


# -- declared options: flags generated from the config dataclasses --
def _base_type(d: Declared) -> Any:
    """The field's type without ``| None``."""
    args = [a for a in typing.get_args(d.type) if a is not type(None)]
    if typing.get_origin(d.type) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return d.type


def _flag_type(d: Declared) -> Any:
    if d.scale is not None:
        return float  # in larger units: fractions allowed
    tp = _base_type(d)
    return tp if tp in (int, float, str, bool) else str


def add_declared(p: Options, cls: type, prefix: str, *names: str) -> None:
    """Flags for the declared options ``names`` of config dataclass ``cls`` (all, without names).

    Each flag has no default of its own (None: not given), so the variable and
    the config file are not overridden by a flag nobody typed; its help ends
    with the default and the variable.
    """
    by_name = {d.name: d for d in declared(cls, prefix)}
    for name in names or tuple(by_name):
        d = by_name[name]
        if d.flag is None:
            raise ValueError(f"{cls.__name__}.{name} is declared without a flag")
        said = f"default {d.shown_default}" + (f"; ${d.env}" if d.env else "")
        # A help that ends in a parenthesis takes the default inside it: "(one claim; default 8; $…)".
        help = f"{d.help[:-1]}; {said})" if d.help.endswith(")") else f"{d.help} ({said})"
        tp = _flag_type(d)
        if tp is bool:
            p.add_argument(d.flag, dest=name, action="store_true", default=None, help=help)
        else:
            p.add_argument(d.flag, dest=name, type=tp, default=None, choices=d.choices, metavar=d.metavar, help=help)


def given(args: argparse.Namespace, cls: type, prefix: str) -> dict[str, Any]:
    """The declared options of ``cls`` that the flags or the config file gave in ``args`` (field -> value)."""
    out: dict[str, Any] = {}
    for d in declared(cls, prefix):
        value = vars(args).get(d.name) if d.flag is not None else None
        if value is None:
            continue
        if d.scale is not None:
            # A byte count given in MiB: a positive fraction never rounds down to nothing.
            value = (max(1, int(value * d.scale)) if value > 0 else int(value * d.scale)) if _base_type(d) is int else value * d.scale
        out[d.name] = value
    return out


def resolve(cls: type[T], prefix: str, args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None, **fixed: Any) -> T:
    """A worker's config: defaults < environment < config file < flags < ``fixed``.

    The one resolver of the workers' options. ``args``: the parsed command line,
    a ``--config`` file's values included (they are the parser's defaults, so a
    flag beats the file); ``fixed``: values the command computes itself (None:
    not given).
    """
    values = given(args, cls, prefix) if args is not None else {}
    values.update({k: v for k, v in fixed.items() if v is not None})
    return from_env(cls, prefix, environ, **values)


#: The variables every worker's shared options read (flags declared above): variable -> (flag, help).
SHARED: dict[str, tuple[str, str]] = {
    REDIS_URL_ENV: ("--redis", "the run's Redis URL (its password belongs in --redis-password-file)"),
    REDIS_PASSWORD_FILE_ENV: ("--redis-password-file", "file whose first line is the Redis password"),
    DEBUG_LOGGERS_ENV: ("--debug-logger", "vendor loggers (comma-separated) to log at DEBUG"),
    TRUST_KEYS_ENV: ("--trust-key", "key files (comma-separated) whose signatures readers accept"),
}
