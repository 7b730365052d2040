"""LEB128 varints (FORMAT.md §3): the gap-stream decoder and the encoders.

- :func:`leb128_indices`: decode a LEB128 gap stream into absolute indices,
  validating every rule of FORMAT.md §3 on the way (the varint rules of
  :func:`aurora_store.codec.varint.decode`, the gap and range rules of
  :func:`aurora_store.codec.encodings.decode_indices`); :func:`leb128_decode`
  is the plain varint decoder;
- :func:`leb128_encode` / :func:`leb128_encode_gaps` / :func:`leb128_size`:
  the encoder and its size.

The decoders' numpy twins are the reference implementations in
:mod:`aurora_store.codec.varint` and :mod:`aurora_store.codec.encodings`,
because they own the error types: a kernel only answers "valid, here are the
values" or "invalid", and on "invalid" the caller runs the reference
decoder, which raises the error (same reason, same offsets) whichever path
is active. Malformed streams are the rare path, so diagnosing them twice
costs nothing that matters. The encoders' twins are here.

Positions inside the kernels are unsigned integers (numba's negative-index
checks on signed ones halve the decoder's speed). The kernels never trust
values: a stream is bounds-checked byte by byte.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aurora_store.codec.kernels.jit import compiled, readonly, use_jit

__all__ = [
    "leb128_decode",
    "leb128_indices",
    "leb128_encode",
    "leb128_encode_gaps",
    "leb128_size",
]

_MAX_VARINT_VALUE = np.uint64(1 << 63)
_INT64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------------------
# Kernel bodies (plain Python in numba's subset; compiled lazily)


def _leb128_decode(b: Any, out: Any) -> Any:
    """Varints of ``b`` into ``out`` (sized to the count of terminal bytes).

    False on any malformed varint: truncated, longer than 10 bytes (caught
    at the tenth byte, which may then only be 0 or 1), or above 2^63.
    """
    u0, u1, u7, u63 = np.uint64(0), np.uint64(1), np.uint64(7), np.uint64(63)
    payload, more = np.uint64(0x7F), np.uint64(0x80)
    n = np.uint64(b.size)
    p = u0
    k = u0
    while p < n:
        c = np.uint64(b[p])
        p += u1
        v = c & payload
        if c >= more:
            s = u7
            while True:
                if p >= n:
                    return False
                c = np.uint64(b[p])
                p += u1
                if s == u63 and c > u1:
                    return False
                v |= (c & payload) << s
                if c < more:
                    break
                s += u7
            if v > _MAX_VARINT_VALUE:
                return False
        out[k] = v
        k += u1
    return True


def _leb128_indices(b: Any, start: Any, stop: Any, out: Any) -> Any:
    """Gap stream ``b`` -> absolute indices in ``out`` (``nnz = out.size``).

    Accepts exactly what the reference accepts: well-formed varints, exactly
    ``nnz`` of them, every gap below the span, no gap of 0 after the first,
    every index below ``stop`` (``0 <= start < stop < 2^63``, so the running
    sum, kept in uint64, cannot wrap). False on anything else.

    Gaps of one or two bytes (nearly all of them at RL densities) are read
    without a data-dependent branch: both bytes are loaded, and the second
    counts only when the first has its continuation bit set.
    """
    u0, u1, u2, u7, u14, u63 = (np.uint64(0), np.uint64(1), np.uint64(2), np.uint64(7), np.uint64(14), np.uint64(63))
    payload, more = np.uint64(0x7F), np.uint64(0x80)
    n = np.uint64(b.size)
    nnz = np.uint64(out.size)
    span = np.uint64(stop - start)
    stop_u = np.uint64(stop)
    pos = np.uint64(start)
    p = u0
    k = u0
    while p < n:
        if k == nnz:
            return False
        c0 = np.uint64(b[p])
        c1 = np.uint64(b[p + u1]) if p + u1 < n else u0
        cont = c0 >> u7
        if (cont & (c1 >> u7)) != u0:
            # Three bytes or more: the general loop, from the third byte.
            v = (c0 & payload) | ((c1 & payload) << u7)
            p += u2
            s = u14
            while True:
                if p >= n:
                    return False
                c = np.uint64(b[p])
                p += u1
                if s == u63 and c > u1:
                    return False
                v |= (c & payload) << s
                if c < more:
                    break
                s += u7
        else:
            if p + cont >= n:
                return False  # the stream ends inside a two-byte varint
            v = (c0 & payload) | (((c1 & payload) << u7) * cont)
            p += u1 + cont
        # v >= span also catches values above 2^63 (the span is below it).
        if v >= span:
            return False
        if k == u0:
            pos = np.uint64(start) + v
        elif v == u0:
            return False
        else:
            pos += v
        if pos >= stop_u:
            return False
        out[k] = np.int64(pos)
        k += u1
    return k == nnz


def _leb128_size(values: Any) -> Any:
    """LEB128 bytes of uint64 ``values``."""
    u0, u7 = np.uint64(0), np.uint64(7)
    total = np.uint64(values.size)
    for k in range(np.uint64(values.size)):
        v = values[k]
        total += np.uint64(v >= np.uint64(1 << 7))
        if v >= np.uint64(1 << 14):
            v >>= np.uint64(14)
            while v != u0:
                v >>= u7
                total += np.uint64(1)
    return np.int64(total)


def _leb128_write(values: Any, out: Any) -> Any:
    """LEB128 of uint64 ``values`` into ``out`` (one byte longer than the
    encoding: a one-byte varint also stores a throwaway second byte, so
    values below 2^14 are written without a data-dependent branch)."""
    u1, u7 = np.uint64(1), np.uint64(7)
    payload, more = np.uint64(0x7F), np.uint64(0x80)
    p = np.uint64(0)
    for k in range(np.uint64(values.size)):
        v = values[k]
        if v < np.uint64(1 << 14):
            two = np.uint64(v >= more)
            out[p] = np.uint8((v & payload) | (two << u7))
            out[p + u1] = np.uint8(v >> u7)
            p += u1 + two
        else:
            while v >= more:
                out[p] = np.uint8((v & payload) | more)
                v >>= u7
                p += u1
            out[p] = np.uint8(v)
            p += u1
    return np.int64(p)


def _leb128_gaps(indices: Any, start: Any) -> Any:
    """LEB128 of ``indices[0] - start, indices[1] - indices[0], ...``
    (sorted, unique, ``>= start``: the encoder trusts its input; a negative
    gap wraps to uint64, as in the numpy twin). Same two passes as
    :func:`_leb128_size` and :func:`_leb128_write`, on the gaps."""
    u0, u1, u7 = np.uint64(0), np.uint64(1), np.uint64(7)
    payload, more = np.uint64(0x7F), np.uint64(0x80)
    n = np.uint64(indices.size)
    total = n
    prev = np.int64(start)
    for k in range(n):
        v = np.uint64(indices[k] - prev)
        prev = indices[k]
        total += np.uint64(v >= more)
        if v >= np.uint64(1 << 14):
            v >>= np.uint64(14)
            while v != u0:
                v >>= u7
                total += u1
    out = np.empty(total + u1, np.uint8)
    p = u0
    prev = np.int64(start)
    for k in range(n):
        v = np.uint64(indices[k] - prev)
        prev = indices[k]
        if v < np.uint64(1 << 14):
            two = np.uint64(v >= more)
            out[p] = np.uint8((v & payload) | (two << u7))
            out[p + u1] = np.uint8(v >> u7)
            p += u1 + two
        else:
            while v >= more:
                out[p] = np.uint8((v & payload) | more)
                v >>= u7
                p += u1
            out[p] = np.uint8(v)
            p += u1
    return out[:total]


# ---------------------------------------------------------------------------
# Wrappers and numpy twins


def leb128_decode(data: np.ndarray) -> np.ndarray | None:
    """Compiled varint decoder: uint64 values, or ``None`` if the stream is
    malformed (the reference decoder then says how). ``data`` is uint8."""
    n_values = int(np.count_nonzero(data < 0x80))
    out = np.empty(n_values, np.uint64)
    if not compiled(_leb128_decode)(readonly(data), out):
        return None
    return out


def leb128_indices(data: np.ndarray, start: int, stop: int, nnz: int) -> np.ndarray | None:
    """Compiled gap-stream decoder: int64 absolute indices, or ``None`` if the
    stream breaks any rule (the reference decoder then says which).

    Needs ``0 <= start < stop < 2^63``; a caller outside that range uses the
    reference decoder.
    """
    if not (0 <= start < stop <= _INT64_MAX):
        raise ValueError(f"range [{start}, {stop}) is outside what the kernel handles")
    if nnz > data.size or nnz < 0:
        return None  # every varint takes at least one byte: the count cannot match
    out = np.empty(nnz, np.int64)
    if not compiled(_leb128_indices)(readonly(data), start, stop, out):
        return None
    return out


def leb128_size(values: np.ndarray, jit: bool | None = None) -> int:
    """Bytes of the LEB128 encoding of non-negative ``values``."""
    if values.size == 0:
        return 0
    v = np.ascontiguousarray(values).reshape(-1).astype(np.uint64, copy=False)
    if use_jit(jit):
        return int(compiled(_leb128_size)(readonly(v)))
    return int(_byte_lengths(v).sum())


def leb128_encode(values: np.ndarray, jit: bool | None = None) -> np.ndarray:
    """LEB128 of non-negative integer ``values`` (the caller checks the sign), as uint8."""
    v = np.ascontiguousarray(values).reshape(-1)
    if v.size == 0:
        return np.empty(0, np.uint8)
    v = v.astype(np.uint64, copy=False)
    if use_jit(jit):
        v = readonly(v)
        size = compiled(_leb128_size)(v)
        out = np.empty(size + 1, np.uint8)
        compiled(_leb128_write)(v, out)
        return out[:size]
    return _encode_numpy(v)


def leb128_encode_gaps(indices: np.ndarray, start: int, jit: bool | None = None) -> np.ndarray:
    """LEB128 of the gaps of sorted, unique int64 ``indices`` from ``start``, as uint8."""
    if indices.size == 0:
        return np.empty(0, np.uint8)
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    if use_jit(jit):
        out: np.ndarray = compiled(_leb128_gaps)(readonly(idx), np.int64(start))
        return out
    return _encode_numpy(np.diff(idx, prepend=np.int64(start)).astype(np.uint64))


def _byte_lengths(v: np.ndarray) -> np.ndarray:
    """LEB128 bytes per uint64 value (1..10); compares only against the
    thresholds below the largest value."""
    n = np.ones(v.shape, dtype=np.int64)
    top = int(v.max()) if v.size else 0
    k = 1
    while k < 10 and top >> (7 * k):
        n += v >= np.uint64(1 << (7 * k))
        k += 1
    return n


def _encode_numpy(v: np.ndarray) -> np.ndarray:
    """Each varint written from its last byte backwards: byte ``end - j``
    holds 7-bit group ``len - 1 - j``, so each pass only touches the values
    that are at least ``j + 1`` bytes long."""
    lengths = _byte_lengths(v)
    longest = int(lengths.max())
    if longest == 1:
        return v.astype(np.uint8)
    ends = np.cumsum(lengths) - 1
    out = np.empty(int(ends[-1]) + 1, dtype=np.uint8)
    out[ends] = (v >> (7 * (lengths - 1)).astype(np.uint64)).astype(np.uint8)
    sel = np.arange(v.size)
    for j in range(1, longest):
        sel = sel[lengths[sel] > j]
        group = (v[sel] >> (7 * (lengths[sel] - 1 - j)).astype(np.uint64)) & np.uint64(0x7F)
        out[ends[sel] - j] = group.astype(np.uint8) | np.uint8(0x80)
    return out
