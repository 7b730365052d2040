"""Connecting to Redis by URL, with timeouts chosen on purpose.

redis-py's defaults leave ``socket_timeout`` unset for some paths and set it
for others; a blocking ``XREAD`` longer than the socket timeout then fails
with a timeout that looks like a dead server. Aurora opens two kinds of
client: a *command* client with short timeouts, and a *blocking* client whose
read timeout exceeds the longest block it will ask for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from aurora_store.errors import ConfigError

__all__ = ["RedisConfig", "connect", "key_prefix", "validate_run_name"]


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

    @classmethod
    def from_env(cls) -> RedisConfig:
        kw: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            raw = os.environ.get(f"AURORA_REDIS_{f.name.upper()}")
            if raw is not None:
                try:
                    kw[f.name] = int(raw) if f.name == "health_check_interval_s" else float(raw)
                except ValueError:
                    raise ConfigError(f"AURORA_REDIS_{f.name.upper()}={raw!r} is not a number") from None
        return cls(**kw)


def connect(url: str, config: RedisConfig | None = None, block_s: float | None = None) -> Any:
    """A redis-py client for ``redis://`` or ``rediss://`` URLs (user and password in the URL).

    ``block_s``: the longest blocking read this client will issue; its read
    timeout is set above it.
    """
    import redis

    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"Redis URL must start with redis://, rediss:// or unix://, got {url.split('@')[-1]!r}")
    cfg = config or RedisConfig.from_env()
    timeout = cfg.command_timeout_s if block_s is None else block_s + cfg.block_margin_s
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=cfg.connect_timeout_s,
        socket_timeout=timeout,
        health_check_interval=cfg.health_check_interval_s,
        decode_responses=False,
    )


_RUN_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def validate_run_name(run: str) -> str:
    if not run or len(run) > 128 or not set(run) <= _RUN_OK:
        raise ConfigError(f"run name {run!r} must be 1-128 characters of letters, digits, '-', '_' or '.'")
    return run


def key_prefix(run: str) -> str:
    """``aurora:{run}:``: every key of a run shares the ``{run}`` hash tag, so
    multi-key scripts also work on Redis Cluster (one slot per run)."""
    return f"aurora:{{{validate_run_name(run)}}}:"
