"""The Relay's heartbeat: ``relay:{region}`` = mirror URL, with a TTL, while the mirror is usable.

Actors read the region's mirror only while this key exists. It is set
first once the mirror has caught up with origin, refreshed every
``heartbeat_s``, and deleted on a graceful stop; a killed Relay's key
expires after ``ttl_s`` and the region's Actors fall back to origin.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.coordination.keys import RunKeys
from workers.relay.retry import redis_may_fail

__all__ = ["Heartbeat", "relay_key"]

log = logging.getLogger("aurora.relay")


def relay_key(run: str, region: str) -> str:
    """``aurora:{run}:relay:{region}``: the region's mirror URL while its Relay heartbeats."""
    return RunKeys(run).relay(region)


class Heartbeat:
    """Beats ``key`` = ``value`` every ``period_s`` with a TTL of ``ttl_s``, from a thread of its own."""

    # KEYS[1] heartbeat key; ARGV[1] the mirror URL this Relay set.
    # Returns 1 if the key was ours and is gone, 0 if another Relay holds it.
    RELEASE = """
    if redis.call('GET', KEYS[1]) == ARGV[1] then
        return redis.call('DEL', KEYS[1])
    end
    return 0
    """

    def __init__(
        self, redis: Any, key: str, value: str, period_s: float, ttl_s: float, region: str, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.redis = redis
        self.key = key
        self.value = value
        self.period_s = period_s
        self.ttl_s = ttl_s
        self.region = region
        self.clock = clock
        self._release = redis.register_script(self.RELEASE)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> None:
        """Beat at once (not a period from now), then every period; a second call does nothing."""
        with self._lock:
            if self._thread is not None or self._stopped:
                return
            self._thread = threading.Thread(target=self._loop, name=f"relay-{self.region}-heartbeat", daemon=True)
        self.beat()
        self._thread.start()

    def beat(self) -> None:
        """One ``SET key value PX ttl``; a Redis outage is logged and ridden out."""

        def failed(e: BaseException) -> None:
            log.warning("relay %s: heartbeat failed: %s", self.region, e)

        with redis_may_fail(failed):  # keep beating through Redis hiccups
            self.redis.set(self.key, self.value, px=max(1, int(self.ttl_s * 1000)))

    def _loop(self) -> None:
        while not self.clock.wait(self._stop, self.period_s):
            self.beat()

    def stop(self) -> None:
        """Stop beating; once this returns no thread of ours can set the key again."""
        with self._lock:
            self._stopped = True
        self._stop.set()
        t = self._thread
        # A thread that start() has not started yet finds the event set and ends at once.
        if t is not None and t.ident is not None:
            t.join()

    def release(self) -> None:
        """Delete the key if it still holds our value (a graceful stop); it expires by itself otherwise."""

        def failed(e: BaseException) -> None:
            log.warning(
                "relay %s: could not delete %s (it expires in %.0f s): %s", self.region, self.key, self.ttl_s, e
            )

        with redis_may_fail(failed):  # the key expires by itself anyway
            self._release(keys=[self.key], args=[self.value])
