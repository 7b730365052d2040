"""Unsigned LEB128 varints, vectorized with numpy.

FORMAT.md §3: 7 payload bits per byte, least significant group first, the high
bit set on every byte but the last. 198 is ``C6 01``, 127 is ``7F``, 128 is
``80 01``. Both directions work on whole arrays: the loops below run over
byte *positions* (at most 10), never over elements.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "MAX_VARINT_BYTES",
    "MAX_VARINT_VALUE",
    "VarintError",
    "encoded_size",
    "encode",
    "decode",
]

MAX_VARINT_BYTES = 10
#: Largest value a reader accepts (FORMAT.md: "above 2^63" is rejected).
MAX_VARINT_VALUE = 1 << 63


class VarintError(ValueError):
    """A varint stream is malformed; ``offset`` is the byte where it went wrong."""

    def __init__(self, reason: str, offset: int) -> None:
        self.reason = reason
        self.offset = offset
        super().__init__(f"{reason} at byte {offset}")


def _byte_lengths(values: np.ndarray) -> np.ndarray:
    """Number of LEB128 bytes for each value (1..10)."""
    v = values.astype(np.uint64, copy=False)
    n = np.ones(v.shape, dtype=np.int64)
    for k in range(1, MAX_VARINT_BYTES):
        n += v >= np.uint64(1 << (7 * k))
    return n


def encoded_size(values: np.ndarray) -> int:
    """Bytes :func:`encode` would produce, without producing them."""
    if values.size == 0:
        return 0
    return int(_byte_lengths(values).sum())


def encode(values: np.ndarray) -> bytes:
    """Encode non-negative integers (any integer dtype) as concatenated varints."""
    if values.size == 0:
        return b""
    v = np.ascontiguousarray(values).reshape(-1)
    if v.dtype.kind == "i" and bool((v < 0).any()):
        raise ValueError("LEB128 encodes non-negative integers only")
    v = v.astype(np.uint64, copy=False)
    lengths = _byte_lengths(v)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    for k in range(int(lengths.max())):
        sel = lengths > k
        group = ((v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        more = (lengths[sel] > k + 1).astype(np.uint8) << 7
        out[starts[sel] + k] = group | more
    return out.tobytes()


def decode(
    data: bytes | bytearray | memoryview | np.ndarray, expected_count: int | None = None
) -> np.ndarray:
    """Decode a stream of varints into a uint64 array.

    Rejects, with :class:`VarintError`: a truncated last varint (trailing
    bytes), a varint longer than 10 bytes, a value above 2^63, and, when
    ``expected_count`` is given, a different number of values.
    """
    b = (
        np.frombuffer(data, dtype=np.uint8)
        if not isinstance(data, np.ndarray)
        else data.reshape(-1)
    )
    if b.dtype != np.uint8:
        raise TypeError("varint stream must be bytes or a uint8 array")
    if b.size == 0:
        out = np.empty(0, dtype=np.uint64)
    else:
        last = (b & 0x80) == 0
        ends = np.flatnonzero(last)
        if ends.size == 0 or ends[-1] != b.size - 1:
            start = int(ends[-1]) + 1 if ends.size else 0
            raise VarintError("truncated varint (stream ends inside a varint)", start)
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        if int(lengths.max()) > MAX_VARINT_BYTES:
            bad = int(np.flatnonzero(lengths > MAX_VARINT_BYTES)[0])
            raise VarintError("varint longer than 10 bytes", int(starts[bad]))
        # Position of every byte inside its varint, without a per-element loop.
        pos = np.arange(b.size, dtype=np.int64) - np.repeat(starts, lengths)
        payload = (b & 0x7F).astype(np.uint64)
        # The tenth byte carries bit 63 only; anything more is above 2^64.
        tenth = pos == MAX_VARINT_BYTES - 1
        if bool((payload[tenth] > 1).any()):
            bad = int(np.flatnonzero(tenth & (payload > 1))[0])
            raise VarintError("varint value above 2^63", bad - MAX_VARINT_BYTES + 1)
        contrib = payload << (pos.astype(np.uint64) * np.uint64(7))
        out = np.add.reduceat(contrib, starts)
        if bool((out > np.uint64(MAX_VARINT_VALUE)).any()):
            bad = int(np.flatnonzero(out > np.uint64(MAX_VARINT_VALUE))[0])
            raise VarintError("varint value above 2^63", int(starts[bad]))
    if expected_count is not None and out.size != expected_count:
        raise VarintError(
            f"stream holds {out.size} varints, expected {expected_count}", int(b.size)
        )
    return out
