"""Fetching a version's segments from their announcements, before its manifest is in hand.

The Trainer announces each segment the moment it is durable (``segment``
events on the run's stream: key, bytes, sha256), and writes the version's
manifest only after the last one. A reader that waits for the manifest pays,
per version, the manifest's round trip plus a first-byte round trip per
round of segment requests plus the decode of the segments that arrive last.
A :class:`Prefetcher` starts each announced download at once instead.

Announcements come through Redis, which every worker can write, so they are
never trusted (FORMAT.md §4.1):

- prefetched bytes are only *held*: nothing decodes them, or even parses
  them, until the version's manifest has been read (and, in a signed run,
  has verified); then :func:`~aurora_store.lineage.fetch.fetch_objects`
  takes them through :meth:`Prefetcher.take`, checks their size and
  sha256 against the manifest, and decodes each segment as soon as it
  passes, while the others are still on the wire;
- held bytes whose digest differs from the manifest's are dropped and the
  object is read from the store again; bytes for a key the manifest does not
  list are never taken, and are dropped once the version is staged (or
  when too many versions are held);
- held memory is bounded (``max_held_bytes``): a download is sized by its
  announced length (a ranged read of at most that many bytes plus one, so
  an object bigger than announced cannot fill memory, and cannot match);
  an announcement that does not fit is not prefetched, its segment is
  fetched the ordinary way after the manifest;
- only the next ``versions_ahead`` versions after the one held are
  prefetched, and only keys of the form ``deltas/v{V}/{attempt}/seg-NNNNN.safetensors``
  whose ``V`` is the announced version.

Keys are the store keys the manifest's segments resolve to; bytes are
matched by key and digest, so a copy prefetched from origin serves a fetch
from the region's mirror as well (the manifest's sha256 decides either way).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from aurora_store.config import DEFAULT_STREAMS
from aurora_store.errors import AuroraError
from aurora_store.storage import Store

__all__ = [
    "FETCH_MODES",
    "DEFAULT_MAX_HELD_BYTES",
    "PrefetchStats",
    "Prefetcher",
    "announced_segment",
]

log = logging.getLogger("aurora.lineage")

FETCH_MODES = ("announced", "manifest-first")
"""How a reader fetches a version's segments: ``announced`` (start each one from its
announcement, :class:`Prefetcher`), ``manifest-first`` (read the manifest, then every
segment it lists: the path before prefetching, kept to measure against)."""

#: Held bytes of announced segments, across versions: a few deltas of a large model.
DEFAULT_MAX_HELD_BYTES = 256 << 20

_DELTA_SEGMENT = re.compile(r"^deltas/v([0-9]{10})/[0-9a-f]{16,}/seg-[0-9]{5}\.safetensors$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def announced_segment(version: int, key: str, size: str | int, sha256: str) -> tuple[str, int, str] | None:
    """``(key, bytes, sha256)`` of a well-formed delta segment announcement of ``version``, else None."""
    m = _DELTA_SEGMENT.fullmatch(key)
    if m is None or int(m.group(1)) != version or not _HEX64.fullmatch(sha256):
        return None
    try:
        n = int(size)
    except (TypeError, ValueError):
        return None
    return (key, n, sha256) if n >= 0 else None


@dataclass(slots=True)
class PrefetchStats:
    """What a :class:`Prefetcher` did (its own counters, for logs and tests)."""

    started: int = 0
    """Downloads started from announcements."""
    taken: int = 0
    """Held objects handed to a fetch (then checked against the manifest)."""
    refused: int = 0
    """Announcements not prefetched: malformed, out of the version window, or over the memory bound."""
    dropped: int = 0
    """Held objects let go untaken (a key no manifest listed, a version staged another way, a failed read)."""
    mismatched: int = 0
    """Downloads whose length or sha256 differed from their announcement (dropped at once)."""
    peak_held_bytes: int = 0
    """Most bytes held (or reserved for downloads under way) at once."""
    waited_s: float = 0.0
    """Time fetches spent waiting in :meth:`Prefetcher.take` for downloads still under way (summed over threads)."""


@dataclass(slots=True)
class _Slot:
    version: int
    size: int
    """Announced length: what the slot reserves of the budget."""
    sha256: str
    future: Future[bytes | None]


class Prefetcher:
    """Downloads announced segments on ``streams`` threads and holds them, bounded, until a fetch takes them.

    Thread-safe: announcements usually come from a stager's thread, takes
    from a fetch's pool.
    """

    def __init__(
        self,
        streams: int = DEFAULT_STREAMS,
        max_held_bytes: int = DEFAULT_MAX_HELD_BYTES,
        versions_ahead: int = 2,
    ) -> None:
        if streams < 1 or max_held_bytes < 0 or versions_ahead < 1:
            raise ValueError(f"streams >= 1, max_held_bytes >= 0, versions_ahead >= 1 (got {streams}, {max_held_bytes}, {versions_ahead})")
        self.max_held_bytes = max_held_bytes
        self.versions_ahead = versions_ahead
        self.stats = PrefetchStats()
        self._pool = ThreadPoolExecutor(streams, thread_name_prefix="aurora-prefetch")
        self._lock = threading.Lock()
        self._slots: dict[str, _Slot] = {}
        self._held = 0
        self._closed = False

    @property
    def held_bytes(self) -> int:
        """Bytes held or reserved for downloads under way."""
        with self._lock:
            return self._held

    def versions(self) -> set[int]:
        """Versions with something held or on its way."""
        with self._lock:
            return {s.version for s in self._slots.values()}

    def announce(self, store: Store, version: int, key: str, size: str | int, sha256: str, held_version: int) -> bool:
        """Start downloading one announced segment of ``version`` from ``store``; returns whether it was started.

        ``held_version``: the newest version the caller has staged; only the
        ``versions_ahead`` after it are prefetched.
        """
        ref = announced_segment(version, key, size, sha256)
        with self._lock:
            if self._closed:
                return False
            if ref is None or not held_version < version <= held_version + self.versions_ahead:
                self.stats.refused += 1
                return False
            if key in self._slots:
                return False  # announced twice (a Relay and origin, a retried publish): one download
            n = ref[1]
            if self._held + n > self.max_held_bytes:
                self.stats.refused += 1
                log.debug(
                    "prefetch of %s refused: %d bytes held, %d announced, bound %d",
                    key,
                    self._held,
                    n,
                    self.max_held_bytes,
                )
                return False
            self._held += n
            self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, self._held)
            self.stats.started += 1
            fut: Future[bytes | None] = self._pool.submit(self._download, store, key, n, ref[2])
            self._slots[key] = _Slot(version, n, ref[2], fut)
        return True

    def _download(self, store: Store, key: str, size: int, sha256: str) -> bytes | None:
        try:
            # At most one byte past the announced length: an object bigger than
            # announced cannot fill memory here, and is caught as a mismatch.
            data = store.get_range(key, 0, size + 1)
        except (AuroraError, OSError, ValueError) as e:
            log.debug("prefetch of %s failed: %s", store.where(key), e)
            self._release(key)
            return None
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha256:
            # Wrong announcement, or the object is still being written elsewhere: the
            # manifest's fetch reads it again. Let the memory go now.
            with self._lock:
                self.stats.mismatched += 1
            self._release(key)
            return None
        return data

    def _release(self, key: str) -> None:
        with self._lock:
            slot = self._slots.pop(key, None)
            if slot is not None:
                self._held -= slot.size
                self.stats.dropped += 1

    def take(self, key: str, size: int, sha256: str) -> bytes | None:
        """The held bytes of ``key`` if they are ``size`` bytes with ``sha256`` (the manifest's); else None.

        Waits for a download under way. Whatever it returns, ``key`` is no
        longer held. The caller still checks what it gets (the same check as
        for bytes read from the store); a None means: read the store.
        """
        with self._lock:
            slot = self._slots.get(key)
        if slot is None:
            return None
        if slot.size != size or slot.sha256 != sha256:
            # Announced as something the manifest does not list: never used.
            self._release(key)
            return None
        t0 = time.perf_counter()
        try:
            data = slot.future.result()
        except Exception:  # noqa: BLE001 - a download that broke is one not prefetched
            data = None
        with self._lock:
            self.stats.waited_s += time.perf_counter() - t0
            if self._slots.get(key) is slot:
                del self._slots[key]
                self._held -= slot.size
                if data is not None:
                    self.stats.taken += 1
                else:
                    self.stats.dropped += 1
        return data

    def drop_through(self, version: int) -> int:
        """Let go of everything held for versions up to ``version`` (staged, or given up); returns how many."""
        with self._lock:
            gone = [k for k, s in self._slots.items() if s.version <= version]
        for k in gone:
            with self._lock:
                slot = self._slots.get(k)
            if slot is not None:
                slot.future.cancel()
                self._release(k)
        return len(gone)

    def close(self) -> None:
        """Stop: cancel queued downloads, drop everything held."""
        with self._lock:
            self._closed = True
            slots = list(self._slots.values())
            self._slots.clear()
            self._held = 0
        for s in slots:
            s.future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
