"""Delta checkpoints: parameter changes -> segments, and segments -> a staged version.

:func:`encode_segments` is a generator: it yields each segment as soon as it
is full, so a publisher can upload segment *i* while *i+1* is still being
encoded (cut-through). :func:`stage_segments` is its inverse: it decodes and
validates every segment of a version, and the whole version together (no
overlapping entries), before anything may be applied.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aurora_store.codec.entries import (
    DecodedEntry,
    EncodedEntry,
    EncodeOptions,
    ParamSpec,
    encode_entry,
)
from aurora_store.codec.extract import ParamDelta
from aurora_store.errors import ChainError, EntryError, SegmentError
from aurora_store.format.limits import MAX_ENTRIES_PER_SEGMENT, MAX_HEADER_BYTES, VersionGuard
from aurora_store.format.segment import Segment, decode_segment, encode_segment

__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "EncodedSegment",
    "StagedDelta",
    "encode_segments",
    "stage_segments",
]

#: Target size of one segment object (FORMAT.md / ARCHITECTURE.md: about 16 MiB).
DEFAULT_SEGMENT_BYTES = 16 << 20
_MIN_PIECE_NNZ = 4096
# A segment is cut before its header could pass half the readers' limit, or it
# has as many entries as they accept (format/limits.py): many small parameters
# make a header large while the payload stays small. An entry's share of the
# header is its metadata (escaped inside a JSON string) and its two tensors' rows.
_HEADER_ROOM = MAX_HEADER_BYTES // 2


def _header_share(e: EncodedEntry) -> int:
    # 8 per UTF-8 byte of the name covers its worst escaping: a control character is
    # \u0001 in aurora.entries, then \\u0001 in the header that holds that string.
    return 800 + 8 * len(e.param.encode("utf-8", "surrogatepass")) + 24 * len(e.spec.shape)


@dataclass(frozen=True, slots=True)
class EncodedSegment:
    """One segment object, ready to upload."""

    index: int
    data: bytes
    entries: tuple[EncodedEntry, ...]

    @property
    def nnz(self) -> int:
        return sum(e.nnz for e in self.entries)


def encode_segments(
    deltas: Iterable[ParamDelta],
    version: int,
    options: EncodeOptions | None = None,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    params_out: dict[str, dict[str, object]] | None = None,
) -> Iterator[EncodedSegment]:
    """Pack parameter changes into segments of about ``segment_bytes``.

    Large parameters are split into index ranges sized to the room left in
    the current segment, using the bytes per changed element measured so far.
    ``params_out`` (if given) receives the manifest's ``params`` table.
    """
    if segment_bytes < 1024:
        raise ValueError(f"segment_bytes must be at least 1024, got {segment_bytes}")
    opts = options or EncodeOptions()
    current: list[EncodedEntry] = []
    size = 0
    header = 0
    index = 0
    bytes_per_elem = 3.0  # refined by measurement as entries are encoded
    enc_bytes = enc_elems = 0

    def flush() -> EncodedSegment:
        nonlocal current, size, header, index
        seg = EncodedSegment(index, encode_segment(current, version, version - 1, opts.format), tuple(current))
        index += 1
        current, size, header = [], 0, 0
        return seg

    for d in deltas:
        if d.nnz == 0:
            continue
        if params_out is not None:
            params_out[d.name] = {"shape": list(d.spec.shape), "dtype": d.spec.dtype, "nnz": d.nnz}
        lo = 0
        range_start = 0
        numel = d.spec.numel
        while lo < d.nnz:
            room = segment_bytes - size
            if room < segment_bytes // 16 and current:
                yield flush()
                room = segment_bytes
            take = max(_MIN_PIECE_NNZ, int(room / bytes_per_elem))
            hi = min(d.nnz, lo + take)
            range_stop = numel if hi == d.nnz else int(d.indices[hi])
            entry = encode_entry(
                d.name,
                d.spec,
                range_start,
                range_stop,
                d.indices[lo:hi],
                d.new_bits[lo:hi],
                d.old_bits[lo:hi],
                opts,
                d.read_new_range,
            )
            enc_bytes += entry.nbytes
            enc_elems += entry.nnz
            bytes_per_elem = max(0.05, enc_bytes / max(1, enc_elems))
            share = _header_share(entry)
            if current and (
                size + entry.nbytes > segment_bytes or header + share > _HEADER_ROOM or len(current) >= MAX_ENTRIES_PER_SEGMENT
            ):
                yield flush()
            current.append(entry)
            size += entry.nbytes
            header += share
            lo, range_start = hi, range_stop
    if current:
        yield flush()


@dataclass(frozen=True, slots=True)
class StagedDelta:
    """Every entry of one delta version, decoded and validated; ready to apply."""

    version: int
    base_version: int
    entries: tuple[DecodedEntry, ...]
    parts: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    """What a holder made of each segment as it was decoded (``fetch_delta(prepare=...)``), in
    segment order; empty when nothing was asked (see aurora_store.apply.prepare.prepare_part)."""

    @property
    def nnz(self) -> int:
        return sum(e.nnz for e in self.entries)

    def params(self) -> set[str]:
        return {e.param for e in self.entries}


def stage_segments(
    segments: Sequence[tuple[str, bytes]],
    version: int,
    model: Mapping[str, ParamSpec] | None,
    guard: VersionGuard | None = None,
) -> StagedDelta:
    """Decode and validate all segments ``(name, bytes)`` of delta ``version``.

    ``guard`` bounds the version as its entries arrive (overlaps, entry
    count, decode budget); by default :meth:`VersionGuard.for_model`, whose
    budget covers a delta that touches every parameter of ``model``.
    """
    g = guard if guard is not None else VersionGuard.for_model(model)
    return assemble_staged([(where, decode_segment(data, where, model, g)) for where, data in segments], version)


def assemble_staged(segments: Sequence[tuple[str, Segment]], version: int) -> StagedDelta:
    """Checks across the decoded segments of one version, then the staged delta.

    Every segment belongs to this version and its base, and no two entries of
    one parameter overlap (within a segment or across segments). Decoding
    through one :class:`VersionGuard` refuses an overlap as it arrives; this
    check stays for segments decoded without a shared one.
    """
    if not version >= 1:
        raise ChainError(f"delta version {version} must be >= 1")
    entries: list[DecodedEntry] = []
    origin: list[tuple[str, int]] = []
    for where, seg in segments:
        if seg.version != version or seg.base_version != version - 1:
            raise SegmentError(
                where, f"belongs to version {seg.version} (base {seg.base_version}), expected {version} (base {version - 1})"
            )
        for i, e in enumerate(seg.entries):
            entries.append(e)
            origin.append((where, i))
    order = sorted(range(len(entries)), key=lambda k: (entries[k].param, entries[k].start))
    for prev, cur in zip(order, order[1:], strict=False):
        a, b = entries[prev], entries[cur]
        if a.param == b.param and b.start < a.stop:
            where, i = origin[cur]
            raise EntryError(
                where,
                i,
                b.param,
                f"range [{b.start}, {b.stop}) overlaps [{a.start}, {a.stop}) of {origin[prev][0]} entry {origin[prev][1]}",
            )
    return StagedDelta(version, version - 1, tuple(entries))
