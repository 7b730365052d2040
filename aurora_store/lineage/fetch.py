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

import hashlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from aurora_store.codec.entries import ParamSpec
from aurora_store.config import DEFAULT_STREAMS
from aurora_store.errors import (
    ChainError,
    FormatError,
    IntegrityError,
    ManifestError,
    ObjectNotFound,
    SegmentError,
    VersionNotFound,
)
from aurora_store.format.manifest import Manifest, manifest_key, version_dir
from aurora_store.format.segment import decode_segment
from aurora_store.lineage.plan import plan_chain, scan_versions
from aurora_store.storage import Store

if TYPE_CHECKING:
    import torch

    from aurora_store.format.checkpoint import StagedDelta

T = TypeVar("T")

__all__ = [
    "ManifestReader",
    "read_manifest",
    "fetch_objects",
    "fetch_delta",
    "fetch_snapshot",
    "materialize",
]


def read_manifest(store: Store, kind: str, version: int) -> Manifest:
    key = manifest_key(kind, version)
    try:
        data = store.get(key)
    except ObjectNotFound:
        raise VersionNotFound(f"{store.where(key)}: {kind} {version} is not committed") from None
    m = Manifest.from_bytes(data, store.where(key))
    if m.kind != kind or m.version != version:
        raise ManifestError(
            store.where(key), f"describes {m.kind} {m.version}, expected {kind} {version}"
        )
    return m


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

    def __init__(self, store: Store) -> None:
        self.store = store
        self._seen: dict[tuple[str, int], Manifest | None] = {}

    def get(self, kind: str, version: int) -> Manifest | None:
        key = (kind, version)
        if key not in self._seen:
            try:
                self._seen[key] = read_manifest(self.store, kind, version)
            except (VersionNotFound, ManifestError):
                self._seen[key] = None
        return self._seen[key]

    def cost(self, kind: str, version: int) -> int | None:
        m = self.get(kind, version)
        return None if m is None else m.total_bytes


def fetch_objects(store: Store, m: Manifest, streams: int = DEFAULT_STREAMS, then: Callable[[str, bytes], T] | None = None) -> list[tuple[str, T]]:
    """Download every object of a version over ``streams`` connections; verify size and sha256.

    ``then(where, data)`` runs in the download thread right after the check
    (decoding a segment there overlaps it with the other downloads and frees
    the raw bytes early); without it the bytes themselves are returned.
    """
    vdir = version_dir(m.kind, m.version)

    def one(i: int) -> tuple[str, Any]:
        ref = m.segments[i]
        key = f"{vdir}/{ref.key}"
        where = store.where(key)
        try:
            data = store.get(key)
        except ObjectNotFound:
            raise ObjectNotFound(
                f"{where}: listed in the manifest of {m.kind} {m.version} but missing"
            ) from None
        if len(data) != ref.bytes:
            raise IntegrityError(
                f"{where}: {len(data)} bytes, manifest says {ref.bytes} (truncated or replaced)"
            )
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise IntegrityError(f"{where}: sha256 does not match the manifest (corrupted)")
        return where, (then(where, data) if then is not None else data)

    if not m.segments:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(streams, len(m.segments)))) as pool:
        return list(pool.map(one, range(len(m.segments))))


def fetch_delta(
    store: Store,
    version: int,
    model: Mapping[str, ParamSpec] | None,
    streams: int = DEFAULT_STREAMS,
    expect_base_state: str | None = None,
    manifest: Manifest | None = None,
) -> tuple[Manifest, StagedDelta]:
    """Fetch, verify, decode and validate delta ``version``. Applies nothing.

    ``manifest``: the version's manifest when the caller already read it
    (a :class:`ManifestReader`); read from the store otherwise.
    """
    from aurora_store.format.checkpoint import assemble_staged

    if manifest is not None and (manifest.kind, manifest.version) != ("delta", version):
        raise ValueError(f"fetch_delta({version}) was handed the manifest of {manifest.kind} {manifest.version}")
    m = manifest if manifest is not None else read_manifest(store, "delta", version)
    if expect_base_state is not None and m.base_state != expect_base_state:
        raise ChainError(
            f"{store.where(manifest_key('delta', version))}: base_state {m.base_state} does not match "
            f"the held version's state {expect_base_state}"
        )
    segs = fetch_objects(store, m, streams, lambda where, data: decode_segment(data, where, model))
    staged = assemble_staged(segs, version)
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
    store: Store, version: int, streams: int = DEFAULT_STREAMS, manifest: Manifest | None = None
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Fetch and verify a snapshot; returns its fused tensors (on the CPU).

    ``manifest`` as for :func:`fetch_delta`.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    from aurora_store.codec.extract import spec_of

    if manifest is not None and (manifest.kind, manifest.version) != ("snapshot", version):
        raise ValueError(f"fetch_snapshot({version}) was handed the manifest of {manifest.kind} {manifest.version}")
    m = manifest if manifest is not None else read_manifest(store, "snapshot", version)
    tensors: dict[str, torch.Tensor] = {}
    objects: list[tuple[str, bytes]] = fetch_objects(store, m, streams)
    for where, data in objects:
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
    return m, tensors


def materialize(
    store: Store,
    target: int,
    streams: int = DEFAULT_STREAMS,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, torch.Tensor], str]:
    """Full fused weights of version ``target``: newest usable snapshot, then deltas.

    Returns (tensors, state). Each delta is checked against the state of the
    version it lands on before it is applied. A snapshot that fails its
    checks (damaged bytes, a bad manifest) is set aside with a ``progress``
    note and the chain is planned again without it: an older snapshot and
    more deltas reach the same version. A damaged delta is not skipped (no
    other path crosses it) and its error propagates.
    """
    from aurora_store.apply.sink import FusedWeights, apply_delta

    index = scan_versions(store)
    refused: set[tuple[str, int]] = set()
    while True:
        plan = plan_chain(index.without(refused), target)
        if plan.snapshot is None:
            why = f" (snapshot(s) {sorted(v for _, v in refused)} failed their checks)" if refused else ""
            raise ChainError(f"version {target} is unreachable: no usable snapshot at or below it{why}")
        try:
            sm, tensors = fetch_snapshot(store, plan.snapshot, streams)
        except (FormatError, IntegrityError) as e:
            refused.add(("snapshot", plan.snapshot))
            if progress:
                progress(f"snapshot {plan.snapshot} is unusable ({e}); planning around it")
            continue
        break
    if progress:
        progress(f"snapshot {plan.snapshot}: {len(tensors)} tensors, {sm.total_bytes} bytes")
    state = sm.state
    sink = FusedWeights(tensors)
    for v in plan.deltas:
        m, staged = fetch_delta(store, v, sink.specs(), streams, expect_base_state=state)
        apply_delta(staged, sink)
        state = m.state
        if progress:
            progress(f"delta {v}: {staged.nnz} changed elements, {m.total_bytes} bytes")
    return tensors, state
