"""The Relay's heartbeat: what it holds at origin from its start, and its mirror once that is usable.

Two keys, both with a TTL of ``ttl_s``, refreshed every ``heartbeat_s`` in
one transaction (so they live and die together):

- ``relay-held:{region}`` = ``{"versions": [...]}``, from the Relay's first
  beat: the versions it is mirroring (its mirror's newest and those being
  copied). Origin retention (the Trainer's, ``aurora gc --redis``) keeps
  what they need, so a Relay that is behind still catches up delta by delta
  (:mod:`aurora_store.coordination.retention` reads them);
- ``relay:{region}`` = the mirror's token (:func:`~aurora_store.coordination.keys.mirror_token`,
  a digest: the URL itself, which may carry credentials, is never written), only once the
  mirror has caught up with origin (:meth:`Heartbeat.serve`): Actors read the region's
  mirror only while it exists and names their own ``--mirror``.

Both are deleted on a graceful stop; a killed Relay's keys expire after
``ttl_s``, and the region's Actors fall back to origin. A Redis outage is
ridden out (:class:`~aurora_store.outage.Dependency`, logged once); the
stream reader, which meets the same outage, ends the Relay if it lasts
longer than the budget.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.coordination.keys import RunKeys, mirror_token
from aurora_store.coordination.redisconn import translate_redis_errors
from aurora_store.coordination.retention import relay_held_value
from aurora_store.errors import CoordinationError, OutageTooLong
from aurora_store.outage import Dependency

__all__ = ["Heartbeat", "relay_key"]

log = logging.getLogger("aurora.relay")


def relay_key(run: str, region: str) -> str:
    """``aurora:{run}:relay:{region}``: the region's mirror token while its Relay heartbeats."""
    return RunKeys(run).relay(region)


class Heartbeat:
    """Beats the Relay's keys every ``period_s`` with a TTL of ``ttl_s``, from a thread of its own."""

    # KEYS[1] the mirror key, KEYS[2] the held key; ARGV[1] the mirror token this Relay set.
    # Deletes the held key; deletes the mirror key only if it still holds ARGV[1] (not
    # another Relay's). Returns 1 if the mirror key was ours and is gone, else 0.
    RELEASE = """
    redis.call('DEL', KEYS[2])
    if redis.call('GET', KEYS[1]) == ARGV[1] then
        return redis.call('DEL', KEYS[1])
    end
    return 0
    """

    def __init__(
        self,
        redis: Any,
        run: str,
        region: str,
        mirror_url: str,
        period_s: float,
        ttl_s: float,
        held: Callable[[], Iterable[int]],
        dep: Dependency,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        keys = RunKeys(run)
        self.redis = redis
        self.key = keys.relay(region)
        """The mirror key (``relay:{region}``)."""
        self.held_key = keys.relay_held(region)
        self.value = mirror_token(mirror_url)
        self.period_s = period_s
        self.ttl_s = ttl_s
        self.region = region
        self.held = held
        self.dep = dep
        self.clock = clock
        self._release = redis.register_script(self.RELEASE)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._serving = False
        self._warned: set[str] = set()

    def start(self) -> None:
        """Beat at once (not a period from now), then every period; a second call does nothing."""
        with self._lock:
            if self._thread is not None or self._stopped:
                return
            self._thread = threading.Thread(target=self._loop, name=f"relay-{self.region}-heartbeat", daemon=True)
        self.beat()
        self._thread.start()

    def serve(self) -> None:
        """The mirror has caught up: advertise it from now on (beats at once)."""
        with self._lock:
            if self._serving or self._stopped:
                return
            self._serving = True
        self.start()
        self.beat()

    def beat(self) -> None:
        """One transaction: ``SET held … PX ttl`` (and ``SET mirror … PX ttl`` once serving)."""
        ttl_ms = max(1, int(self.ttl_s * 1000))
        value = relay_held_value(self.held())
        try:
            with self.dep.guard("heartbeat"), translate_redis_errors("Relay.heartbeat"):
                pipe = self.redis.pipeline(transaction=True)
                pipe.set(self.held_key, value, px=ttl_ms)
                if self._serving:
                    pipe.set(self.key, self.value, px=ttl_ms)
                pipe.execute()
        except OutageTooLong:
            pass  # the stream reader meets the same outage and ends the Relay
        except CoordinationError as e:
            # Redis answered with an error (read-only replica, out of memory): a hint lost, logged once per kind.
            kind = type(e.__cause__ or e).__name__
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("relay %s: heartbeat refused: %s", self.region, e)

    def _loop(self) -> None:
        while not self.clock.wait(self._stop, self.period_s):
            self.beat()

    def stop(self) -> None:
        """Stop beating; once this returns no thread of ours can set the keys again."""
        with self._lock:
            self._stopped = True
        self._stop.set()
        t = self._thread
        # A thread that start() has not started yet finds the event set and ends at once.
        if t is not None and t.ident is not None:
            t.join()

    def release(self) -> None:
        """Delete the keys (the mirror key only if it still holds our value): a graceful stop.
        Left alone, they expire by themselves."""
        try:
            with translate_redis_errors("Relay.release"):
                self._release(keys=[self.key, self.held_key], args=[self.value])
        except CoordinationError as e:
            # Said already if Redis is away (the outage's own line): quietly, then.
            log.log(
                logging.DEBUG if self.dep.away else logging.WARNING,
                "relay %s: could not delete %s (it expires in %.0f s): %s",
                self.region,
                self.key,
                self.ttl_s,
                e,
            )
