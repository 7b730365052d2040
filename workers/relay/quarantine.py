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

from collections.abc import Iterable

from aurora_store.clock import Clock
from workers.quarantine import QuarantineBook
from workers.relay.config import VersionId

__all__ = ["Quarantine"]


class Quarantine(QuarantineBook):
    """Failed versions with their back-off; thread-safe, timed on ``clock``."""

    def __init__(self, initial_s: float, max_s: float, clock: Clock) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        super().__init__(self.delay_after, clock)

    def delay_after(self, failures: int) -> float:
        """The wait after the ``failures``-th failure in a row: ``initial_s`` doubling, capped."""
        return min(self.max_s, self.initial_s * 2.0 ** max(0, failures - 1))

    def failed(self, vid: VersionId, reason: str) -> tuple[int, float]:
        """Record a failed attempt: ``(failures so far, seconds until the next attempt)``."""
        return self.record(vid, reason)

    def cleared(self, vid: VersionId) -> int:
        """``vid`` was mirrored: forget it. Returns its failures (0 if it was never quarantined)."""
        e = self.pop(vid)
        return 0 if e is None else e.failures

    def keep_only(self, vids: Iterable[VersionId]) -> None:
        """Forget versions no longer at origin (retention removed them)."""
        keep = set(vids)
        self.forget(lambda vid: vid not in keep)
