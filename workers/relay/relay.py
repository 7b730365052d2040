"""Relay: a region's mirror of a run (docs/WORKERS.md, "Relay loop").

A Relay copies every committed version from the origin store into a store
near its region's Actors, so that one copy of each version crosses into the
region however many Actors read it there. It

1. on start, takes the origin stream's newest id, *then* lists origin and
   copies every committed version the mirror lacks (segments first, manifest
   last, create-only), so nothing announced between the listing and the
   following is missed;
2. follows the origin stream from that id: a ``segment`` event is copied at
   once (cut-through: before its manifest exists) and re-announced on
   ``region:{region}:events``; a ``version`` event copies whatever segment is
   still missing, then the manifest, then re-announces the version; a
   ``commit`` event is re-announced after the versions announced before it;
3. heartbeats ``relay:{region}`` = mirror URL with a TTL once the mirror has
   caught up, and deletes it on a graceful stop (a killed Relay's key expires,
   and the region's Actors fall back to origin).

The parts, one module each: :mod:`~workers.relay.follower` (the stream and
the listings), :mod:`~workers.relay.copier` (verified object copies on a pool
of ``streams``), :mod:`~workers.relay.mirror` (versions complete in the
mirror, manifests last) and :mod:`~workers.relay.heartbeat`. :class:`Relay`
wires them to one store pair, one Redis and one clock.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.coordination.bus import SEGMENT, Bus, Event
from aurora_store.coordination.redisconn import connect
from aurora_store.storage import Store, open_store
from workers.relay.config import RelayConfig, RelayStats, VersionId
from workers.relay.copier import Copier, Traffic
from workers.relay.follower import Follower, ListingSchedule
from workers.relay.heartbeat import Heartbeat, relay_key
from workers.relay.mirror import VersionMirror
from workers.relay.retry import redis_may_fail

__all__ = ["Relay", "run_relay"]

log = logging.getLogger("aurora.relay")


class Relay:
    """One region's Relay. ``run(stop)`` follows origin until ``stop`` is set.

    ``clock`` times every wait of its loops (back-off, heartbeat period,
    listing schedule), so tests can pass a manual one.
    """

    def __init__(
        self,
        config: RelayConfig,
        origin: Store | None = None,
        mirror: Store | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.cfg = config
        self.origin = origin or open_store(config.origin, dict(config.origin_options))
        self.mirror = mirror or open_store(config.mirror, dict(config.mirror_options))
        self.clock = clock
        self.redis = connect(config.redis)
        self._reader = connect(config.redis, block_s=config.block_ms / 1000)
        self.bus = Bus(self.redis, config.run)
        self.heartbeat_key = relay_key(config.run, config.region)
        # One lock over the copier's and the mirror's bookkeeping: stats() is a consistent snapshot.
        self._lock = threading.Lock()
        self._traffic = Traffic()
        self._closed = False
        self.heartbeat = Heartbeat(
            self.redis, self.heartbeat_key, config.mirror, config.heartbeat_s, config.ttl_s, config.region, clock
        )
        self.copier = Copier(
            self.origin, self.mirror, config.streams, config.region, self._lock, self._traffic, clock, self._segment_copied
        )
        self.schedule = ListingSchedule(config.resync_s, config.retry_s, clock)
        self.versions = VersionMirror(
            self.origin, self.mirror, self.copier, config.region, config.retry_s, self._lock, self._traffic, clock,
            self._announce, self.schedule.want_resync,
        )
        self.follower = Follower(
            self.bus, Bus(self._reader, config.run), self.copier, self.versions, self.schedule, config.region,
            config.origin, config.mirror, config.block_ms, config.backoff, clock, self._announce, self._start_heartbeat,
        )

    def __repr__(self) -> str:
        return f"Relay(region={self.cfg.region!r}, origin={self.cfg.origin!r}, mirror={self.cfg.mirror!r})"

    # -- what it did -------------------------------------------------------------
    def stats(self) -> RelayStats:
        t = self._traffic
        with self._lock:
            return RelayStats(
                versions_mirrored=t.versions_mirrored,
                bytes_copied=t.bytes_copied,
                bytes_fetched=t.bytes_fetched,
                segments_copied=t.segments_copied,
                segments_rejected=t.segments_rejected,
                last_event_id=self.follower.last_id,
                mirrored=self.versions.mirrored(),
                bytes_by_version=dict(t.by_version),
            )

    @property
    def caught_up(self) -> threading.Event:
        """Set once a listing of origin has been mirrored completely (heartbeats start then)."""
        return self.follower.synced

    # -- main loop ---------------------------------------------------------------
    def run(self, stop: threading.Event) -> RelayStats:
        """Catch up by listing, then follow the origin stream until ``stop`` is set."""
        self.follower.run(stop)
        return self.stats()

    def sync(self) -> bool:
        """List origin and mirror every committed version the mirror lacks.

        Only objects named by committed manifests are copied: orphans of
        attempts that never committed stay behind. Returns whether every
        version is now in the mirror. :meth:`run` lists by itself; call this
        directly only while no :meth:`run` is in progress.
        """
        return self.versions.sync()

    def close(self, release: bool = True) -> None:
        """Stop heartbeating and copying; ``release`` deletes the heartbeat key (graceful stop)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.follower.shutdown()
        self.copier.shutdown()
        # After every thread that could still start or beat has stopped.
        self.heartbeat.stop()
        if release:
            self.heartbeat.release()
        self.redis.close()
        self._reader.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the region --------------------------------------------------------------
    def _announce(self, type: str, version: int, **fields: Any) -> None:
        def failed(e: BaseException) -> None:
            log.warning("relay %s: could not announce %s %d: %s", self.cfg.region, type, version, e)

        with redis_may_fail(failed):  # announcements are hints; the mirror is what counts
            self.bus.announce(type, version, region=self.cfg.region, **fields)

    def _segment_copied(self, vid: VersionId, ev: Event, key: str, size: int, sha: str) -> None:
        self._announce(SEGMENT, vid[1], index=ev.get("index"), key=key, bytes=size, sha256=sha)

    def _start_heartbeat(self) -> None:
        with self._lock:
            if self._closed:
                return
        self.heartbeat.start()


def run_relay(config: RelayConfig, stop: threading.Event, clock: Clock = SYSTEM_CLOCK) -> RelayStats:
    """Run a Relay until ``stop`` is set; delete its heartbeat key on the way out."""
    relay = Relay(config, clock=clock)
    try:
        return relay.run(stop)
    finally:
        relay.close(release=True)
