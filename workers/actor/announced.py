"""The Actor's side of ``--fetch announced``: a version's reads start from its announcements.

- each ``segment`` announcement starts that segment's download at once
  (:class:`~aurora_store.lineage.prefetch.Prefetcher`: held, bounded, never
  decoded before the manifest lists it with that sha256);
- a ``version`` announcement of the next version starts reading its
  manifest and the Trainer's record of its state (two round trips) beside
  the stager's poll of the run's head, instead of after it.

Everything read early is read exactly as the stager would read it later
(:func:`~aurora_store.lineage.fetch.read_manifest` with the Actor's trust
keys and commit records; the same Redis hash), so an announcement can only
make the stager look sooner, never make it accept something else: a read
that fails is dropped here and done again the ordinary way, which raises
what it raises. ``--fetch manifest-first`` does none of this.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from aurora_store.coordination.bus import Event
from aurora_store.format.manifest import Manifest
from aurora_store.format.signing import TrustKeys
from aurora_store.lineage.fetch import Held, read_manifest
from aurora_store.lineage.interfaces import CommitRecords
from aurora_store.lineage.prefetch import Prefetcher
from aurora_store.storage import Store
from workers.common import RunKeys, read_expected_state

__all__ = ["AnnouncedFetch"]

log = logging.getLogger("aurora.actor")


class AnnouncedFetch:
    """Reads started by announcements, for one Actor's stager (one thread announces; fetches take)."""

    def __init__(self, streams: int, max_held_bytes: int, redis: Any, keys: RunKeys) -> None:
        self.prefetch = Prefetcher(streams, max_held_bytes)
        self._redis = redis
        self._keys = keys
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="aurora-announced")
        self._early: tuple[int, Store, Future[Manifest], Future[str | None]] | None = None

    def segment(self, store: Store, ev: Event, held_version: int) -> None:
        """A ``segment`` announcement: start its download from ``store`` (where the announcement says it is)."""
        self.prefetch.drop_through(held_version)
        self.prefetch.announce(
            store, ev.version, ev.get("key"), ev.get("bytes"), ev.get("sha256"), held_version
        )

    def version(
        self,
        store: Store,
        ev: Event,
        held_version: int,
        trust: TrustKeys | None,
        commits: CommitRecords | None,
    ) -> None:
        """A ``version`` announcement of the next delta: read its manifest and expected state now."""
        if ev.version != held_version + 1 or ev.get("kind", "delta") != "delta":
            return
        if self._early is not None and self._early[0] == ev.version and self._early[1] is store:
            return
        m = self._pool.submit(read_manifest, store, "delta", ev.version, trust, commits)
        want = self._pool.submit(read_expected_state, self._redis, self._keys, ev.version)
        self._early = (ev.version, store, m, want)

    def manifest(self, store: Store, version: int) -> Manifest | None:
        """The manifest read early for ``version`` from ``store``, if that read succeeded (waits for it)."""
        e = self._early
        if e is None or e[0] != version or e[1] is not store:
            return None
        try:
            return e[2].result()
        except Exception as err:  # noqa: BLE001 - read again the ordinary way, which raises what it raises
            log.debug("early manifest read of delta %d failed: %s", version, err)
            return None

    def expected_state(self, version: int) -> tuple[bool, str | None]:
        """``(True, state or None)`` when the Trainer's record of ``version`` was read early; ``(False, None)`` otherwise."""
        e = self._early
        if e is None or e[0] != version:
            return False, None
        try:
            return True, e[3].result()
        except Exception:  # noqa: BLE001 - read again, through the outage handling
            return False, None

    def held(self, version: int) -> Held | None:
        """What a fetch of ``version`` takes held segments with (None: nothing held for it)."""
        return self.prefetch.take if version in self.prefetch.versions() else None

    def done(self, version: int) -> None:
        """``version`` is staged or refused: let go of what is held for it and earlier."""
        self.prefetch.drop_through(version)
        if self._early is not None and self._early[0] <= version:
            self._early = None

    def close(self) -> None:
        self.prefetch.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
