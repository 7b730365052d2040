"""Riding out a Redis outage: which errors mean "Redis is away", and retrying until it is back.

A Relay's job is the mirror; Redis only carries hints (announcements, the
heartbeat). So Redis going away (refused, timed out, restarting) must never
stop a Relay: stream reads are retried with back-off, announcements and
heartbeats that fail are logged and dropped. Every other error is a bug or a
store failure and propagates.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import redis

from aurora_store.clock import Clock
from aurora_store.config import Backoff
from aurora_store.errors import CoordinationError

__all__ = ["is_redis_error", "redis_may_fail", "retry_while_redis_away"]

T = TypeVar("T")


def is_redis_error(e: BaseException) -> bool:
    """Whether ``e`` means Redis is away: the coordination layer's error, or redis-py's own
    (from calls made on a client directly), or the socket errors beneath them."""
    return isinstance(e, (CoordinationError, redis.exceptions.RedisError, ConnectionError, TimeoutError))


@contextlib.contextmanager
def redis_may_fail(on_error: Callable[[BaseException], None]) -> Iterator[None]:
    """Run the body; an error meaning Redis is away goes to ``on_error`` (to be logged) instead of up."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - sorted by is_redis_error; the rest propagates
        if not is_redis_error(e):
            raise
        on_error(e)


def retry_while_redis_away(
    fn: Callable[[], T],
    stop: threading.Event,
    clock: Clock,
    backoff: Backoff,
    on_error: Callable[[BaseException], None],
) -> T | None:
    """``fn()``, attempted until it returns or ``stop`` is set (then ``None``).

    An attempt that fails because Redis is away is reported to ``on_error``
    and followed by the next delay of ``backoff`` (waited on ``clock``, so a
    stop cuts it short); any other error propagates at once.
    """
    delays = backoff.delays()
    while not stop.is_set():
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - sorted by is_redis_error; the rest propagates
            if not is_redis_error(e):
                raise
            on_error(e)
            clock.wait(stop, next(delays))
    return None
