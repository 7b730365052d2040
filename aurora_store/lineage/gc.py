"""Retention: remove versions no retained chain needs, orphans, and dead temporary files.

The rule (``aurora gc``, the Trainer every N steps, each Relay on its mirror)
keeps the newest K snapshots and every version after the oldest of them, so
any version from that snapshot on stays reachable (snapshot plus deltas).

The store alone cannot tell which versions live Actors still hold or are
staging, nor which a Relay is still copying; a caller that knows (the
coordination layer, :mod:`aurora_store.coordination.retention`) passes a
:class:`~aurora_store.lineage.interfaces.HeldVersions`. Each held version
keeps its own manifest, the chain that reaches it (snapshot plus deltas, as
:func:`~aurora_store.lineage.plan.plan_chain` would pick) and the deltas after
it, so its holder still catches up delta by delta. Only ``force`` deletes
them anyway (an operator who knows those holders are gone).

Garbage that no manifest names goes once older than a *grace*: an orphan (an
object of a publish attempt that never committed) looks exactly like an
object of a publish in flight until its manifest lands, and a temporary
file (:data:`~aurora_store.storage.base.TEMP_PREFIX`, written by the
local-file backend) exactly like one being written. A grace far longer than
any write (an hour by default) tells the dead from the busy.

Held versions are read *before* anything is deleted, and an error reading
them (Redis away) propagates: retention never deletes blind. Deletion goes
manifest first, so a version disappears before its objects; a collection
cut short leaves orphans, which the next one removes.

Results that Actors wrote to the store (``results/<actor id>/``,
:mod:`aurora_store.lineage.results`) are no version's: the Trainer
deletes each once it has read it, and what is left (a settle the ledger
refused, a Trainer that died before reading) goes once older than the grace,
unless a step the ledger still holds may read it (a long batch, a batch a
resumed Trainer reopens): :func:`~aurora_store.lineage.results.results_to_remove`.
Which steps those are comes from an
:class:`~aurora_store.lineage.results.OpenBatches` (``held`` answers it when
it is :func:`aurora_store.coordination.retention.run_held_versions`); with
none, old results are kept (nobody can tell), and an error asking it
propagates like one reading held versions. Weight readers never look there
(like ``eval/``).

Trainer checkpoints (``checkpoints/step-N/``) are pruned by the Trainer
itself; what it never sees are the parts of an attempt that was not
committed (a Trainer killed while uploading). Those go once no record lists
them, their attempt stopped writing a grace ago and can no longer commit
(:mod:`aurora_store.lineage.ckpt_orphans`).

Only versions that count (:mod:`aurora_store.lineage.trusted`: trusted, on
the chain, at or below the Trainer's head when the caller has it) decide the
floor: anyone can plant ``snapshots/v9999999999`` and would otherwise move the
floor above every real version. A listed manifest that does not count is
never a reason to delete anything: one at or below the chain's head goes by
the rule like any version (below the floor and unheld: deleted), one above
it is left in place and named (``not_committed``). It may be a plant or a
version written after the head was read; an operator who knows inspects and
deletes it. Without version 0 in the store the root of the chain is
inferred, so deleting "everything that does not count" could delete a real
chain; leaving those manifests costs only their bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aurora_store.errors import AuroraError, ConfigError
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.lineage.ckpt_orphans import checkpoint_orphans
from aurora_store.lineage.interfaces import HeldVersions
from aurora_store.lineage.plan import VersionIndex, plan_chain
from aurora_store.lineage.report import Lineage, read_lineage
from aurora_store.lineage.results import RESULTS_PREFIX, OpenBatches, results_to_remove
from aurora_store.storage import Store
from aurora_store.storage.base import TEMP_PREFIX

if TYPE_CHECKING:
    from aurora_store.format.signing import TrustKeys
    from aurora_store.lineage.interfaces import CommitRecords
    from aurora_store.lineage.trusted import Committed

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_MIN_ORPHAN_AGE_S",
    "GcPlan",
    "plan_gc",
    "retain",
    "retained",
    "retention_floor",
    "run_gc",
]

#: An uncommitted attempt (or a temporary file) younger than this may still be being written.
DEFAULT_GRACE_S = 3600.0
#: The older name of :data:`DEFAULT_GRACE_S` (``aurora gc --min-orphan-age``).
DEFAULT_MIN_ORPHAN_AGE_S = DEFAULT_GRACE_S

VersionId = tuple[str, int]


def retention_floor(snapshots: Iterable[int], keep_snapshots: int) -> int | None:
    """The oldest snapshot the rule keeps, or None while fewer than ``keep_snapshots`` exist (all kept)."""
    if keep_snapshots < 1:
        raise ConfigError(f"--keep-snapshots must be >= 1, got {keep_snapshots}")
    snaps = sorted(set(snapshots), reverse=True)
    return snaps[keep_snapshots - 1] if len(snaps) >= keep_snapshots else None


def retained(kind: str, version: int, floor: int | None) -> bool:
    """Whether the rule alone keeps ``kind`` ``version``: the floor snapshot and everything after it.

    The delta *at* the floor stays too: its ``weights_digest`` is what binds the
    floor snapshot to the chain (FORMAT.md §4.1); without it no reader would use
    that snapshot.
    """
    if floor is None:
        return True
    return version >= floor


@dataclass(slots=True)
class GcPlan:
    """What a collection removes (or, in a dry run, would remove), and what it spared and why."""

    versions: list[VersionId] = field(default_factory=list)
    """(kind, version) whose manifest and objects go."""
    orphans: list[str] = field(default_factory=list)
    """Objects no manifest references, older than the grace."""
    kept_snapshots: list[int] = field(default_factory=list)
    """The newest snapshots, kept by the rule."""
    young_orphans: int = 0
    """Orphans spared because they may belong to a publish in flight."""
    kept_for_held: list[VersionId] = field(default_factory=list)
    """(kind, version) the rule alone would remove, kept because live holders need them."""
    forced: list[VersionId] = field(default_factory=list)
    """(kind, version) live holders need, removed anyway (``force``)."""
    held: frozenset[int] | None = None
    """The versions live holders reported; None when nobody was asked (no Redis)."""
    temp_files: list[str] = field(default_factory=list)
    """Temporary files (``.tmp-*``) older than the grace: writers that died."""
    results: list[str] = field(default_factory=list)
    """Result objects (``results/``) older than the grace that no step the ledger holds may read."""
    young_results: int = 0
    """Result objects younger than the grace: perhaps not settled yet."""
    results_for_open_batches: int = 0
    """Result objects older than the grace, kept: a step the ledger still holds may read them."""
    results_unasked: int = 0
    """Result objects older than the grace, kept: no ledger was asked which batches are open."""
    checkpoint_orphans: list[str] = field(default_factory=list)
    """Checkpoint objects no record lists, of attempts that stopped a grace ago and can no longer commit."""
    young_checkpoint_objects: int = 0
    """Checkpoint objects no record lists, kept: their attempt may still be uploading or commit."""
    unreadable_checkpoints: list[str] = field(default_factory=list)
    """Checkpoint folders kept whole: their record could not be read."""
    young_temp_files: int = 0
    """Temporary files spared: they may be being written."""
    dry_run: bool = True
    """Whether nothing was deleted."""
    removed: int = 0
    """Objects deleted (0 in a dry run)."""
    not_committed: list[VersionId] = field(default_factory=list)
    """(kind, version) listed but not counted, above the chain's head: left in place for an operator."""

    def keys(self, lin: Lineage) -> list[str]:
        """Every key to delete, manifests first (a version disappears before its objects).

        Manifests go oldest version first, a snapshot before the delta of its
        version: a collection cut short leaves the newest versions, a chain
        with no gap, which still counts (:mod:`aurora_store.lineage.trusted`).
        """
        out = [manifest_key(k, v) for k, v in sorted(self.versions, key=lambda kv: (kv[1], kv[0] != "snapshot"))]
        for k, v in self.versions:
            m = lin.manifests[(k, v)] if (k, v) in lin.manifests else lin.uncounted[(k, v)]
            out.extend(f"{version_dir(k, v)}/{s.key}" for s in m.segments)
        return out + self.orphans + self.temp_files + self.results + self.checkpoint_orphans

    def summary(self) -> str:
        """One line: what went (or would go) and what was kept."""
        what = f"{len(self.versions)} version(s), {len(self.orphans)} orphan(s), {len(self.temp_files)} temporary file(s)"
        if self.results:
            what += f", {len(self.results)} result object(s)"
        if self.checkpoint_orphans:
            what += f", {len(self.checkpoint_orphans)} uncommitted checkpoint object(s)"
        line = f"would remove {what}" if self.dry_run else f"removed {self.removed} object(s): {what}"
        line += f"; kept snapshots {self.kept_snapshots}"
        if self.kept_for_held:
            line += f"; kept {len(self.kept_for_held)} version(s) for live holders"
        if self.forced:
            line += f"; removed {len(self.forced)} held version(s) by force"
        if self.not_committed:
            line += f"; left {len(self.not_committed)} manifest(s) that are not committed"
        return line


def _needed_by(lin: Lineage, held: frozenset[int]) -> set[VersionId]:
    """(kind, version) a holder of each version in ``held`` needs: that version, the
    chain that reaches it, and every delta after it."""
    index = VersionIndex(
        frozenset(v for k, v in lin.manifests if k == "delta"),
        frozenset(v for k, v in lin.manifests if k == "snapshot"),
    )
    need: set[VersionId] = set()
    for h in held:
        try:
            chain = plan_chain(index, h)
        except AuroraError:
            # Unreachable from the store (or never committed): its holder can only
            # move forward, so keep its own manifests and what follows.
            need.update((k, v) for k, v in [*lin.manifests, *lin.uncounted] if v == h)
        else:
            if chain.snapshot is not None:
                need.add(("snapshot", chain.snapshot))
                if ("delta", chain.snapshot) in lin.manifests:
                    need.add(("delta", chain.snapshot))  # binds that snapshot (FORMAT.md §4.1)
            need.update(("delta", v) for v in chain.deltas)
        need.update(("delta", v) for v in index.deltas if v > h)
    return need


def _held_set(held: HeldVersions | frozenset[int] | None) -> frozenset[int] | None:
    if held is None or isinstance(held, frozenset):
        return held
    return frozenset(held.held_versions())


def plan_gc(
    lin: Lineage,
    keep_snapshots: int,
    orphan_age: Callable[[str], float | None],
    min_orphan_age_s: float,
    held: HeldVersions | frozenset[int] | None = None,
    force: bool = False,
    spare_orphan: Callable[[str], bool] | None = None,
) -> GcPlan:
    """Pure planning over a lineage; ``orphan_age(key)`` gives an object's age in seconds.

    ``held`` (optional) names versions live Actors hold or stage and live
    Relays copy; whatever they need is kept even when the retention rule
    alone would remove it, unless ``force``. ``spare_orphan(key)`` True
    keeps an orphan whatever its age (counted in ``young_orphans``): the
    caller knows it is being written.

    Only the versions that count (``lin.manifests``) set the floor; the
    manifests that do not (``lin.uncounted``) follow the module docstring.
    """
    floor = retention_floor((v for k, v in lin.manifests if k == "snapshot"), keep_snapshots)
    held_now = _held_set(held)
    plan = GcPlan(held=held_now)
    snaps = sorted((v for k, v in lin.manifests if k == "snapshot"), reverse=True)
    plan.kept_snapshots = snaps[:keep_snapshots]
    need = _needed_by(lin, held_now) if held_now and floor is not None else set()
    if floor is not None:
        for kind, v in sorted(lin.manifests):
            if retained(kind, v, floor):
                continue
            if (kind, v) in need:
                (plan.forced if force else plan.kept_for_held).append((kind, v))
                if not force:
                    continue
            plan.versions.append((kind, v))
    head = lin.committed.head if lin.committed is not None else None
    for kind, v in sorted(lin.uncounted, key=lambda kv: (kv[1], kv[0])):
        if head is None or v > head:
            plan.not_committed.append((kind, v))
        elif floor is not None and not retained(kind, v, floor):
            if (kind, v) in need:
                (plan.forced if force else plan.kept_for_held).append((kind, v))
                if not force:
                    continue
            plan.versions.append((kind, v))
    for key in lin.orphans:
        age = orphan_age(key)
        if age is not None and age >= min_orphan_age_s and not (spare_orphan is not None and spare_orphan(key)):
            plan.orphans.append(key)
        else:
            plan.young_orphans += 1
    return plan


def _temp_files(store: Store) -> list[str]:
    """Keys of every temporary file under the run root (hidden from :meth:`Store.list`).

    Only the local-file backend writes them (S3 and memory create in one
    request), so other backends are not listed a second time.
    """
    if store.protocol != "file":
        return []
    try:
        found = store.fs.find(store.root)
    except FileNotFoundError:
        return []
    root = store.root + "/"
    return sorted(p[len(root) :] for p in found if p.startswith(root) and os.path.basename(p).startswith(TEMP_PREFIX))


def _prune_empty_folders(store: Store, keys: Iterable[str]) -> None:
    """Remove folders the deletion emptied (local files only; object stores have no folders)."""
    if store.protocol != "file":
        return
    folders = {os.path.dirname(k) for k in keys}
    for folder in sorted(folders, key=lambda f: -f.count("/")):
        while folder and folder not in ("deltas", "snapshots"):
            try:
                os.rmdir(f"{store.root}/{folder}")
            except OSError:
                break  # not empty (or gone): stop climbing
            folder = os.path.dirname(folder)


def retain(
    store: Store,
    keep_snapshots: int,
    held: HeldVersions | frozenset[int] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    force: bool = False,
    dry_run: bool = False,
    say: Callable[[str], None] | None = None,
    spare_orphan: Callable[[str], bool] | None = None,
    trust: TrustKeys | None = None,
    commits: CommitRecords | None = None,
    ceiling: int | None = None,
    committed: Committed | None = None,
    batches: OpenBatches | None = None,
) -> GcPlan:
    """Apply retention to ``store``: the call the Trainer makes every N steps and each Relay on its mirror.

    Keeps the newest ``keep_snapshots`` snapshots and every version after the
    oldest of them; keeps whatever ``held`` says live Actors and Relays need
    (unless ``force``; a frozenset is taken as already read); removes orphans
    and temporary files older than ``grace_s`` (``spare_orphan`` as in
    :func:`plan_gc`). ``held`` is read first: if that fails (Redis away) the
    error propagates and nothing is deleted. ``dry_run`` only plans. ``say``
    receives one line per decision (None: silent). Returns the plan, with
    ``removed`` set.

    Which versions count (:func:`~aurora_store.lineage.report.read_lineage`):
    ``trust``, ``commits`` and ``ceiling`` (the Trainer's head, from its
    fenced record or its own memory) as there; ``committed``: those of the
    run's origin, for a mirror (a Relay's clean-up).

    ``batches``: which steps the ledger holds, whose results stay (default:
    ``held`` when it answers that too; None: old results are kept).
    ``force`` also removes old results of open batches, and checkpoint
    objects of attempts whose step is not behind the head.
    """
    if grace_s < 0:
        raise ConfigError(f"the grace must be >= 0 seconds, got {grace_s}")
    if batches is None and isinstance(held, OpenBatches):
        batches = held
    held_now = _held_set(held)  # before anything else: never delete blind
    lin = read_lineage(store, trust, commits, ceiling, committed=committed)
    now = time.time()

    def age(key: str) -> float | None:
        t = store.modified(key)
        return None if t is None else now - t

    plan = plan_gc(lin, keep_snapshots, age, grace_s, held_now, force, spare_orphan)
    for key in _temp_files(store):
        a = age(key)
        if a is not None and a >= grace_s:
            plan.temp_files.append(key)
        else:
            plan.young_temp_files += 1
    # Everything below is read before anything is deleted; an error (Redis or the store away) propagates.
    sweep = results_to_remove(store.list(RESULTS_PREFIX), age, grace_s, batches, force)
    plan.results, plan.young_results = sweep.remove, sweep.young
    plan.results_for_open_batches, plan.results_unasked = sweep.open_batches, sweep.unasked
    head = lin.committed.head if lin.committed is not None else None
    ckpt = checkpoint_orphans(store, age, grace_s, head, force)
    plan.checkpoint_orphans, plan.young_checkpoint_objects, plan.unreadable_checkpoints = ckpt.remove, ckpt.young, ckpt.unreadable
    plan.dry_run = dry_run
    keys = plan.keys(lin)
    if say is not None:
        _report(plan, grace_s, say)
    if not dry_run:
        for k in keys:
            store.delete(k)
            plan.removed += 1
        _prune_empty_folders(store, keys)
    if say is not None:
        say(f"{'dry run: would remove' if dry_run else 'removed'} {len(keys)} object(s); kept snapshots {plan.kept_snapshots}")
    return plan


def _report(plan: GcPlan, grace_s: float, say: Callable[[str], None]) -> None:
    verb = "would delete" if plan.dry_run else "deleting"
    for kind, v in plan.versions:
        say(f"{verb} {kind} {v}" + (" (held by a live Actor or Relay: --force)" if (kind, v) in plan.forced else ""))
    if plan.orphans:
        say(f"{verb} {len(plan.orphans)} orphan object(s)")
    if plan.temp_files:
        say(f"{verb} {len(plan.temp_files)} temporary file(s) older than {grace_s:.0f}s")
    if plan.results:
        say(f"{verb} {len(plan.results)} result object(s) older than {grace_s:.0f}s (results/: read, or never settled)")
    if plan.results_for_open_batches:
        say(
            f"keeping {plan.results_for_open_batches} result object(s) older than {grace_s:.0f}s: a batch the ledger holds may still read them"
        )
    if plan.results_unasked:
        say(
            f"keeping {plan.results_unasked} result object(s) older than {grace_s:.0f}s: no ledger was asked which batches are "
            "open (--redis URL --run NAME; --force removes them)"
        )
    if plan.checkpoint_orphans:
        say(f"{verb} {len(plan.checkpoint_orphans)} checkpoint object(s) no record lists (attempts that were never committed)")
    if plan.young_checkpoint_objects:
        say(f"keeping {plan.young_checkpoint_objects} uncommitted checkpoint object(s): their attempt may still be uploading or commit")
    if plan.unreadable_checkpoints:
        say(
            f"keeping {len(plan.unreadable_checkpoints)} checkpoint folder(s) whose record cannot be read: {plan.unreadable_checkpoints[:5]}"
        )
    if plan.kept_for_held:
        say(
            f"keeping {len(plan.kept_for_held)} version(s) that live Actors still need (or live Relays mirror): "
            f"{plan.kept_for_held} (--force deletes them)"
        )
    if plan.young_orphans:
        say(f"keeping {plan.young_orphans} orphan object(s) younger than {grace_s:.0f}s (maybe a publish in flight)")
    if plan.young_temp_files:
        say(f"keeping {plan.young_temp_files} temporary file(s) younger than {grace_s:.0f}s (maybe a write in flight)")
    if plan.not_committed:
        shown = ", ".join(f"{k} {v}" for k, v in plan.not_committed[:10])
        more = f" and {len(plan.not_committed) - 10} more" if len(plan.not_committed) > 10 else ""
        say(
            f"leaving {len(plan.not_committed)} manifest(s) that are not committed ({shown}{more}): not counted for "
            "retention; inspect them (`aurora lineage`) and delete them if nobody published them"
        )


def run_gc(
    store: Store,
    keep_snapshots: int,
    apply: bool = False,
    min_orphan_age_s: float = DEFAULT_MIN_ORPHAN_AGE_S,
    say: Callable[[str], None] = print,
    held: HeldVersions | None = None,
    force: bool = False,
    trust: TrustKeys | None = None,
    ceiling: int | None = None,
) -> GcPlan:
    """Plan, print, and (with ``apply``) delete: :func:`retain` with the CLI's defaults (a dry run, printing)."""
    return retain(store, keep_snapshots, held, min_orphan_age_s, force=force, dry_run=not apply, say=say, trust=trust, ceiling=ceiling)
