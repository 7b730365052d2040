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

Every byte from origin is untrusted. An announced segment is written to the
mirror only if its size and sha256 match the announcement; every object of a
version is checked against its manifest before the manifest is written. A
segment that fails is not written (an error names it); the version is
retried from the manifest, then by later listings, so a mirror never holds a
manifest whose objects were not verified against it.

Threads: the caller's thread reads the stream; copies run on a pool of
``streams``; version and commit handling (and listings) run in stream order
on one more thread, so a region sees ``segment`` events of a version before
its ``version`` event and a ``commit`` after the versions before it.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any

from aurora_store.coordination.bus import COMMIT, SEGMENT, VERSION, Bus, BusGap, Event
from aurora_store.coordination.redisconn import connect, key_prefix, validate_run_name
from aurora_store.errors import AuroraError, ConfigError, ObjectNotFound
from aurora_store.format.manifest import Manifest, manifest_key, version_dir
from aurora_store.storage.store import Store, open_store

__all__ = [
    "RelayConfig",
    "RelayStats",
    "Relay",
    "run_relay",
    "add_arguments",
    "config_from_args",
    "run_from_args",
    "main",
]

log = logging.getLogger("aurora.relay")

_OBJECT_KEY = re.compile(r"^(delta|snapshot)s/v([0-9]{10})/[0-9a-f]{16,}/(?:seg|shard)-[0-9]{5}\.safetensors$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: The run's model description (docs/WORKERS.md), mirrored along with the versions.
MODEL_KEYS = ("model/config.json", "model/tokenizer.json")
_REGION = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

VersionId = tuple[str, int]
"""(kind, version): ``("delta", 5)`` and ``("snapshot", 5)`` are different objects."""


def relay_key(run: str, region: str) -> str:
    """``aurora:{run}:relay:{region}``: the region's mirror URL while its Relay heartbeats."""
    return f"{key_prefix(run)}relay:{region}"


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Where a Relay copies from and to, and how often it proves it is alive."""

    origin: str
    """Run root at origin (``s3://bucket/prefix/run``, ``file:///path``)."""
    mirror: str
    """Run root of the region's mirror; also the value of the heartbeat key."""
    redis: str
    """Redis URL of the run."""
    run: str
    """Run name (Redis namespace)."""
    region: str
    """Region this Relay serves (letters, digits, ``.``, ``_``, ``-``)."""
    origin_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """fsspec storage options of the origin (may hold credentials: never logged)."""
    mirror_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    """fsspec storage options of the mirror (may hold credentials: never logged)."""
    heartbeat_s: float = 2.0
    """Period of the heartbeat ``SET``."""
    ttl_s: float = 6.0
    """TTL of the heartbeat key: how long Actors keep using a silent Relay's mirror."""
    block_ms: int = 1000
    """Longest blocking stream read; also bounds how long a stop takes to be noticed."""
    streams: int = 8
    """Concurrent object copies (connections to each store)."""
    resync_s: float = 60.0
    """Period of a full listing of origin even without a gap (0: only on gaps and failures)."""
    retry_s: float = 5.0
    """Delay before listing again after a version could not be mirrored."""

    def __post_init__(self) -> None:
        validate_run_name(self.run)
        if not _REGION.fullmatch(self.region):
            raise ConfigError(f"region {self.region!r} must be 1-64 letters, digits, '.', '_' or '-'")
        if not self.origin or not self.mirror:
            raise ConfigError("a Relay needs an origin and a mirror URL")
        if self.origin.rstrip("/") == self.mirror.rstrip("/"):
            raise ConfigError(f"mirror {self.mirror!r} is the origin itself")
        if self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ConfigError(
                f"need 0 < heartbeat_s < ttl_s (got heartbeat_s={self.heartbeat_s}, ttl_s={self.ttl_s})"
            )
        if self.block_ms < 1:
            raise ConfigError(f"block_ms must be >= 1 (0 would block forever), got {self.block_ms}")
        if not 1 <= self.streams <= 256:
            raise ConfigError(f"streams must be 1..256, got {self.streams}")
        if self.resync_s < 0 or self.retry_s <= 0:
            raise ConfigError(f"resync_s must be >= 0 and retry_s > 0 ({self.resync_s}, {self.retry_s})")


@dataclass(frozen=True, slots=True)
class RelayStats:
    """What a Relay has done so far (a consistent snapshot)."""

    versions_mirrored: int
    """Versions this process committed to the mirror (its manifest written)."""
    bytes_copied: int
    """Bytes written to the mirror."""
    bytes_fetched: int
    """Bytes read from origin: what crossed into the region."""
    segments_copied: int
    """Objects (segments, shards) written to the mirror."""
    segments_rejected: int
    """Objects read from origin whose size or sha256 did not match; never written."""
    last_event_id: str
    """Newest origin stream id handled."""
    mirrored: tuple[VersionId, ...]
    """Versions known to be complete in the mirror, in order."""
    bytes_by_version: Mapping[VersionId, int]
    """Bytes fetched from origin per version (objects and manifest)."""


class Relay:
    """One region's Relay. ``run(stop)`` follows origin until ``stop`` is set."""

    # KEYS[1] heartbeat key; ARGV[1] the mirror URL this Relay set.
    # Returns 1 if the key was ours and is gone, 0 if another Relay holds it.
    RELEASE = """
    if redis.call('GET', KEYS[1]) == ARGV[1] then
        return redis.call('DEL', KEYS[1])
    end
    return 0
    """

    def __init__(
        self,
        config: RelayConfig,
        origin: Store | None = None,
        mirror: Store | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = config
        self.origin = origin or open_store(config.origin, dict(config.origin_options))
        self.mirror = mirror or open_store(config.mirror, dict(config.mirror_options))
        self.clock = clock
        self.redis = connect(config.redis)
        self._reader = connect(config.redis, block_s=config.block_ms / 1000)
        self.bus = Bus(self.redis, config.run)
        self._read_bus = Bus(self._reader, config.run)
        self.heartbeat_key = relay_key(config.run, config.region)
        self._release = self.redis.register_script(self.RELEASE)
        self._pool = ThreadPoolExecutor(config.streams, thread_name_prefix=f"relay-{config.region}-copy")
        # Version, commit and listing work, one at a time in stream order.
        self._serial = ThreadPoolExecutor(1, thread_name_prefix=f"relay-{config.region}-version")
        self._lock = threading.Lock()
        self._have: dict[str, str] = {}  # mirror key -> sha256 verified in it
        self._inflight: dict[str, Future[None]] = {}
        self._segments_announced: set[str] = set()
        self._complete: set[VersionId] = set()
        self._announced: set[VersionId] = set()
        self._t0: dict[VersionId, float] = {}
        self._by_version: dict[VersionId, int] = {}
        self._versions_mirrored = 0
        self._bytes_copied = 0
        self._bytes_fetched = 0
        self._segments_copied = 0
        self._segments_rejected = 0
        self._last_id = "0"
        self._next_sync = math.inf
        self._sync_queued = False
        self._synced = threading.Event()
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"Relay(region={self.cfg.region!r}, origin={self.cfg.origin!r}, mirror={self.cfg.mirror!r})"

    # -- what it did -------------------------------------------------------------
    def stats(self) -> RelayStats:
        with self._lock:
            return RelayStats(
                versions_mirrored=self._versions_mirrored,
                bytes_copied=self._bytes_copied,
                bytes_fetched=self._bytes_fetched,
                segments_copied=self._segments_copied,
                segments_rejected=self._segments_rejected,
                last_event_id=self._last_id,
                mirrored=tuple(sorted(self._complete, key=lambda k: (k[1], k[0]))),
                bytes_by_version=dict(self._by_version),
            )

    @property
    def caught_up(self) -> threading.Event:
        """Set once a listing of origin has been mirrored completely (heartbeats start then)."""
        return self._synced

    # -- main loop ---------------------------------------------------------------
    def run(self, stop: threading.Event) -> RelayStats:
        """Catch up by listing, then follow the origin stream until ``stop`` is set."""
        self._last_id = self._tail_id_until(stop)
        if stop.is_set():
            return self.stats()
        # The stream's end was taken *before* this listing: whatever is
        # announced from now on is read after it, so nothing falls in between.
        self._sync_now()
        backoff = 0.1
        while not stop.is_set():
            self._maybe_resync()
            try:
                events = self._read_bus.read(self._last_id, block_ms=self.cfg.block_ms)
            except BusGap as e:
                log.warning("relay %s: %s; listing origin", self.cfg.region, e)
                self._last_id = self._tail_id_until(stop)
                self._queue_sync()
                continue
            except Exception as e:  # noqa: BLE001 - Redis down or restarting: keep trying
                if not _is_redis_error(e):
                    raise
                log.warning("relay %s: reading %s failed: %s", self.cfg.region, self.bus.stream(), e)
                stop.wait(backoff)
                backoff = min(5.0, backoff * 2)
                continue
            backoff = 0.1
            for ev in events:
                self._dispatch(ev)
                with self._lock:
                    self._last_id = ev.id
        return self.stats()

    def close(self, release: bool = True) -> None:
        """Stop heartbeating and copying; ``release`` deletes the heartbeat key (graceful stop)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._hb_stop.set()
        self._serial.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._hb_thread is not None:
            self._hb_thread.join()
        # After every thread that could still beat has stopped.
        if release:
            try:
                self._release(keys=[self.heartbeat_key], args=[self.cfg.mirror])
            except Exception as e:  # noqa: BLE001 - the key expires by itself anyway
                if not _is_redis_error(e):
                    raise
                log.warning("relay %s: could not delete %s (it expires in %.0f s): %s", self.cfg.region, self.heartbeat_key, self.cfg.ttl_s, e)
        self.redis.close()
        self._reader.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stream ------------------------------------------------------------------
    def _tail_id(self) -> str:
        """Id of the newest entry ever added to the origin stream (``$``), or ``0``."""
        return str(self.bus.tail_id())

    def _tail_id_until(self, stop: threading.Event) -> str:
        delay = 0.1
        while not stop.is_set():
            try:
                return self._tail_id()
            except Exception as e:  # noqa: BLE001
                if not _is_redis_error(e):
                    raise
                log.warning("relay %s: Redis unreachable (%s); retrying", self.cfg.region, e)
                stop.wait(delay)
                delay = min(5.0, delay * 2)
        return self._last_id

    def _dispatch(self, ev: Event) -> None:
        if ev.type == SEGMENT:
            self._on_segment(ev)
        elif ev.type == VERSION:
            kind = ev.get("kind", "delta")
            if kind not in ("delta", "snapshot") or ev.version < 0:
                log.warning("relay %s: ignoring version event %s of kind %r", self.cfg.region, ev.id, kind)
                return
            self._serial.submit(self._guard, self._mirror_version, kind, ev.version, ev)
        elif ev.type == COMMIT:
            self._serial.submit(self._guard, self._reannounce_commit, ev)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one bad version must not stop the Relay
            log.exception("relay %s: %s failed", self.cfg.region, getattr(fn, "__name__", fn))
            self._want_resync()

    def _on_segment(self, ev: Event) -> None:
        key, sha = ev.get("key"), ev.get("sha256")
        m = _OBJECT_KEY.fullmatch(key)
        try:
            size = int(ev.get("bytes"))
        except ValueError:
            size = -1
        if m is None or int(m.group(2)) != ev.version or not _HEX64.fullmatch(sha) or size < 0:
            log.warning("relay %s: ignoring malformed segment event %s (key %r)", self.cfg.region, ev.id, key[:200])
            return
        self._copy_async(key, size, sha, announce=ev)

    def _reannounce_commit(self, ev: Event) -> None:
        extra = {k: v for k, v in ev.fields.items() if k not in ("type", "version")}
        self._announce(COMMIT, ev.version, **extra)

    def _announce(self, type: str, version: int, **fields: Any) -> None:
        try:
            self.bus.announce(type, version, region=self.cfg.region, **fields)
        except Exception as e:  # noqa: BLE001 - announcements are hints; the mirror is what counts
            if not _is_redis_error(e):
                raise
            log.warning("relay %s: could not announce %s %d: %s", self.cfg.region, type, version, e)

    # -- copying -----------------------------------------------------------------
    def _copy_async(self, key: str, size: int, sha: str, announce: Event | None = None) -> Future[None]:
        """Copy one object unless it is in the mirror or on its way (each object crosses once)."""
        with self._lock:
            if self._have.get(key) == sha:
                done: Future[None] = Future()
                done.set_result(None)
                return done
            f = self._inflight.get(key)
            if f is None:
                # _copy drops this entry under the same lock, so it can only run after it is set.
                f = self._pool.submit(self._copy, key, size, sha, announce)
                self._inflight[key] = f
            return f

    def _copy(self, key: str, size: int, sha: str, announce: Event | None) -> None:
        m = _OBJECT_KEY.fullmatch(key)
        assert m is not None
        vid: VersionId = (m.group(1), int(m.group(2)))
        ok = False
        try:
            ok = self._copy_impl(key, size, sha, vid)
        except (AuroraError, OSError) as e:
            log.error("relay %s: copying %s failed: %s", self.cfg.region, self.origin.where(key), e)
        finally:
            with self._lock:
                self._inflight.pop(key, None)
                if ok:
                    self._have[key] = sha
                first = ok and announce is not None and key not in self._segments_announced
                if first:
                    self._segments_announced.add(key)
        if first and announce is not None:
            self._announce(SEGMENT, vid[1], index=announce.get("index"), key=key, bytes=size, sha256=sha)

    def _copy_impl(self, key: str, size: int, sha: str, vid: VersionId) -> bool:
        if self.mirror.exists(key):
            # Written by an earlier run of this Relay: check it here, in the region,
            # rather than bring it across again.
            have = self.mirror.get(key)
            if len(have) == size and hashlib.sha256(have).hexdigest() == sha:
                return True
            log.error(
                "relay %s: mirror object %s is %d bytes with another sha256 than expected; not replacing it",
                self.cfg.region, self.mirror.where(key), len(have),
            )
            return False
        with self._lock:
            self._t0.setdefault(vid, self.clock())
        try:
            data = self.origin.get(key)
        except ObjectNotFound:
            log.error("relay %s: %s was announced but is not in the origin store", self.cfg.region, self.origin.where(key))
            return False
        with self._lock:
            self._bytes_fetched += len(data)
            self._by_version[vid] = self._by_version.get(vid, 0) + len(data)
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            with self._lock:
                self._segments_rejected += 1
            log.error(
                "relay %s: %s %d: %s is %d bytes with sha256 %s…, expected %d bytes with %s…; not mirrored",
                self.cfg.region, vid[0], vid[1], self.origin.where(key), len(data),
                hashlib.sha256(data).hexdigest()[:12], size, sha[:12],
            )
            return False
        self.mirror.put(key, data, mode="create")
        with self._lock:
            self._bytes_copied += len(data)
            self._segments_copied += 1
        return True

    # -- versions ----------------------------------------------------------------
    def _mirror_version(self, kind: str, version: int, ev: Event | None = None) -> bool:
        """Make ``kind`` ``version`` complete in the mirror; announce it to the region.

        Runs on the serial thread. Returns whether the version is in the mirror.
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
                self._announce_version(m)
            return True
        with self._lock:
            t0 = self._t0.setdefault(vid, self.clock())
        try:
            data = self.origin.get(mk)
        except ObjectNotFound:
            log.warning("relay %s: %s %d was announced but %s does not exist", self.cfg.region, kind, version, self.origin.where(mk))
            self._want_resync()
            return False
        with self._lock:
            self._bytes_fetched += len(data)
            self._by_version[vid] = self._by_version.get(vid, 0) + len(data)
        m = Manifest.from_bytes(data, self.origin.where(mk))
        if m.kind != kind or m.version != version:
            log.error("relay %s: %s describes %s %d; not mirrored", self.cfg.region, self.origin.where(mk), m.kind, m.version)
            return False
        if ev is not None and ev.get("state") and ev.get("state") != m.state:
            log.warning(
                "relay %s: %s %d announced with state %s…, its manifest says %s…; the store wins",
                self.cfg.region, kind, version, ev.get("state")[:19], m.state[:19],
            )
        vdir = version_dir(kind, version)
        refs = [(f"{vdir}/{r.key}", r.bytes, r.sha256) for r in m.segments]
        missing = refs
        # Two rounds: the first may only wait for a cut-through copy that was
        # checked against its announcement; the second checks against the manifest.
        for _ in range(2):
            futures = [self._copy_async(k, b, s) for k, b, s in missing]
            wait_all(futures)
            with self._lock:
                missing = [(k, b, s) for k, b, s in refs if self._have.get(k) != s]
            if not missing:
                break
        if missing:
            log.error(
                "relay %s: %s %d not mirrored: %d of %d object(s) missing or failed verification (first: %s); listing again in %.0f s",
                self.cfg.region, kind, version, len(missing), len(refs), self.origin.where(missing[0][0]), self.cfg.retry_s,
            )
            self._want_resync()
            return False
        self.mirror.put(mk, data, mode="create")
        with self._lock:
            self._bytes_copied += len(data)
            self._versions_mirrored += 1
            self._complete.add(vid)
            fetched = self._by_version.get(vid, 0)
        log.info(
            "relay %s: %s %d mirrored: %d bytes in %.3f s (%d object(s))",
            self.cfg.region, kind, version, fetched, self.clock() - t0, len(refs),
        )
        self._announce_version(m)
        return True

    def _announce_version(self, m: Manifest) -> None:
        vid: VersionId = (m.kind, m.version)
        with self._lock:
            if vid in self._announced:
                return
            self._announced.add(vid)
        self._announce(
            VERSION, m.version, kind=m.kind, state=m.state, base_state=m.base_state or "",
            bytes=m.total_bytes, segments=len(m.segments),
        )

    # -- listing -----------------------------------------------------------------
    def sync(self) -> bool:
        """List origin and mirror every committed version the mirror lacks.

        Only objects named by committed manifests are copied: orphans of
        attempts that never committed stay behind. Returns whether every
        version is now in the mirror. :meth:`run` lists by itself; call this
        directly only while no :meth:`run` is in progress.
        """
        from aurora_store.lineage.fetch import scan_versions

        self._copy_model_description()
        index = scan_versions(self.origin)
        ok = True
        for v in sorted(index.deltas | index.snapshots):
            for kind, have in (("delta", index.deltas), ("snapshot", index.snapshots)):
                if v not in have:
                    continue
                try:
                    ok = self._mirror_version(kind, v) and ok
                except (AuroraError, OSError) as e:
                    # One damaged version must not hold back the ones after it.
                    log.error("relay %s: %s %d not mirrored: %s", self.cfg.region, kind, v, e)
                    ok = False
        return ok

    def _copy_model_description(self) -> None:
        """``model/`` (docs/WORKERS.md), so the mirror is a run root an Actor can join from.

        These objects have no digest to check against; they are created once,
        before v0, and are copied create-only as they are.
        """
        for key in MODEL_KEYS:
            with self._lock:
                if key in self._have:
                    continue
            if not self.mirror.exists(key):
                try:
                    data = self.origin.get(key)
                except ObjectNotFound:
                    continue  # not written yet (or a run without one)
                self.mirror.put(key, data, mode="create")
                with self._lock:
                    self._bytes_fetched += len(data)
                    self._bytes_copied += len(data)
            with self._lock:
                self._have[key] = ""

    def _sync_now(self) -> None:
        try:
            ok = self.sync()
        except Exception as e:  # noqa: BLE001 - origin unreachable: list again later
            log.error("relay %s: listing %s failed: %s", self.cfg.region, self.cfg.origin, e)
            ok = False
        now = self.clock()
        with self._lock:
            self._sync_queued = False
            if ok:
                self._next_sync = now + self.cfg.resync_s if self.cfg.resync_s > 0 else math.inf
            else:
                self._next_sync = min(self._next_sync, now + self.cfg.retry_s)
        if ok and not self._synced.is_set():
            log.info("relay %s: mirror %s caught up with %s", self.cfg.region, self.cfg.mirror, self.cfg.origin)
            # Only now may the region's Actors turn to the mirror.
            self._start_heartbeat()
            self._synced.set()

    def _queue_sync(self) -> None:
        with self._lock:
            if self._sync_queued:
                return
            self._sync_queued = True
        self._serial.submit(self._sync_now)

    def _want_resync(self) -> None:
        with self._lock:
            self._next_sync = min(self._next_sync, self.clock() + self.cfg.retry_s)

    def _maybe_resync(self) -> None:
        with self._lock:
            due = self.clock() >= self._next_sync
            if due:
                self._next_sync = math.inf
        if due:
            self._queue_sync()

    # -- heartbeat ---------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        with self._lock:
            if self._hb_thread is not None or self._closed:
                return
            self._hb_thread = threading.Thread(target=self._heartbeat_loop, name=f"relay-{self.cfg.region}-heartbeat", daemon=True)
        self._beat()  # at once, not a period from now
        self._hb_thread.start()

    def _beat(self) -> None:
        try:
            self.redis.set(self.heartbeat_key, self.cfg.mirror, px=max(1, int(self.cfg.ttl_s * 1000)))
        except Exception as e:  # noqa: BLE001 - keep beating through Redis hiccups
            if not _is_redis_error(e):
                raise
            log.warning("relay %s: heartbeat failed: %s", self.cfg.region, e)

    def _heartbeat_loop(self) -> None:
        while not self._hb_stop.wait(self.cfg.heartbeat_s):
            self._beat()


def _is_redis_error(e: BaseException) -> bool:
    import redis

    return isinstance(e, (redis.exceptions.RedisError, ConnectionError, TimeoutError))


def run_relay(config: RelayConfig, stop: threading.Event) -> RelayStats:
    """Run a Relay until ``stop`` is set; delete its heartbeat key on the way out."""
    relay = Relay(config)
    try:
        return relay.run(stop)
    finally:
        relay.close(release=True)


# -- command line --------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``aurora relay``."""
    d = RelayConfig.__dataclass_fields__
    p.add_argument("--store", required=True, metavar="URL", help="run root at origin")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", help="fsspec option of the origin store (repeatable)")
    p.add_argument("--mirror", required=True, metavar="URL", help="run root of the region's mirror")
    p.add_argument("--mirror-option", action="append", metavar="KEY=VALUE", help="fsspec option of the mirror store (repeatable)")
    p.add_argument("--redis", required=True, metavar="URL", help="redis://[user:password@]host:port/db or rediss://")
    p.add_argument("--run", required=True, metavar="NAME", help="run name (Redis namespace)")
    p.add_argument("--region", required=True, help="region this Relay serves")
    p.add_argument("--heartbeat-s", type=float, default=d["heartbeat_s"].default, help="heartbeat period (default %(default)s)")
    p.add_argument("--ttl-s", type=float, default=d["ttl_s"].default, help="heartbeat key TTL (default %(default)s)")
    p.add_argument("--block-ms", type=int, default=d["block_ms"].default, help="longest blocking stream read (default %(default)s)")
    p.add_argument(
        "--streams", type=int, default=None,
        help=f"concurrent copies (default: AURORA_STREAMS or {d['streams'].default})",
    )
    p.add_argument("--resync-s", type=float, default=d["resync_s"].default, help="list origin this often even without a gap; 0: never (default %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true")


def config_from_args(args: argparse.Namespace) -> RelayConfig:
    import os

    from aurora_tools.cli import storage_options

    streams = args.streams
    if streams is None:
        raw = os.environ.get("AURORA_STREAMS", str(RelayConfig.__dataclass_fields__["streams"].default))
        try:
            streams = int(raw)
        except ValueError:
            raise ConfigError(f"AURORA_STREAMS={raw!r} is not an integer") from None
    return RelayConfig(
        origin=args.store,
        mirror=args.mirror,
        redis=args.redis,
        run=args.run,
        region=args.region,
        origin_options=storage_options(args.storage_option),
        mirror_options=storage_options(args.mirror_option, "--mirror-option"),
        heartbeat_s=args.heartbeat_s,
        ttl_s=args.ttl_s,
        block_ms=args.block_ms,
        streams=streams,
        resync_s=args.resync_s,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """``aurora relay``: run until SIGTERM or SIGINT, then delete the heartbeat key and exit 0."""
    from workers.common import install_stop_handlers, setup_logging

    setup_logging(f"relay[{args.region}]", getattr(args, "verbose", False))
    config = config_from_args(args)
    stop = threading.Event()
    install_stop_handlers(stop)
    stats = run_relay(config, stop)
    log.info(
        "relay %s stopped: %d version(s) mirrored, %d bytes copied",
        config.region, stats.versions_mirrored, stats.bytes_copied,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aurora relay", description="Mirror a run into a region's store.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except AuroraError as e:
        print(f"aurora relay: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
