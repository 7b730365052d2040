"""What one poll of Redis tells the stager: the region's Relay mirror, the run's head and commit."""

from __future__ import annotations

from dataclasses import dataclass

from aurora_store.coordination.records import RunRecords

__all__ = ["Polled"]


@dataclass(frozen=True, slots=True)
class Polled:
    """The region's Relay mirror URL, the run's head and commit, read in one round trip."""

    relay_url: str | None
    """The mirror URL the region's Relay heartbeats with; None while none does."""
    head: int | None
    """The newest version the Trainer published; None before the run's first."""
    commit: int | None
    """The newest version the Trainer committed to (a Commit); None before any."""

    @classmethod
    def read(cls, records: RunRecords, region: str) -> Polled:
        """One poll (raw: the caller rides out outages)."""
        return cls(*records.mirror_head_commit(region))
