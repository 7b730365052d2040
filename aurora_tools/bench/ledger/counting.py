"""Counting what a redis-py client sends: round trips (socket writes of requests) and commands.

A pipeline is one round trip carrying many commands. Works for a single
Redis (:func:`counting_client`) and for a Redis Cluster
(:func:`counting_cluster_client`, one pool per node, all counted together).
"""

from __future__ import annotations

import threading
from typing import Any

import redis

from aurora_store.coordination.redisconn import cluster_seeds

__all__ = ["CallCounter", "CountingConnection", "counting_client", "counting_cluster_client"]


class CallCounter:
    """Round trips (socket writes of requests) and commands a client sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.round_trips = 0
        self.commands = 0

    def add(self, round_trips: int, commands: int) -> None:
        with self._lock:
            self.round_trips += round_trips
            self.commands += commands

    def reset(self) -> None:
        with self._lock:
            self.round_trips = 0
            self.commands = 0

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.round_trips, self.commands


class CountingConnection(redis.connection.Connection):
    """A redis-py connection that counts what it sends.

    Every request reaches the socket through ``send_packed_command`` once (a
    pipeline packs all its commands into that one write and then reads all
    replies), so counting those calls counts round trips; commands are
    counted where they are packed.
    """

    def __init__(self, *args: Any, counter: CallCounter, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counter = counter

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        self.counter.add(0, 1)
        super().send_command(*args, **kwargs)

    def pack_commands(self, commands: Any) -> Any:
        commands = list(commands)
        self.counter.add(0, len(commands))
        return super().pack_commands(commands)

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        self.counter.add(1, 0)
        super().send_packed_command(command, check_health)


def counting_client(url: str, counter: CallCounter, max_connections: int | None = None) -> Any:
    """A redis-py client of ``url`` whose traffic ``counter`` counts (no health-check PINGs)."""
    pool = redis.ConnectionPool.from_url(
        url,
        connection_class=CountingConnection,
        counter=counter,
        max_connections=max_connections,
        socket_timeout=30.0,
        socket_connect_timeout=5.0,
        health_check_interval=0,
    )
    return redis.Redis(connection_pool=pool)


def counting_cluster_client(url: str, counter: CallCounter) -> Any:
    """A ``redis.RedisCluster`` of ``url`` whose traffic to every node ``counter`` counts.

    RedisCluster passes only known keyword arguments on to its node pools, so
    the counter rides on a connection class made for it.
    """

    class _Counting(CountingConnection):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("counter", counter)
            super().__init__(*args, **kwargs)

    from redis.cluster import ClusterNode, RedisCluster

    plain, seeds = cluster_seeds(url)
    # from_url: the node pools are then built from these keyword arguments, connection class included.
    return RedisCluster.from_url(
        plain,
        startup_nodes=[ClusterNode(h, p) for h, p in seeds],
        connection_class=_Counting,
        socket_timeout=30.0,
        socket_connect_timeout=5.0,
    )
