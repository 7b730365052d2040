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
``commit`` after the versions before it. The mirror's retention runs on that
thread too, every ``clean_every_s``, so it never races a listing.

Redis away is ridden out (:class:`~aurora_store.outage.Dependency`: one log
line when it goes, one when it is back; an outage longer than the budget
ends the Relay with :class:`~aurora_store.errors.OutageTooLong`). So is a
store away: the stores a Relay uses retry through it
(:func:`~aurora_store.outage.riding`). An error that ends the Relay on
another thread reaches :meth:`Follower.run` through the Relay's
:class:`~workers.relay.halt.Halt`.
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
from aurora_store.coordination.bus import COMMIT, SEGMENT, VERSION, Bus, BusGap, Event
from aurora_store.errors import AuroraError, OutageTooLong
from aurora_store.outage import Dependency, is_transient
from workers.relay.copier import Copier, object_version
from workers.relay.halt import Halt
from workers.relay.mirror import Announce, VersionMirror

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

    def want_resync(self, delay_s: float | None = None) -> None:
        """A version could not be mirrored: list again within ``delay_s`` (default ``retry_s``)."""
        self.due_by(self.clock.monotonic() + (self.retry_s if delay_s is None else delay_s))

    def due_by(self, t: float) -> None:
        """List again no later than ``t`` (``clock.monotonic()`` time)."""
        with self._lock:
            self._next = min(self._next, t)

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
        """A listing ended: the next one in ``resync_s`` (0: never) if it was complete, else in
        ``retry_s``; sooner if something asked for one meanwhile."""
        now = self.clock.monotonic()
        with self._lock:
            self._queued = False
            if ok:
                self._next = min(self._next, now + self.resync_s if self.resync_s > 0 else math.inf)
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
        redis: Dependency,
        halt: Halt,
        clock: Clock,
        announce: Announce,
        on_caught_up: Callable[[], None],
        clean: Callable[[], object] | None = None,
        clean_every_s: float = 0.0,
        cut_through: bool = True,
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
        self.redis = redis
        self.halt = halt
        self.clock = clock
        self._announce = announce
        self._on_caught_up = on_caught_up
        self._clean = clean if clean_every_s > 0 else None
        self.clean_every_s = clean_every_s
        self.cut_through = cut_through
        """Copy each segment from its announcement (``fetch="announced"``); False: only from manifests."""
        self._next_clean = math.inf
        # Version, commit, listing and retention work, one at a time in stream order.
        self._serial = ThreadPoolExecutor(1, thread_name_prefix=f"relay-{region}-version")
        self._lock = threading.Lock()
        self.last_id = "0"
        self.synced = threading.Event()
        self.listings = 0
        """Listings of origin done, counted once each has ended and the next one is scheduled."""

    # -- the loop ----------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Catch up by listing, then follow the origin stream until ``stop`` is set.

        ``stop`` is the Relay's halt event: an error that ends the Relay on
        another thread sets it, and is raised here.
        """
        try:
            self._run(stop)
        except Exception as e:  # noqa: BLE001 - a stop cuts an outage wait short with its last error
            if not (stop.is_set() and is_transient(e)):
                raise
        self.halt.raise_if_failed()

    def _run(self, stop: threading.Event) -> None:
        self._set_last(self._tail_id(stop))
        if stop.is_set():
            return
        # The stream's end was taken *before* this listing: whatever is
        # announced from now on is read after it, so nothing falls in between.
        self.schedule.queue()
        self._sync_now()
        while not stop.is_set():
            try:
                events = self.redis.call(self._read, "reading the origin stream", stop)
            except BusGap as e:
                log.warning("relay %s: %s; listing origin", self.region, e)
                self._set_last(self._tail_id(stop))
                self._queue_sync()
                continue
            for ev in events:
                self._dispatch(ev)
                self._set_last(ev.id)

    def _read(self) -> list[Event]:
        if self.schedule.take_due():
            self._queue_sync()
        if self._clean is not None and self.clock.monotonic() >= self._next_clean:
            self._next_clean = self.clock.monotonic() + self.clean_every_s
            self._serial.submit(self._guard, self._clean)
        return self._read_bus.read(self.last_id, block_ms=self.block_ms)

    def _set_last(self, event_id: str) -> None:
        with self._lock:
            self.last_id = event_id

    def _tail_id(self, stop: threading.Event) -> str:
        """Id of the newest entry ever added to the origin stream (``$``), or ``0``; waits while Redis is away."""
        return str(self.redis.call(self.bus.tail_id, "reading the origin stream's end", stop))

    # -- events ------------------------------------------------------------------
    def _dispatch(self, ev: Event) -> None:
        if ev.type == SEGMENT:
            if not self.cut_through:
                return  # manifest-first: the version event copies what its manifest lists
            ref = segment_ref(ev)
            if ref is None:
                log.warning("relay %s: ignoring malformed segment event %s (key %r)", self.region, ev.id, ev.get("key")[:200])
                return
            self.copier.copy_async(*ref, announce=ev)
        elif ev.type == VERSION:
            kind = ev.get("kind", "delta")
            if kind not in ("delta", "snapshot") or ev.version < 0:
                log.warning("relay %s: ignoring version event %s of kind %r", self.region, ev.id, kind)
                return
            self._serial.submit(self._guard, self.mirror.mirror_version, kind, ev.version, ev)
            if not self.synced.is_set():
                self._queue_sync()  # waiting for the run (or catching up): the run is here now
        elif ev.type == COMMIT:
            self._serial.submit(self._guard, self._reannounce_commit, ev)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> None:
        """Serial work: one bad version must not stop the Relay; an outage past its budget does."""
        try:
            fn(*args)
        except OutageTooLong as e:
            self.halt.fail(e)
        except (AuroraError, OSError) as e:
            if self.halt.is_set():
                return  # a stop cut an outage wait short
            log.error("relay %s: %s failed: %s", self.region, getattr(fn, "__name__", fn), e)
            self.schedule.want_resync()
        except Exception:  # noqa: BLE001 - a bug: say where, keep mirroring
            log.exception("relay %s: %s failed", self.region, getattr(fn, "__name__", fn))
            self.schedule.want_resync()

    def _reannounce_commit(self, ev: Event) -> None:
        extra = {k: v for k, v in ev.fields.items() if k not in ("type", "version")}
        self._announce(COMMIT, ev.version, **extra)

    # -- listings ----------------------------------------------------------------
    def _sync_now(self) -> None:
        ok = False
        try:
            ok = self.mirror.sync()
        except OutageTooLong as e:
            self.halt.fail(e)
        except (AuroraError, OSError) as e:
            if not self.halt.is_set():
                if not self.synced.is_set() and not is_transient(e):
                    # The first listing is refused (credentials, a bad URL): nothing will change that.
                    self.halt.fail(e)
                else:
                    log.error("relay %s: listing %s failed: %s", self.region, self.origin_url, e)
        except Exception:  # noqa: BLE001 - a bug: say where, list again later
            log.exception("relay %s: listing %s failed", self.region, self.origin_url)
        self.schedule.listed(ok)
        # A quarantined version gets its attempt at its time, whatever the resync period.
        self.schedule.due_by(self.mirror.quarantine.next_at())
        if ok and not self.synced.is_set():
            log.info("relay %s: mirror %s caught up with %s", self.region, self.mirror_url, self.origin_url)
            # Only now may the region's Actors turn to the mirror.
            self._on_caught_up()
            self.synced.set()
            if self._clean is not None:
                self._next_clean = self.clock.monotonic() + self.clean_every_s
        with self._lock:
            self.listings += 1

    def _queue_sync(self) -> None:
        if self.schedule.queue():
            self._serial.submit(self._sync_now)

    def shutdown(self) -> None:
        """Cancel queued version work and wait for the running one."""
        self._serial.shutdown(wait=True, cancel_futures=True)
