"""What the lineage layer needs from the coordination layer, as narrow Protocols.

Lineage (retention, readers, stagers) sits below coordination: it must not
import Redis, the bus or the ledger. Where it needs a fact only the running
system knows, it names that fact here as a small Protocol; the coordination
layer implements it and the caller passes the implementation in. Tests pass
plain objects. Each Protocol is ``runtime_checkable`` so a caller can assert
what it was handed, but ``isinstance`` checks only that the method exists,
not its signature.

Every answer from these interfaces is advisory in one direction: it may make
lineage keep more or fetch earlier, never trust less. The store stays the
source of truth (a committed version is one whose manifest exists; every
object is checked against its manifest).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["CommitRecords", "HeldVersions", "SegmentAnnouncements"]


@runtime_checkable
class HeldVersions(Protocol):
    """Versions that live Actors hold or are staging right now.

    Why: retention (``aurora gc``) decides from the store alone which
    versions no retained chain needs, but an Actor that still serves version
    V, or is halfway through staging it, needs V's manifest and the
    snapshot and deltas that reach it (and the deltas after it, to catch up
    in O(missed steps)). Deleting those would turn a cheap catch-up into a
    full snapshot fetch, or fail a stage in flight. Only the coordination
    layer (Actor heartbeats, leases) knows these versions.
    """

    def held_versions(self) -> frozenset[int]:
        """Every version some live Actor holds or stages; empty when none."""
        ...


@runtime_checkable
class CommitRecords(Protocol):
    """The commit record of a version, in Redis-commit mode (FORMAT §1).

    Why: in that mode a version is committed when its record is written,
    and the record pins the exact manifest bytes by digest. A reader that
    finds a manifest in the store checks it against the record, so a
    manifest replaced or written by a stray publisher is refused rather
    than applied.
    """

    def commit_record(self, kind: str, version: int) -> str | None:
        """``"sha256:<hex>"`` of the manifest bytes of ``kind`` ``version`` recorded at
        commit time, or None if no record exists."""
        ...


@runtime_checkable
class SegmentAnnouncements(Protocol):
    """Segments announced for a version before its manifest is written.

    Why: the publisher announces each segment as it lands, so a stager can
    start downloading while the rest of the version is still being encoded
    (cut-through). Announcements are untrusted hints: they only let a
    stager prefetch; every byte is checked against the manifest once it
    exists, and nothing is applied before that.
    """

    def announced_segments(self, kind: str, version: int) -> Sequence[tuple[str, int, str]]:
        """``(key, bytes, sha256)`` of each segment announced for ``kind``
        ``version`` so far (keys relative to the run root), in announcement
        order; empty when none."""
        ...
