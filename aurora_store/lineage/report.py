"""What a run holds: one row per version that counts, plus what does not, orphans and gaps.

This reads manifests and listings only (cheap); :mod:`aurora_store.lineage.verify`
re-hashes objects. Notebooks and ``aurora lineage`` are built on it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from aurora_store.errors import AuroraError, ManifestError
from aurora_store.format.manifest import Manifest, manifest_key, parse_version_dir, version_dir
from aurora_store.storage import Store

if TYPE_CHECKING:
    from aurora_store.format.signing import TrustKeys
    from aurora_store.lineage.interfaces import CommitRecords
    from aurora_store.lineage.trusted import Committed

__all__ = ["VersionRow", "Lineage", "gap_ranges", "read_lineage", "layer_of"]

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class VersionRow:
    """One committed version."""

    kind: str
    version: int
    base: int | None
    state: str
    bytes: int
    changed: int
    """Changed elements (deltas); 0 for snapshots."""
    numel: int
    """Elements of the parameters listed (all of them for a snapshot)."""
    segments: int
    created_at: str
    key_id: str | None = None
    """Key id of the manifest's signature (FORMAT.md §4.1), as written; None: unsigned.
    Verified only when :func:`read_lineage` was given trust keys."""

    @property
    def density(self) -> float | None:
        if self.kind != "delta":
            return None
        return self.changed / self.numel if self.numel else 0.0


@dataclass(slots=True)
class Lineage:
    """Everything :func:`read_lineage` found."""

    url: str
    rows: list[VersionRow] = field(default_factory=list)
    manifests: dict[tuple[str, int], Manifest] = field(default_factory=dict)
    """The manifests that count (rows)."""
    orphans: list[str] = field(default_factory=list)
    """Keys no manifest references (killed or in-flight publishes)."""
    gaps: list[list[int]] = field(default_factory=list)
    """``[first, last]`` of each run of versions, between the first and last manifest read, with
    neither a delta nor a snapshot (ranges: their size never depends on the version numbers)."""
    ignored: list[tuple[str, int, str]] = field(default_factory=list)
    """(kind, version, why) of each manifest read that does not count (:mod:`aurora_store.lineage.trusted`):
    planted, beyond the chain or the Trainer's head, or a snapshot not bound to it. Shown as "not committed"."""
    uncounted: dict[tuple[str, int], Manifest] = field(default_factory=dict)
    """The manifests of :attr:`ignored` (retention needs their objects)."""
    committed: Committed | None = None
    """The versions that count, as computed (or given)."""
    problems: list[str] = field(default_factory=list)
    """Manifests that could not be read."""

    @property
    def model_numel(self) -> int | None:
        snaps = [m for (k, _), m in self.manifests.items() if k == "snapshot"]
        return snaps[-1].numel if snaps else None

    def to_json(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = asdict(r)
            d["density"] = r.density
            rows.append(d)
        return {
            "url": self.url,
            "versions": rows,
            "orphans": self.orphans,
            "gaps": self.gaps,
            "not_committed": [{"kind": k, "version": v, "why": why} for k, v, why in self.ignored],
            "problems": self.problems,
        }

    def param_density(self) -> dict[int, dict[str, float]]:
        """Delta version -> {fused param: changed fraction}."""
        out: dict[int, dict[str, float]] = {}
        for (kind, v), m in sorted(self.manifests.items()):
            if kind != "delta":
                continue
            out[v] = {n: int(p.get("nnz", 0)) / max(1, _numel(p["shape"])) for n, p in m.params.items()}
        return out


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def layer_of(param: str) -> int | None:
    """Decoder layer index of a parameter name, or None (embeddings, final norm)."""
    m = _LAYER.search(param)
    return int(m.group(1)) if m else None


def _key_id(m: Manifest) -> str | None:
    sig = m.extra.get("signature")
    kid = sig.get("key_id") if isinstance(sig, dict) else None
    return kid if isinstance(kid, str) else None


def read_lineage(
    store: Store,
    trust: TrustKeys | None = None,
    commits: CommitRecords | None = None,
    ceiling: int | None = None,
    snapshot_only: bool | None = None,
    committed: Committed | None = None,
) -> Lineage:
    """Read every manifest of the run and classify every object under it.

    ``trust``: a manifest these keys do not accept (unsigned, untrusted or bad
    signature) is a problem, and left out like an unreadable one.
    ``commits``: the run commits through Redis (FORMAT.md §1); a manifest
    without a matching record is a problem too (not committed, or refused).

    Of the manifests read, only those that count
    (:mod:`aurora_store.lineage.trusted`: on the chain from the root, at or
    below ``ceiling``, the Trainer's head, when given) are rows and
    :attr:`Lineage.manifests`; the others are named in
    :attr:`Lineage.ignored` and kept in :attr:`Lineage.uncounted`.
    ``committed``: the versions that count, computed elsewhere (a mirror
    counts what origin counts: a version here counts when it counts there
    with the same state). ``snapshot_only`` as for
    :func:`~aurora_store.lineage.trusted.chain_of` (None: this listing decides).
    """
    from aurora_store.lineage.fetch import read_manifest_bytes  # capped: a planted giant is refused, never read whole
    from aurora_store.lineage.trusted import chain_of, fact_of

    if commits is not None:
        from aurora_store.lineage.fetch import check_commit_record
    lin = Lineage(store.url)
    keys = store.list()
    by_vdir: dict[tuple[str, int], list[str]] = {}
    for k in keys:
        parts = k.split("/")
        if len(parts) >= 3 and parts[0] in ("deltas", "snapshots"):
            v = parse_version_dir(parts[1])
            if v is not None:
                by_vdir.setdefault((parts[0][:-1], v), []).append(k)
    read: dict[tuple[str, int], Manifest] = {}
    for (kind, v), ks in sorted(by_vdir.items(), key=lambda x: (x[0][1], x[0][0])):
        vdir = version_dir(kind, v)
        mkey = f"{vdir}/manifest.json"
        if mkey not in ks:
            lin.orphans.extend(ks)  # never committed: every object is an orphan
            continue
        try:
            data = read_manifest_bytes(store, mkey, kind, v)
            if commits is not None:
                check_commit_record(commits, kind, v, data, store.where(mkey))
            m = Manifest.from_bytes(data, store.where(mkey))
            if m.kind != kind or m.version != v:
                raise ManifestError(store.where(mkey), f"describes {m.kind} {m.version}, expected {kind} {v}")
            if trust is not None:
                trust.check_json(json.loads(data), store.where(mkey), kind, v)
        except AuroraError as e:
            lin.problems.append(str(e))
            continue
        read[(kind, v)] = m
        referenced = {f"{vdir}/{s.key}" for s in m.segments} | {mkey}
        lin.orphans.extend(k for k in ks if k not in referenced)
    if committed is None:
        facts = {kv: fact_of(m, store.where(manifest_key(*kv))) for kv, m in read.items()}
        committed = chain_of(facts, ceiling, snapshot_only)
        lin.ignored = list(committed.ignored)
    else:
        for (kind, v), m in read.items():
            if not committed.counts(kind, v):
                lin.ignored.append((kind, v, "not a version the run's origin counts"))
            elif committed.states.get(v) != m.state:
                lin.ignored.append((kind, v, f"its state differs from origin's at v{v}"))
    lin.committed = committed
    skip = {(kind, v) for kind, v, _ in lin.ignored}
    for (kind, v), m in read.items():
        if (kind, v) in skip:
            lin.uncounted[(kind, v)] = m
            continue
        lin.manifests[(kind, v)] = m
        lin.rows.append(
            VersionRow(
                kind=kind,
                version=v,
                base=m.base_version,
                state=m.state,
                bytes=m.total_bytes,
                changed=m.nnz if kind == "delta" else 0,
                numel=m.numel,
                segments=len(m.segments),
                created_at=m.created_at,
                key_id=_key_id(m),
            )
        )
    # Density over the whole model, when a snapshot tells us its size.
    total = lin.model_numel
    if total:
        lin.rows = [VersionRow(**{**asdict(r), "numel": total}) if r.kind == "delta" else r for r in lin.rows]
    lin.gaps = gap_ranges({v for _, v in read})
    return lin


def gap_ranges(versions: Iterable[int]) -> list[list[int]]:
    """``[first, last]`` of each run of missing versions between the lowest and highest of ``versions``.

    Proportional to the versions given, never to the numbers between them:
    one planted manifest at ``v9999999999`` is one range, not ten billion entries.
    """
    have = sorted(set(versions))
    return [[a + 1, b - 1] for a, b in zip(have, have[1:], strict=False) if b > a + 1]
