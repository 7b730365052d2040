"""Publishing versions: segments first, over S connections, manifest last.

The encoder runs in the caller's thread and yields segments one by one; each
is handed to a pool of ``streams`` uploaders as soon as it exists, so upload
of segment *i* overlaps encoding of *i+1* (cut-through). At most
``2 x streams`` encoded segments wait in memory. The manifest is written
create-only after every segment landed: a publisher killed at any point
leaves only orphans under its own attempt id, never a visible version.

Stream count and segment size have one source, :class:`PublishConfig`,
read from the environment by :meth:`PublishConfig.from_env`
(``AURORA_STREAMS``, ``AURORA_SEGMENT_MIB``); the CLI's flags and the
Trainer's settings are overrides on top of it. The segment size adapts to
the delta unless one is set (:func:`segment_bytes_for`): a delta is cut
into about ``2 x streams`` segments, so a small delta still keeps every
stream busy and a large one is not cut into needlessly many objects. With
a size known before the delta (set, or, in :class:`aurora_store.Publisher`,
taken from the previous delta), the extraction runs ahead of the encoding
on its own thread (:func:`read_ahead`) and the first segment goes out while
the last parameters are still being scanned.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import queue
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from aurora_store.codec.entries import EncodeOptions
from aurora_store.codec.extract import ParamDelta
from aurora_store.config import SEGMENT_MIB_ENV, env_name, from_env, streams_field
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
from aurora_store.lineage.binding import MODEL_FIELD, WEIGHTS_DIGEST_FIELD, ModelFile, model_listing
from aurora_store.version import __version__

__all__ = [
    "ENCODE_ENV_PREFIX",
    "encode_options_from_env",
    "PublishConfig",
    "SegmentEvent",
    "publish_delta",
    "publish_snapshot",
    "DEFAULT_SHARD_BYTES",
    "MIN_SEGMENT_BYTES",
    "segment_bytes_for",
    "estimate_delta_bytes",
]

if TYPE_CHECKING:
    from aurora_store.codec.fusion import FusionPlan
    from aurora_store.format.signing import Signer
    from aurora_store.lineage.shards import ReadGate

log = logging.getLogger("aurora.publish")


def _utc_now() -> str:
    """A manifest's ``created_at`` (FORMAT.md §4): UTC, to the second."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_MIB = 1 << 20
_WEIGHTS_DIGEST = re.compile(r"^(?:tree-)?sha256:[0-9a-f]{64}$")

#: Target size of one snapshot shard.
DEFAULT_SHARD_BYTES = 1 << 30
_EXTRACT_AHEAD = 4
"""Parameters extracted ahead of the encoder (each holds its changed indices and bits)."""

_T = TypeVar("_T")


def read_ahead(items: Iterable[_T], depth: int, name: str) -> Iterator[_T]:
    """``items`` as they come, produced on a thread of their own (``name``) up to ``depth`` ahead.

    An exception raised producing them is raised here, in order, after the
    items before it. If the consumer stops early (or fails), the producer is
    told to stop and its iterator is closed; this waits for it.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    q: queue.Queue[tuple[int, Any]] = queue.Queue(depth)
    stop = threading.Event()

    def put(item: tuple[int, Any]) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        it = iter(items)
        try:
            for x in it:
                if not put((0, x)):
                    return
            put((1, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            put((2, e))
        finally:
            close = getattr(it, "close", None)
            if stop.is_set() and callable(close):
                close()

    t = threading.Thread(target=produce, name=name, daemon=True)
    t.start()
    try:
        while True:
            kind, x = q.get()
            if kind == 0:
                yield x
            elif kind == 1:
                return
            else:
                raise x
    finally:
        stop.set()
        t.join()


#: Smallest segment the adaptive size picks: below it, per-request cost dominates.
MIN_SEGMENT_BYTES = 64 << 10


def segment_bytes_for(
    delta_bytes: int,
    streams: int,
    floor: int = MIN_SEGMENT_BYTES,
    ceiling: int = DEFAULT_SEGMENT_BYTES,
) -> int:
    """Segment size that cuts a delta of ``delta_bytes`` into about ``2 x streams`` segments.

    ``clamp(ceil(delta_bytes / (2 x streams)), floor, ceiling)``. Two segments
    per stream keep every connection busy while the next segment is being
    encoded; the floor keeps tiny deltas from turning into many tiny
    requests, the ceiling keeps one segment's memory and retry cost bounded.
    """
    if streams < 1:
        raise ConfigError(f"streams must be >= 1, got {streams}")
    if not 1024 <= floor <= ceiling:
        raise ConfigError(f"need 1024 <= floor <= ceiling, got floor={floor}, ceiling={ceiling}")
    per = -(-max(0, delta_bytes) // (2 * streams))
    return int(min(ceiling, max(floor, per)))


def estimate_delta_bytes(deltas: Iterable[ParamDelta]) -> int:
    """Encoded size of ``deltas`` assumed for sizing: the raw bytes of the changed values.

    Deterministic and known before encoding. The default encoding measures
    about 1.65 bytes per changed bf16 element at RL densities (values xor'ed
    and compressed, indices gap-coded), the paper's leb128 about 3.3: the raw
    value width sits between, within a factor of two of either, so a delta
    lands in roughly ``streams`` to ``4 x streams`` segments. The estimate
    only picks a size; it never limits one.
    """
    return sum(d.nnz * int(d.new_bits.itemsize) for d in deltas)


ENCODE_ENV_PREFIX = "AURORA_"
"""Prefix of the encoder's variables: ``AURORA_INDEX_ENCODINGS``, ``AURORA_VALUE_MODES``,
``AURORA_CODECS`` (comma lists) and ``AURORA_ZSTD_LEVEL``."""


def encode_options_from_env(environ: Mapping[str, str] | None = None) -> EncodeOptions:
    """The encodings a publisher may choose from: the defaults, then the ``AURORA_*`` encoder
    variables (an empty one counts as unset). The codec layer reads no environment: the
    worker or command that publishes calls this and passes the options in."""
    env = os.environ if environ is None else environ
    names = {env_name(f, ENCODE_ENV_PREFIX) for f in dataclasses.fields(EncodeOptions)}
    return from_env(EncodeOptions, ENCODE_ENV_PREFIX, {k: v for k, v in env.items() if k in names and v != ""})


@dataclass(frozen=True, slots=True)
class PublishConfig:
    """How a version is cut and sent.

    The one source of stream count and segment size for every publisher
    (CLI, Trainer, benchmarks). Read the environment with :meth:`from_env`;
    plain construction uses the defaults below and reads nothing.
    """

    streams: int = streams_field()
    """Concurrent uploads (TCP connections) per version. Env ``AURORA_STREAMS``."""
    segment_bytes: int | None = field(default=None, metadata={"env": SEGMENT_MIB_ENV, "scale": _MIB})
    """Target segment size in bytes; None (the default) adapts it to each delta with
    :func:`segment_bytes_for`. Env ``AURORA_SEGMENT_MIB``, in MiB (fractions allowed)."""
    options: EncodeOptions = field(default_factory=EncodeOptions, metadata={"env": False})
    """Encodings the encoder may choose from (a worker resolves their variables and passes them in)."""
    shard_bytes: int = field(default=DEFAULT_SHARD_BYTES, metadata={"env": "AURORA_SHARD_MIB", "scale": _MIB})
    """Target snapshot shard size in bytes. Env ``AURORA_SHARD_MIB``, in MiB."""

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= 256:
            raise ConfigError(f"streams must be 1..256, got {self.streams}")
        if self.segment_bytes is not None and self.segment_bytes < 1024:
            raise ConfigError(f"segment_bytes must be >= 1024, got {self.segment_bytes}")
        if self.shard_bytes < 1 << 20:
            raise ConfigError(f"shard_bytes must be >= 1 MiB, got {self.shard_bytes}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> PublishConfig:
        """Defaults, then ``AURORA_STREAMS`` / ``AURORA_SEGMENT_MIB`` / ``AURORA_SHARD_MIB``,
        then ``overrides`` (a None override means "not given")."""
        return from_env(cls, "AURORA_", environ, **overrides)

    def segment_bytes_for(self, delta_bytes: int) -> int:
        """The segment size of a delta of about ``delta_bytes``: the set one, else adaptive."""
        if self.segment_bytes is not None:
            return self.segment_bytes
        return segment_bytes_for(delta_bytes, self.streams)


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

    def __init__(self, store: Any, streams: int, window: int | None = None) -> None:
        self.store = store
        self.pool = ThreadPoolExecutor(max_workers=streams, thread_name_prefix="aurora-upload")
        self.slots = threading.Semaphore(window or 2 * streams)
        self.futures: list[Future[None]] = []

    def reserve(self) -> None:
        """Wait for a free slot before building the next object (then ``submit(..., reserved=True)``)."""
        self._raise_failed()
        self.slots.acquire()

    def _raise_failed(self) -> None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def submit(self, key: str, data: bytes, done: Callable[[], None] | None = None, reserved: bool = False) -> None:
        if not reserved:
            self._raise_failed()
            self.slots.acquire()

        def run() -> None:
            try:
                self.store.put(key, data, mode="create")
            finally:
                self.slots.release()
            if done is not None:
                try:
                    done()
                except Exception as e:  # noqa: BLE001 - an announcement is a hint: the manifest is the commit
                    log.warning(
                        "segment %s is durable but its announcement failed (%s: %s); readers find it by the manifest",
                        key,
                        type(e).__name__,
                        e,
                    )

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
    attempt: str | None = None,
    created_at: str | None = None,
    signer: Signer | None = None,
    weights_digest: str | Callable[[], str] | None = None,
    commit: Callable[[str, int, bytes], None] | None = None,
) -> Manifest:
    """Encode, upload and commit delta ``version`` on top of a base with ``base_state``.

    ``weights_digest``: the FORMAT.md §4.1 digest of the weights this delta
    produces (:func:`aurora_store.apply.sink.tree_weights_digest`), or a
    callable returning it, called once every segment is uploaded: a digest
    hashed on another thread overlaps the extraction, encoding and uploads
    instead of delaying them. Required at a version that also gets a
    snapshot (publish the delta first): it is what binds that snapshot to
    the chain, so readers use the snapshot only if the two digests are
    equal. Optional at any other version (None: the manifest carries none).

    ``signer``: sign the manifest (FORMAT.md §4.1); None writes it unsigned.
    Signatures are deterministic, so a retry still writes equal bytes.

    ``commit``: Redis-commit mode (FORMAT.md §1;
    :meth:`aurora_store.coordination.commit.RedisCommitLog.publish_callback`):
    called with ``(kind, version, manifest bytes)`` before the manifest is
    written; it records the commit (first writer wins) or raises
    :class:`~aurora_store.errors.VersionConflict`. The manifest is then
    written over whatever the store holds at its key (the record, not the
    store, decided). None: the create-only manifest write is the commit.

    ``attempt`` and ``created_at`` (default: new ones) make a retry of a
    publish whose answer was lost write the very same segment and manifest
    bytes, so each create-only write reads back equal bytes instead of a
    conflict. ``on_segment`` is called once a segment is durable; an error
    it raises is logged, not fatal (announcements are hints).

    With an adaptive segment size (``config.segment_bytes`` None) the size
    depends on the whole delta, so ``deltas`` is gathered first (only the
    sparse changes are held: indices and bit patterns); with a set size,
    extraction, encoding and upload all overlap.
    """
    cfg = config or PublishConfig()
    if version < 1:
        raise ConfigError(f"a delta version must be >= 1, got {version}")
    if cfg.segment_bytes is None:
        deltas = list(deltas)
        segment_bytes = cfg.segment_bytes_for(estimate_delta_bytes(deltas))
    else:
        segment_bytes = cfg.segment_bytes
        # Extraction (a scan of every weight) on a thread of its own, a few parameters ahead of
        # encoding: the two overlap on two cores instead of taking turns on one.
        deltas = read_ahead(deltas, _EXTRACT_AHEAD, "aurora-extract")
    attempt = attempt or new_attempt_id()
    vdir = version_dir("delta", version)
    params: dict[str, dict[str, object]] = {}
    refs: list[SegmentRef] = []
    up = _Uploader(store, cfg.streams)
    try:
        seg: EncodedSegment
        for seg in encode_segments(deltas, version, cfg.options, segment_bytes, params):
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
        created_at=created_at or _utc_now(),
        extra=_checked_digest(weights_digest() if callable(weights_digest) else weights_digest),
    )
    if signer is not None:
        m = signer.sign(m)  # last: the signature covers the manifest exactly as written
    _commit(store, "delta", version, m.to_bytes(), commit)
    return m


def _checked_digest(digest: str | None) -> dict[str, Any]:
    if digest is None:
        return {}
    if not _WEIGHTS_DIGEST.fullmatch(digest):
        raise ConfigError(f"weights_digest {digest[:80]!r} is not 'sha256:' or 'tree-sha256:' + 64 hex digits")
    return {WEIGHTS_DIGEST_FIELD: digest}


def publish_snapshot(
    store: Any,
    run: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    state: str | None,
    config: PublishConfig | None = None,
    producer: Mapping[str, Any] | None = None,
    attempt: str | None = None,
    created_at: str | None = None,
    signer: Signer | None = None,
    model: Sequence[ModelFile] | None = None,
    commit: Callable[[str, int, bytes], None] | None = None,
    tree_digest: bool = False,
    weights_digest: str | None = None,
    plan: FusionPlan | None = None,
    gate: ReadGate | None = None,
) -> Manifest:
    """Write full weights (fused names) as shards, then the manifest. ``gate``: ``tensors`` are read only
    inside its ``reading()`` (their owner may pause it, :class:`~aurora_store.lineage.shards.ReadGate`).

    ``plan``: ``tensors`` are under source names, fused as they are written (no fused
    copy is made: :mod:`aurora_store.lineage.shards`); None: already fused.

    ``tree_digest``: the manifest's ``weights_digest`` in the tree form (FORMAT.md §4.1), hashed a
    tensor per thread; a writer uses one form throughout a run. ``weights_digest``: that digest, already
    computed by the caller over these very weights (the one the delta at ``version`` carries).

    ``attempt``, ``created_at``, ``signer`` and ``commit``: as for :func:`publish_delta` (a retry writes equal bytes).

    The manifest carries the ``weights_digest`` of ``tensors`` (FORMAT.md §4.1); at ``version`` > 0
    readers use the snapshot only if the delta of that version, published before, carries the same
    digest. ``model``: the files under ``model/`` (version 0's manifest lists them, FORMAT.md §1).
    ``state``: the version's state; ``None`` for the first snapshot of a run (its own content digest).
    """
    from aurora_store.apply.sink import tree_weights_digest
    from aurora_store.apply.sink import weights_digest as streamed_digest
    from aurora_store.lineage.shards import shard_file, shard_groups, snapshot_tensors

    digest_of = tree_weights_digest if tree_digest else streamed_digest
    cfg = config or PublishConfig()
    attempt = attempt or new_attempt_id()
    vdir = version_dir("snapshot", version)
    items = snapshot_tensors(tensors, plan)
    refs: list[SegmentRef] = []
    # One shard file per upload stream, built when a stream is free: a copy at memory speed, so
    # no stream waits, and the files in memory stay at most ``streams`` shards (no fused copy).
    up = _Uploader(store, cfg.streams, window=cfg.streams)
    try:
        for i, shard in enumerate(shard_groups(items, cfg.shard_bytes)):
            if not shard:
                continue
            up.reserve()
            with gate.reading() if gate is not None else nullcontext():
                data = shard_file(shard, {"aurora.format": "1", "aurora.kind": "snapshot", "aurora.version": str(version)})
            rel = f"{attempt}/shard-{i:05d}.safetensors"
            refs.append(SegmentRef(rel, len(data), hashlib.sha256(data).hexdigest()))
            up.submit(f"{vdir}/{rel}", data, reserved=True)
            del data
    finally:
        up.wait()
    if weights_digest is None:
        with gate.reading() if gate is not None else nullcontext():
            weights_digest = digest_of({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, plan)
    segments = tuple(refs)
    params = {it.name: {"shape": list(it.shape), "dtype": it.dtype} for it in items}
    m = Manifest(
        kind="snapshot",
        run=run,
        version=version,
        segments=segments,
        params=params,
        state=state if state is not None else content_digest(segments),
        producer={"name": PRODUCER_NAME, "version": __version__, **(producer or {})},
        created_at=created_at or _utc_now(),
        extra={
            **_checked_digest(weights_digest),
            **({MODEL_FIELD: model_listing(model)} if model is not None else {}),
        },
    )
    if signer is not None:
        m = signer.sign(m)  # last: the signature covers the manifest exactly as written
    _commit(store, "snapshot", version, m.to_bytes(), commit)
    return m


def _commit(store: Any, kind: str, version: int, data: bytes, commit: Callable[[str, int, bytes], None] | None) -> None:
    """Write the manifest: the commit point (create-only), or after ``commit`` recorded it (Redis-commit mode)."""
    if commit is None:
        store.put(manifest_key(kind, version), data, mode="create")
        return
    commit(kind, version, data)
    store.put(manifest_key(kind, version), data, mode="overwrite")
