"""Copying objects origin -> mirror: verified, create-only, each object across once.

Every byte from origin is untrusted: an object is written to the mirror only
if its size and sha256 match what it was announced (or listed in its
manifest) with. One that fails is not written and an error names it (once
per object); the version it belongs to is retried from its manifest, then
quarantined (:mod:`~workers.relay.quarantine`) if it still fails.

Each copy ends in an *outcome* (:data:`COPIED`, :data:`REJECTED`,
:data:`MISSING`, :data:`FAILED`), so the version mirror can tell damage at
origin (quarantine it) from a store error. Outages are not outcomes: the
stores the Relay hands in ride them out (:func:`aurora_store.outage.riding`),
and one longer than the budget ends the Relay (:class:`~workers.relay.halt.Halt`).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from aurora_store import metrics
from aurora_store.clock import Clock
from aurora_store.coordination.bus import Event
from aurora_store.errors import AuroraError, ObjectNotFound, ObjectTooLarge, OutageTooLong
from aurora_store.storage import Store
from workers.common import MAX_MODEL_FILE_BYTES
from workers.relay.config import VersionId
from workers.relay.halt import Halt

__all__ = ["COPIED", "FAILED", "MISSING", "REJECTED", "Copier", "Traffic", "object_version"]

COPIED = "copied"
"""The object is in the mirror, verified (copied now, or found there)."""
REJECTED = "rejected"
"""Its bytes at origin do not match (size or sha256): damage, or a forged announcement."""
MISSING = "missing"
"""Origin does not have it."""
FAILED = "failed"
"""A store error that is not an outage (or the Relay is stopping)."""

log = logging.getLogger("aurora.relay")

_OBJECT_KEY = re.compile(r"^(delta|snapshot)s/v([0-9]{10})/[0-9a-f]{16,}/(?:seg|shard)-[0-9]{5}\.safetensors$")

OnCopied = Callable[[VersionId, Event, str, int, str], None]
"""``(version id, announcement, key, bytes, sha256)``: an announced object first landed in the mirror."""


def object_version(key: str) -> VersionId | None:
    """The version a segment or shard key belongs to, or None for any other key."""
    m = _OBJECT_KEY.fullmatch(key)
    return None if m is None else (m.group(1), int(m.group(2)))


@dataclass(slots=True)
class Traffic:
    """What crossed into the region. Guarded by the Relay's lock, like the rest of its bookkeeping."""

    bytes_fetched: int = 0
    """Bytes read from origin."""
    bytes_copied: int = 0
    """Bytes written to the mirror."""
    segments_copied: int = 0
    """Objects written to the mirror."""
    segments_rejected: int = 0
    """Objects whose size or sha256 did not match; never written."""
    versions_mirrored: int = 0
    """Manifests written to the mirror."""
    by_version: dict[VersionId, int] = field(default_factory=dict)
    """Bytes fetched from origin per version."""
    started: dict[VersionId, float] = field(default_factory=dict)
    """When the first object of each version was fetched (``clock.monotonic()``)."""

    def fetched(self, vid: VersionId, nbytes: int) -> None:
        self.bytes_fetched += nbytes
        self.by_version[vid] = self.by_version.get(vid, 0) + nbytes


class Copier:
    """Copies objects on a pool of ``streams`` threads; an object in the mirror or on its way is not copied again."""

    def __init__(
        self,
        origin: Store,
        mirror: Store,
        streams: int,
        region: str,
        lock: threading.Lock,
        traffic: Traffic,
        clock: Clock,
        on_copied: OnCopied,
        halt: Halt | None = None,
    ) -> None:
        self.origin = origin
        self.mirror = mirror
        self.region = region
        self.clock = clock
        self.halt = halt or Halt()
        self._lock = lock
        self._traffic = traffic
        self._on_copied = on_copied
        self._pool = ThreadPoolExecutor(streams, thread_name_prefix=f"relay-{region}-copy")
        self._have: dict[str, str] = {}  # mirror key -> sha256 verified in it
        self._inflight: dict[str, Future[str]] = {}
        self._announced: set[str] = set()
        self._logged: set[str] = set()  # keys whose rejection was logged at ERROR already

    # -- what the mirror holds ---------------------------------------------------
    def missing(self, refs: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
        """The ``(key, bytes, sha256)`` of ``refs`` not verified in the mirror."""
        with self._lock:
            return [(k, b, s) for k, b, s in refs if self._have.get(k) != s]

    def has(self, key: str) -> bool:
        """Whether ``key`` is known to be in the mirror."""
        with self._lock:
            return key in self._have

    def forget(self, keys: Iterable[str] = (), versions: Iterable[VersionId] = ()) -> None:
        """``keys``, and every object of ``versions``, were deleted from the mirror (its retention):
        they are no longer taken for present, and are copied again if asked."""
        gone = set(versions)
        with self._lock:
            for k in keys:
                self._have.pop(k, None)
            for k in [k for k in self._have if object_version(k) in gone]:
                del self._have[k]

    def inflight_keys(self) -> set[str]:
        """Keys being copied right now."""
        with self._lock:
            return set(self._inflight)

    def inflight_versions(self) -> set[int]:
        """Versions with an object being copied right now (cut-through copies included)."""
        with self._lock:
            keys = list(self._inflight)
        return {vid[1] for vid in map(object_version, keys) if vid is not None}

    def copy_plain(self, key: str) -> None:
        """Copy ``key`` as it is if origin has it and the mirror does not (no digest to check it against)."""
        with self._lock:
            if key in self._have:
                return
        if not self.mirror.exists(key):
            try:
                # No size to check it against (a model description file): capped at the readers' limit.
                data = self.origin.get_capped(key, MAX_MODEL_FILE_BYTES, "the limit on a model file")
            except ObjectNotFound:
                return  # not written yet (or a run without one)
            except ObjectTooLarge as e:
                # Not a model file any reader would take: not mirrored (and the Relay goes on).
                self._rejected(key, "relay %s: %s; not mirrored", self.region, e, fetched=False)
                return
            self.mirror.put(key, data, mode="create")
            with self._lock:
                self._traffic.bytes_fetched += len(data)
                self._traffic.bytes_copied += len(data)
            metrics.active().copied(self.region, "model", len(data))
        with self._lock:
            self._have[key] = ""

    # -- copies ------------------------------------------------------------------
    def copy_async(self, key: str, size: int, sha: str, announce: Event | None = None) -> Future[str]:
        """Copy one object unless it is in the mirror or on its way (each object crosses once).

        The future's result is the outcome. With ``announce`` (the segment
        event it came from), ``on_copied`` is called the first time the object lands.
        """
        with self._lock:
            if self._have.get(key) == sha:
                done: Future[str] = Future()
                done.set_result(COPIED)
                return done
            f = self._inflight.get(key)
            if f is None:
                # _copy drops this entry under the same lock, so it can only run after it is set.
                f = self._pool.submit(self._copy, key, size, sha, announce)
                self._inflight[key] = f
            return f

    def _copy(self, key: str, size: int, sha: str, announce: Event | None) -> str:
        vid = object_version(key)
        assert vid is not None
        outcome = FAILED
        try:
            outcome = self._copy_impl(key, size, sha, vid)
        except OutageTooLong as e:
            self.halt.fail(e)
        except (AuroraError, OSError) as e:
            if not self.halt.is_set():  # else: a stop cut an outage wait short
                log.error("relay %s: copying %s failed: %s", self.region, self.origin.where(key), e)
        finally:
            ok = outcome == COPIED
            with self._lock:
                self._inflight.pop(key, None)
                if ok:
                    self._have[key] = sha
                first = ok and announce is not None and key not in self._announced
                if first:
                    self._announced.add(key)
        if first and announce is not None:
            self._on_copied(vid, announce, key, size, sha)
        return outcome

    def _rejected(self, key: str, msg: str, *args: object, fetched: bool = True) -> str:
        """Log a rejection: at ERROR the first time for ``key``, then quietly (the version's quarantine speaks).

        ``fetched``: the bytes came from origin (counted in ``segments_rejected``)."""
        with self._lock:
            first = key not in self._logged
            self._logged.add(key)
            self._traffic.segments_rejected += int(fetched)
        log.log(logging.ERROR if first else logging.DEBUG, msg, *args)
        return REJECTED

    def _copy_impl(self, key: str, size: int, sha: str, vid: VersionId) -> str:
        if self.mirror.exists(key):
            # Written by an earlier run of this Relay: check it here, in the region,
            # rather than bring it across again.
            try:
                have = self.mirror.get_capped(key, size, "the size it was announced or listed with")
                found = f"{len(have)} bytes with another sha256"
            except ObjectTooLarge:
                have, found = b"", "larger"  # not the object, and never read whole
            if len(have) == size and hashlib.sha256(have).hexdigest() == sha:
                return COPIED
            # Never replaced: a mirror manifest may already name it, and a forged
            # announcement must not be able to make us delete a good object.
            return self._rejected(
                key,
                "relay %s: mirror object %s is %s than expected (%d bytes); not replacing it",
                self.region,
                self.mirror.where(key),
                found,
                size,
                fetched=False,
            )
        with self._lock:
            self._traffic.started.setdefault(vid, self.clock.monotonic())
        try:
            # At most one byte past the expected size: an object of any size at origin costs
            # no more than that to refuse.
            data = self.origin.get_capped(key, size, "the size it was announced or listed with")
        except ObjectTooLarge as e:
            with self._lock:
                self._traffic.fetched(vid, size + 1)
            return self._rejected(key, "relay %s: %s %d: %s; not mirrored", self.region, vid[0], vid[1], e)
        except ObjectNotFound:
            with self._lock:
                first = key not in self._logged
                self._logged.add(key)
            log.log(
                logging.ERROR if first else logging.DEBUG,
                "relay %s: %s was announced but is not in the origin store",
                self.region,
                self.origin.where(key),
            )
            return MISSING
        with self._lock:
            self._traffic.fetched(vid, len(data))
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            return self._rejected(
                key,
                "relay %s: %s %d: %s is %d bytes with sha256 %s…, expected %d bytes with %s…; not mirrored",
                self.region,
                vid[0],
                vid[1],
                self.origin.where(key),
                len(data),
                hashlib.sha256(data).hexdigest()[:12],
                size,
                sha[:12],
            )
        self.mirror.put(key, data, mode="create")
        with self._lock:
            self._traffic.bytes_copied += len(data)
            self._traffic.segments_copied += 1
        metrics.active().copied(self.region, vid[0], len(data))
        return COPIED

    def shutdown(self) -> None:
        """Cancel queued copies and wait for running ones."""
        self._pool.shutdown(wait=True, cancel_futures=True)
