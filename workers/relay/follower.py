"""Following origin: its announcement stream, and listings of its store when the stream is not enough.

On start the follower takes the origin stream's newest id, *then* lists
origin, so nothing announced between the listing and the following is
missed. It then reads the stream from that id: a ``segment`` event is
copied at once (cut-through: before its manifest exists); a ``version``
event completes the version (whatever segment is still missing, then the
manifest); a ``commit`` event is re-announced after the versions announced
before it. A gap in the stream (trimmed, or Redis lost it), a version that
could not be mirrored and the periodic ``resync_s`` all lead to a listing.

Threads: the caller's thread reads the stream; version and commit handling
(and listings) run in stream order on one more thread, so a region sees
``segment`` events of a version before its ``version`` event and a
``commit`` after the versions before it.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aurora_store.clock import Clock
from aurora_store.config import Backoff
from aurora_store.coordination.bus import COMMIT, SEGMENT, VERSION, Bus, BusGap, Event
from workers.relay.copier import Copier, object_version
from workers.relay.mirror import Announce, VersionMirror
from workers.relay.retry import retry_while_redis_away

__all__ = ["Follower", "ListingSchedule", "segment_ref"]

log = logging.getLogger("aurora.relay")

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def segment_ref(ev: Event) -> tuple[str, int, str] | None:
    """``(key, bytes, sha256)`` of a well-formed ``segment`` event, else None (never trusted further)."""
    key, sha = ev.get("key"), ev.get("sha256")
    vid = object_version(key)
    try:
        size = int(ev.get("bytes"))
    except ValueError:
        size = -1
    if vid is None or vid[1] != ev.version or not _HEX64.fullmatch(sha) or size < 0:
        return None
    return key, size, sha


class ListingSchedule:
    """When origin is listed next: every ``resync_s`` after a complete listing, ``retry_s`` after a failure."""

    def __init__(self, resync_s: float, retry_s: float, clock: Clock) -> None:
        self.resync_s = resync_s
        self.retry_s = retry_s
        self.clock = clock
        self._lock = threading.Lock()
        self._next = math.inf
        self._queued = False

    def want_resync(self) -> None:
        """A version could not be mirrored: list again within ``retry_s``."""
        with self._lock:
            self._next = min(self._next, self.clock.monotonic() + self.retry_s)

    def take_due(self) -> bool:
        """Whether a listing is due now (and, if so, no longer scheduled)."""
        with self._lock:
            due = self.clock.monotonic() >= self._next
            if due:
                self._next = math.inf
        return due

    def queue(self) -> bool:
        """Mark a listing queued; False if one already is."""
        with self._lock:
            if self._queued:
                return False
            self._queued = True
            return True

    def listed(self, ok: bool) -> None:
        """A listing ended: the next one in ``resync_s`` (0: never) if it was complete, else in ``retry_s``."""
        now = self.clock.monotonic()
        with self._lock:
            self._queued = False
            if ok:
                self._next = now + self.resync_s if self.resync_s > 0 else math.inf
            else:
                self._next = min(self._next, now + self.retry_s)


class Follower:
    """Reads the origin stream and hands each event to the copier or, in order, to the version mirror."""

    def __init__(
        self,
        bus: Bus,
        read_bus: Bus,
        copier: Copier,
        mirror: VersionMirror,
        schedule: ListingSchedule,
        region: str,
        origin_url: str,
        mirror_url: str,
        block_ms: int,
        backoff: Backoff,
        clock: Clock,
        announce: Announce,
        on_caught_up: Callable[[], None],
    ) -> None:
        self.bus = bus
        self._read_bus = read_bus
        self.copier = copier
        self.mirror = mirror
        self.schedule = schedule
        self.region = region
        self.origin_url = origin_url
        self.mirror_url = mirror_url
        self.block_ms = block_ms
        self.backoff = backoff
        self.clock = clock
        self._announce = announce
        self._on_caught_up = on_caught_up
        # Version, commit and listing work, one at a time in stream order.
        self._serial = ThreadPoolExecutor(1, thread_name_prefix=f"relay-{region}-version")
        self._lock = threading.Lock()
        self.last_id = "0"
        self.synced = threading.Event()

    # -- the loop ----------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Catch up by listing, then follow the origin stream until ``stop`` is set."""
        self._set_last(self._tail_id_until(stop))
        if stop.is_set():
            return
        # The stream's end was taken *before* this listing: whatever is
        # announced from now on is read after it, so nothing falls in between.
        self._sync_now()
        while not stop.is_set():
            try:
                events = retry_while_redis_away(self._read, stop, self.clock, self.backoff, self._read_failed)
            except BusGap as e:
                log.warning("relay %s: %s; listing origin", self.region, e)
                self._set_last(self._tail_id_until(stop))
                self._queue_sync()
                continue
            for ev in events or ():
                self._dispatch(ev)
                self._set_last(ev.id)

    def _read(self) -> list[Event]:
        if self.schedule.take_due():
            self._queue_sync()
        return self._read_bus.read(self.last_id, block_ms=self.block_ms)

    def _read_failed(self, e: BaseException) -> None:
        log.warning("relay %s: reading %s failed: %s", self.region, self.bus.stream(), e)

    def _set_last(self, event_id: str) -> None:
        with self._lock:
            self.last_id = event_id

    def _tail_id_until(self, stop: threading.Event) -> str:
        """Id of the newest entry ever added to the origin stream (``$``), or ``0``; retried while Redis is away."""

        def failed(e: BaseException) -> None:
            log.warning("relay %s: Redis unreachable (%s); retrying", self.region, e)

        tail = retry_while_redis_away(lambda: str(self.bus.tail_id()), stop, self.clock, self.backoff, failed)
        return self.last_id if tail is None else tail

    # -- events ------------------------------------------------------------------
    def _dispatch(self, ev: Event) -> None:
        if ev.type == SEGMENT:
            ref = segment_ref(ev)
            if ref is None:
                log.warning(
                    "relay %s: ignoring malformed segment event %s (key %r)", self.region, ev.id, ev.get("key")[:200]
                )
                return
            self.copier.copy_async(*ref, announce=ev)
        elif ev.type == VERSION:
            kind = ev.get("kind", "delta")
            if kind not in ("delta", "snapshot") or ev.version < 0:
                log.warning("relay %s: ignoring version event %s of kind %r", self.region, ev.id, kind)
                return
            self._serial.submit(self._guard, self.mirror.mirror_version, kind, ev.version, ev)
        elif ev.type == COMMIT:
            self._serial.submit(self._guard, self._reannounce_commit, ev)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one bad version must not stop the Relay
            log.exception("relay %s: %s failed", self.region, getattr(fn, "__name__", fn))
            self.schedule.want_resync()

    def _reannounce_commit(self, ev: Event) -> None:
        extra = {k: v for k, v in ev.fields.items() if k not in ("type", "version")}
        self._announce(COMMIT, ev.version, **extra)

    # -- listings ----------------------------------------------------------------
    def _sync_now(self) -> None:
        try:
            ok = self.mirror.sync()
        except Exception as e:  # noqa: BLE001 - origin unreachable: list again later
            log.error("relay %s: listing %s failed: %s", self.region, self.origin_url, e)
            ok = False
        self.schedule.listed(ok)
        if ok and not self.synced.is_set():
            log.info("relay %s: mirror %s caught up with %s", self.region, self.mirror_url, self.origin_url)
            # Only now may the region's Actors turn to the mirror.
            self._on_caught_up()
            self.synced.set()

    def _queue_sync(self) -> None:
        if self.schedule.queue():
            self._serial.submit(self._sync_now)

    def shutdown(self) -> None:
        """Cancel queued version work and wait for the running one."""
        self._serial.shutdown(wait=True, cancel_futures=True)
