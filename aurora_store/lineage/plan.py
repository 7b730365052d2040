"""Which versions a run holds, and the cheapest way to reach one.

:func:`plan_chain` decides whether to replay deltas from a held version or
to start from a snapshot. It reads nothing itself: given only version
numbers it prefers replay whenever the chain is unbroken; given a
:data:`Cost` (bytes per manifest, which the caller reads: manifests are
small) it compares the bytes each path must fetch. :func:`scan_versions`
is the one listing that feeds it. Neither imports torch, so the read-only
tools (``aurora lineage``, ``aurora verify``, ``aurora gc``) and retention
can use them cheaply.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aurora_store.errors import ChainError, VersionNotFound
from aurora_store.format.manifest import parse_version_dir
from aurora_store.storage import Store

__all__ = ["ChainPlan", "Cost", "VersionIndex", "plan_chain", "scan_versions"]

Cost = Callable[[str, int], int | None]
"""``cost(kind, version)``: bytes a reader fetches for that version (its manifest's
``total_bytes``), or None when the version is not there to fetch (no manifest, or
one the reader will not use)."""


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

    def without(self, excluded: set[tuple[str, int]] | frozenset[tuple[str, int]]) -> VersionIndex:
        """This index with ``(kind, version)`` pairs removed (versions a reader refuses to use)."""
        if not excluded:
            return self
        return VersionIndex(
            frozenset(v for v in self.deltas if ("delta", v) not in excluded),
            frozenset(v for v in self.snapshots if ("snapshot", v) not in excluded),
        )


@dataclass(frozen=True, slots=True)
class ChainPlan:
    """How to reach ``target``: optionally a snapshot, then deltas in order."""

    target: int
    """The version reached."""
    snapshot: int | None
    """Snapshot to start from; None when replaying from the held version."""
    deltas: tuple[int, ...]
    """Deltas to apply, oldest first."""
    bytes: int | None = None
    """What the plan fetches, when it was planned with a :data:`Cost` (else None)."""


def plan_chain(index: VersionIndex, target: int, held: int | None = None, cost: Cost | None = None) -> ChainPlan:
    """Plan the cheapest path to ``target``.

    Without ``cost``: from a held version, replaying the missed deltas wins
    whenever the chain is unbroken; otherwise the newest snapshot at or below
    ``target`` from which every delta up to ``target`` exists.

    With ``cost`` and a held version: the path that fetches the fewest
    bytes, replay from ``held`` or any snapshot above it plus the deltas
    after it. A replay of many versions can outweigh one snapshot: a
    laggard that replays a hundred dense deltas pays more than the newest
    snapshot and a few deltas, and holds each decoded delta meanwhile. The
    walk goes down from ``target`` adding each delta's bytes and stops as
    soon as that sum alone reaches the best path found (no older start can
    be cheaper), so it reads few manifests. Equal bytes favour replay (no
    full copy of the weights in memory). A delta ``cost`` calls missing
    breaks the chain there, as one absent from ``index`` does.

    With ``cost`` and no held version, the newest usable snapshot is chosen
    as without it (older snapshots pay for more deltas) and ``bytes`` says
    what it costs.
    """
    if target not in index.deltas and target not in index.snapshots:
        raise VersionNotFound(f"version {target} is not committed (no manifest)")
    if held is not None and held > target:
        raise ChainError(f"cannot go back from version {held} to {target}: deltas only move forward")
    if held == target:
        return ChainPlan(target, None, (), 0 if cost is not None else None)
    if cost is None or held is None:
        plan = _plan_by_count(index, target, held)
        if cost is None:
            return plan
        return _priced(plan, cost, index, target)
    return _plan_by_bytes(index, target, held, cost)


def _replay_floor(index: VersionIndex, target: int) -> int:
    """The lowest ``lo`` such that every delta ``lo..target`` is in ``index`` (``target + 1`` when
    delta ``target`` is not): a walk down over the deltas that exist, never a range of numbers."""
    lo = target + 1
    while lo - 1 in index.deltas:
        lo -= 1
    return lo


def _plan_by_count(index: VersionIndex, target: int, held: int | None) -> ChainPlan:
    lo = _replay_floor(index, target)  # a start at s replays s+1..target: it needs s + 1 >= lo
    if held is not None and held + 1 >= lo:
        return ChainPlan(target, None, tuple(range(held + 1, target + 1)))
    usable = [s for s in index.snapshots if lo - 1 <= s <= target]
    if usable:
        s = max(usable)
        return ChainPlan(target, s, tuple(range(s + 1, target + 1)))
    raise _unreachable(index, target, held)


def _priced(plan: ChainPlan, cost: Cost, index: VersionIndex, target: int) -> ChainPlan:
    """``plan`` with its bytes; a snapshot or delta the cost calls missing makes it unusable."""
    total = 0
    for kind, v in ([("snapshot", plan.snapshot)] if plan.snapshot is not None else []) + [("delta", d) for d in plan.deltas]:
        c = cost(kind, v)
        if c is None:
            # The index listed it but the reader cannot use it: plan again without it.
            return _priced(_plan_by_count(index.without({(kind, v)}), target, None), cost, index.without({(kind, v)}), target)
        total += c
    return ChainPlan(plan.target, plan.snapshot, plan.deltas, total)


def _plan_by_bytes(index: VersionIndex, target: int, held: int, cost: Cost) -> ChainPlan:
    best: tuple[int, int | None] | None = None
    """(bytes, snapshot or None for replay)"""
    acc = 0  # bytes of the deltas after v up to the target
    v = target
    while True:
        if v == held:
            if best is None or acc <= best[0]:
                best = (acc, None)
            break  # a snapshot at or below the held version cannot beat replaying from it
        if best is not None and acc >= best[0]:
            break  # every older start pays at least acc
        if v in index.snapshots:
            c = cost("snapshot", v)
            if c is not None and (best is None or acc + c < best[0]):
                best = (acc + c, v)
        if v not in index.deltas:
            break  # the chain is broken below v
        c = cost("delta", v)
        if c is None:
            break
        acc += c
        v -= 1
    if best is None:
        raise _unreachable(index, target, held)
    start = held if best[1] is None else best[1]
    return ChainPlan(target, best[1], tuple(range(start + 1, target + 1)), best[0])


def _unreachable(index: VersionIndex, target: int, held: int | None) -> ChainError:
    start = held if held is not None else (min(index.snapshots) if index.snapshots else None)
    if start is None:
        return ChainError(f"version {target} is unreachable: the store holds no snapshot at or below it")
    # The first few missing deltas, found by walking up from the start over those that exist.
    missing: list[int] = []
    v = start + 1
    while v <= target and len(missing) < 10:
        if v not in index.deltas:
            missing.append(v)
        v += 1
    if not missing:
        return ChainError(f"version {target} is unreachable from version {start}: a version on the way cannot be used")
    return ChainError(f"version {target} is unreachable: delta(s) {missing} missing after version {start}")


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
