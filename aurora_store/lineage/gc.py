"""``aurora gc``: remove orphans and versions that no retained chain needs.

Retention keeps the newest N snapshots and every delta after the oldest of
them, so any version from that snapshot on stays reachable (snapshot plus
deltas). Orphans (objects of publish attempts that never committed) are
removed only once older than ``min_orphan_age_s``: a publish in flight
looks exactly like an orphan until its manifest lands.

The store alone cannot tell which versions live Actors still hold or are
staging; a caller that knows (the coordination layer) passes a
:class:`~aurora_store.lineage.interfaces.HeldVersions`, and each held
version keeps its own manifest, the chain that reaches it (snapshot plus
deltas, as :func:`~aurora_store.lineage.plan.plan_chain` would pick) and
the deltas after it, so its holder still catches up delta by delta.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aurora_store.errors import AuroraError, ConfigError
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.lineage.interfaces import HeldVersions
from aurora_store.lineage.plan import VersionIndex, plan_chain
from aurora_store.lineage.report import Lineage, read_lineage
from aurora_store.storage import Store

__all__ = ["GcPlan", "plan_gc", "run_gc", "DEFAULT_MIN_ORPHAN_AGE_S"]

#: An uncommitted attempt younger than this may still be publishing.
DEFAULT_MIN_ORPHAN_AGE_S = 3600.0


@dataclass(slots=True)
class GcPlan:
    """What a collection would remove."""

    versions: list[tuple[str, int]] = field(default_factory=list)
    """(kind, version) whose manifest and objects go."""
    orphans: list[str] = field(default_factory=list)
    kept_snapshots: list[int] = field(default_factory=list)
    young_orphans: int = 0
    """Orphans spared because they may belong to a publish in flight."""
    kept_for_held: list[tuple[str, int]] = field(default_factory=list)
    """(kind, version) retention alone would remove, kept for versions live Actors hold."""

    def keys(self, lin: Lineage) -> list[str]:
        """Every key to delete, manifests first (a version disappears before its objects)."""
        out = [manifest_key(k, v) for k, v in self.versions]
        for k, v in self.versions:
            m = lin.manifests[(k, v)]
            out.extend(f"{version_dir(k, v)}/{s.key}" for s in m.segments)
        return out + self.orphans


def _needed_by(lin: Lineage, held: frozenset[int]) -> set[tuple[str, int]]:
    """(kind, version) a holder of each version in ``held`` needs: that version, the
    chain that reaches it, and every delta after it."""
    index = VersionIndex(
        frozenset(v for k, v in lin.manifests if k == "delta"),
        frozenset(v for k, v in lin.manifests if k == "snapshot"),
    )
    need: set[tuple[str, int]] = set()
    for h in held:
        try:
            chain = plan_chain(index, h)
        except AuroraError:
            # Unreachable from the store (or never committed): its holder can only
            # move forward, so keep its own manifests and what follows.
            need.update((k, v) for k, v in lin.manifests if v == h)
        else:
            if chain.snapshot is not None:
                need.add(("snapshot", chain.snapshot))
            need.update(("delta", v) for v in chain.deltas)
        need.update(("delta", v) for v in index.deltas if v > h)
    return need


def plan_gc(
    lin: Lineage,
    keep_snapshots: int,
    orphan_age: Callable[[str], float | None],
    min_orphan_age_s: float,
    held: HeldVersions | None = None,
) -> GcPlan:
    """Pure planning over a lineage; ``orphan_age(key)`` gives an object's age in seconds.

    ``held`` (optional) names versions live Actors hold or stage; whatever
    they need is kept even when the retention rule alone would remove it.
    """
    if keep_snapshots < 1:
        raise ConfigError(f"--keep-snapshots must be >= 1, got {keep_snapshots}")
    plan = GcPlan()
    snaps = sorted((v for k, v in lin.manifests if k == "snapshot"), reverse=True)
    plan.kept_snapshots = snaps[:keep_snapshots]
    if len(snaps) >= keep_snapshots:
        oldest = plan.kept_snapshots[-1]
        need = _needed_by(lin, held.held_versions()) if held is not None else set()
        for kind, v in sorted(lin.manifests):
            if (kind == "delta" and v <= oldest) or (kind == "snapshot" and v < oldest):
                if (kind, v) in need:
                    plan.kept_for_held.append((kind, v))
                else:
                    plan.versions.append((kind, v))
    for key in lin.orphans:
        age = orphan_age(key)
        if age is not None and age >= min_orphan_age_s:
            plan.orphans.append(key)
        else:
            plan.young_orphans += 1
    return plan


def run_gc(
    store: Store,
    keep_snapshots: int,
    apply: bool = False,
    min_orphan_age_s: float = DEFAULT_MIN_ORPHAN_AGE_S,
    say: Callable[[str], None] = print,
    held: HeldVersions | None = None,
) -> GcPlan:
    """Plan, print, and (with ``apply``) delete; ``held`` as in :func:`plan_gc`."""
    lin = read_lineage(store)
    now = time.time()

    def age(key: str) -> float | None:
        t = store.modified(key)
        return None if t is None else now - t

    plan = plan_gc(lin, keep_snapshots, age, min_orphan_age_s, held)
    keys = plan.keys(lin)
    verb = "deleting" if apply else "would delete"
    for kind, v in plan.versions:
        say(f"{verb} {kind} {v}")
    if plan.orphans:
        say(f"{verb} {len(plan.orphans)} orphan object(s)")
    if plan.kept_for_held:
        say(f"keeping {len(plan.kept_for_held)} version(s) that live Actors still need: {plan.kept_for_held}")
    if plan.young_orphans:
        say(f"keeping {plan.young_orphans} orphan object(s) younger than {min_orphan_age_s:.0f}s (maybe a publish in flight)")
    if apply:
        for k in keys:
            store.delete(k)
    say(f"{'removed' if apply else 'dry run: would remove'} {len(keys)} object(s); kept snapshots {plan.kept_snapshots}")
    return plan
