"""The numpy twins of :mod:`aurora_store.quant.kernels`: the same results, bit for bit, without numba.

Used when numba is missing or ``AURORA_NO_JIT=1`` is set, and by the tests,
which run both paths and compare them. Each is vectorized over a whole band
of rows or a whole change; the float32 arithmetic and the FP8 rounding are
the kernels' (:func:`fp8_bits` rounds from the float32 bit pattern exactly
as they do).
"""

from __future__ import annotations

import numpy as np

__all__ = ["BLOCK", "FP8_MAX", "AMAX_FLOOR", "NONFINITE", "fp8_bits", "scales_of", "blocks_numpy", "all_blocks_numpy", "changes_numpy"]

BLOCK = 128
FP8_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-4)
#: bf16 magnitudes at or above this (exponent all ones) are infinities or NaNs.
NONFINITE = 0x7F80


def fp8_bits(p: np.ndarray) -> np.ndarray:
    """``float8_e4m3fn`` bytes of float32 values of magnitude below 464, rounded to nearest even (as the kernels do)."""
    p = np.ascontiguousarray(p, dtype=np.float32)
    u = p.view(np.uint32)
    a = u & np.uint32(0x7FFFFFFF)
    v = ((a + np.uint32(0x7FFFF) + ((a >> 20) & 1)) >> 20) - np.uint32(960)
    sub = (np.abs(p) + np.float32(16384.0)).view(np.uint32) - np.uint32(0x46800000)
    return (np.where(a < 0x3C800000, sub, v) | ((u >> 24) & 0x80)).astype(np.uint8)


def scales_of(peak: np.ndarray) -> np.ndarray:
    """Block scales (float32) of largest magnitudes given as bf16 bits."""
    amax = (np.asarray(peak).astype(np.uint32) << 16).view(np.float32)
    return np.maximum(amax, AMAX_FLOOR) / FP8_MAX


def _widen(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


def blocks_numpy(
    bits: np.ndarray, rows: int, cols: int, blocks: np.ndarray, q: np.ndarray, scale: np.ndarray, peak: np.ndarray, ties: np.ndarray
) -> tuple[int, int]:
    nbr, nbc = -(-rows // BLOCK), -(-cols // BLOCK)
    rescaled = elements = 0
    b3 = bits.reshape(-1, rows, cols)
    q3 = q.reshape(-1, rows, cols)
    for b in blocks.tolist():
        e, br, bc = b // (nbr * nbc), (b // nbc) % nbr, b % nbc
        sl = (e, slice(br * BLOCK, (br + 1) * BLOCK), slice(bc * BLOCK, (bc + 1) * BLOCK))
        x = b3[sl]
        m = x & 0x7FFF
        top = int(m.max())
        peak[b], ties[b] = top, int(np.count_nonzero(m == top))
        s = scales_of(np.array([top], np.uint16))[0]
        rescaled += int(scale[b] != s)
        scale[b] = s
        q3[sl] = fp8_bits(_widen(x) * (np.float32(1) / s))
        elements += x.size
    return rescaled, elements


def all_blocks_numpy(bits: np.ndarray, rows: int, cols: int, q: np.ndarray, scale: np.ndarray, peak: np.ndarray, ties: np.ndarray) -> None:
    """Every block, a band of 128 rows at a time: padded to whole blocks, reshaped to (row, block col, col)."""
    nbc = -(-cols // BLOCK)
    b3 = bits.reshape(-1, rows, cols)
    q3 = q.reshape(b3.shape)
    b = 0
    for e in range(b3.shape[0]):
        for r0 in range(0, rows, BLOCK):
            x = b3[e, r0 : r0 + BLOCK]
            mags = np.zeros((x.shape[0], nbc * BLOCK), np.uint16)
            mags[:, :cols] = x & 0x7FFF
            v = mags.reshape(x.shape[0], nbc, BLOCK)
            top = v.max(axis=(0, 2))
            mags[:, cols:] = 0xFFFF  # padding never ties with a peak (peaks are at most 0x7FFF)
            n = (v == top[None, :, None]).sum(axis=(0, 2))
            s = scales_of(top)
            inv = np.repeat(np.float32(1) / s, BLOCK)[:cols]
            q3[e, r0 : r0 + BLOCK] = fp8_bits(_widen(x) * inv[None, :])
            peak[b : b + nbc], ties[b : b + nbc], scale[b : b + nbc] = top, n, s
            b += nbc


def changes_numpy(
    rows: int,
    cols: int,
    size: int,
    idx: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    q: np.ndarray,
    scale: np.ndarray,
    peak: np.ndarray,
    ties: np.ndarray,
) -> tuple[np.ndarray, np.ndarray] | int:
    nbr, nbc = -(-rows // BLOCK), -(-cols // BLOCK)
    i = idx.astype(np.int64)
    if i.size and (int(i[0]) < 0 or int(i[-1]) >= size or bool((np.diff(i) <= 0).any())):
        return -2
    if bool(((new & NONFINITE) == NONFINITE).any()):
        return -1
    mn = (new & 0x7FFF).astype(np.int64)
    rem = i % (rows * cols)
    blk = ((i // (rows * cols)) * nbr + (rem // cols) // BLOCK) * nbc + (rem % cols) // BLOCK
    touched, at = np.unique(blk, return_inverse=True)
    hi = np.full(touched.size, -1, np.int64)
    np.maximum.at(hi, at, mn)
    p = peak[touched].astype(np.int64)

    def per_block(mask: np.ndarray) -> np.ndarray:
        return np.bincount(at, weights=mask, minlength=touched.size).astype(np.int64)

    left = ties[touched] - per_block((old & 0x7FFF) == p[at]) + per_block(mn == p[at])
    up = hi > p
    rescale = up & (scales_of(np.maximum(hi, 0).astype(np.uint16)) != scale[touched])
    shrunk = ~up & (left <= 0)
    kept = ~up & ~shrunk
    ties[touched[kept]] = left[kept]
    peak[touched[up]] = hi[up]
    ties[touched[up]] = per_block(mn == hi[at])[up]
    sel = ~(rescale | shrunk)[at]
    q[i[sel]] = fp8_bits(_widen(new[sel]) * (np.float32(1) / scale[blk[sel]]))
    return touched[shrunk], touched[rescale]
