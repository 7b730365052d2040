"""Segment objects: safetensors files that carry entries (FORMAT.md §3).

The writer lays out a standard safetensors file (8-byte little-endian header
length, JSON header padded with spaces to 8 bytes, then the tensors back to
back), so any safetensors reader opens it. The reader is our own: every byte
is untrusted, and each problem is reported naming the segment and entry
before anything is applied.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aurora_store.codec.encodings import StreamError
from aurora_store.codec.entries import DecodedEntry, EncodedEntry, ParamSpec, decode_entry
from aurora_store.errors import EntryError, SegmentError
from aurora_store.format.limits import (
    MAX_ENTRIES_PER_SEGMENT,
    MAX_HEADER_BYTES,
    VersionGuard,
    load_json,
)

__all__ = [
    "FORMAT_VERSION",
    "READ_FORMATS",
    "MAX_HEADER_BYTES",
    "Segment",
    "encode_segment",
    "decode_segment",
    "parse_safetensors",
    "check_header_length",
]

FORMAT_VERSION = "1"
#: ``aurora.format`` values this reader accepts. Writers write ``"2"`` unless their
#: options ask for format 1 (``EncodeOptions.format``; docs/FORMAT.md §3.1).
READ_FORMATS = ("1", "2")
# MAX_HEADER_BYTES (format/limits.py): a header larger than this is refused
# from its 8-byte length, before a byte of it is parsed.

_ITEMSIZE = {
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}


@dataclass(frozen=True, slots=True)
class Segment:
    """A decoded, validated segment."""

    version: int
    base_version: int
    entries: tuple[DecodedEntry, ...]


def _write_safetensors(tensors: Sequence[tuple[str, str, list[int], bytes]], metadata: Mapping[str, str]) -> bytes:
    """Serialize (name, dtype code, shape, raw bytes) tuples, in the order given."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, code, shape, raw in tensors:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    hj = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    hj += b" " * (-len(hj) % 8)
    return b"".join([struct.pack("<Q", len(hj)), hj, *(t[3] for t in tensors)])


def encode_segment(entries: Sequence[EncodedEntry], version: int, base_version: int, fmt: int = 1) -> bytes:
    """Pack entries into one segment object, marked ``aurora.format = fmt``.

    A format-1 segment may not carry format 2's ``rice`` indices or
    ``planes`` values (a format-1 reader could not read them).
    """
    if fmt not in (1, 2):
        raise ValueError(f"segment format {fmt} is not 1 or 2")
    if fmt == 1:
        for e in entries:
            if e.encoding == "rice" or e.val_codec == "planes":
                raise ValueError(f"{e.param} [{e.start}, {e.stop}): {e.encoding}/{e.val_codec} needs a format-2 segment")
    tensors: list[tuple[int, str, str, list[int], bytes]] = []
    metas: list[dict[str, Any]] = []
    for i, e in enumerate(entries):
        idx_name = f"{i}.idx" if e.idx is not None else None
        val_name = f"{i}.val"
        metas.append(e.metadata(idx_name, val_name))
        vwidth = _ITEMSIZE[e.val_dtype]
        tensors.append((vwidth, val_name, e.val_dtype, [len(e.val) // vwidth], e.val))
        if e.idx is not None and idx_name is not None:
            tensors.append((1, idx_name, "U8", [len(e.idx)], e.idx))
    # Widest tensors first keeps every value tensor aligned to its element size.
    tensors.sort(key=lambda t: -t[0])
    metadata = {
        "aurora.format": str(fmt),
        "aurora.kind": "delta",
        "aurora.version": str(version),
        "aurora.base_version": str(base_version),
        "aurora.entries": json.dumps(metas, separators=(",", ":")),
    }
    return _write_safetensors([t[1:] for t in tensors], metadata)


def parse_safetensors(data: bytes | memoryview, where: str) -> tuple[dict[str, str], dict[str, tuple[str, tuple[int, ...], memoryview]]]:
    """Parse and bounds-check a safetensors container.

    Returns (metadata, tensors) where tensors maps a name to (dtype code,
    shape, bytes). The tensors must tile the data region exactly, as the
    safetensors specification requires: no gaps, overlaps or trailing bytes.
    """
    buf = memoryview(data)
    n = check_header_length(buf, where)
    header = load_json(bytes(buf[8 : 8 + n]), lambda why: SegmentError(where, f"header is {why}"))
    if not isinstance(header, dict):
        raise SegmentError(where, "header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise SegmentError(where, "__metadata__ must map strings to strings")
    body = buf[8 + n :]
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, tuple[str, tuple[int, ...], memoryview]] = {}
    for name, t in header.items():
        if not isinstance(t, dict):
            raise SegmentError(where, f"tensor {name!r}: description is not an object")
        code, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if not isinstance(code, str) or code not in _ITEMSIZE:
            raise SegmentError(where, f"tensor {name!r}: unknown dtype {code!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise SegmentError(where, f"tensor {name!r}: bad shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1] <= len(body)
        ):
            raise SegmentError(
                where,
                f"tensor {name!r}: data_offsets {offs!r} outside the {len(body)}-byte data region (truncated?)",
            )
        numel = 1
        for d in shape:
            numel *= d
        if numel * _ITEMSIZE[code] != offs[1] - offs[0]:
            raise SegmentError(
                where,
                f"tensor {name!r}: {code}{shape} needs {numel * _ITEMSIZE[code]} bytes, data_offsets give {offs[1] - offs[0]}",
            )
        spans.append((offs[0], offs[1], name))
        tensors[name] = (code, tuple(shape), body[offs[0] : offs[1]])
    spans.sort()
    pos = 0
    for a, b, name in spans:
        if a != pos:
            raise SegmentError(where, f"tensor {name!r} starts at {a}, expected {pos} (gap or overlap)")
        pos = b
    if pos != len(body):
        raise SegmentError(where, f"{len(body) - pos} bytes after the last tensor")
    return meta, tensors


def check_header_length(data: bytes | memoryview, where: str) -> int:
    """The header length of a safetensors object, refused past :data:`MAX_HEADER_BYTES`.

    Looks at the first 8 bytes (and the object's length) only, so an object
    announcing a 90 MB header is refused without a byte of that header
    parsed; the first 8 bytes alone (a ranged read) are enough to refuse it.
    Snapshot shards, which the safetensors library reads, are checked with
    it first too.
    """
    if len(data) < 8:
        raise SegmentError(where, f"{len(data)} bytes is too short for a safetensors header")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > MAX_HEADER_BYTES:
        raise SegmentError(where, f"header length {n} is absurdly large (the reader's limit is {MAX_HEADER_BYTES} bytes)")
    if 8 + n > len(data):
        raise SegmentError(
            where,
            f"header length {n} points past the end of the {len(data)}-byte object (truncated?)",
        )
    return int(n)


def _int_meta(meta: Mapping[str, str], key: str, where: str) -> int:
    raw = meta.get(key)
    if raw is None:
        raise SegmentError(where, f"metadata {key!r} is missing")
    if not raw.isascii() or not raw.isdigit():
        raise SegmentError(where, f"metadata {key!r} is not a decimal integer: {raw!r}")
    try:
        return int(raw)
    except ValueError:  # more digits than Python converts (4300)
        raise SegmentError(where, f"metadata {key!r} has {len(raw)} digits, too many for a version") from None


def decode_segment(
    data: bytes | memoryview,
    where: str,
    model: Mapping[str, ParamSpec] | None = None,
    guard: VersionGuard | None = None,
    formats: Sequence[str] = READ_FORMATS,
) -> Segment:
    """Parse and validate every entry of a segment. Changes nothing anywhere.

    ``guard`` is shared by every segment of one version (they may decode in
    parallel threads): each entry is checked against the others of the
    version (overlaps, entry count, decode budget) before any of its streams
    is decompressed. Without one, a segment is checked on its own: its
    entries may not overlap each other. ``formats`` are the ``aurora.format``
    values accepted (``("1",)`` reads as a format-1 reader does).
    """
    if guard is None:
        guard = VersionGuard(None)
    meta, tensors = parse_safetensors(data, where)
    fmt_text = meta.get("aurora.format")
    if fmt_text not in formats:
        known = " and ".join(repr(f) for f in formats)
        raise SegmentError(where, f"aurora.format is {fmt_text!r}, this reader knows {known}")
    fmt = int(str(fmt_text))
    if meta.get("aurora.kind") != "delta":
        raise SegmentError(where, f"aurora.kind is {meta.get('aurora.kind')!r}, expected 'delta'")
    version = _int_meta(meta, "aurora.version", where)
    base = _int_meta(meta, "aurora.base_version", where)
    metas = load_json(meta.get("aurora.entries", ""), lambda why: SegmentError(where, f"aurora.entries is {why}"))
    if not isinstance(metas, list):
        raise SegmentError(where, "aurora.entries is not a JSON list")
    if len(metas) > MAX_ENTRIES_PER_SEGMENT:
        raise SegmentError(where, f"{len(metas)} entries, more than the reader's limit of {MAX_ENTRIES_PER_SEGMENT}")

    def tensor(name: str) -> tuple[str, tuple[int, ...], memoryview]:
        t = tensors.get(name)
        if t is None:
            raise StreamError(f"names tensor {name!r}, which the segment lacks")
        return t

    out: list[DecodedEntry] = []
    for i, m in enumerate(metas):

        def claim(param: str, start: int, stop: int, nnz: int, cost: int, i: int = i) -> None:
            guard.claim(where, i, param, start, stop, nnz, cost)

        try:
            out.append(decode_entry(m, tensor, model, claim, fmt))
        except StreamError as e:
            param = m.get("param") if isinstance(m, dict) and isinstance(m.get("param"), str) else None
            raise EntryError(where, i, param, str(e)) from None
    return Segment(version, base, tuple(out))
