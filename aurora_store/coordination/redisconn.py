"""Connecting to Redis by URL, with timeouts chosen on purpose; redis-py's errors translated.

redis-py's defaults leave ``socket_timeout`` unset for some paths and set it
for others; a blocking ``XREAD`` longer than the socket timeout then fails
with a timeout that looks like a dead server. Aurora opens two kinds of
client: a *command* client with short timeouts, and a *blocking* client whose
read timeout exceeds the longest block it will ask for.

redis-py's exceptions stop at the coordination layer: the public methods of
the ledger, the bus and the status reader run inside
:class:`translate_redis_errors`, so a caller sees
:class:`~aurora_store.errors.RedisUnavailable` (wait and try again) or
:class:`~aurora_store.errors.CoordinationError` (a bug or bad data), both
also ``ConnectionError``.
"""

from __future__ import annotations

from contextlib import ContextDecorator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import redis
import redis.exceptions as rx

from aurora_store.config import from_env
from aurora_store.coordination.keys import key_prefix, validate_run_name
from aurora_store.credentials import (
    REDIS_PASSWORD_FILE_ENV,
    REDIS_URL_ENV,
    read_password_file,
    redis_child_env,
    resolve_redis_url,
)
from aurora_store.errors import ConfigError, CoordinationError, RedisUnavailable
from aurora_store.redact import redact_url

__all__ = [
    "RedisConfig",
    "REDIS_ENV_PREFIX",
    "REDIS_URL_ENV",
    "REDIS_PASSWORD_FILE_ENV",
    "read_password_file",
    "resolve_redis_url",
    "redis_child_env",
    "connect",
    "key_prefix",
    "validate_run_name",
    "translate_redis_errors",
    "translate_redis_error",
]

REDIS_ENV_PREFIX = "AURORA_REDIS_"
"""Environment variables of :class:`RedisConfig`: ``AURORA_REDIS_<FIELD>``."""


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Timeouts of Redis clients (seconds). Environment: ``AURORA_REDIS_<FIELD>``."""

    connect_timeout_s: float = 5.0
    """TCP/TLS connect timeout."""
    command_timeout_s: float = 10.0
    """Socket read timeout of ordinary commands and scripts."""
    block_margin_s: float = 5.0
    """Extra read timeout above a blocking read's own block time."""
    health_check_interval_s: int = 15
    """Idle connections are PINGed before use after this long."""

    def __post_init__(self) -> None:
        if min(self.connect_timeout_s, self.command_timeout_s, self.block_margin_s) <= 0:
            raise ConfigError(f"RedisConfig: timeouts must be positive ({self})")


def connect(url: str | None = None, config: RedisConfig | None = None, block_s: float | None = None) -> Any:
    """A redis-py client for ``redis://``, ``rediss://`` or ``unix://`` URLs.

    ``url``: None takes ``$AURORA_REDIS_URL``; a URL without a password takes
    the one in ``$AURORA_REDIS_PASSWORD_FILE`` (:func:`resolve_redis_url`).
    ``config``: default :class:`RedisConfig` from the environment.
    ``block_s``: the longest blocking read this client will issue; its read
    timeout is set above it.
    """
    url = resolve_redis_url(url)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"Redis URL must start with redis://, rediss:// or unix://, got {redact_url(url)!r}")
    cfg = config or from_env(RedisConfig, REDIS_ENV_PREFIX)
    timeout = cfg.command_timeout_s if block_s is None else block_s + cfg.block_margin_s
    try:
        return redis.Redis.from_url(
            url,
            socket_connect_timeout=cfg.connect_timeout_s,
            socket_timeout=timeout,
            health_check_interval=cfg.health_check_interval_s,
            decode_responses=False,
        )
    except ValueError as e:  # redis-py's URL parser: its message may quote the URL
        raise ConfigError(f"Redis URL {redact_url(url)!r}: {redact_url(str(e))}") from None


# Errors that mean "the server is away for now": refused, dropped, timed out,
# still loading its data, a failover in progress. redis-py files its
# authentication failures under ConnectionError too; those are configuration.
_AWAY: tuple[type[BaseException], ...] = (
    rx.ConnectionError,
    rx.TimeoutError,
    rx.ClusterDownError,
    rx.TryAgainError,
    rx.ReadOnlyError,
)
_NOT_AWAY: tuple[type[BaseException], ...] = tuple(
    c for c in (getattr(rx, n, None) for n in ("AuthenticationError", "AuthorizationError", "ExternalAuthProviderError")) if isinstance(c, type)
)


def translate_redis_error(op: str, e: BaseException) -> CoordinationError | None:
    """The Aurora error for redis-py error ``e`` raised during ``op``; None if ``e`` is not redis-py's."""
    if not isinstance(e, rx.RedisError):
        return None
    if isinstance(e, _AWAY) and not isinstance(e, _NOT_AWAY):
        return RedisUnavailable(op, str(e) or type(e).__name__)
    return CoordinationError(f"redis error during {op}: {type(e).__name__}: {e}")


class translate_redis_errors(ContextDecorator):  # noqa: N801 - used like a function: with/@translate_redis_errors(op)
    """Context manager and decorator: redis-py errors inside become Aurora's.

    ``with translate_redis_errors("Ledger.claim"): ...`` or
    ``@translate_redis_errors("Bus.read")``. Connection, timeout, loading and
    failover errors become :class:`~aurora_store.errors.RedisUnavailable`;
    any other redis-py error (a script error, a wrong type, a refused
    command) :class:`~aurora_store.errors.CoordinationError`. The original is
    the new error's ``__cause__``; errors that are not redis-py's pass
    through untouched.
    """

    __slots__ = ("op",)

    def __init__(self, op: str) -> None:
        self.op = op

    def __enter__(self) -> translate_redis_errors:
        return self

    def __exit__(self, tp: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> Literal[False]:
        if e is None:
            return False
        translated = translate_redis_error(self.op, e)
        if translated is None:
            return False
        raise translated from e
