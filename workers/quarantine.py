"""The bookkeeping of a quarantine: versions that failed, and when each may be tried again.

The Actor's stager and the Relay's mirror both refuse a version that failed
validation until a back-off passes (fetching it on every loop is an egress
storm that fixes nothing). Each keeps its own policy (delays, log lines);
this is what they share: per-version failure counts and next-attempt times,
thread-safe, timed on a :class:`~aurora_store.clock.Clock`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from aurora_store.clock import Clock

__all__ = ["QuarantineBook", "QuarantineEntry", "VersionId"]

VersionId = tuple[str, int]
"""(kind, version): ``("delta", 7)`` or ``("snapshot", 5)``."""


@dataclass(slots=True)
class QuarantineEntry:
    failures: int
    next_at: float
    reason: str


class QuarantineBook:
    """Failed versions with their next-attempt times; ``delay(n)`` is the wait after the n-th failure in a row."""

    def __init__(self, delay: Callable[[int], float], clock: Clock) -> None:
        self._delay = delay
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[VersionId, QuarantineEntry] = {}

    def allowed(self, vid: VersionId) -> bool:
        """Whether ``vid`` may be fetched now (not quarantined, or its wait is over)."""
        with self._lock:
            e = self._entries.get(vid)
            return e is None or self.clock.monotonic() >= e.next_at

    def record(self, vid: VersionId, reason: str) -> tuple[int, float]:
        """A failed attempt: ``(failures so far, seconds until the next attempt)``."""
        with self._lock:
            e = self._entries.get(vid)
            n = 1 if e is None else e.failures + 1
            delay = self._delay(n)
            self._entries[vid] = QuarantineEntry(n, self.clock.monotonic() + delay, reason)
            return n, delay

    def pop(self, vid: VersionId) -> QuarantineEntry | None:
        """Forget ``vid`` (it passed); its entry, or None if it was never quarantined."""
        if not self._entries:  # the common case: no lock taken
            return None
        with self._lock:
            return self._entries.pop(vid, None)

    def forget(self, drop: Callable[[VersionId], bool]) -> None:
        """Forget every version ``drop`` says is no longer wanted."""
        with self._lock:
            for vid in [v for v in self._entries if drop(v)]:
                del self._entries[vid]

    def next_at(self) -> float:
        """When the earliest quarantined version may be tried again (``inf`` if none)."""
        with self._lock:
            return min((e.next_at for e in self._entries.values()), default=math.inf)

    def blocked(self) -> frozenset[VersionId]:
        """Versions whose wait is not over."""
        now = self.clock.monotonic()
        with self._lock:
            return frozenset(vid for vid, e in self._entries.items() if now < e.next_at)

    def failures(self) -> dict[VersionId, int]:
        """Quarantined versions and their failed attempts so far."""
        with self._lock:
            return {vid: e.failures for vid, e in self._entries.items()}
