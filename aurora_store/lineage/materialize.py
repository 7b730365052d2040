"""Full weights of one version: a snapshot that counts, then the deltas after it.

Why apart from :mod:`aurora_store.lineage.fetch`: planning here asks
:mod:`aurora_store.lineage.trusted` which versions count, and that reads
through fetch; keeping the two apart keeps each module small and the import
order one-way. ``aurora delta apply``, the Trainer's resume and notebooks
call it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aurora_store.config import DEFAULT_STREAMS
from aurora_store.errors import ChainError, FormatError, IntegrityError, VersionNotFound
from aurora_store.format.manifest import Manifest
from aurora_store.lineage.fetch import ManifestReader, fetch_delta, fetch_snapshot, read_manifest
from aurora_store.lineage.plan import plan_chain
from aurora_store.lineage.trusted import committed_versions
from aurora_store.storage import Store

if TYPE_CHECKING:
    import torch

    from aurora_store.format.signing import TrustKeys
    from aurora_store.lineage.interfaces import CommitRecords

__all__ = ["materialize"]


def materialize(
    store: Store,
    target: int,
    streams: int = DEFAULT_STREAMS,
    progress: Callable[[str], None] | None = None,
    trust: TrustKeys | None = None,
    commits: CommitRecords | None = None,
) -> tuple[dict[str, torch.Tensor], str]:
    """Full fused weights of version ``target``: newest usable snapshot, then deltas.

    Returns (tensors, state). Each delta is checked against the state of the
    version it lands on before it is applied. A snapshot that fails its
    checks (damaged bytes, a bad manifest) is set aside with a ``progress``
    note and the chain is planned again without it: an older snapshot and
    more deltas reach the same version. A damaged delta is not skipped (no
    other path crosses it) and its error propagates. ``trust``: every
    manifest used is checked (:func:`read_manifest`); an untrusted snapshot
    is planned around like a damaged one, an untrusted delta refused.

    Plans only over the versions that count
    (:func:`~aurora_store.lineage.trusted.committed_versions` of ``store``,
    which the caller names as the run's origin): on the chain from the root,
    at or below ``target``; a manifest listed beside them is named in a
    ``progress`` note and never read past its manifest. Versions above
    ``target`` are not read at all.
    """
    from aurora_store.apply.sink import FusedWeights, apply_delta

    reader = ManifestReader(store, trust, commits)

    def read(kind: str, version: int) -> Manifest:
        m = reader.get(kind, version)
        if m is None:
            raise VersionNotFound(reader.why(kind, version) or f"{kind} {version} is not readable")
        return m

    committed = committed_versions(store, ceiling=target, read=read)
    reader.snapshot_only = committed.snapshot_only
    index = committed.index
    if progress:
        for kind, v, why in committed.ignored:
            if v <= target:
                progress(f"{kind} {v} is not used: {why}")
    if target not in index.deltas and target not in index.snapshots:
        whys = [f"{kind} {v}: {why}" for kind, v, why in committed.ignored if v == target]
        for kind, v, _ in committed.ignored:
            if v == target and reader.why(kind, v) is not None:
                read_manifest(store, kind, v, trust, commits)  # raises what refused it (a signature, a record)
        if whys:
            raise VersionNotFound(f"{store.url}: version {target} is not committed ({'; '.join(whys)})")
    refused: dict[tuple[str, int], str] = {}
    while True:
        try:
            plan = plan_chain(index.without(set(refused)), target)
        except (ChainError, VersionNotFound) as e:
            if not refused:
                raise
            # Say what set the snapshots aside, not that the target vanished from the plan.
            failed = "; ".join(f"snapshot {v}: {why}" for (_, v), why in sorted(refused.items()))
            raise ChainError(f"version {target} is unreachable: {failed}") from e
        if plan.snapshot is None:
            raise ChainError(f"version {target} is unreachable: no usable snapshot at or below it")
        try:
            known = reader.get("snapshot", plan.snapshot)
            if known is None and commits is not None:  # refused by its record: say why, never re-read unchecked
                known = read_manifest(store, "snapshot", plan.snapshot, trust, commits)
            sm, tensors = fetch_snapshot(store, plan.snapshot, streams, known, trust=trust)
        except (FormatError, IntegrityError, VersionNotFound) as e:
            refused[("snapshot", plan.snapshot)] = str(e)
            if progress:
                progress(f"snapshot {plan.snapshot} is unusable ({e}); planning around it")
            continue
        break
    if progress:
        progress(f"snapshot {plan.snapshot}: {len(tensors)} tensors, {sm.total_bytes} bytes")
    state = sm.state
    sink = FusedWeights(tensors)
    for v in plan.deltas:
        known = reader.get("delta", v)  # read and checked while counting the chain
        m, staged = fetch_delta(store, v, sink.specs(), streams, expect_base_state=state, manifest=known, trust=trust)
        apply_delta(staged, sink)
        state = m.state
        if progress:
            progress(f"delta {v}: {staged.nnz} changed elements, {m.total_bytes} bytes")
    return tensors, state
