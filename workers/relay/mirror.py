"""What is mirrored: a version is complete in the mirror once its manifest is, and that comes last.

Every object of a version is checked against its manifest before the
manifest is written (create-only), so a mirror never holds a manifest whose
objects were not verified against it. A version that cannot be completed is
left without its manifest: listed again later if origin does not have it
yet, quarantined with back-off (:mod:`~workers.relay.quarantine`) if what
origin has fails verification.

The mirror keeps what its region needs (:meth:`VersionMirror.clean`): the
newest ``keep_snapshots`` snapshots and every version after the oldest of
them, plus whatever the region's live Actors hold; a listing copies nothing
older, so retention and catch-up agree.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_all

from aurora_store import metrics
from aurora_store.clock import Clock
from aurora_store.coordination.bus import VERSION, Event
from aurora_store.errors import (
    AuroraError,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    SignatureError,
    VersionNotFound,
)
from aurora_store.format.limits import MAX_MANIFEST_BYTES
from aurora_store.format.manifest import Manifest, manifest_key, parse_version_dir, version_dir
from aurora_store.format.signing import TrustKeys
from aurora_store.lineage.fetch import check_commit_record
from aurora_store.lineage.gc import GcPlan, retain, retained, retention_floor
from aurora_store.lineage.interfaces import CommitRecords
from aurora_store.lineage.plan import VersionIndex, scan_versions
from aurora_store.lineage.trusted import Committed, Fact, committed_versions
from aurora_store.storage import Store
from workers.relay.config import VersionId
from workers.relay.copier import Copier, Traffic
from workers.relay.quarantine import Quarantine

__all__ = ["MODEL_KEYS", "VersionMirror"]

log = logging.getLogger("aurora.relay")

#: The run's model description (docs/WORKERS.md), mirrored along with the versions.
MODEL_KEYS = ("model/config.json", "model/tokenizer.json")

Announce = Callable[..., None]
"""``announce(type, version, **fields)`` on the region's stream."""

WantListing = Callable[..., None]
"""``want_resync(delay_s=None)``: list origin again within ``delay_s`` (default ``retry_s``)."""

_NOT_YET = "not yet"


class VersionMirror:
    """Completes versions in the mirror (objects verified, manifest last) and announces them to the region."""

    def __init__(
        self,
        origin: Store,
        mirror: Store,
        copier: Copier,
        region: str,
        retry_s: float,
        lock: threading.Lock,
        traffic: Traffic,
        clock: Clock,
        announce: Announce,
        want_resync: WantListing,
        quarantine: Quarantine | None = None,
        keep_snapshots: int = 0,
        trust: TrustKeys | None = None,
    ) -> None:
        self.origin = origin
        self.mirror = mirror
        self.copier = copier
        self.region = region
        self.retry_s = retry_s
        self.clock = clock
        self.quarantine = quarantine or Quarantine(retry_s, max(retry_s, 600.0), clock)
        self.keep_snapshots = keep_snapshots
        self.trust = trust
        """Mirror only manifests these keys signed (FORMAT.md §4.1); None: no check."""
        self.resolve_commits: Callable[[], CommitRecords | None] | None = None
        """Asked once, at the first manifest read from origin: the run's Redis commit records
        (FORMAT.md §1, Redis-commit mode), or None when the store commits (:mod:`workers.commits`)."""
        self._commits: CommitRecords | None = None
        self._commits_known = False
        self._unrecorded: set[VersionId] = set()
        self._lock = lock
        self._traffic = traffic
        self._announce = announce
        self._want_resync = want_resync
        self._complete: set[VersionId] = set()
        self._announced: set[VersionId] = set()
        self._inflight: set[int] = set()
        self._waiting = False
        self.removed = 0
        """Objects the mirror's retention deleted."""
        self._origin_counted: Committed | None = None
        """The versions origin counted at the last listing: the mirror keeps and counts only those."""
        self._origin_facts: dict[tuple[str, int], Fact] = {}
        """What each of origin's manifests said (read once: a committed manifest never changes)."""

    def mirrored(self) -> tuple[VersionId, ...]:
        """Versions known to be complete in the mirror, in order; the caller holds the Relay's lock."""
        return tuple(sorted(self._complete, key=lambda k: (k[1], k[0])))

    def held_versions(self) -> frozenset[int]:
        """What this Relay needs origin to keep: its mirror's newest version and those being copied."""
        with self._lock:
            out = set(self._inflight)
            if self._complete:
                out.add(max(v for _, v in self._complete))
        return frozenset(out | self.copier.inflight_versions())

    # -- one version -------------------------------------------------------------
    def mirror_version(self, kind: str, version: int, ev: Event | None = None) -> bool:
        """Make ``kind`` ``version`` complete in the mirror; announce it to the region.

        Runs on the Relay's serial thread. Returns whether the version is in
        the mirror. A quarantined version is not fetched before its time.
        """
        vid: VersionId = (kind, version)
        mk = manifest_key(kind, version)
        with self._lock:
            complete = vid in self._complete
        if complete or self.mirror.exists(mk):
            with self._lock:
                self._complete.add(vid)
                fresh = ev is not None and vid not in self._announced
            if fresh:
                # Mirrored by an earlier run of this Relay; tell the region anyway.
                m = Manifest.from_bytes(self.mirror.get_capped(mk, MAX_MANIFEST_BYTES, "the manifest limit"), self.mirror.where(mk))
                self.announce_version(m)
            return True
        if not self.quarantine.allowed(vid):
            return False
        with self._lock:
            self._inflight.add(version)
        try:
            problem = self._mirror(kind, version, ev)
        finally:
            with self._lock:
                self._inflight.discard(version)
        if problem is None:
            failures = self.quarantine.cleared(vid)
            if failures:
                log.warning("relay %s: %s %d mirrored after %d failed attempt(s); out of quarantine", self.region, kind, version, failures)
            return True
        if problem is _NOT_YET:
            return False
        failures, delay = self.quarantine.failed(vid, problem)
        log.log(
            logging.ERROR if failures == 1 else logging.DEBUG,
            "relay %s: %s %d not mirrored: %s; quarantined: next attempt in %.1f s, then twice as long each time (up to %.0f s)",
            self.region,
            kind,
            version,
            problem,
            delay,
            self.quarantine.max_s,
        )
        self._want_resync(delay)
        return False

    def _mirror(self, kind: str, version: int, ev: Event | None) -> str | None:
        """Mirror one version: None when done, :data:`_NOT_YET`, or why it failed verification."""
        vid: VersionId = (kind, version)
        mk = manifest_key(kind, version)
        with self._lock:
            t0 = self._traffic.started.setdefault(vid, self.clock.monotonic())
        try:
            # Capped one byte past the manifest limit: a planted giant is refused, never read whole.
            data = self.origin.get_capped(mk, MAX_MANIFEST_BYTES, "the manifest limit")
        except ObjectNotFound:
            log.warning("relay %s: %s %d was announced but %s does not exist", self.region, kind, version, self.origin.where(mk))
            self._want_resync()
            return _NOT_YET
        except ObjectTooLarge as e:
            return f"its manifest is not valid: {e}"
        with self._lock:
            self._traffic.fetched(vid, len(data))
        commits = self.commit_records()
        if commits is not None:
            # Before the manifest is parsed or anything copied for it: not committed, nothing to mirror.
            try:
                check_commit_record(commits, kind, version, data, self.origin.where(mk))
            except VersionNotFound as e:
                if vid not in self._unrecorded:
                    self._unrecorded.add(vid)
                    log.warning("relay %s: %s; not mirrored until it is recorded", self.region, e)
                return _NOT_YET
            except ManifestError as e:
                return str(e)
            self._unrecorded.discard(vid)
        try:
            m = Manifest.from_bytes(data, self.origin.where(mk))
        except AuroraError as e:
            return f"its manifest is not valid: {e}"
        if m.kind != kind or m.version != version:
            return f"{self.origin.where(mk)} describes {m.kind} {m.version}"
        if self.trust is not None:
            try:
                # Before any object is copied for it: the manifest names what to copy.
                self.trust.check_json(json.loads(data), self.origin.where(mk), kind, version)
            except SignatureError as e:
                return str(e)
        if ev is not None and ev.get("state") and ev.get("state") != m.state:
            log.warning(
                "relay %s: %s %d announced with state %s…, its manifest says %s…; the store wins",
                self.region,
                kind,
                version,
                ev.get("state")[:19],
                m.state[:19],
            )
        vdir = version_dir(kind, version)
        refs = [(f"{vdir}/{r.key}", r.bytes, r.sha256) for r in m.segments]
        # A copy in flight may be a cut-through one, checked against its announcement
        # rather than the manifest: those (only) get a second round, against the manifest.
        joined = self.copier.inflight_keys()
        missing = refs
        for _ in range(2):
            futures: list[Future[str]] = [self.copier.copy_async(k, b, s) for k, b, s in missing]
            wait_all(futures)
            missing = self.copier.missing(refs)
            if not any(k in joined for k, _, _ in missing):
                break
            joined = set()
        if missing:
            if self.copier.halt.is_set():
                return _NOT_YET  # stopping: a copy was cut short, nothing is known to be wrong
            return f"{len(missing)} of {len(refs)} object(s) missing or failed verification (first: {self.origin.where(missing[0][0])})"
        self.mirror.put(mk, data, mode="create")
        with self._lock:
            self._traffic.bytes_copied += len(data)
            self._traffic.versions_mirrored += 1
            self._complete.add(vid)
            fetched = self._traffic.by_version.get(vid, 0)
        metrics.active().copied(self.region, kind, len(data))
        metrics.active().mirrored(self.region, kind, version, self.clock.monotonic() - t0)
        log.info(
            "relay %s: %s %d mirrored: %d bytes in %.3f s (%d object(s))",
            self.region,
            kind,
            version,
            fetched,
            self.clock.monotonic() - t0,
            len(refs),
        )
        self.announce_version(m)
        return None

    def commit_records(self) -> CommitRecords | None:
        """The run's commit records (Redis-commit mode), or None; resolved once, on first use."""
        if not self._commits_known and self.resolve_commits is not None:
            self._commits = self.resolve_commits()
            self._commits_known = True
        return self._commits

    def announce_version(self, m: Manifest) -> None:
        """Tell the region about a complete version, once."""
        vid: VersionId = (m.kind, m.version)
        with self._lock:
            if vid in self._announced:
                return
            self._announced.add(vid)
        self._announce(
            VERSION,
            m.version,
            kind=m.kind,
            state=m.state,
            base_state=m.base_state or "",
            bytes=m.total_bytes,
            segments=len(m.segments),
        )

    # -- every version -----------------------------------------------------------
    def sync(self) -> bool:
        """List origin and mirror every committed version the mirror lacks (and retention keeps).

        Only objects named by committed manifests are copied: orphans of
        attempts that never committed stay behind. A run that has nothing at
        origin yet (no model description, no version) is waited for, said
        once. Returns whether the mirror now holds every version it should,
        quarantined versions and manifests without a commit record aside (their own attempts are scheduled).
        """
        # model/ (docs/WORKERS.md), so the mirror is a run root an Actor can join from.
        # These objects have no digest to check against; they are created once,
        # before v0, and are copied create-only as they are.
        for key in MODEL_KEYS:
            self.copier.copy_plain(key)
        index = scan_versions(self.origin)
        if index.latest is None and not any(self.copier.has(k) for k in MODEL_KEYS):
            if not self._waiting:
                self._waiting = True
                log.info(
                    "relay %s: nothing at %s yet (no model description, no version): waiting for the run to appear",
                    self.region,
                    self.origin.url,
                )
            return False
        if self._waiting:
            self._waiting = False
            log.info("relay %s: the run appeared at %s", self.region, self.origin.url)
        # What origin counts (issue 24): planted names there neither move the floor nor get mirrored.
        # A manifest refused there (a signature, a commit record) is still tried, and quarantined, as before.
        counted = self._counted_at_origin(index)
        floor = retention_floor(counted.index.snapshots, self.keep_snapshots) if self.keep_snapshots else None
        index = counted.index
        at_origin = [
            (kind, v)
            for v in sorted(index.deltas | index.snapshots)
            for kind, have in (("delta", index.deltas), ("snapshot", index.snapshots))
            if v in have
        ]
        at_origin = sorted({*at_origin, *((k, v) for k, v, _ in counted.refused)}, key=lambda kv: (kv[1], kv[0]))
        self.quarantine.keep_only(at_origin)
        ok = True
        for kind, v in at_origin:
            if not retained(kind, v, floor) or not self.quarantine.allowed((kind, v)):
                continue
            try:
                done = self.mirror_version(kind, v)
            except (AuroraError, OSError) as e:
                if self.copier.halt.is_set():
                    return False
                # One damaged version must not hold back the ones after it.
                log.error("relay %s: %s %d not mirrored: %s", self.region, kind, v, e)
                ok = False
                continue
            # A manifest without a commit record (Redis-commit runs) is no version: it must not keep
            # the mirror from being advertised (its record always lands before a real manifest).
            if not done and (kind, v) not in self.quarantine.failures() and (kind, v) not in self._unrecorded:
                ok = False
        return ok

    def _counted_at_origin(self, listed: VersionIndex) -> Committed:
        """Origin's versions that count (:mod:`aurora_store.lineage.trusted`): trusted, on its chain."""
        self._origin_counted = committed_versions(self.origin, self.trust, self.commit_records(), listed=listed, cache=self._origin_facts)
        return self._origin_counted

    # -- retention ---------------------------------------------------------------
    def clean(self, held: frozenset[int], grace_s: float) -> GcPlan | None:
        """Apply retention to the mirror: ``held`` are the versions the region's live Actors hold.

        Runs on the serial thread (never beside a listing or a version being
        completed); the bookkeeping forgets what went, so it is not taken for
        present. Returns the plan, or None when retention is off.
        """
        if not self.keep_snapshots:
            return None
        with self._lock:
            head = max((v for _, v in self._complete), default=-1)

        def copying(key: str) -> bool:
            # Objects of versions after the mirror's newest may be cut-through copies landing
            # right now (the copier marks them present only after they land): never delete one.
            parts = key.split("/")
            v = parse_version_dir(parts[1]) if len(parts) > 2 else None
            return v is None or v > head

        origin = self._origin_counted or self._counted_at_origin(scan_versions(self.origin))
        plan = retain(self.mirror, self.keep_snapshots, held, grace_s, spare_orphan=copying, committed=origin)
        gone = set(plan.versions)
        with self._lock:
            self._complete -= gone
        # Orphans too: the verified objects of a quarantined version are orphans in the
        # mirror, and a later attempt must copy them again, not trust they are there.
        self.copier.forget(plan.orphans, gone)
        with self._lock:
            self.removed += plan.removed
        if plan.removed:
            log.info("relay %s: mirror retention: %s", self.region, plan.summary())
        return plan
