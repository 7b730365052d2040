"""Unsigned LEB128 varints.

FORMAT.md §3: 7 payload bits per byte, least significant group first, the high
bit set on every byte but the last. 198 is ``C6 01``, 127 is ``7F``, 128 is
``80 01``.

Both directions run as compiled kernels (:mod:`aurora_store.codec.kernels`) where
numba is available, and as whole-array numpy otherwise; the numpy decoder is
the reference that says *why* a stream is malformed. Its loops run over byte
*positions* (at most 10), never over elements.
"""

from __future__ import annotations

import numpy as np

from aurora_store.codec import kernels
from aurora_store.errors import VarintError

__all__ = [
    "MAX_VARINT_BYTES",
    "MAX_VARINT_VALUE",
    "VarintError",
    "encoded_size",
    "encode",
    "decode",
    "decode_reference",
    "as_bytes",
]

MAX_VARINT_BYTES = 10
#: Largest value a reader accepts (FORMAT.md: "above 2^63" is rejected).
MAX_VARINT_VALUE = 1 << 63


def encoded_size(values: np.ndarray) -> int:
    """Bytes :func:`encode` would produce, without producing them."""
    return kernels.leb128_size(values)


def encode(values: np.ndarray) -> bytes:
    """Encode non-negative integers (any integer dtype) as concatenated varints."""
    if values.size == 0:
        return b""
    v = np.ascontiguousarray(values).reshape(-1)
    if v.dtype.kind == "i" and bool((v < 0).any()):
        raise ValueError("LEB128 encodes non-negative integers only")
    return kernels.leb128_encode(v).tobytes()


def as_bytes(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    """A stream as a flat uint8 array (no copy)."""
    b = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    if b.dtype != np.uint8:
        raise TypeError("varint stream must be bytes or a uint8 array")
    return b


def decode(
    data: bytes | bytearray | memoryview | np.ndarray,
    expected_count: int | None = None,
    jit: bool | None = None,
) -> np.ndarray:
    """Decode a stream of varints into a uint64 array.

    Rejects, with :class:`VarintError`: a truncated last varint (trailing
    bytes), a varint longer than 10 bytes, a value above 2^63, and, when
    ``expected_count`` is given, a different number of values. ``jit``
    forces the compiled kernel (``True``) or numpy (``False``); by default
    :func:`aurora_store.codec.kernels.path` decides. Errors are the same either way.
    """
    b = as_bytes(data)
    use_jit = kernels.jit_enabled() if jit is None else jit
    out = kernels.leb128_decode(b) if b.size and use_jit else None
    if out is None:
        out = decode_reference(b)
    if expected_count is not None and out.size != expected_count:
        raise VarintError(f"stream holds {out.size} varints, expected {expected_count}", int(b.size))
    return out


def decode_reference(b: np.ndarray) -> np.ndarray:
    """The numpy decoder, and the reference for every rejection and its offset.

    Precedence when a stream has several faults: truncation (the stream
    must end on a terminal byte) first, then the first varint longer than
    10 bytes, then the first varint whose tenth byte is above 1, then the
    first value above 2^63. Each varint is evaluated by Horner's rule from
    its last byte (the most significant group) backwards.
    """
    if b.size == 0:
        return np.empty(0, dtype=np.uint64)
    ends = np.flatnonzero(b < 0x80)
    if ends.size == 0 or ends[-1] != b.size - 1:
        start = int(ends[-1]) + 1 if ends.size else 0
        raise VarintError("truncated varint (stream ends inside a varint)", start)
    out = b[ends].astype(np.uint64)
    if ends.size == b.size:  # every varint is one byte
        return out
    lengths = np.diff(ends, prepend=np.int64(-1))
    longest = int(lengths.max())
    if longest > MAX_VARINT_BYTES:
        bad = int(np.flatnonzero(lengths > MAX_VARINT_BYTES)[0])
        raise VarintError("varint longer than 10 bytes", int(ends[bad] - lengths[bad] + 1))
    if longest == MAX_VARINT_BYTES:
        # The tenth byte carries bit 63 only; anything more is above 2^64.
        ten = np.flatnonzero(lengths == MAX_VARINT_BYTES)
        over = np.flatnonzero(out[ten] > 1)
        if over.size:
            raise VarintError("varint value above 2^63", int(ends[ten[over[0]]]) - MAX_VARINT_BYTES + 1)
    sel = np.flatnonzero(lengths > 1)  # varints still being extended
    pos = ends[sel]
    seven = np.uint64(7)
    for _ in range(1, longest):
        pos = pos - 1
        out[sel] = (out[sel] << seven) | (b[pos] & 0x7F).astype(np.uint64)
        # The byte before belongs to the same varint when it is a continuation
        # byte. At pos 0, b[-1] is the stream's last byte: terminal, so no.
        more = b[pos - 1] >= 0x80
        if not bool(more.any()):
            break
        sel, pos = sel[more], pos[more]
    if longest == MAX_VARINT_BYTES:
        above = np.flatnonzero(out > np.uint64(MAX_VARINT_VALUE))
        if above.size:
            k = int(above[0])
            raise VarintError("varint value above 2^63", int(ends[k] - lengths[k] + 1))
    return out
