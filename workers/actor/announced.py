"""The Actor's side of ``--fetch announced``: a version's reads start from its announcements.

- each ``segment`` announcement starts that segment's download at once
  (:class:`~aurora_store.lineage.prefetch.Prefetcher`: held, bounded, never
  decoded before the manifest lists it with that sha256);
- a ``version`` announcement of the next version starts reading its
  manifest and the Trainer's record of its state (two round trips) beside
  the stager's poll of the run's head, instead of after it;
- for an engine whose workers read the store themselves (vLLM), the held
  segments, once the manifest is read and each passes its size and sha256
  check, are written to a private local folder (:meth:`AnnouncedFetch.spill`)
  that the workers then stage from instead of the store.

Everything read early is read exactly as the stager would read it later
(:func:`~aurora_store.lineage.fetch.read_manifest` with the Actor's trust
keys and commit records; the same Redis hash), so an announcement can only
make the stager look sooner, never make it accept something else: a read
that fails is dropped here and done again the ordinary way, which raises
what it raises. ``--fetch manifest-first`` does none of this.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from aurora_store.coordination.bus import Event
from aurora_store.coordination.records import RunRecords
from aurora_store.format.manifest import Manifest, version_dir
from aurora_store.format.signing import TrustKeys
from aurora_store.lineage.fetch import Held, fetch_objects, read_manifest
from aurora_store.lineage.interfaces import CommitRecords
from aurora_store.lineage.prefetch import Prefetcher
from aurora_store.storage import Store, open_store

__all__ = ["AnnouncedFetch"]

log = logging.getLogger("aurora.actor")


class AnnouncedFetch:
    """Reads started by announcements, for one Actor's stager (one thread announces; fetches take)."""

    def __init__(self, streams: int, max_held_bytes: int, records: RunRecords) -> None:
        self.prefetch = Prefetcher(streams, max_held_bytes)
        self._records = records
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="aurora-announced")
        self._early: tuple[int, Store, Future[Manifest]] | None = None
        # Kept apart from the manifest read: the stager checks the state after the fetch is done
        # (:meth:`done`), so the record read early outlives the version's held segments.
        self._state: tuple[int, Future[str | None]] | None = None
        self._spill_root: Path | None = None

    def segment(self, store: Store, ev: Event, held_version: int) -> None:
        """A ``segment`` announcement: start its download from ``store`` (where the announcement says it is)."""
        self.prefetch.drop_through(held_version)
        self.prefetch.announce(store, ev.version, ev.get("key"), ev.get("bytes"), ev.get("sha256"), held_version)

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
        self._early = (ev.version, store, m)
        self.expect(ev.version)

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

    def expect(self, version: int) -> None:
        """Start reading the Trainer's record of ``version``'s state now, beside the fetch (the stager
        found the version by polling before its announcement arrived); once is enough."""
        e = self._state
        if e is None or e[0] != version:
            self._state = (version, self._pool.submit(self._records.expected_state, version))

    def expected_state(self, version: int) -> tuple[bool, str | None]:
        """``(True, state or None)`` when the Trainer's record of ``version`` was read early; ``(False, None)`` otherwise.

        Once: a later check of ``version`` (the one before activation) reads the record again.
        """
        e = self._state
        if e is None or e[0] != version:
            return False, None
        self._state = None
        try:
            return True, e[1].result()
        except Exception:  # noqa: BLE001 - read again, through the outage handling
            return False, None

    def held(self, version: int) -> Held | None:
        """What a fetch of ``version`` takes held segments with (None: nothing held for it)."""
        return self.prefetch.take if version in self.prefetch.versions() else None

    def done(self, version: int) -> None:
        """``version`` is staged or refused: let go of what is held for it and earlier.

        The Trainer's record of ``version`` read early stays for the state check after the fetch
        (:meth:`expected_state`); older ones go.
        """
        self.prefetch.drop_through(version)
        e = self._early
        if e is not None and e[0] <= version:
            self._early = None
        st = self._state
        if st is not None and st[0] < version:
            self._state = None

    def spill(self, store: Store, m: Manifest, streams: int) -> Store | None:
        """Every segment of ``m`` in a private local folder, as a store; None when nothing is held for its version.

        For an engine whose workers read a store themselves (vLLM): held
        bytes are used where they pass ``m``'s size and sha256 check, the
        rest read from ``store`` and checked the same way
        (:func:`~aurora_store.lineage.fetch.fetch_objects`, which raises what
        a fetch raises). The workers then check every object against ``m``
        again as they read it. :meth:`unspill` removes the folder.
        """
        take = self.held(m.version)
        if take is None:
            return None
        objects: list[tuple[str, bytes]] = fetch_objects(store, m, streams, held=take)
        if self._spill_root is None:
            shm = "/dev/shm"  # memory-backed where there is one: the workers read it back at once
            base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
            self._spill_root = Path(tempfile.mkdtemp(prefix="aurora-spill-", dir=base))  # 0700
        local = open_store(f"file://{self._spill_root / f'v{m.version}'}")
        vdir = version_dir(m.kind, m.version)
        for ref, (_where, data) in zip(m.segments, objects, strict=True):
            local.put(f"{vdir}/{ref.key}", data, mode="overwrite")
        return local

    def unspill(self, version: int) -> None:
        """Remove what :meth:`spill` wrote for ``version`` (the workers have staged it, or refused it)."""
        if self._spill_root is not None:
            shutil.rmtree(self._spill_root / f"v{version}", ignore_errors=True)

    def close(self) -> None:
        self.prefetch.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._spill_root is not None:
            shutil.rmtree(self._spill_root, ignore_errors=True)
            self._spill_root = None
