"""Index encodings, value modes and the zstd codec of FORMAT.md §3.

Pure functions over numpy arrays. Encoders trust their input (they are fed by
extraction); decoders trust nothing and raise :class:`StreamError` with a
reason that the segment reader wraps into an error naming segment and entry.
This module is the one place that calls zstandard: its ``ZstdError`` never
leaves here untranslated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

from aurora_store.codec import kernels, varint
from aurora_store.errors import StreamError

__all__ = [
    "INDEX_ENCODINGS",
    "VALUE_MODES",
    "CODECS",
    "DTYPES",
    "DtypeInfo",
    "StreamError",
    "encode_indices",
    "indices_size",
    "decode_indices",
    "index_stream_bound",
    "zstd_compressor",
    "zstd_compress",
    "zstd_decompress",
]

INDEX_ENCODINGS = ("leb128", "bitmask", "dense", "u32", "u64")
VALUE_MODES = ("new", "xor")
CODECS = ("none", "zstd")
#: Largest flat index (int64); decoded indices are int64 on every path.
MAX_INDEX = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class DtypeInfo:
    """How one parameter dtype is carried."""

    name: str
    """FORMAT.md name, e.g. ``"bfloat16"``."""
    st_code: str
    """safetensors dtype code of the value tensor, e.g. ``"BF16"``."""
    bits_code: str
    """safetensors code of the raw bit-pattern tensor (``"U16"``/``"U32"``)."""
    width: int
    """Bytes per element."""
    bits: np.dtype
    """numpy unsigned dtype with the same width, used for all bit work."""


DTYPES: dict[str, DtypeInfo] = {
    "bfloat16": DtypeInfo("bfloat16", "BF16", "U16", 2, np.dtype("<u2")),
    "float16": DtypeInfo("float16", "F16", "U16", 2, np.dtype("<u2")),
    "float32": DtypeInfo("float32", "F32", "U32", 4, np.dtype("<u4")),
}


# --------------------------------------------------------------------------
# Indices


def indices_size(encoding: str, indices: np.ndarray, start: int, stop: int) -> int:
    """Size in bytes of the raw (uncompressed) index stream, computed cheaply."""
    n = int(indices.size)
    if encoding == "leb128":
        if n == 0:
            return 0
        return varint.encoded_size(np.diff(indices, prepend=np.int64(start)))
    if encoding == "bitmask":
        return (stop - start + 7) // 8
    if encoding == "dense":
        return 0
    if encoding == "u32":
        return 4 * n
    if encoding == "u64":
        return 8 * n
    raise ValueError(f"unknown index encoding {encoding!r}")


def encode_indices(encoding: str, indices: np.ndarray, start: int, stop: int) -> bytes:
    """Encode sorted, unique absolute indices in ``[start, stop)``."""
    if encoding == "leb128":
        return kernels.leb128_encode_gaps(indices, start).tobytes()
    if encoding == "bitmask":
        mask = np.zeros(stop - start, dtype=bool)
        mask[indices - start] = True
        return np.packbits(mask, bitorder="little").tobytes()
    if encoding == "u32":
        if stop > 1 << 32:
            raise ValueError("u32 indices cannot address elements at or past 2^32")
        return indices.astype("<u4").tobytes()
    if encoding == "u64":
        return indices.astype("<u8").tobytes()
    if encoding == "dense":
        return b""
    raise ValueError(f"unknown index encoding {encoding!r}")


def index_stream_bound(encoding: str, nnz: int, start: int, stop: int) -> int:
    """Largest decompressed size FORMAT.md allows for an index stream."""
    if encoding == "leb128":
        return varint.MAX_VARINT_BYTES * nnz
    if encoding == "bitmask":
        return (stop - start + 7) // 8
    if encoding == "u32":
        return 4 * nnz
    if encoding == "u64":
        return 8 * nnz
    raise StreamError(f"unknown index encoding {encoding!r}")


def decode_indices(encoding: str, data: bytes | memoryview, start: int, stop: int, nnz: int) -> np.ndarray:
    """Decode and fully validate an index stream; returns int64 absolute indices."""
    if encoding == "leb128":
        b = varint.as_bytes(data)
        if kernels.jit_enabled() and 0 <= start < stop <= MAX_INDEX:
            found = kernels.leb128_indices(b, start, stop, nnz)
            if found is not None:
                return found
        # numpy, or the kernel refused the stream: the reference says why.
        return _decode_leb128_reference(b, start, stop, nnz)
    if encoding == "bitmask":
        nbits = stop - start
        expected = (nbits + 7) // 8
        if len(data) != expected:
            raise StreamError(f"bitmask stream is {len(data)} bytes, expected {expected} for range [{start}, {stop})")
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
        if bool(bits[nbits:].any()):
            raise StreamError(f"bitmask sets a bit past the range [{start}, {stop})")
        idx = np.flatnonzero(bits).astype(np.int64) + start
        if idx.size != nnz:
            raise StreamError(f"bitmask marks {idx.size} indices, nnz is {nnz}")
        return idx
    if encoding in ("u32", "u64"):
        width = 4 if encoding == "u32" else 8
        if len(data) != width * nnz:
            raise StreamError(f"{encoding} stream is {len(data)} bytes, expected {width * nnz} for nnz {nnz}")
        raw = np.frombuffer(data, dtype="<u4" if width == 4 else "<u8")
        if nnz == 0:
            return np.empty(0, dtype=np.int64)
        if bool((raw >= np.uint64(stop)).any()) or bool((raw < np.uint64(start)).any()):
            bad = (raw >= np.uint64(stop)) | (raw < np.uint64(start))
            k = int(np.flatnonzero(bad)[0])
            raise StreamError(f"index {int(raw[k])} at position {k} outside [{start}, {stop})")
        idx = raw.astype(np.int64)
        if nnz > 1 and bool((np.diff(idx) <= 0).any()):
            k = int(np.flatnonzero(np.diff(idx) <= 0)[0]) + 1
            raise StreamError(f"{encoding} indices not strictly increasing at position {k}")
        return idx
    raise StreamError(f"unknown index encoding {encoding!r}")


def _decode_leb128_reference(b: np.ndarray, start: int, stop: int, nnz: int) -> np.ndarray:
    """The numpy leb128 index decoder: the reference for every rejection."""
    try:
        gaps = varint.decode(b, expected_count=nnz, jit=False)
    except varint.VarintError as e:
        raise StreamError(f"leb128 index stream: {e}") from None
    if nnz == 0:
        return np.empty(0, dtype=np.int64)
    span = np.uint64(stop - start)
    # Bounding every gap first keeps the running sum far from uint64 overflow.
    if bool((gaps >= span).any()):
        k = int(np.flatnonzero(gaps >= span)[0])
        raise StreamError(f"leb128 gap {int(gaps[k])} at position {k} leaves the range [{start}, {stop})")
    if nnz > 1 and bool((gaps[1:] == 0).any()):
        k = int(np.flatnonzero(gaps[1:] == 0)[0]) + 1
        raise StreamError(f"leb128 gap of 0 at position {k} (indices must be unique)")
    # Sum in uint64: each gap is below the span (< 2^63), so a wrapped sum
    # shows up as a decrease, which the strictly-increasing check catches.
    idx_u = np.cumsum(gaps, dtype=np.uint64) + np.uint64(start)
    if nnz > 1 and bool((idx_u[1:] <= idx_u[:-1]).any()):
        k = int(np.flatnonzero(idx_u[1:] <= idx_u[:-1])[0]) + 1
        raise StreamError(f"leb128 index at position {k} leaves the range [{start}, {stop}) (running sum overflows)")
    if int(idx_u[0]) < start or int(idx_u[-1]) >= stop:
        k = int(np.flatnonzero((idx_u >= np.uint64(stop)) | (idx_u < np.uint64(start)))[0])
        raise StreamError(f"index {int(idx_u[k])} at position {k} outside [{start}, {stop})")
    return idx_u.astype(np.int64)


# --------------------------------------------------------------------------
# zstd


def zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    """A compressor for :func:`zstd_compress`. Reusing one for several streams
    (all those of one entry) saves setting up its tables each time; it is
    not safe to share between threads."""
    try:
        return zstandard.ZstdCompressor(level=level, write_content_size=True)
    except zstandard.ZstdError as e:
        raise StreamError(f"zstd compressor at level {level}: {e}") from None


def zstd_compress(
    data: bytes | memoryview | np.ndarray,
    level: int,
    compressor: zstandard.ZstdCompressor | None = None,
) -> bytes:
    """One zstd frame with the content size recorded in its header.

    ``data`` is anything with the buffer protocol (a contiguous array is
    compressed without a copy); ``compressor``, from :func:`zstd_compressor`
    at the same ``level``, is used instead of a new one when given.
    """
    cctx = compressor if compressor is not None else zstd_compressor(level)
    try:
        return cctx.compress(np.ascontiguousarray(data).data if isinstance(data, np.ndarray) else data)
    except zstandard.ZstdError as e:
        raise StreamError(f"zstd compression failed: {e}") from None


def zstd_decompress(frame: bytes | memoryview, expected: int | None, bound: int) -> bytes:
    """Decompress exactly one frame, never producing more than ``bound`` bytes.

    ``expected`` is the exact size FORMAT.md requires (values), or ``None``
    where only the bound is known (a leb128 index stream).

    A frame that declares its content size (Aurora's writer always does)
    within the bound is decompressed in one call into a buffer of exactly
    that size: zstd refuses a frame that would produce more than it
    declares, and the call refuses bytes after the frame. If that call fails
    for any reason, or the frame does not declare its size, the frame is fed
    to a streaming decompressor in slices sized to the remaining allowance,
    so a frame that claims or expands to gigabytes costs at most the bound
    plus about 512 KiB of memory before it is refused; that path also words
    every error.
    """
    if len(frame) < 4:
        raise StreamError("zstd frame is corrupt: shorter than a frame header")
    try:
        params = zstandard.get_frame_parameters(bytes(frame[:18]))
    except zstandard.ZstdError as e:
        raise StreamError(f"zstd frame is corrupt: {e}") from None
    declared = params.content_size
    if declared in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
        return _zstd_stream(frame, expected, bound)
    if declared > bound:
        raise StreamError(f"zstd frame declares {declared} bytes, more than the bound {bound}")
    try:
        out = zstandard.ZstdDecompressor().decompress(frame, max_output_size=declared, allow_extra_data=False)
    except zstandard.ZstdError:
        # Corrupt, truncated or followed by other bytes: the streaming path
        # finds which, and says so in the same words as for any other frame.
        return _zstd_stream(frame, expected, bound)
    if len(out) != declared:  # zstd enforces the declared size; this is a backstop
        raise StreamError(f"zstd frame decompresses to {len(out)} bytes, declared {declared}")
    if expected is not None and len(out) != expected:
        raise StreamError(f"zstd frame decompresses to {len(out)} bytes, expected {expected}")
    return out


def _zstd_stream(frame: bytes | memoryview, expected: int | None, bound: int) -> bytes:
    """The bounded streaming decompressor (see :func:`zstd_decompress`)."""
    # Feed the frame in slices small enough that one slice cannot expand far
    # past the bound: a zstd block expands at most ~32768x (a 3-byte RLE
    # block header -> 128 KiB), so a slice of allowance/32768 bytes (at least
    # 16) overshoots by at most ~512 KiB before the check below refuses it.
    dobj = zstandard.ZstdDecompressor().decompressobj(read_across_frames=False)
    chunks: list[bytes] = []
    produced = 0
    view = memoryview(frame)
    pos = 0
    try:
        while pos < len(view) and not dobj.eof:
            step = max(16, (bound + 1 - produced) >> 15)
            chunk = dobj.decompress(view[pos : pos + step])
            pos += step
            produced += len(chunk)
            if produced > bound:
                raise StreamError(f"zstd frame decompresses past the bound of {bound} bytes")
            chunks.append(chunk)
    except zstandard.ZstdError as e:
        raise StreamError(f"zstd frame is corrupt: {e}") from None
    if not dobj.eof:
        raise StreamError("zstd frame is truncated (no end of frame)")
    trailing = len(dobj.unused_data) + max(0, len(view) - pos)
    if trailing:
        raise StreamError(f"zstd stream has {trailing} bytes after its frame")
    result = b"".join(chunks)
    if expected is not None and len(result) != expected:
        raise StreamError(f"zstd frame decompresses to {len(result)} bytes, expected {expected}")
    return result
