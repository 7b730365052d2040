"""Which versions live Actors still need: the ledger's answer to retention.

The lineage layer asks through its ``HeldVersions`` interface
(:mod:`aurora_store.lineage.interfaces`) and knows nothing of Redis; this
module answers it from the ledger's Actor records.
"""

from __future__ import annotations

from aurora_store.coordination.ledger import ActorRecord, Ledger
from aurora_store.errors import ConfigError

__all__ = ["LedgerHeldVersions", "versions_held_by"]


def versions_held_by(a: ActorRecord) -> frozenset[int]:
    """The versions one Actor holds or is staging: its active one, its staged one, and those between.

    An Actor on ``active`` with ``staged`` > ``active`` holds every delta in
    between (staged in order, waiting for their Commit). Negative values
    (an Actor that has staged nothing yet reports ``-1``) are no versions.
    """
    out: set[int] = set()
    if a.active is not None:
        out.add(a.active)
    if a.staged is not None:
        lo = a.staged if a.active is None else min(a.active, a.staged)
        out.update(range(lo, a.staged + 1))
    return frozenset(v for v in out if v >= 0)


class LedgerHeldVersions:
    """``HeldVersions`` over a ledger: versions of live Actors (registered, ``alive``, heard from recently).

    ``heartbeat_timeout_ms``: an ``alive`` Actor silent for longer than this
    holds nothing (the Trainer reaps it with the same timeout); None counts
    every Actor the registry still calls ``alive``. Each call reads the
    registry afresh.
    """

    def __init__(self, ledger: Ledger, heartbeat_timeout_ms: int | None = None) -> None:
        if heartbeat_timeout_ms is not None and heartbeat_timeout_ms <= 0:
            raise ConfigError(f"heartbeat_timeout_ms must be positive, got {heartbeat_timeout_ms}")
        self.ledger = ledger
        self.heartbeat_timeout_ms = heartbeat_timeout_ms

    def held_versions(self) -> frozenset[int]:
        """Versions that live Actors hold (active) or are staging (staged, and those before it)."""
        actors = [a for a in self.ledger.actors() if a.status == "alive"]
        if self.heartbeat_timeout_ms is not None and actors:
            now = self.ledger.server_time_ms()
            actors = [a for a in actors if now - a.heartbeat_ms <= self.heartbeat_timeout_ms]
        out: set[int] = set()
        for a in actors:
            out |= versions_held_by(a)
        return frozenset(out)
