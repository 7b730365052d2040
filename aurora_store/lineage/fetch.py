"""Reading versions back: manifests, verified objects, decoded deltas, snapshots.

Reading verifies every object against its manifest (size and sha256) and
decodes everything before returning, so a caller gets either a fully
validated version or an error naming the object at fault. Which versions
exist and how to reach one is :mod:`aurora_store.lineage.plan`.

Importing this module loads no torch: :func:`read_manifest` and
:func:`fetch_objects` serve the torch-free tools (``aurora verify``);
decoding and snapshots import their heavy modules when called.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from aurora_store.codec.entries import ParamSpec
from aurora_store.config import DEFAULT_STREAMS
from aurora_store.errors import (
    ChainError,
    IntegrityError,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    SegmentError,
    VersionNotFound,
)
from aurora_store.format.limits import MAX_MANIFEST_BYTES, VersionGuard, load_json
from aurora_store.format.manifest import Manifest, manifest_key, version_dir
from aurora_store.format.segment import Segment, check_header_length, decode_segment
from aurora_store.lineage.plan import VersionIndex
from aurora_store.storage import Store

if TYPE_CHECKING:
    import torch

    from aurora_store.format.checkpoint import StagedDelta
    from aurora_store.format.signing import TrustKeys
    from aurora_store.lineage.interfaces import CommitRecords

T = TypeVar("T")

#: Most threads a fetch with held bytes waits and decodes on.
_HELD_WIDTH = 32

Held = Callable[[str, int, str], "bytes | None"]
"""``held(key, bytes, sha256)``: bytes of that store key fetched ahead of its manifest, or None."""

log = logging.getLogger("aurora.lineage")

__all__ = [
    "ManifestReader",
    "read_manifest",
    "read_manifest_bytes",
    "check_trusted",
    "check_commit_record",
    "bound_index",
    "check_weights_digest",
    "fetch_objects",
    "fetch_delta",
    "fetch_snapshot",
]


def read_manifest(store: Store, kind: str, version: int, trust: TrustKeys | None = None, commits: CommitRecords | None = None) -> Manifest:
    """The manifest of ``kind`` ``version``, parsed and validated.

    ``trust``: refuse (:class:`~aurora_store.errors.SignatureError`) a
    manifest that is unsigned, signed by a key not in it, or badly signed
    (FORMAT.md §4.1); the signature is checked over the object as read.
    None: signatures are ignored.

    ``commits``: the run commits through Redis (FORMAT.md §1, Redis-commit
    mode): a manifest with no record is not committed
    (:class:`~aurora_store.errors.VersionNotFound`), one whose bytes differ
    from its record is refused (:class:`~aurora_store.errors.ManifestError`),
    before it is parsed. None: the manifest's existence is the commit.
    """
    key = manifest_key(kind, version)
    # The record is read beside the object, not after it: one round trip, not two, on a far link.
    record = _side_reads().submit(commits.commit_record, kind, version) if commits is not None else None
    data = read_manifest_bytes(store, key, kind, version)
    if commits is not None:
        assert record is not None
        check_commit_record(commits, kind, version, data, store.where(key), record)
    if trust is not None:
        # The signature is checked over the object as read, parsed here and let go before the
        # manifest is built from the same bytes: one parsed copy of a large manifest at a time.
        _check_signed(trust, data, store.where(key), kind, version)
    m = Manifest.from_bytes(data, store.where(key))
    if m.kind != kind or m.version != version:
        raise ManifestError(store.where(key), f"describes {m.kind} {m.version}, expected {kind} {version}")
    return m


def _check_signed(trust: TrustKeys, data: bytes, where: str, kind: str, version: int) -> None:
    """``trust``'s check of manifest bytes ``data`` (already within the manifest limit)."""
    obj = load_json(data, lambda why: ManifestError(where, why))
    if not isinstance(obj, dict):
        raise ManifestError(where, "not a JSON object")
    trust.check_json(obj, where, kind, version)


def read_manifest_bytes(store: Store, key: str, kind: str, version: int) -> bytes:
    """The bytes of the manifest at ``key``, read as a range capped one byte past the manifest limit.

    Why: an object of any size can be planted at a manifest's key; reading it whole
    first would let it take all memory before any check. Too large:
    :class:`~aurora_store.errors.ManifestError` (a bad version, as any other);
    absent: :class:`~aurora_store.errors.VersionNotFound`.
    """
    try:
        return store.get_capped(key, MAX_MANIFEST_BYTES, "the manifest limit")
    except ObjectNotFound:
        raise VersionNotFound(f"{store.where(key)}: {kind} {version} is not committed") from None
    except ObjectTooLarge:
        raise ManifestError(store.where(key), f"more than the reader's limit of {MAX_MANIFEST_BYTES} bytes") from None


@functools.cache
def _side_reads() -> ThreadPoolExecutor:
    """Threads for reads made beside another (a manifest's commit record beside the manifest)."""
    return ThreadPoolExecutor(4, thread_name_prefix="aurora-side-read")


def check_commit_record(
    commits: CommitRecords, kind: str, version: int, data: bytes, where: str, early: Future[str | None] | None = None
) -> None:
    """Refuse manifest bytes ``data`` that do not match the Redis commit record of ``kind`` ``version``.

    ``early``: the record's read, started beside the read of ``data``. A record
    is written before its manifest, so a read that found none may have run
    ahead of the writer: then the record is read again, after ``data``.
    """
    want = early.result() if early is not None else None
    if want is None:
        want = commits.commit_record(kind, version)
    if want is None:
        raise VersionNotFound(f"{where}: {kind} {version} has no Redis commit record (the run commits through Redis): not committed")
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    if got != want:
        raise ManifestError(
            where,
            f"does not match its Redis commit record ({got[:19]}…, record {want[:19]}…): written by a publisher "
            "that lost the commit, or replaced",
        )


def check_trusted(store: Store, m: Manifest, trust: TrustKeys | None) -> None:
    """Refuse a manifest already in hand that ``trust`` does not accept (no-op without trust).

    For manifests read elsewhere (a :class:`ManifestReader`, another process):
    checked as the object re-serializes, which is byte-for-byte what Aurora's
    writers sign.
    """
    if trust is not None:
        trust.check(m, store.where(manifest_key(m.kind, m.version)))


class ManifestReader:
    """Manifests of one store, each read at most once: the :data:`~aurora_store.lineage.plan.Cost`
    a planner compares paths by, and the manifests the fetch that follows reuses.

    Why: planning a catch-up reads the manifests of the versions it weighs
    (small objects, but each a round trip on a far link); the deltas it then
    fetches need the same manifests again. Committed manifests never change,
    so one read serves both. A manifest that is absent or unreadable costs
    None (the planner routes around it); the fetch of that version, if it
    comes to one, reads it again and raises the error that names it.
    """

    def __init__(self, store: Store, trust: TrustKeys | None = None, commits: CommitRecords | None = None) -> None:
        self.store = store
        self.trust = trust
        """Checked on every manifest read; one refused counts as unreadable (None)."""
        self.commits = commits
        """Redis-commit mode's records (:func:`read_manifest`); a manifest that does not match counts as unreadable."""
        self._seen: dict[tuple[str, int], Manifest | None] = {}
        self._why: dict[tuple[str, int], str] = {}
        self._unbound: dict[int, str | None] = {}
        self.snapshot_only = False
        """Set True only from a trusted fact (origin's listing, the Trainer's record): the run holds no
        deltas, so its snapshots bind to nothing (:meth:`unbound`). Never from this store's own listing."""

    def get(self, kind: str, version: int) -> Manifest | None:
        key = (kind, version)
        if key not in self._seen:
            try:
                self._seen[key] = read_manifest(self.store, kind, version, self.trust, self.commits)
            except (VersionNotFound, ManifestError) as e:
                self._seen[key] = None
                self._why[key] = str(e)
        return self._seen[key]

    def why(self, kind: str, version: int) -> str | None:
        """Why :meth:`get` found no usable manifest (absent, malformed, refused by ``trust``), if it did not."""
        return self._why.get((kind, version))

    def cost(self, kind: str, version: int) -> int | None:
        m = self.get(kind, version)
        if m is not None and kind == "snapshot" and self.unbound(version) is not None:
            return None  # not bound to the chain (FORMAT.md §4.1): never a path
        return None if m is None else m.total_bytes

    def unbound(self, version: int, run_has_deltas: bool | None = None) -> str | None:
        """Why snapshot ``version`` must not be used (FORMAT.md §4.1), or None when it may.

        At V > 0 the committed delta manifest of V must carry a
        ``weights_digest`` equal to the snapshot's; that delta is read here
        (one small object). ``run_has_deltas``: whether the run holds any
        delta (a snapshot-only run, ``transfer="full"``, binds nothing);
        None: :attr:`snapshot_only` says, which only a trusted fact sets.
        This store is never listed to find out: a mirror serving one forged
        snapshot and no delta would pass for a snapshot-only run (issue 24).
        Logged once per snapshot and reader: a planted snapshot is worth a line.
        """
        if version in self._unbound:
            return self._unbound[version]
        why = _unbound_reason(self, version, (not self.snapshot_only) if run_has_deltas is None else run_has_deltas)
        self._unbound[version] = why
        if why is not None:
            log.warning("%s: snapshot %d is not used: %s", self.store.url, version, why)
        return why


def _unbound_reason(reader: ManifestReader, version: int, run_has_deltas: bool) -> str | None:
    from aurora_store.lineage.binding import manifest_weights_digest, snapshot_unbound

    if version == 0:
        return None
    sm = reader.get("snapshot", version)
    if sm is None:
        return f"its manifest is missing or unreadable ({reader.why('snapshot', version)})"
    where = reader.store.where(manifest_key("snapshot", version))
    try:
        s_digest = manifest_weights_digest(sm.extra, where)
    except ManifestError as e:
        return str(e)
    dm = reader.get("delta", version)
    d_digest = None
    if dm is not None:
        try:
            d_digest = manifest_weights_digest(dm.extra, reader.store.where(manifest_key("delta", version)))
        except ManifestError as e:
            return str(e)
    return snapshot_unbound(version, s_digest, d_digest, dm is not None, run_has_deltas)


def bound_index(index: VersionIndex, reader: ManifestReader) -> VersionIndex:
    """``index`` without the snapshots that are not bound to the chain (FORMAT.md §4.1).

    Reads the manifest of each snapshot at V > 0 and of the delta at V (small
    objects, each read once per ``reader``); what a planner without a
    :data:`~aurora_store.lineage.plan.Cost` must be given. Whether the run
    holds deltas is taken from ``index``, so it must be origin's listing,
    never a mirror's (issue 24); :mod:`aurora_store.lineage.trusted` also
    drops manifests off the chain.
    """
    has = bool(index.deltas)
    drop = {("snapshot", v) for v in index.snapshots if reader.unbound(v, has) is not None}
    return index.without(drop)


def check_weights_digest(store: Store, m: Manifest, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse weights read from snapshot ``m`` whose digest differs from its ``weights_digest``.

    A snapshot without the field (an older writer) passes: at V > 0 the
    planner never picks one (it is not bound), and version 0 is the root.
    """
    from aurora_store.apply.sink import digest_as
    from aurora_store.lineage.binding import manifest_weights_digest

    where = store.where(manifest_key(m.kind, m.version))
    want = manifest_weights_digest(m.extra, where)
    if want is None:
        return
    got = digest_as(want, tensors)  # the form the manifest names (FORMAT.md §4.1)
    if got != want:
        raise IntegrityError(f"{where}: the shards hold weights with digest {got[:19]}…, the manifest says {want[:19]}…")


def fetch_objects(
    store: Store,
    m: Manifest,
    streams: int = DEFAULT_STREAMS,
    then: Callable[[str, bytes], T] | None = None,
    held: Held | None = None,
) -> list[tuple[str, T]]:
    """Download every object of a version over ``streams`` connections; verify size and sha256.

    ``then(where, data)`` runs in the download thread right after the check
    (decoding a segment there overlaps it with the other downloads and frees
    the raw bytes early); without it the bytes themselves are returned.

    ``held(key, bytes, sha256)``: bytes already downloaded for that store key
    (a :class:`~aurora_store.lineage.prefetch.Prefetcher`'s ``take``, waiting
    for one under way), or None. They pass the same check as bytes read here
    before ``then`` sees them; bytes that fail it are dropped and the object
    is read from the store.
    """
    vdir = version_dir(m.kind, m.version)
    gets = threading.BoundedSemaphore(max(1, streams))

    def one(i: int) -> tuple[str, Any]:
        ref = m.segments[i]
        key = f"{vdir}/{ref.key}"
        where = store.where(key)
        early = held(key, ref.bytes, ref.sha256) if held is not None else None
        if early is not None and len(early) == ref.bytes and hashlib.sha256(early).hexdigest() == ref.sha256:
            return where, (then(where, early) if then is not None else early)
        try:
            with gets:
                # At most one byte past the listed size: a bigger object is refused, never read whole.
                data = store.get_capped(key, ref.bytes, f"the size the manifest of {m.kind} {m.version} lists")
        except ObjectNotFound:
            raise ObjectNotFound(f"{where}: listed in the manifest of {m.kind} {m.version} but missing") from None
        if len(data) != ref.bytes:
            raise IntegrityError(f"{where}: {len(data)} bytes, manifest says {ref.bytes} (truncated or replaced)")
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise IntegrityError(f"{where}: sha256 does not match the manifest (corrupted)")
        return where, (then(where, data) if then is not None else data)

    if not m.segments:
        return []
    # With held bytes, a thread mostly waits for a prefetch under way, then decodes: up to one
    # per segment, so each is decoded the moment it lands rather than when a thread frees up;
    # reads of the store stay at ``streams`` at a time.
    width = min(len(m.segments), max(streams, _HELD_WIDTH)) if held is not None else min(streams, len(m.segments))
    with ThreadPoolExecutor(max_workers=max(1, width)) as pool:
        return list(pool.map(one, range(len(m.segments))))


def fetch_delta(
    store: Store,
    version: int,
    model: Mapping[str, ParamSpec] | None,
    streams: int = DEFAULT_STREAMS,
    expect_base_state: str | None = None,
    manifest: Manifest | None = None,
    trust: TrustKeys | None = None,
    held: Held | None = None,
    prepare: Callable[[Segment], Any] | None = None,
) -> tuple[Manifest, StagedDelta]:
    """Fetch, verify, decode and validate delta ``version``. Applies nothing.

    ``manifest``: the version's manifest when the caller already read it
    (a :class:`ManifestReader`); read from the store otherwise.
    ``trust``: as for :func:`read_manifest`, checked before any segment is read.
    ``held``: segments fetched ahead from their announcements
    (:func:`fetch_objects`); asked only once the manifest is read and trusted.
    ``prepare(segment)``: run on each decoded segment in its download thread,
    while the other segments are still on the wire (an engine's per-segment
    preparation); the results are the staged delta's ``parts``, in segment
    order. An exception from it fails the fetch like a decoding error.
    """
    from aurora_store.format.checkpoint import assemble_staged

    if manifest is not None and (manifest.kind, manifest.version) != ("delta", version):
        raise ValueError(f"fetch_delta({version}) was handed the manifest of {manifest.kind} {manifest.version}")
    if manifest is not None:
        check_trusted(store, manifest, trust)
    m = manifest if manifest is not None else read_manifest(store, "delta", version, trust)
    if expect_base_state is not None and m.base_state != expect_base_state:
        raise ChainError(
            f"{store.where(manifest_key('delta', version))}: base_state {m.base_state} does not match "
            f"the held version's state {expect_base_state}"
        )
    # One guard for the whole version: overlaps and the decode budget are checked
    # as entries arrive, across the segments being decoded in parallel.
    guard = VersionGuard.for_manifest(m.params, model)

    def then(where: str, data: bytes) -> tuple[Segment, Any]:
        seg = decode_segment(data, where, model, guard)
        return seg, (prepare(seg) if prepare is not None else None)

    done = fetch_objects(store, m, streams, then, held)
    staged = assemble_staged([(where, seg) for where, (seg, _) in done], version)
    if prepare is not None:
        staged = dataclasses.replace(staged, parts=tuple(part for _, (_, part) in done))
    declared = {n: int(p.get("nnz", 0)) for n, p in m.params.items()}
    counted: dict[str, int] = {}
    for e in staged.entries:
        counted[e.param] = counted.get(e.param, 0) + e.nnz
    for name in counted.keys() | declared.keys():
        if declared.get(name, 0) != counted.get(name, 0):
            n = counted.get(name, 0)
            raise ManifestError(
                store.where(manifest_key("delta", version)),
                f"params[{name!r}].nnz is {declared.get(name, 0)}, segments carry {n}",
            )
    return m, staged


def fetch_snapshot(
    store: Store,
    version: int,
    streams: int = DEFAULT_STREAMS,
    manifest: Manifest | None = None,
    trust: TrustKeys | None = None,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Fetch and verify a snapshot; returns its fused tensors (on the CPU).

    ``manifest`` and ``trust`` as for :func:`fetch_delta`.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    from aurora_store.codec.extract import spec_of

    if manifest is not None and (manifest.kind, manifest.version) != ("snapshot", version):
        raise ValueError(f"fetch_snapshot({version}) was handed the manifest of {manifest.kind} {manifest.version}")
    if manifest is not None:
        check_trusted(store, manifest, trust)
    m = manifest if manifest is not None else read_manifest(store, "snapshot", version, trust)
    tensors: dict[str, torch.Tensor] = {}
    objects: list[tuple[str, bytes]] = fetch_objects(store, m, streams)
    for where, data in objects:
        check_header_length(data, where)  # before the library parses a header of any size
        try:
            part = load(data)
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise SegmentError(where, f"not a readable safetensors shard: {e}") from None
        for name, t in part.items():
            if name in tensors:
                raise SegmentError(where, f"tensor {name!r} appears in two shards")
            tensors[name] = t
    specs = m.param_specs()
    if set(tensors) != set(specs):
        missing, extra = sorted(set(specs) - set(tensors)), sorted(set(tensors) - set(specs))
        raise ManifestError(
            store.where(manifest_key("snapshot", version)),
            f"shards do not match params (missing {missing[:5]}, extra {extra[:5]})",
        )
    for name, t in tensors.items():
        if spec_of(t, name) != specs[name]:
            raise ManifestError(
                store.where(manifest_key("snapshot", version)),
                f"{name}: shard holds {list(t.shape)} {t.dtype}, params say {list(specs[name].shape)} {specs[name].dtype}",
            )
    check_weights_digest(store, m, tensors)
    return m, tensors
