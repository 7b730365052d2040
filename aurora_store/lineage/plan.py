"""Which versions a run holds, and the cheapest way to reach one.

:func:`plan_chain` is a pure function over version numbers: it decides
whether to replay deltas from a held version or to start from a snapshot,
without reading anything. :func:`scan_versions` is the one listing that
feeds it. Neither imports torch, so the read-only tools (``aurora lineage``,
``aurora verify``, ``aurora gc``) and retention can use them cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

from aurora_store.errors import ChainError, VersionNotFound
from aurora_store.format.manifest import parse_version_dir
from aurora_store.storage import Store

__all__ = ["ChainPlan", "VersionIndex", "plan_chain", "scan_versions"]


@dataclass(frozen=True, slots=True)
class VersionIndex:
    """Committed versions of a run (those whose manifest exists)."""

    deltas: frozenset[int]
    """Versions with a committed delta manifest."""
    snapshots: frozenset[int]
    """Versions with a committed snapshot manifest."""

    @property
    def latest(self) -> int | None:
        allv = self.deltas | self.snapshots
        return max(allv) if allv else None


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """How to reach ``target``: optionally a snapshot, then deltas in order."""

    target: int
    """The version reached."""
    snapshot: int | None
    """Snapshot to start from; None when replaying from the held version."""
    deltas: tuple[int, ...]
    """Deltas to apply, oldest first."""


def plan_chain(index: VersionIndex, target: int, held: int | None = None) -> ChainPlan:
    """Plan the cheapest path to ``target``.

    From a held version, replaying the missed deltas costs O(missed steps) and
    wins whenever the chain is unbroken. Otherwise: the newest snapshot at or
    below ``target`` from which every delta up to ``target`` exists.
    """
    if target not in index.deltas and target not in index.snapshots:
        raise VersionNotFound(f"version {target} is not committed (no manifest)")
    if held is not None:
        if held > target:
            raise ChainError(
                f"cannot go back from version {held} to {target}: deltas only move forward"
            )
        if held == target:
            return ChainPlan(target, None, ())
        if all(v in index.deltas for v in range(held + 1, target + 1)):
            return ChainPlan(target, None, tuple(range(held + 1, target + 1)))
    for s in sorted((s for s in index.snapshots if s <= target), reverse=True):
        if all(v in index.deltas for v in range(s + 1, target + 1)):
            return ChainPlan(target, s, tuple(range(s + 1, target + 1)))
    start = held if held is not None else (min(index.snapshots) if index.snapshots else None)
    if start is None:
        raise ChainError(
            f"version {target} is unreachable: the store holds no snapshot at or below it"
        )
    missing = [v for v in range(start + 1, target + 1) if v not in index.deltas]
    raise ChainError(
        f"version {target} is unreachable: delta(s) {missing[:10]} missing after version {start}"
    )


def scan_versions(store: Store) -> VersionIndex:
    """List committed versions: a version exists exactly when its manifest does.

    One recursive listing per kind (a single request per 1,000 keys on S3),
    not a request per version.
    """
    found: dict[str, set[int]] = {"delta": set(), "snapshot": set()}
    for kind in found:
        for key in store.list(f"{kind}s"):
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == "manifest.json":
                v = parse_version_dir(parts[1])
                if v is not None:
                    found[kind].add(v)
    return VersionIndex(frozenset(found["delta"]), frozenset(found["snapshot"]))
