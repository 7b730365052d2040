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
3. heartbeats ``relay-held:{region}`` (what it is mirroring, so origin
   retention keeps it) from its start, and ``relay:{region}`` = mirror URL
   with a TTL once the mirror has caught up; deletes both on a graceful stop
   (a killed Relay's keys expire, and the region's Actors fall back to origin);
4. cleans its mirror every ``gc_every_s``: the newest ``keep_snapshots``
   snapshots and every version after the oldest of them, plus whatever the
   region's live Actors hold (:func:`aurora_store.lineage.gc.retain`).

It rides out Redis, origin and mirror being away for up to
``outage_budget_s`` (:mod:`aurora_store.outage`), waits for a run that has not
appeared at origin yet, and quarantines a version that fails verification
(:mod:`~workers.relay.quarantine`) instead of fetching it every ``retry_s``.

The parts, one module each: :mod:`~workers.relay.follower` (the stream and
the listings), :mod:`~workers.relay.copier` (verified object copies on a pool
of ``streams``), :mod:`~workers.relay.mirror` (versions complete in the
mirror, manifests last; its retention), :mod:`~workers.relay.quarantine`,
:mod:`~workers.relay.halt` and :mod:`~workers.relay.heartbeat`.
:class:`Relay` wires them to one store pair, one Redis and one clock.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.coordination.bus import SEGMENT, Bus, Event
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.redisconn import connect
from aurora_store.coordination.retention import LedgerHeldVersions
from aurora_store.errors import CoordinationError, OutageTooLong
from aurora_store.lineage.gc import GcPlan
from aurora_store.lineage.interfaces import CommitRecords
from aurora_store.outage import Dependency, riding
from aurora_store.redact import redact_url
from aurora_store.storage import Store, open_store
from workers.commits import RidingRecords, resolve_commit_records
from workers.relay.config import RelayConfig, RelayStats, VersionId
from workers.relay.copier import Copier, Traffic
from workers.relay.follower import Follower, ListingSchedule
from workers.relay.halt import Halt
from workers.relay.heartbeat import Heartbeat, relay_key
from workers.relay.mirror import VersionMirror
from workers.relay.quarantine import Quarantine

__all__ = ["Relay", "run_relay"]

log = logging.getLogger("aurora.relay")


class Relay:
    """One region's Relay. ``run(stop)`` follows origin until ``stop`` is set.

    ``clock`` times every wait of its loops (back-off, heartbeat period,
    listing schedule, quarantine), so tests can pass a manual one.
    ``origin`` and ``mirror`` are the stores as the Relay uses them (every
    call rides out an outage: ``origin_dep``, ``mirror_dep``);
    ``origin_store`` and ``mirror_store`` are the stores themselves.
    """

    def __init__(
        self,
        config: RelayConfig,
        origin: Store | None = None,
        mirror: Store | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.cfg = config
        self.clock = clock
        self.halt = Halt()
        back = config.backoff
        initial, longest = max(0.01, back.initial_s), max(0.01, back.initial_s, back.max_s)

        def dependency(name: str) -> Dependency:
            return Dependency(name, log, config.outage_budget_s, clock, initial, longest)

        self.redis_dep = dependency("Redis")
        self.origin_dep = dependency(f"the origin store ({config.region} Relay)")
        self.mirror_dep = dependency(f"the mirror store ({config.region} Relay)")
        # Every store call waits out an outage (each is safe to repeat: reads, create-only writes,
        # deletes); one past the budget raises OutageTooLong, which ends the Relay.
        self.origin_store = origin or open_store(config.origin, dict(config.origin_options))
        self.mirror_store = mirror or open_store(config.mirror, dict(config.mirror_options))
        self.origin = riding(self.origin_store, self.origin_dep, self.halt.event)
        self.mirror = riding(self.mirror_store, self.mirror_dep, self.halt.event)
        self.redis = connect(config.redis)
        self._reader = connect(config.redis, block_s=config.block_ms / 1000)
        self.bus = Bus(self.redis, config.run)
        self.ledger = Ledger(self.redis, config.run)
        self.heartbeat_key = relay_key(config.run, config.region)
        # One lock over the copier's and the mirror's bookkeeping: stats() is a consistent snapshot.
        self._lock = threading.Lock()
        self._traffic = Traffic()
        self._closed = False
        self.copier = Copier(
            self.origin,
            self.mirror,
            config.streams,
            config.region,
            self._lock,
            self._traffic,
            clock,
            self._segment_copied,
            self.halt,
        )
        self.schedule = ListingSchedule(config.resync_s, config.retry_s, clock)
        self.quarantine = Quarantine(config.retry_s, config.quarantine_max_s, clock)
        self.versions = VersionMirror(
            self.origin,
            self.mirror,
            self.copier,
            config.region,
            config.retry_s,
            self._lock,
            self._traffic,
            clock,
            self._announce,
            self.schedule.want_resync,
            self.quarantine,
            config.keep_snapshots,
            trust=config.trust.for_run(config.run) if config.trust is not None else None,
        )
        self.versions.resolve_commits = self._commit_records
        self.heartbeat = Heartbeat(
            self.redis,
            config.run,
            config.region,
            config.mirror,
            config.heartbeat_s,
            config.ttl_s,
            self.versions.held_versions,
            self.redis_dep,
            clock,
        )
        self.region_held = LedgerHeldVersions(self.ledger, int(config.actor_timeout_s * 1000), region=config.region)
        self.follower = Follower(
            self.bus,
            Bus(self._reader, config.run),
            self.copier,
            self.versions,
            self.schedule,
            config.region,
            config.origin,
            config.mirror,
            config.block_ms,
            self.redis_dep,
            self.halt,
            clock,
            self._announce,
            self._serve,
            self.clean_mirror if config.keep_snapshots else None,
            config.gc_every_s,
            cut_through=config.fetch == "announced",
        )

    def _commit_records(self) -> CommitRecords | None:
        """The run's Redis commit records when it commits through Redis (:mod:`workers.commits`)."""
        found = resolve_commit_records(
            self.redis,
            self.cfg.run,
            self.origin_store,
            lambda fn, what: self.redis_dep.call(fn, what, self.halt.event),
            lambda fn, what: self.origin_dep.call(fn, what, self.halt.event),
            log,
            f"relay {self.cfg.region}",
        )
        return None if found is None else RidingRecords(found, self.redis_dep, self.halt.event)

    def __repr__(self) -> str:
        return f"Relay(region={self.cfg.region!r}, origin={redact_url(self.cfg.origin)!r}, mirror={redact_url(self.cfg.mirror)!r})"

    # -- what it did -------------------------------------------------------------
    def stats(self) -> RelayStats:
        t = self._traffic
        quarantined = self.quarantine.failures()
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
                quarantined=quarantined,
                listings=self.follower.listings,
                removed=self.versions.removed,
            )

    def held_versions(self) -> frozenset[int]:
        """What this Relay needs origin to keep (advertised with its heartbeat): ``HeldVersions``."""
        return self.versions.held_versions()

    @property
    def caught_up(self) -> threading.Event:
        """Set once a listing of origin has been mirrored completely (the mirror is advertised then)."""
        return self.follower.synced

    # -- main loop ---------------------------------------------------------------
    def run(self, stop: threading.Event) -> RelayStats:
        """Catch up by listing, then follow the origin stream until ``stop`` is set.

        Raises :class:`~aurora_store.errors.OutageTooLong` when Redis or a
        store stays away longer than ``outage_budget_s``, and the error of a
        first listing that origin refuses (credentials, a bad URL). ``stop``
        is set when this returns or raises.
        """

        # The Relay's own threads wait on its halt event; a stop from outside is one more reason to set it.
        def relay_stop() -> None:
            stop.wait()
            self.halt.stop()

        threading.Thread(target=relay_stop, name=f"relay-{self.cfg.region}-stop", daemon=True).start()
        try:
            self.heartbeat.start()
            self.follower.run(self.halt.event)
        finally:
            self.halt.stop()
            stop.set()  # ends the thread above
        return self.stats()

    def sync(self) -> bool:
        """List origin and mirror every committed version the mirror lacks.

        Only objects named by committed manifests are copied: orphans of
        attempts that never committed stay behind. Returns whether every
        version is now in the mirror. :meth:`run` lists by itself; call this
        directly only while no :meth:`run` is in progress.
        """
        return self.versions.sync()

    def clean_mirror(self) -> GcPlan | None:
        """Apply retention to the mirror once (``run`` does it every ``gc_every_s``).

        Skipped (None) while Redis cannot say what the region's live Actors
        hold: retention never deletes blind. Call it directly only while no
        :meth:`run` is in progress.
        """
        held: frozenset[int] | None = None
        with self.redis_dep.guard("reading the region's Actors for mirror retention"):
            held = self.region_held.held_versions()
        if held is None:
            return None
        return self.versions.clean(held, self.cfg.grace_s)

    def close(self, release: bool = True) -> None:
        """Stop heartbeating and copying; ``release`` deletes the heartbeat keys (graceful stop)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.halt.stop()
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
        """Announcements are hints (the mirror is what counts): one that fails is dropped."""
        try:
            with self.redis_dep.guard("announcing to the region"):
                self.bus.announce(type, version, region=self.cfg.region, **fields)
        except OutageTooLong:
            pass  # the stream reader meets the same outage and ends the Relay
        except CoordinationError as e:
            log.warning("relay %s: could not announce %s %d: %s", self.cfg.region, type, version, e)

    def _segment_copied(self, vid: VersionId, ev: Event, key: str, size: int, sha: str) -> None:
        self._announce(SEGMENT, vid[1], index=ev.get("index"), key=key, bytes=size, sha256=sha)

    def _serve(self) -> None:
        with self._lock:
            if self._closed:
                return
        self.heartbeat.serve()


def run_relay(config: RelayConfig, stop: threading.Event, clock: Clock = SYSTEM_CLOCK) -> RelayStats:
    """Run a Relay until ``stop`` is set; delete its heartbeat keys on the way out."""
    relay = Relay(config, clock=clock)
    try:
        return relay.run(stop)
    finally:
        relay.close(release=True)
