"""The versions of a run that count: taken from trusted facts, never from a bare listing.

Why: anyone who can write objects into the bucket can create a manifest under
any free name (create-only stops overwrites, not new names). A listing
therefore says what *exists*, not what the Trainer committed. Everything that
decides on versions (the retention floor, what gc deletes, which version a
fresh Actor aims at, what ``aurora delta apply`` plans over, what ``aurora
lineage`` and ``aurora verify`` report) asks this module instead.

A listed manifest counts only when all of these hold:

- **Trust**: with trust keys, it is signed by one of them (FORMAT.md §4.1);
  in Redis-commit mode, its bytes match the commit record (FORMAT.md §1).
- **Ceiling**: it is at or below ``ceiling``, the head of the Trainer's
  fenced record in Redis, when the caller has it. Nothing above it counts.
- **Chain**: it lies on the chain of states. The root is version 0's
  snapshot; when retention removed version 0 (or delta 1 after it: a
  collection cut short), the root is a snapshot bound to its delta (equal
  ``weights_digest``, FORMAT.md §4.1) or the oldest delta (a run on a base
  every worker builds, or a collected one); of several such candidates the
  one whose chain is longest wins. From the
  root, delta V+1 counts when its ``base_state`` is the state of V; the
  chain stops at the first gap or mismatch. A snapshot at V > 0 counts only
  when delta V counts and binds it (equal ``weights_digest`` and ``state``).
- **Snapshot-only runs** (``transfer="full"``: every version a self-rooted
  snapshot, no delta at all) bind nothing; their snapshots count as they
  are. Whether a run is one must come from a trusted source: the caller says
  so (``snapshot_only``), or it is read from the listing of the store the
  caller names as origin. A mirror's listing never decides it (issue 24,
  hole 2: a mirror serving only a forged ``snapshots/vN`` with the true
  ``state`` copied in would otherwise look like a snapshot-only run).

Every listed manifest that does not count is named once in
:attr:`Committed.ignored` with the reason. Everything here is proportional to
the manifests listed: no loop runs over a range of version numbers, so a
manifest planted at ``v9999999999`` costs what any other manifest costs.

What an attacker who can write the bucket of an unsigned run without Redis
can still do (no key and no record tell the Trainer's manifests from theirs):

- append the next version H+1 on the true state chain: a delta whose
  ``base_state`` is the state of H, any weights. It is indistinguishable from
  the Trainer's own, readers apply it, and the Trainer's next publish at H+1
  then stops with a conflict naming the object (an operator removes it);
- in a snapshot-only run, plant a snapshot at any free version: nothing binds
  it;
- on a run whose version 0 was collected, plant a self-consistent chain
  rooted at a snapshot bound to its own delta, longer than the run's
  retained window, and have it taken for the run's chain;
- fill the bucket: every listed object costs a listing entry, and each
  manifest one capped read.

Signatures (``--sign-key`` / ``--trust-key``) or Redis (the Trainer's fenced
head as the ceiling, commit records) close each of these.

Pure over parsed manifests (:func:`chain_of`) plus one reader over a store
(:func:`committed_versions`); no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aurora_store.errors import AuroraError, ManifestError, StoreUnavailable
from aurora_store.format.manifest import Manifest, manifest_key
from aurora_store.lineage.plan import VersionIndex, scan_versions
from aurora_store.storage import Store

if TYPE_CHECKING:
    from aurora_store.format.signing import TrustKeys
    from aurora_store.lineage.interfaces import CommitRecords

__all__ = ["Committed", "Fact", "Ignored", "chain_of", "committed_versions", "fact_of"]

VersionId = tuple[str, int]
Ignored = tuple[str, int, str]
"""(kind, version, why): a listed manifest that does not count."""


@dataclass(frozen=True, slots=True)
class Fact:
    """What the chain rule needs of one manifest (a few strings: kept, the manifest need not be)."""

    kind: str
    version: int
    state: str
    base_state: str | None
    base_version: int | None
    digest: str | None
    """Its ``weights_digest``; None when absent."""
    bad_digest: str | None = None
    """Why its ``weights_digest`` is malformed (then it binds nothing)."""


def fact_of(m: Manifest, where: str = "") -> Fact:
    """The :class:`Fact` of a parsed manifest."""
    from aurora_store.lineage.binding import manifest_weights_digest

    bad = None
    try:
        digest = manifest_weights_digest(m.extra, where or manifest_key(m.kind, m.version))
    except ManifestError as e:
        digest, bad = None, str(e)
    return Fact(m.kind, m.version, m.state, m.base_state, m.base_version, digest, bad)


@dataclass(slots=True)
class Committed:
    """The versions of a run that count (see the module docstring)."""

    index: VersionIndex
    """Versions that count."""
    ignored: list[Ignored] = field(default_factory=list)
    """Listed manifests that do not count, each named once with why, in version order."""
    states: dict[int, str] = field(default_factory=dict)
    """version -> its state, for every version that counts."""
    root: int | None = None
    """The first version of the chain (None: nothing counts)."""
    head: int | None = None
    """The newest version that counts."""
    snapshot_only: bool = False
    """Whether the run holds no delta (every snapshot self-rooted)."""
    ceiling: int | None = None
    """The ceiling it was computed under, if any."""
    refused: list[Ignored] = field(default_factory=list)
    """The part of :attr:`ignored` that could not be read or trusted (a signature, a commit
    record, a malformed manifest), as opposed to readable manifests off the chain."""

    def counts(self, kind: str, version: int) -> bool:
        return version in (self.index.deltas if kind == "delta" else self.index.snapshots)

    def ignored_text(self, limit: int = 20) -> list[str]:
        """One line per ignored manifest (the first ``limit``), then how many more."""
        out = [f"{kind} {v}: {why}" for kind, v, why in self.ignored[:limit]]
        if len(self.ignored) > limit:
            out.append(f"… and {len(self.ignored) - limit} more")
        return out


def _binds(snap: Fact, delta: Fact | None) -> str | None:
    """Why ``snap`` (at V > 0) is not bound by ``delta`` (the counted delta of V), or None."""
    if snap.bad_digest is not None:
        return snap.bad_digest
    if snap.digest is None:
        return "its manifest carries no weights_digest"
    if delta is None:
        return f"no counted delta {snap.version} binds it"
    if delta.bad_digest is not None:
        return delta.bad_digest
    if delta.digest is None:
        return f"delta {snap.version} carries no weights_digest (the writer never snapshotted this version)"
    if delta.digest != snap.digest:
        return f"its weights_digest {snap.digest[:19]}… differs from delta {snap.version}'s {delta.digest[:19]}…"
    if delta.state != snap.state:
        return f"its state {snap.state[:19]}… differs from delta {snap.version}'s {delta.state[:19]}…"
    return None


def _walk(root: int, deltas: Mapping[int, Fact], snaps: Mapping[int, Fact]) -> tuple[list[int], dict[int, str]]:
    """Versions of the chain from ``root`` (in order) and their states; proportional to its length."""
    # Version 0's snapshot, else the delta at the root (binding a snapshot, or the oldest: its base is outside the store).
    states = {root: snaps[0].state if root == 0 and 0 in snaps else deltas[root].state}
    chain = [root]
    v = root + 1
    while v in deltas:
        d = deltas[v]
        if d.base_state != states[v - 1] or (d.base_version is not None and d.base_version != v - 1):
            break
        states[v] = d.state
        chain.append(v)
        v += 1
    return chain, states


def chain_of(
    facts: Mapping[VersionId, Fact],
    ceiling: int | None = None,
    snapshot_only: bool | None = None,
    refused: Iterable[Ignored] = (),
) -> Committed:
    """The versions that count among ``facts`` (manifests already read and trusted; see the module docstring).

    ``refused``: manifests the caller could not read or trust, named in
    ``ignored`` as they are. ``snapshot_only`` None: the run is taken as
    snapshot-only when ``facts`` hold no delta; a caller whose facts come
    from an untrusted store must say.
    """
    ignored: list[Ignored] = list(refused)
    refused_list = [r for r in ignored if not r[2].startswith("above the run's head")]
    deltas: dict[int, Fact] = {}
    snaps: dict[int, Fact] = {}
    for (kind, v), f in facts.items():
        if ceiling is not None and v > ceiling:
            ignored.append((kind, v, f"above the run's head {ceiling} (the Trainer's record)"))
        elif kind == "delta":
            deltas[v] = f
        else:
            snaps[v] = f
    only = (not deltas) if snapshot_only is None else snapshot_only
    if only:
        for v in deltas:
            ignored.append(("delta", v, "the run holds no deltas (snapshot-only)"))
        counted_snaps = set(snaps)
        out = Committed(VersionIndex(frozenset(), frozenset(counted_snaps)), snapshot_only=True, ceiling=ceiling, refused=refused_list)
        out.states = {v: f.state for v, f in snaps.items()}
        if counted_snaps:
            out.root, out.head = min(counted_snaps), max(counted_snaps)
        out.ignored = sorted(ignored, key=lambda x: (x[1], x[0]))
        return out

    # The root: version 0's snapshot when there is one (written first, create-only) and delta 1
    # follows it; else (retention collected the history, or a collection was cut short) the
    # longest chain from a snapshot bound to its delta, or from the oldest delta.
    if 0 in snaps and (1 in deltas or not deltas):
        candidates = [0]
    else:
        candidates = sorted(v for v, s in snaps.items() if v in deltas and _binds(s, deltas[v]) is None)
        if deltas:
            candidates = sorted(set(candidates) | {min(deltas)})
    best: tuple[list[int], dict[int, str]] = ([], {})
    covered = -1
    for r in candidates:
        if r <= covered:
            continue  # already on an earlier candidate's chain
        chain, states = _walk(r, deltas, snaps)
        covered = chain[-1]
        if len(chain) > len(best[0]):
            best = (chain, states)
    chain, states = best
    out = Committed(VersionIndex(frozenset(), frozenset()), snapshot_only=False, ceiling=ceiling, refused=refused_list)
    if not chain:
        for v in deltas:
            ignored.append(("delta", v, "no root: no version-0 snapshot and no snapshot bound to its delta"))
        for v in snaps:
            ignored.append(("snapshot", v, "no root: no version-0 snapshot and no snapshot bound to its delta"))
        out.ignored = sorted(ignored, key=lambda x: (x[1], x[0]))
        return out
    root, end = chain[0], chain[-1]
    counted_d = {v for v in chain if v in deltas and not (v == 0 and 0 in snaps)}
    counted_s: set[int] = set()
    for v, s in snaps.items():
        if v < root or v > end:
            ignored.append(("snapshot", v, _off_chain(v, root, end, deltas)))
        elif v == 0:
            counted_s.add(v)  # the root
        else:
            why = _binds(s, deltas.get(v) if v in counted_d else None)
            if why is None:
                counted_s.add(v)
            else:
                ignored.append(("snapshot", v, f"not bound to the chain: {why}"))
    for v in deltas:
        if v not in counted_d:
            ignored.append(("delta", v, _off_chain(v, root, end, deltas) if v > 0 else "a delta at version 0 (the root is a snapshot)"))
    out.index = VersionIndex(frozenset(counted_d), frozenset(counted_s))
    out.states = {v: states[v] for v in chain}
    out.root, out.head = root, end
    out.ignored = sorted(ignored, key=lambda x: (x[1], x[0]))
    return out


def _off_chain(v: int, root: int, end: int, deltas: Mapping[int, Fact]) -> str:
    if v < root:
        return f"before the chain's first version {root}"
    if v == end + 1 and v in deltas:
        return f"not on the chain: its base_state {str(deltas[v].base_state)[:19]}… is not the state of v{end}"
    if end + 1 not in deltas:
        return f"not on the chain, which ends at v{end} (delta {end + 1} is missing)"
    return f"not on the chain, which ends at v{end}"


def committed_versions(
    store: Store,
    trust: TrustKeys | None = None,
    commits: CommitRecords | None = None,
    ceiling: int | None = None,
    snapshot_only: bool | None = None,
    read: Callable[[str, int], Manifest] | None = None,
    listed: VersionIndex | None = None,
    cache: dict[VersionId, Fact] | None = None,
) -> Committed:
    """The committed versions of ``store``, from trusted sources only (see the module docstring).

    Lists the store once (or takes ``listed``) and reads every manifest at or
    below ``ceiling`` (each a capped read through
    :func:`~aurora_store.lineage.fetch.read_manifest`, checked against
    ``trust`` and ``commits``; ``read(kind, version)`` replaces that read, a
    :class:`~aurora_store.lineage.fetch.ManifestReader` for one). Manifests
    above the ceiling are named, never read. ``snapshot_only`` None: this
    store's listing decides, so pass origin here, never a mirror (or say).
    A store that does not answer raises
    (:class:`~aurora_store.errors.StoreUnavailable`); a manifest that cannot
    be read or trusted does not count and is named.

    ``cache``: facts of manifests read by an earlier call over the same store
    (a committed manifest never changes), updated here and pruned to what is
    listed now, so a caller that asks again and again (a Relay) reads each
    manifest once.
    """
    from aurora_store.lineage.fetch import read_manifest

    index = listed if listed is not None else scan_versions(store)
    if read is None:

        def read(kind: str, version: int) -> Manifest:
            return read_manifest(store, kind, version, trust, commits)

    facts: dict[VersionId, Fact] = {}
    refused: list[Ignored] = []
    for kind, versions in (("delta", index.deltas), ("snapshot", index.snapshots)):
        for v in versions:
            if ceiling is not None and v > ceiling:
                refused.append((kind, v, f"above the run's head {ceiling} (the Trainer's record)"))
                continue
            if cache is not None and (kind, v) in cache:
                facts[(kind, v)] = cache[(kind, v)]
                continue
            try:
                m = read(kind, v)
            except StoreUnavailable:
                raise
            except AuroraError as e:
                refused.append((kind, v, f"not committed: {e}"))
                continue
            facts[(kind, v)] = fact_of(m, store.where(manifest_key(kind, v)))
    if cache is not None:
        for gone in [kv for kv in cache if kv not in facts]:
            del cache[gone]
        cache.update(facts)
    if snapshot_only is None and index.deltas:
        snapshot_only = False  # deltas are listed at origin: never a snapshot-only run, whatever was readable
    return chain_of(facts, ceiling, snapshot_only, refused)
