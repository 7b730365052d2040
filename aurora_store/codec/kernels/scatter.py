"""The scatter: overwrite or XOR values at the indices of a flat array.

:func:`apply_bits` writes a decoded entry into a parameter's bit view. The
compiled kernel bounds-checks every index before it writes any (compiled
code has no bounds checks of its own, and indices come from untrusted
segments); the numpy twin refuses the same inputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aurora_store.codec.kernels.jit import compiled, readonly, unsigned, use_jit

__all__ = ["apply_bits"]


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


# ---------------------------------------------------------------------------
# Wrapper


def apply_bits(flat: np.ndarray, indices: np.ndarray, bits: np.ndarray, xor: bool, jit: bool | None = None) -> None:
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
    flat = unsigned(flat)
    bits = unsigned(np.ascontiguousarray(bits))
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    if use_jit(jit):
        ok = compiled(_apply)(flat, readonly(indices), readonly(bits), bool(xor))
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
