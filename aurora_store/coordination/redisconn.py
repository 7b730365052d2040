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

import logging
import time
from contextlib import ContextDecorator, suppress
from dataclasses import dataclass
from functools import cache
from types import TracebackType
from typing import Any, Literal

import redis
import redis.exceptions as rx

from aurora_store.config import Backoff, from_env
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

log = logging.getLogger("aurora.redis")

__all__ = [
    "RedisConfig",
    "REDIS_ENV_PREFIX",
    "REDIS_URL_ENV",
    "REDIS_PASSWORD_FILE_ENV",
    "read_password_file",
    "resolve_redis_url",
    "redis_child_env",
    "connect",
    "CLUSTER_SCHEMES",
    "is_cluster_url",
    "cluster_seeds",
    "is_cluster_client",
    "server_time_ms",
    "on_master_of",
    "wait_for_replica",
    "REPLICA_WAIT_MS",
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
    cluster_connect_wait_s: float = 120.0
    """How long building a Redis Cluster client waits for a seed to answer (a cluster still
    starting, a network away), retrying with back-off and saying so once in the log. A plain
    Redis client connects on its first command, whose outage the worker rides out."""

    def __post_init__(self) -> None:
        if min(self.connect_timeout_s, self.command_timeout_s, self.block_margin_s) <= 0 or self.cluster_connect_wait_s < 0:
            raise ConfigError(f"RedisConfig: timeouts must be positive ({self})")


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
"""URL schemes of a Redis Cluster: ``redis+cluster://[user[:password]@]host:port[,host:port...][/0]``
(``rediss+cluster://`` for TLS). Every ``host:port`` is a seed node; one that answers is enough."""


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (:data:`CLUSTER_SCHEMES`)."""
    return url.startswith(CLUSTER_SCHEMES)


def connect(url: str | None = None, config: RedisConfig | None = None, block_s: float | None = None) -> Any:
    """A redis-py client for ``redis://``, ``rediss://``, ``unix://`` or (Redis Cluster) ``redis+cluster://`` URLs.

    ``url``: None takes ``$AURORA_REDIS_URL``; a URL without a password takes
    the one in ``$AURORA_REDIS_PASSWORD_FILE`` (:func:`resolve_redis_url`).
    ``config``: default :class:`RedisConfig` from the environment.
    ``block_s``: the longest blocking read this client will issue; its read
    timeout is set above it.

    A cluster URL gives a :class:`redis.cluster.RedisCluster` with the same
    timeouts: it follows ``MOVED`` and a failover itself, and what it cannot
    ride out (no master for the run's slot yet) is
    :class:`~aurora_store.errors.RedisUnavailable` like any outage.
    """
    url = resolve_redis_url(url)
    cfg = config or from_env(RedisConfig, REDIS_ENV_PREFIX)
    timeout = cfg.command_timeout_s if block_s is None else block_s + cfg.block_margin_s
    if is_cluster_url(url):
        return _connect_cluster(url, cfg, timeout)
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(f"Redis URL must start with redis://, rediss://, unix:// or redis+cluster://, got {redact_url(url)!r}")
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


def is_cluster_client(client: Any) -> bool:
    """Whether ``client`` (or the client a riding proxy wraps) is redis-py's cluster client."""
    from redis.cluster import NodesManager

    return isinstance(getattr(client, "nodes_manager", None), NodesManager)


def on_master_of(client: Any, key: str) -> dict[str, Any]:
    """Keyword arguments that send a keyless command (``INFO``, ``CONFIG GET``) to the master
    serving ``key`` on a cluster (redis-py would pick any node); ``{}`` on plain Redis."""
    return {"target_nodes": client.get_node_from_key(key)} if is_cluster_client(client) else {}


def server_time_ms(client: Any, key: str) -> int:
    """The server's ``TIME`` in milliseconds; on a cluster, of the master that serves ``key``.

    The ledger's scripts stamp leases with their own node's clock, and plain
    ``TIME`` on a cluster goes to any node, whose clock may differ.
    """
    s, us = client.time(**on_master_of(client, key))
    return int(s) * 1000 + int(us) // 1000


REPLICA_WAIT_MS = 1000
"""How long :func:`wait_for_replica` waits for a replica to confirm the writes so far."""


def wait_for_replica(client: Any, key: str, timeout_ms: int = REPLICA_WAIT_MS) -> int | None:
    """On a cluster: ``WAIT 1 timeout_ms`` on the master serving ``key``; the replicas that confirmed.

    Replication is asynchronous, so a master killed right after a write may
    take it along: its replica is promoted without it. After a write that
    must survive a failover (a commit record), this waits until one replica
    holds it, or ``timeout_ms`` (0 replicas: the write stands, unconfirmed;
    a master without a live replica must not stop the run). None on plain
    Redis, where there is no failover to survive.
    """
    if not is_cluster_client(client):
        return None
    node = client.get_node_from_key(key)
    return int(client.execute_command("WAIT", 1, int(timeout_ms), target_nodes=node))


def cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``redis+cluster://`` URL -> (a plain ``redis://`` URL of its first seed, every seed's (host, port)).

    The plain URL keeps the user, password and query (TLS options), which
    redis-py applies to every node. A database other than 0 is refused: a
    cluster has only database 0.
    """
    scheme, _, rest = url.partition("://")
    plain = "rediss" if scheme.startswith("rediss") else "redis"
    netloc, slash, tail = rest.partition("/")
    path, q, query = tail.partition("?")
    if not slash and "?" in netloc:
        netloc, q, query = netloc.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    if path not in ("", "0"):
        raise ConfigError(f"Redis Cluster URL {redact_url(url)!r}: a cluster has only database 0, not {path!r}")
    seeds: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, colon, port = item.strip().rpartition(":")
        if not colon:
            host, port = port, "6379"
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"Redis Cluster URL {redact_url(url)!r}: seed {item!r} is not host:port")
        seeds.append((host, int(port)))
    h0, p0 = seeds[0]
    host0 = f"[{h0}]" if ":" in h0 else h0
    return f"{plain}://{userinfo}{at}{host0}:{p0}/0{q}{query}", seeds


_TOPOLOGY_ERRORS: tuple[type[BaseException], ...] = (rx.ConnectionError, rx.TimeoutError, rx.ClusterDownError, rx.TryAgainError)


@cache
def _cluster_class() -> Any:
    from redis.cluster import RedisCluster

    class AuroraCluster(RedisCluster):
        """redis-py's cluster client, whose pipelines re-read the slot map after a failed node.

        redis-py refreshes its map when a single command meets a dead node,
        but a pipeline whose commands all failed on one (Ledger.settle_many)
        can keep the old map and go on dialling the dead master after its
        replica took over. So a pipeline that fails, or answers with such
        an error, makes the client ask the cluster for its map again.
        """

        def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
            pipe = super().pipeline(transaction, shard_hint)
            execute = pipe.execute

            def execute_refreshing(*args: Any, **kwargs: Any) -> Any:
                try:
                    out = execute(*args, **kwargs)
                except _TOPOLOGY_ERRORS:
                    self.refresh_slots()
                    raise
                if any(isinstance(x, _TOPOLOGY_ERRORS) for x in out or ()):
                    self.refresh_slots()
                return out

            pipe.execute = execute_refreshing
            return pipe

        def refresh_slots(self) -> None:
            """Re-read the slot map from any node that answers (nothing if none does now)."""
            with suppress(Exception):  # none answers now: the next call meets the outage and is retried
                self.nodes_manager.initialize()

    return AuroraCluster


def _connect_cluster(url: str, cfg: RedisConfig, timeout: float) -> Any:
    """redis-py's cluster client reads the slot map in its constructor: no seed answering is an
    outage there, waited out for ``cfg.cluster_connect_wait_s``, then :class:`RedisUnavailable`."""
    from redis.cluster import ClusterNode

    plain, seeds = cluster_seeds(url)
    deadline = time.monotonic() + cfg.cluster_connect_wait_s
    pauses = Backoff(initial_s=0.2, max_s=5.0).delays()
    said = False
    while True:
        try:
            return _cluster_class().from_url(
                plain,
                startup_nodes=[ClusterNode(h, p) for h, p in seeds],
                socket_connect_timeout=cfg.connect_timeout_s,
                socket_timeout=timeout,
                health_check_interval=cfg.health_check_interval_s,
                decode_responses=False,
            )
        except ValueError as e:
            raise ConfigError(f"Redis Cluster URL {redact_url(url)!r}: {redact_url(str(e))}") from None
        except (rx.RedisError, rx.RedisClusterException) as e:  # no seed answered, or the cluster is not up
            err = translate_redis_error("connect to the Redis Cluster", e)
            assert err is not None  # both always translate
            left = deadline - time.monotonic()
            if not isinstance(err, RedisUnavailable) or left <= 0:
                raise err from e
            if not said:
                log.warning("Redis Cluster %s: no seed answers yet (%s); retrying for up to %.0fs", redact_url(url), err, left)
                said = True
            time.sleep(min(next(pauses), left))


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
    c
    for c in (getattr(rx, n, None) for n in ("AuthenticationError", "AuthorizationError", "ExternalAuthProviderError"))
    if isinstance(c, type)
)

# redis-py's cluster client raises these outside RedisError: no seed answered,
# or a slot has no master (yet) in its map. A failover in progress.
_CLUSTER_AWAY: tuple[type[BaseException], ...] = (rx.SlotNotCoveredError,)
_CLUSTER_AWAY_SAYS = ("Redis Cluster cannot be connected", "All slots are not covered")


def translate_redis_error(op: str, e: BaseException) -> CoordinationError | None:
    """The Aurora error for redis-py error ``e`` raised during ``op``; None if ``e`` is not redis-py's."""
    if isinstance(e, rx.RedisClusterException):  # redis-py's cluster client; not a RedisError
        if isinstance(e, _CLUSTER_AWAY) or str(e).startswith(_CLUSTER_AWAY_SAYS):
            return RedisUnavailable(op, str(e) or type(e).__name__)
        return CoordinationError(f"redis cluster error during {op}: {type(e).__name__}: {e}")
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
