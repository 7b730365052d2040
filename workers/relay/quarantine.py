"""Versions that failed verification, and when each may be fetched again.

A version whose manifest does not parse, or whose objects at origin do not
match it (damaged, truncated, missing), will almost always fail again on the
next listing: fetching it every ``retry_s`` from every region is an egress
storm that fixes nothing. A quarantined version is tried again after
``initial_s``, then after twice as long each time, up to ``max_s``; one log
line says it was quarantined, one that it was mirrored after all. A repair
at origin is picked up at the next attempt; a new publish of the run is not
held up (other versions are mirrored as usual).

The delays are deterministic (no jitter): regions are few, and a test can
name the attempt times.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from aurora_store.clock import Clock
from workers.relay.config import VersionId

__all__ = ["Quarantine"]


@dataclass(slots=True)
class _Entry:
    failures: int
    next_at: float
    reason: str


class Quarantine:
    """Failed versions with their back-off; thread-safe, timed on ``clock``."""

    def __init__(self, initial_s: float, max_s: float, clock: Clock) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[VersionId, _Entry] = {}

    def delay_after(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row: ``initial_s`` doubling, capped."""
        return min(self.max_s, self.initial_s * 2.0 ** max(0, failures - 1))

    def allowed(self, vid: VersionId) -> bool:
        """Whether ``vid`` may be fetched now (it is not quarantined, or its wait is over)."""
        with self._lock:
            e = self._entries.get(vid)
            return e is None or self.clock.monotonic() >= e.next_at

    def failed(self, vid: VersionId, reason: str) -> tuple[int, float]:
        """Record a failed attempt: ``(failures so far, seconds until the next attempt)``."""
        with self._lock:
            e = self._entries.get(vid)
            n = 1 if e is None else e.failures + 1
            delay = self.delay_after(n)
            self._entries[vid] = _Entry(n, self.clock.monotonic() + delay, reason)
            return n, delay

    def cleared(self, vid: VersionId) -> int:
        """``vid`` was mirrored: forget it. Returns its failures (0 if it was never quarantined)."""
        with self._lock:
            e = self._entries.pop(vid, None)
            return 0 if e is None else e.failures

    def keep_only(self, vids: Iterable[VersionId]) -> None:
        """Forget versions no longer at origin (retention removed them)."""
        keep = set(vids)
        with self._lock:
            for vid in [v for v in self._entries if v not in keep]:
                del self._entries[vid]

    def next_at(self) -> float:
        """When the earliest quarantined version may be tried again (``inf`` if none)."""
        with self._lock:
            return min((e.next_at for e in self._entries.values()), default=math.inf)

    def failures(self) -> dict[VersionId, int]:
        """Quarantined versions and their failed attempts so far."""
        with self._lock:
            return {vid: e.failures for vid, e in self._entries.items()}
