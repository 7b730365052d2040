"""``aurora verify``: re-hash every object and check the chain of states.

Collects every problem instead of stopping at the first, each naming the
object at fault, so one run tells an operator everything that is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aurora_store.codec.entries import ParamSpec
from aurora_store.config import DEFAULT_STREAMS
from aurora_store.errors import AuroraError, SegmentError
from aurora_store.format.limits import VersionGuard
from aurora_store.format.manifest import Manifest, content_digest, manifest_key
from aurora_store.format.segment import decode_segment
from aurora_store.lineage.fetch import fetch_objects
from aurora_store.lineage.report import Lineage, read_lineage
from aurora_store.storage import Store

if TYPE_CHECKING:
    from aurora_store.format.signing import TrustKeys
    from aurora_store.lineage.interfaces import CommitRecords

__all__ = ["VerifyReport", "verify_run"]


@dataclass(slots=True)
class VerifyReport:
    """Outcome of :func:`verify_run`."""

    checked_versions: int = 0
    checked_objects: int = 0
    checked_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _state_at(lin: Lineage, v: int) -> tuple[str | None, str | None]:
    """(state, manifest key) of version v: the delta's, else the snapshot's."""
    for kind in ("delta", "snapshot"):
        m = lin.manifests.get((kind, v))
        if m is not None:
            return m.state, manifest_key(kind, v)
    return None, None


def verify_run(
    store: Store,
    first: int | None = None,
    last: int | None = None,
    deep: bool = False,
    streams: int = DEFAULT_STREAMS,
    progress: Callable[[str], None] | None = None,
    trust: TrustKeys | None = None,
    commits: CommitRecords | None = None,
    ceiling: int | None = None,
) -> VerifyReport:
    """Verify versions in ``[first, last]`` (all by default).

    Checks: every object's size and sha256 against its manifest; each delta's
    ``base_state`` equals the state of version V-1; each manifest's ``state``
    digest (checked when the manifest is parsed); a snapshot's state equals
    the delta's at the same version, or is its own content digest when it is
    the first version of the run. With ``deep``, every segment is also decoded
    and validated (FORMAT.md §3) against the run's model, the version as a
    whole too (no overlapping entries, the declared ``nnz``). With ``trust``,
    every manifest must be signed by one of its keys (FORMAT.md §4.1): one
    that is not is a problem and none of its objects is read. With
    ``commits`` (a run that commits through Redis, FORMAT.md §1), so is a
    manifest without a matching commit record.

    Only the versions that count (:mod:`aurora_store.lineage.trusted`) are
    checked; every other manifest listed is named "not committed": a warning
    when it lies beyond the chain (a plant, or history an operator should
    look at), a problem when it breaks the chain right after its head (delta
    H+1 on another base), when it is at or below ``ceiling`` (the Trainer's
    head: the record says it was published, yet it does not count), or when
    ``first``/``last`` ask for it.
    """
    rep = VerifyReport()
    lin = read_lineage(store, trust, commits, ceiling)
    rep.problems.extend(lin.problems)
    if lin.orphans:
        rep.warnings.append(f"{len(lin.orphans)} orphan object(s) (uncommitted publish attempts); `aurora gc` removes them")
    head = lin.committed.head if lin.committed is not None else None
    for kind, v, why in lin.ignored:
        line = f"{store.where(manifest_key(kind, v))}: not committed: {why}"
        asked = (first is not None or last is not None) and (first is None or v >= first) and (last is None or v <= last)
        broken = kind == "delta" and head is not None and v == head + 1 and "base_state" in why
        if asked or broken or (ceiling is not None and v <= ceiling):
            rep.problems.append(line)
        else:
            rep.warnings.append(line)
    if not lin.manifests:
        rep.problems.append(f"{store.url}: no committed version")
        return rep
    lo = first if first is not None else min(v for _, v in lin.manifests)
    hi = last if last is not None else max(v for _, v in lin.manifests)
    run_first = min(v for _, v in lin.manifests)
    for a, b in lin.gaps:
        if a <= hi and b >= lo:
            a, b = max(a, lo), min(b, hi)
            span = f"version {a}" if a == b else f"versions {a}–{b}"
            rep.problems.append(f"{store.where(manifest_key('delta', a))}: {span} missing (no delta and no snapshot)")
    model: dict[str, ParamSpec] | None = None
    for (kind, v), m in sorted(lin.manifests.items(), key=lambda x: (x[0][1], x[0][0] != "snapshot")):
        if kind == "snapshot":
            model = m.param_specs()
        if not lo <= v <= hi:
            continue
        rep.checked_versions += 1
        mk = store.where(manifest_key(kind, v))
        if kind == "delta":
            base_state, base_key = _state_at(lin, v - 1)
            if base_state is None:
                if v - 1 >= lo or v - 1 >= run_first:
                    rep.problems.append(f"{mk}: base version {v - 1} is not committed (chain broken)")
            elif m.base_state != base_state:
                rep.problems.append(f"{mk}: base_state {m.base_state} != state {base_state} of {store.where(base_key or '')}")
        else:
            d = lin.manifests.get(("delta", v))
            if d is not None and d.state != m.state:
                rep.problems.append(f"{mk}: snapshot state {m.state} != state {d.state} of delta {v}")
            if d is None and v != run_first:
                rep.problems.append(f"{mk}: snapshot {v} has no delta {v} to vouch for its state and is not the run's first version")
            if d is None and v == run_first and m.state != content_digest(m.segments):
                # The start of a collected run (gc removed the chain below it):
                # its state was vouched for when written and cannot be re-derived now.
                rep.warnings.append(f"{mk}: oldest version; history before it was collected, its state is taken as recorded")
        rep.problems.extend(_check_objects(store, m, deep and kind == "delta", model, streams, rep))
        if progress:
            progress(f"{kind} {v}: {len(m.segments)} object(s), {m.total_bytes} bytes checked")
    return rep


def _check_objects(
    store: Store, m: Manifest, deep: bool, model: Mapping[str, ParamSpec] | None, streams: int, rep: VerifyReport
) -> list[str]:
    """Size and sha256 of every object; with ``deep``, what applying the delta would check.

    A deep check decodes every segment through one :class:`VersionGuard`, as
    ``fetch_delta`` does: entries of one parameter that overlap, across
    segments or within one, are a problem (apply refuses them), and so are a
    segment of another version and a per-parameter ``nnz`` that differs from
    the manifest's. The decoded entries are not kept.
    """
    out: list[str] = []
    guard = VersionGuard.for_manifest(m.params, model) if deep else None

    def check(where: str, data: bytes) -> int:
        if guard is not None:
            seg = decode_segment(data, where, model, guard)
            if seg.version != m.version or seg.base_version != m.version - 1:
                raise SegmentError(
                    where, f"belongs to version {seg.version} (base {seg.base_version}), expected {m.version} (base {m.version - 1})"
                )
        return len(data)

    try:
        sizes = fetch_objects(store, m, streams, check)
        rep.checked_objects += len(sizes)
        rep.checked_bytes += sum(n for _, n in sizes)
    except AuroraError as e:
        out.append(str(e))
        return out
    if guard is not None:
        declared = {n: int(p.get("nnz", 0)) for n, p in m.params.items()}
        for name in sorted(guard.nnz.keys() | declared.keys()):
            if declared.get(name, 0) != guard.nnz.get(name, 0):
                out.append(
                    f"{store.where(manifest_key(m.kind, m.version))}: params[{name!r}].nnz is "
                    f"{declared.get(name, 0)}, segments carry {guard.nnz.get(name, 0)}"
                )
    return out
