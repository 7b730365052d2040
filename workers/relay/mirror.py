"""What is mirrored: a version is complete in the mirror once its manifest is, and that comes last.

Every object of a version is checked against its manifest before the
manifest is written (create-only), so a mirror never holds a manifest whose
objects were not verified against it. A version that cannot be completed
is left without its manifest and listed again later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import wait as wait_all

from aurora_store.clock import Clock
from aurora_store.coordination.bus import VERSION, Event
from aurora_store.errors import AuroraError, ObjectNotFound
from aurora_store.format.manifest import Manifest, manifest_key, version_dir
from aurora_store.lineage.plan import scan_versions
from aurora_store.storage import Store
from workers.relay.config import VersionId
from workers.relay.copier import Copier, Traffic

__all__ = ["MODEL_KEYS", "VersionMirror"]

log = logging.getLogger("aurora.relay")

#: The run's model description (docs/WORKERS.md), mirrored along with the versions.
MODEL_KEYS = ("model/config.json", "model/tokenizer.json")

Announce = Callable[..., None]
"""``announce(type, version, **fields)`` on the region's stream."""


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
        want_resync: Callable[[], None],
    ) -> None:
        self.origin = origin
        self.mirror = mirror
        self.copier = copier
        self.region = region
        self.retry_s = retry_s
        self.clock = clock
        self._lock = lock
        self._traffic = traffic
        self._announce = announce
        self._want_resync = want_resync
        self._complete: set[VersionId] = set()
        self._announced: set[VersionId] = set()

    def mirrored(self) -> tuple[VersionId, ...]:
        """Versions known to be complete in the mirror, in order; the caller holds the Relay's lock."""
        return tuple(sorted(self._complete, key=lambda k: (k[1], k[0])))

    # -- one version -------------------------------------------------------------
    def mirror_version(self, kind: str, version: int, ev: Event | None = None) -> bool:
        """Make ``kind`` ``version`` complete in the mirror; announce it to the region.

        Runs on the Relay's serial thread. Returns whether the version is in the mirror.
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
                m = Manifest.from_bytes(self.mirror.get(mk), self.mirror.where(mk))
                self.announce_version(m)
            return True
        with self._lock:
            t0 = self._traffic.started.setdefault(vid, self.clock.monotonic())
        try:
            data = self.origin.get(mk)
        except ObjectNotFound:
            log.warning("relay %s: %s %d was announced but %s does not exist", self.region, kind, version, self.origin.where(mk))
            self._want_resync()
            return False
        with self._lock:
            self._traffic.fetched(vid, len(data))
        m = Manifest.from_bytes(data, self.origin.where(mk))
        if m.kind != kind or m.version != version:
            log.error("relay %s: %s describes %s %d; not mirrored", self.region, self.origin.where(mk), m.kind, m.version)
            return False
        if ev is not None and ev.get("state") and ev.get("state") != m.state:
            log.warning(
                "relay %s: %s %d announced with state %s…, its manifest says %s…; the store wins",
                self.region, kind, version, ev.get("state")[:19], m.state[:19],
            )
        vdir = version_dir(kind, version)
        refs = [(f"{vdir}/{r.key}", r.bytes, r.sha256) for r in m.segments]
        missing = refs
        # Two rounds: the first may only wait for a cut-through copy that was
        # checked against its announcement; the second checks against the manifest.
        for _ in range(2):
            futures = [self.copier.copy_async(k, b, s) for k, b, s in missing]
            wait_all(futures)
            missing = self.copier.missing(refs)
            if not missing:
                break
        if missing:
            log.error(
                "relay %s: %s %d not mirrored: %d of %d object(s) missing or failed verification (first: %s); listing again in %.0f s",
                self.region, kind, version, len(missing), len(refs), self.origin.where(missing[0][0]), self.retry_s,
            )
            self._want_resync()
            return False
        self.mirror.put(mk, data, mode="create")
        with self._lock:
            self._traffic.bytes_copied += len(data)
            self._traffic.versions_mirrored += 1
            self._complete.add(vid)
            fetched = self._traffic.by_version.get(vid, 0)
        log.info(
            "relay %s: %s %d mirrored: %d bytes in %.3f s (%d object(s))",
            self.region, kind, version, fetched, self.clock.monotonic() - t0, len(refs),
        )
        self.announce_version(m)
        return True

    def announce_version(self, m: Manifest) -> None:
        """Tell the region about a complete version, once."""
        vid: VersionId = (m.kind, m.version)
        with self._lock:
            if vid in self._announced:
                return
            self._announced.add(vid)
        self._announce(
            VERSION, m.version, kind=m.kind, state=m.state, base_state=m.base_state or "",
            bytes=m.total_bytes, segments=len(m.segments),
        )

    # -- every version -----------------------------------------------------------
    def sync(self) -> bool:
        """List origin and mirror every committed version the mirror lacks.

        Only objects named by committed manifests are copied: orphans of
        attempts that never committed stay behind. Returns whether every
        version is now in the mirror.
        """
        # model/ (docs/WORKERS.md), so the mirror is a run root an Actor can join from.
        # These objects have no digest to check against; they are created once,
        # before v0, and are copied create-only as they are.
        for key in MODEL_KEYS:
            self.copier.copy_plain(key)
        index = scan_versions(self.origin)
        ok = True
        for v in sorted(index.deltas | index.snapshots):
            for kind, have in (("delta", index.deltas), ("snapshot", index.snapshots)):
                if v not in have:
                    continue
                try:
                    ok = self.mirror_version(kind, v) and ok
                except (AuroraError, OSError) as e:
                    # One damaged version must not hold back the ones after it.
                    log.error("relay %s: %s %d not mirrored: %s", self.region, kind, v, e)
                    ok = False
        return ok
