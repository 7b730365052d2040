"""Publishing versions: segments first, over S connections, manifest last.

The encoder runs in the caller's thread and yields segments one by one; each
is handed to a pool of ``streams`` uploaders as soon as it exists, so upload
of segment *i* overlaps encoding of *i+1* (cut-through). At most
``2 x streams`` encoded segments wait in memory. The manifest is written
create-only after every segment landed: a publisher killed at any point
leaves only orphans under its own attempt id, never a visible version.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from aurora_store import __version__
from aurora_store.codec.entries import EncodeOptions
from aurora_store.codec.extract import ParamDelta, spec_of
from aurora_store.errors import ConfigError
from aurora_store.format.checkpoint import DEFAULT_SEGMENT_BYTES, EncodedSegment, encode_segments
from aurora_store.format.manifest import (
    PRODUCER_NAME,
    Manifest,
    SegmentRef,
    chain_state,
    content_digest,
    manifest_key,
    new_attempt_id,
    version_dir,
)

__all__ = [
    "PublishConfig",
    "SegmentEvent",
    "publish_delta",
    "publish_snapshot",
    "DEFAULT_SHARD_BYTES",
]

#: Target size of one snapshot shard.
DEFAULT_SHARD_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class PublishConfig:
    """How a version is cut and sent."""

    streams: int = 8
    """Concurrent uploads (TCP connections) per version."""
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    """Target segment size."""
    options: EncodeOptions = field(default_factory=EncodeOptions)
    """Encodings the encoder may choose from."""
    shard_bytes: int = DEFAULT_SHARD_BYTES
    """Target snapshot shard size."""

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= 256:
            raise ConfigError(f"streams must be 1..256, got {self.streams}")
        if self.segment_bytes < 1024:
            raise ConfigError(f"segment_bytes must be >= 1024, got {self.segment_bytes}")
        if self.shard_bytes < 1 << 20:
            raise ConfigError(f"shard_bytes must be >= 1 MiB, got {self.shard_bytes}")


@dataclass(frozen=True, slots=True)
class SegmentEvent:
    """Reported to ``on_segment`` once a segment object is durable in the store."""

    version: int
    index: int
    key: str
    """Key relative to the run root."""
    bytes: int
    sha256: str


class _Uploader:
    """Bounded pool of uploads that fails fast on the first error."""

    def __init__(self, store: Any, streams: int) -> None:
        self.store = store
        self.pool = ThreadPoolExecutor(max_workers=streams, thread_name_prefix="aurora-upload")
        self.slots = threading.Semaphore(2 * streams)
        self.futures: list[Future[None]] = []

    def submit(self, key: str, data: bytes, done: Callable[[], None] | None = None) -> None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        self.slots.acquire()

        def run() -> None:
            try:
                self.store.put(key, data, mode="create")
                if done is not None:
                    done()
            finally:
                self.slots.release()

        self.futures.append(self.pool.submit(run))

    def wait(self) -> None:
        try:
            for f in self.futures:
                f.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


def publish_delta(
    store: Any,
    run: str,
    version: int,
    deltas: Iterable[ParamDelta],
    base_state: str,
    config: PublishConfig | None = None,
    on_segment: Callable[[SegmentEvent], None] | None = None,
    producer: Mapping[str, Any] | None = None,
) -> Manifest:
    """Encode, upload and commit delta ``version`` on top of a base with ``base_state``."""
    cfg = config or PublishConfig()
    if version < 1:
        raise ConfigError(f"a delta version must be >= 1, got {version}")
    attempt = new_attempt_id()
    vdir = version_dir("delta", version)
    params: dict[str, dict[str, object]] = {}
    refs: list[SegmentRef] = []
    up = _Uploader(store, cfg.streams)
    try:
        seg: EncodedSegment
        for seg in encode_segments(deltas, version, cfg.options, cfg.segment_bytes, params):
            rel = f"{attempt}/seg-{seg.index:05d}.safetensors"
            sha = hashlib.sha256(seg.data).hexdigest()
            refs.append(SegmentRef(rel, len(seg.data), sha))
            ev = SegmentEvent(version, seg.index, f"{vdir}/{rel}", len(seg.data), sha)
            done: Callable[[], None] | None = None
            if on_segment is not None:
                done = functools.partial(on_segment, ev)
            up.submit(f"{vdir}/{rel}", seg.data, done)
    finally:
        up.wait()
    segments = tuple(refs)
    m = Manifest(
        kind="delta",
        run=run,
        version=version,
        segments=segments,
        params=params,
        state=chain_state(base_state, content_digest(segments)),
        base_version=version - 1,
        base_state=base_state,
        producer={"name": PRODUCER_NAME, "version": __version__, **(producer or {})},
    )
    store.put(manifest_key("delta", version), m.to_bytes(), mode="create")
    return m


def publish_snapshot(
    store: Any,
    run: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    state: str | None,
    config: PublishConfig | None = None,
    producer: Mapping[str, Any] | None = None,
) -> Manifest:
    """Write full weights (fused names) as shards, then the manifest.

    ``state`` is the state of the version captured; ``None`` for the first
    snapshot of a run, whose state is its own content digest.
    """
    from safetensors.torch import save

    cfg = config or PublishConfig()
    attempt = new_attempt_id()
    vdir = version_dir("snapshot", version)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > cfg.shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.cpu().contiguous()
        size += nbytes
    refs: list[SegmentRef] = []
    up = _Uploader(store, cfg.streams)
    try:
        for i, shard in enumerate(shards):
            if not shard:
                continue
            data = save(
                shard,
                metadata={
                    "aurora.format": "1",
                    "aurora.kind": "snapshot",
                    "aurora.version": str(version),
                },
            )
            rel = f"{attempt}/shard-{i:05d}.safetensors"
            refs.append(SegmentRef(rel, len(data), hashlib.sha256(data).hexdigest()))
            up.submit(f"{vdir}/{rel}", data)
    finally:
        up.wait()
    segments = tuple(refs)
    params = {
        n: {"shape": list(t.shape), "dtype": spec_of(t, n).dtype}
        for n, t in sorted(tensors.items())
    }
    m = Manifest(
        kind="snapshot",
        run=run,
        version=version,
        segments=segments,
        params=params,
        state=state if state is not None else content_digest(segments),
        producer={"name": PRODUCER_NAME, "version": __version__, **(producer or {})},
    )
    store.put(manifest_key("snapshot", version), m.to_bytes(), mode="create")
    return m
