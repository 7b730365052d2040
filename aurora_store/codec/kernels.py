"""Compiled kernels for the codec's hot loops, each with an exact numpy twin.

Four loops dominate publishing and applying a delta, and none of them
vectorizes well in numpy (they are data-dependent: a scan that keeps the few
elements that changed, a byte stream of variable-length integers, a scatter):

- :func:`scan_changes`: compare two bit-pattern arrays and return the
  changed indices with their new and old bits, in one pass over memory;
- :func:`leb128_indices`: decode a LEB128 gap stream into absolute indices,
  validating every rule of FORMAT.md §3 on the way (the varint rules of
  :func:`aurora_store.codec.varint.decode`, the gap and range rules of
  :func:`aurora_store.codec.encodings.decode_indices`); :func:`leb128_decode` is
  the plain varint decoder;
- :func:`apply_bits`: overwrite or XOR values at indices of a flat array;
- :func:`leb128_encode` / :func:`leb128_encode_gaps`: the encoder.

They are compiled with numba (``njit(cache=True, nogil=True)``) the first
time each is used, not at import: importing numba costs a quarter of a
second and compiling a kernel about as much again, once per machine (the
compiled code is cached in ``__pycache__`` next to this file; where that is
not writable, numba's user cache, and failing that nothing is cached). The
kernels are serial: the codec's targets are per core, the scan runs near
memory bandwidth on one, and numba's parallel mode would bring in a
threading layer whose default (workqueue) aborts the process when two Python
threads launch parallel kernels at once, which a publisher with upload
threads could do. ``nogil`` lets callers run kernels on threads instead.

Positions inside the kernels are unsigned integers. numba checks every
array access with a signed index for a negative (wrap-around) value, and
those checks alone halve the speed of the scan and the decoder.

Every kernel has a pure numpy twin, used when numba is not installed or
``AURORA_NO_JIT=1`` is set, and the tests run both and compare them bit for
bit. The decoders' twins are the reference implementations in
:mod:`aurora_store.codec.varint` and :mod:`aurora_store.codec.encodings`, because they
own the error types: a kernel only answers "valid, here are the values" or
"invalid", and on "invalid" the caller runs the reference decoder, which
raises the error (same reason, same offsets) whichever path is active.
Malformed streams are the rare path, so diagnosing them twice costs nothing
that matters.

The kernels trust array shapes and dtypes (the wrappers here check them) but
never trust values: every index a kernel writes through is bounds-checked
first, since compiled code has no bounds checks of its own.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "JIT_ENV",
    "jit_available",
    "jit_enabled",
    "path",
    "numba_version",
    "warm_up",
    "scan_changes",
    "scan_blocks",
    "apply_bits",
    "leb128_decode",
    "leb128_indices",
    "leb128_encode",
    "leb128_encode_gaps",
    "leb128_size",
]

#: Set to ``1`` to use the numpy twins even where numba is installed.
JIT_ENV = "AURORA_NO_JIT"

#: Elements per step of the numpy scan: the mask and the compared slices
#: stay in cache (256 K bf16 elements = 512 KiB per input).
SCAN_CHUNK_ELEMS = 1 << 18

_MAX_VARINT_VALUE = np.uint64(1 << 63)
_INT64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------------------
# Choosing the path


@functools.cache
def _numba() -> Any | None:
    try:
        import numba
    except ImportError:
        return None
    return numba


def jit_available() -> bool:
    """Whether numba can be imported."""
    return _numba() is not None


def jit_enabled() -> bool:
    """Whether the compiled kernels are used: numba is there and
    ``AURORA_NO_JIT`` is unset (or ``0``). Read on every call, so a test
    can switch paths with an environment variable."""
    if os.environ.get(JIT_ENV, "").strip() not in ("", "0"):
        return False
    return jit_available()


def path() -> str:
    """``"jit"`` or ``"numpy"``: which implementation the kernels use now."""
    return "jit" if jit_enabled() else "numpy"


def _use_jit(jit: bool | None) -> bool:
    if jit is None:
        return jit_enabled()
    if jit and not jit_available():
        raise RuntimeError("numba is not installed; the compiled kernels are unavailable")
    return jit


@functools.cache
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled by numba; compiled (or loaded from the cache) on first use."""
    numba = _numba()
    if numba is None:
        raise RuntimeError("numba is not installed; the compiled kernels are unavailable")
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:
        # No writable cache location at all (a read-only install, no home):
        # compile in every process instead of failing.
        return numba.njit(cache=False, nogil=True)(fn)


def numba_version() -> str | None:
    """The installed numba's version, or ``None``."""
    numba = _numba()
    return None if numba is None else str(numba.__version__)


def warm_up() -> float:
    """Compile (or load from the cache) every kernel now, on tiny inputs, so
    that a timed section does not pay for it; returns the seconds it took.
    A no-op on the numpy path."""
    t0 = time.perf_counter()
    if not jit_enabled():
        return 0.0
    for dt in (np.uint16, np.uint32):
        a = np.arange(64, dtype=dt)
        b = (a + 1).astype(dt)
        scan_changes(a, b)
        apply_bits(b, np.arange(3, dtype=np.int64), a[:3], True)
    idx = np.array([1, 200, 70000], dtype=np.int64)
    stream = leb128_encode_gaps(idx, 0)
    leb128_indices(stream, 0, 70001, 3)
    leb128_decode(stream)
    leb128_size(idx)
    leb128_encode(idx)
    return time.perf_counter() - t0


def _readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view: numba compiles one variant per writeability, so
    inputs are always passed read-only (bytes from a segment are)."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


# ---------------------------------------------------------------------------
# Kernel bodies (plain Python in numba's subset; compiled lazily by _compiled)


def _scan_words16(a: Any, b: Any, wa: Any, wb: Any, w0: Any, base: Any, idx: Any, new: Any, old: Any, k0: Any) -> Any:
    """Changed 16-bit lanes of ``a`` vs ``b`` from word ``w0`` on, appended at ``k0``.

    ``wa``/``wb`` are the 64-bit words over the whole-word prefix of ``a``/``b``
    (4 lanes each, little-endian). Blocks of 8 words are OR-reduced first (a
    streaming read); only a block that differs is looked at word by word,
    and a word that differs writes all its lanes, advancing ``k`` only past
    the changed ones (no branch per lane). Indices are written plus ``base``.
    Returns (element position reached, count); it stops early, at a block
    boundary, when the output might not hold another block, so the caller
    can grow it and go on.

    Positions are unsigned (see the module docstring). The lane count is a
    compile-time constant (:func:`_scan_words32` is the same loop for 32-bit
    lanes) so that the lane loop unrolls, which is worth a third.
    """
    u0, u1, u4, u8, u32 = np.uint64(0), np.uint64(1), np.uint64(4), np.uint64(8), np.uint64(32)
    lane_mask = np.uint64(0xFFFF)
    nwords = np.uint64(wa.size)
    cap = np.uint64(idx.size)
    w = np.uint64(w0)
    k = np.uint64(k0)
    while w + u8 <= nwords:
        if k + u32 > cap:
            return np.int64(w * u4), np.int64(k)
        d = wa[w] ^ wb[w]
        for j in range(w + u1, w + u8):
            d |= wa[j] ^ wb[j]
        if d != u0:
            for j in range(w, w + u8):
                x = wa[j] ^ wb[j]
                if x != u0:
                    for lane in range(4):
                        i = u4 * j + np.uint64(lane)
                        idx[k] = base + np.int64(i)
                        new[k] = b[i]
                        old[k] = a[i]
                        k += np.uint64(((x >> np.uint64(16 * lane)) & lane_mask) != u0)
        w += u8
    # The last < 8 words and the lanes past the last whole word.
    if k + u32 > cap:
        return np.int64(w * u4), np.int64(k)
    for t in range(w * u4, np.uint64(a.size)):
        if a[t] != b[t]:
            idx[k] = base + np.int64(t)
            new[k] = b[t]
            old[k] = a[t]
            k += u1
    return np.int64(a.size), np.int64(k)


def _scan_words32(a: Any, b: Any, wa: Any, wb: Any, w0: Any, base: Any, idx: Any, new: Any, old: Any, k0: Any) -> Any:
    """:func:`_scan_words16` for 32-bit lanes (2 per word)."""
    u0, u1, u2, u8, u16 = np.uint64(0), np.uint64(1), np.uint64(2), np.uint64(8), np.uint64(16)
    lane_mask = np.uint64(0xFFFFFFFF)
    nwords = np.uint64(wa.size)
    cap = np.uint64(idx.size)
    w = np.uint64(w0)
    k = np.uint64(k0)
    while w + u8 <= nwords:
        if k + u16 > cap:
            return np.int64(w * u2), np.int64(k)
        d = wa[w] ^ wb[w]
        for j in range(w + u1, w + u8):
            d |= wa[j] ^ wb[j]
        if d != u0:
            for j in range(w, w + u8):
                x = wa[j] ^ wb[j]
                if x != u0:
                    for lane in range(2):
                        i = u2 * j + np.uint64(lane)
                        idx[k] = base + np.int64(i)
                        new[k] = b[i]
                        old[k] = a[i]
                        k += np.uint64(((x >> np.uint64(32 * lane)) & lane_mask) != u0)
        w += u8
    if k + u16 > cap:
        return np.int64(w * u2), np.int64(k)
    for t in range(w * u2, np.uint64(a.size)):
        if a[t] != b[t]:
            idx[k] = base + np.int64(t)
            new[k] = b[t]
            old[k] = a[t]
            k += u1
    return np.int64(a.size), np.int64(k)


def _apply(flat: Any, idx: Any, bits: Any, xor: Any) -> Any:
    """``flat[idx] ^= bits`` or ``flat[idx] = bits``; False (nothing written)
    if an index is outside ``flat``. (A negative index, cast to unsigned,
    becomes a huge one and is refused like any other outside.)"""
    n = np.uint64(flat.size)
    m = np.uint64(idx.size)
    top = np.uint64(0)
    for k in range(m):
        top = max(top, np.uint64(idx[k]))
    if m and top >= n:
        return False
    if xor:
        for k in range(m):
            i = np.uint64(idx[k])
            flat[i] ^= bits[k]
    else:
        for k in range(m):
            flat[np.uint64(idx[k])] = bits[k]
    return True


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
    u0, u1, u2, u7, u14, u63 = (
        np.uint64(0), np.uint64(1), np.uint64(2), np.uint64(7), np.uint64(14), np.uint64(63)
    )
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
# Scan


def _unsigned(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "u":
        return a
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def scan_changes(
    a: np.ndarray, b: np.ndarray, jit: bool | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the bit patterns of ``a`` (old) and ``b`` (new) differ.

    ``a`` and ``b`` are 1-D integer arrays of one dtype (2 or 4 bytes: bit
    views of bf16/f16/f32). Returns sorted int64 indices and the new and old
    bits there, as unsigned integers of the same width, in one pass over
    both arrays. ``jit`` forces a path (default: :func:`path`).
    """
    return scan_blocks([(0, a, b)], jit)


def scan_blocks(
    blocks: Sequence[tuple[int, np.ndarray, np.ndarray]], jit: bool | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`scan_changes` over several ``(offset, old, new)`` pairs of one
    dtype, in increasing offset order (the blocks of a fused parameter).
    Indices are ``offset`` plus the index inside the block, all in one array.
    """
    pairs: list[tuple[int, np.ndarray, np.ndarray]] = []
    for off, a, b in blocks:
        if a.shape != b.shape or a.dtype != b.dtype or a.ndim != 1:
            raise ValueError(
                f"scan needs two 1-D arrays of one dtype, got {a.shape} {a.dtype} and {b.shape} {b.dtype}"
            )
        if a.dtype.itemsize not in (2, 4) or a.dtype.kind not in "iu":
            raise ValueError(f"scan works on 16- or 32-bit integer bit views, got {a.dtype}")
        pairs.append((off, _unsigned(np.ascontiguousarray(a)), _unsigned(np.ascontiguousarray(b))))
    if len({p[1].dtype for p in pairs}) > 1:
        raise ValueError("every block of a scan must have one dtype")
    dtype = pairs[0][1].dtype if pairs else np.dtype(np.uint16)
    # The word kernels read lanes out of 64-bit words, which assumes little-endian.
    if _use_jit(jit) and sys.byteorder == "little":
        return _scan_jit(pairs, dtype)
    return _scan_numpy(pairs, dtype)


def _scan_numpy(
    pairs: list[tuple[int, np.ndarray, np.ndarray]], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Element mask per cache-sized chunk; indices, new and old bits gathered
    while the chunk is still in cache."""
    idx: list[np.ndarray] = []
    new: list[np.ndarray] = []
    old: list[np.ndarray] = []
    mask = np.empty(SCAN_CHUNK_ELEMS, dtype=bool)
    for off, a, b in pairs:
        n = a.size
        for lo in range(0, n, SCAN_CHUNK_ELEMS):
            hi = min(n, lo + SCAN_CHUNK_ELEMS)
            ca, cb = a[lo:hi], b[lo:hi]
            m = mask[: hi - lo]
            np.not_equal(ca, cb, out=m)
            e = np.flatnonzero(m)
            if e.size:
                new.append(cb[e])
                old.append(ca[e])
                e += off + lo
                idx.append(e)
    if not idx:
        return np.empty(0, np.int64), np.empty(0, dtype), np.empty(0, dtype)
    if len(idx) == 1:
        return idx[0], new[0], old[0]
    return np.concatenate(idx), np.concatenate(new), np.concatenate(old)


def _scan_jit(
    pairs: list[tuple[int, np.ndarray, np.ndarray]], dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lanes = 8 // dtype.itemsize
    kern = _compiled(_scan_words16 if lanes == 4 else _scan_words32)
    total = sum(a.size for _, a, _ in pairs)
    # Room for a density of 1.5% (RL steps: ~1%); grown by doubling past that.
    cap = 1024 + total // 64
    idx = np.empty(cap, np.int64)
    new = np.empty(cap, dtype)
    old = np.empty(cap, dtype)
    k = 0
    for off, a, b in pairs:
        n = a.size
        if n and (a.ctypes.data % 8 or b.ctypes.data % 8):
            a, b = a.copy(), b.copy()  # word views need 8-byte alignment (slices at odd offsets)
        whole = n - n % lanes
        wa, wb = a[:whole].view(np.uint64), b[:whole].view(np.uint64)
        a, b, wa, wb = _readonly(a), _readonly(b), _readonly(wa), _readonly(wb)
        pos = 0
        while True:
            pos, k = kern(a, b, wa, wb, pos // lanes, off, idx, new, old, k)
            if pos >= n:
                break
            cap *= 2
            idx, new, old = (_grown(x, k, cap) for x in (idx, new, old))
    if 2 * k < cap:  # mostly empty: keep only what was found
        return idx[:k].copy(), new[:k].copy(), old[:k].copy()
    return idx[:k], new[:k], old[:k]


def _grown(x: np.ndarray, k: int, cap: int) -> np.ndarray:
    out = np.empty(cap, x.dtype)
    out[:k] = x[:k]
    return out


# ---------------------------------------------------------------------------
# Apply


def apply_bits(
    flat: np.ndarray, indices: np.ndarray, bits: np.ndarray, xor: bool, jit: bool | None = None
) -> None:
    """``flat[indices] ^= bits`` (``xor``) or ``flat[indices] = bits``, in place.

    ``flat`` is a writable 1-D bit view (uint16/uint32, or the signed types
    of the same width); ``bits`` has its width; ``indices`` are int64 and
    unique (a decoded entry's are). Raises :class:`IndexError`, having
    written nothing, if an index is outside ``flat``.
    """
    if flat.ndim != 1 or not flat.flags.writeable or not flat.flags.c_contiguous:
        raise ValueError("apply needs a writable, contiguous 1-D array")
    if bits.dtype.itemsize != flat.dtype.itemsize:
        raise ValueError(f"{bits.dtype} values for a {flat.dtype} array")
    if indices.shape != bits.shape or indices.ndim != 1:
        raise ValueError(f"{indices.shape} indices for {bits.shape} values")
    if indices.size == 0:
        return
    flat = _unsigned(flat)
    bits = _unsigned(np.ascontiguousarray(bits))
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    if _use_jit(jit):
        ok = _compiled(_apply)(flat, _readonly(indices), _readonly(bits), bool(xor))
    else:
        ok = _apply_numpy(flat, indices, bits, xor)
    if not ok:
        raise IndexError(f"an index is outside the {flat.size} elements being written")


def _apply_numpy(flat: np.ndarray, idx: np.ndarray, bits: np.ndarray, xor: bool) -> bool:
    # Negative indices would wrap around in numpy; refuse them like the kernel.
    if int(idx.min()) < 0 or int(idx.max()) >= flat.size:
        return False
    if xor:
        flat[idx] ^= bits  # indices are unique, so the gather-xor-scatter is exact
    else:
        flat[idx] = bits
    return True


# ---------------------------------------------------------------------------
# LEB128


def leb128_decode(data: np.ndarray) -> np.ndarray | None:
    """Compiled varint decoder: uint64 values, or ``None`` if the stream is
    malformed (the reference decoder then says how). ``data`` is uint8."""
    n_values = int(np.count_nonzero(data < 0x80))
    out = np.empty(n_values, np.uint64)
    if not _compiled(_leb128_decode)(_readonly(data), out):
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
    if not _compiled(_leb128_indices)(_readonly(data), start, stop, out):
        return None
    return out


def leb128_size(values: np.ndarray, jit: bool | None = None) -> int:
    """Bytes of the LEB128 encoding of non-negative ``values``."""
    if values.size == 0:
        return 0
    v = np.ascontiguousarray(values).reshape(-1).astype(np.uint64, copy=False)
    if _use_jit(jit):
        return int(_compiled(_leb128_size)(_readonly(v)))
    return int(_byte_lengths(v).sum())


def leb128_encode(values: np.ndarray, jit: bool | None = None) -> np.ndarray:
    """LEB128 of non-negative integer ``values`` (the caller checks the sign), as uint8."""
    v = np.ascontiguousarray(values).reshape(-1)
    if v.size == 0:
        return np.empty(0, np.uint8)
    v = v.astype(np.uint64, copy=False)
    if _use_jit(jit):
        v = _readonly(v)
        size = _compiled(_leb128_size)(v)
        out = np.empty(size + 1, np.uint8)
        _compiled(_leb128_write)(v, out)
        return out[:size]
    return _encode_numpy(v)


def leb128_encode_gaps(indices: np.ndarray, start: int, jit: bool | None = None) -> np.ndarray:
    """LEB128 of the gaps of sorted, unique int64 ``indices`` from ``start``, as uint8."""
    if indices.size == 0:
        return np.empty(0, np.uint8)
    idx = np.ascontiguousarray(indices, dtype=np.int64)
    if _use_jit(jit):
        out: np.ndarray = _compiled(_leb128_gaps)(_readonly(idx), np.int64(start))
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
