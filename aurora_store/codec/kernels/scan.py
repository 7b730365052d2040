"""The changed-element scan: compare two bit-pattern arrays in one pass.

:func:`scan_changes` (and :func:`scan_blocks`, over the blocks of a fused
parameter) returns the indices where old and new bits differ, with the new
and old bits there. The compiled kernels read 64-bit words (4 bf16/f16 lanes
or 2 f32 lanes), OR-reduce blocks of 8 words and only look lane by lane at a
block that differs; the numpy twin masks cache-sized chunks.

Positions inside the kernels are unsigned integers: numba checks every array
access with a signed index for a negative (wrap-around) value, and those
checks alone halve the speed of the scan. The kernels trust array shapes and
dtypes (the wrappers check them) and bound every write by the output's
capacity, growing it between calls.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from aurora_store.codec.kernels.jit import compiled, readonly, unsigned, use_jit

__all__ = ["SCAN_CHUNK_ELEMS", "scan_changes", "scan_blocks"]

#: Elements per step of the numpy scan: the mask and the compared slices
#: stay in cache (256 K bf16 elements = 512 KiB per input).
SCAN_CHUNK_ELEMS = 1 << 18


# ---------------------------------------------------------------------------
# Kernel bodies (plain Python in numba's subset; compiled lazily)


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


# ---------------------------------------------------------------------------
# Wrappers


def scan_changes(a: np.ndarray, b: np.ndarray, jit: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the bit patterns of ``a`` (old) and ``b`` (new) differ.

    ``a`` and ``b`` are 1-D integer arrays of one dtype (2 or 4 bytes: bit
    views of bf16/f16/f32). Returns sorted int64 indices and the new and old
    bits there, as unsigned integers of the same width, in one pass over
    both arrays. ``jit`` forces a path (default: :func:`path`).
    """
    return scan_blocks([(0, a, b)], jit)


def scan_blocks(blocks: Sequence[tuple[int, np.ndarray, np.ndarray]], jit: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`scan_changes` over several ``(offset, old, new)`` pairs of one
    dtype, in increasing offset order (the blocks of a fused parameter).
    Indices are ``offset`` plus the index inside the block, all in one array.
    """
    pairs: list[tuple[int, np.ndarray, np.ndarray]] = []
    for off, a, b in blocks:
        if a.shape != b.shape or a.dtype != b.dtype or a.ndim != 1:
            raise ValueError(f"scan needs two 1-D arrays of one dtype, got {a.shape} {a.dtype} and {b.shape} {b.dtype}")
        if a.dtype.itemsize not in (2, 4) or a.dtype.kind not in "iu":
            raise ValueError(f"scan works on 16- or 32-bit integer bit views, got {a.dtype}")
        pairs.append((off, unsigned(np.ascontiguousarray(a)), unsigned(np.ascontiguousarray(b))))
    if len({p[1].dtype for p in pairs}) > 1:
        raise ValueError("every block of a scan must have one dtype")
    dtype = pairs[0][1].dtype if pairs else np.dtype(np.uint16)
    # The word kernels read lanes out of 64-bit words, which assumes little-endian.
    if use_jit(jit) and sys.byteorder == "little":
        return _scan_jit(pairs, dtype)
    return _scan_numpy(pairs, dtype)


def _scan_numpy(pairs: list[tuple[int, np.ndarray, np.ndarray]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _scan_jit(pairs: list[tuple[int, np.ndarray, np.ndarray]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lanes = 8 // dtype.itemsize
    kern = compiled(_scan_words16 if lanes == 4 else _scan_words32)
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
        a, b, wa, wb = readonly(a), readonly(b), readonly(wa), readonly(wb)
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
