"""The safe point's write: sorted indices into a flat array, one compiled pass.

``flat[indices[k]] (^)= bits[k]`` over strictly increasing indices (what
:func:`~aurora_store.apply.prepare.prepare_delta` checked): consecutive
writes fall in the same or the next cache lines. The compiled loop is the
prefetching one of :mod:`aurora_store.codec.kernels.sorted_write`, or a plain
loop where numba cannot build it; every path has a numpy twin.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from aurora_store.codec.kernels.jit import compiled, readonly, use_jit

__all__ = ["write_sorted", "write_whole", "write_kernel", "warm"]

log = logging.getLogger(__name__)


def _write(flat, offset, idx, bits, klo, khi, xor):
    """``flat[idx[k] - offset] (^)= bits[k]`` for k in [klo, khi); False (nothing written)
    if the first or last index is outside ``flat`` (the indices are strictly increasing)."""
    if khi <= klo:
        return True
    n = flat.size
    if idx[klo] < offset or idx[khi - 1] - offset >= n:
        return False
    if xor:
        for k in range(klo, khi):
            flat[np.uint64(idx[k] - offset)] ^= bits[k]
    else:
        for k in range(klo, khi):
            flat[np.uint64(idx[k] - offset)] = bits[k]
    return True


def _write_all(flat, idx, bits, xor):
    """``flat[idx] (^)= bits`` for every index; False (nothing written) if the first or last
    index is outside ``flat`` (the indices are strictly increasing). The plain loop, used where
    the prefetching one (aurora_store.codec.kernels.sorted_write) cannot be built."""
    m = idx.size
    if m == 0:
        return True
    if idx[0] < 0 or idx[m - 1] >= flat.size:
        return False
    # Unsigned positions (all >= 0, checked above): no negative-index wrap-around per element.
    if xor:
        for k in range(m):
            flat[np.uint64(idx[k])] ^= bits[k]
    else:
        for k in range(m):
            flat[np.uint64(idx[k])] = bits[k]
    return True


@functools.cache
def write_kernel() -> Callable[..., Any]:
    """The compiled write loop: the prefetching one, or the plain one if numba cannot build it."""
    try:
        from aurora_store.codec.kernels.sorted_write import write_all

        k = compiled(write_all)
        probe = np.zeros(2, dtype=np.uint16)
        k(probe, readonly(np.array([0, 1], dtype=np.int32)), readonly(np.array([1, 2], dtype=np.uint16)), False)
        if probe.tolist() != [1, 2]:
            raise RuntimeError(f"wrote {probe.tolist()}")
        return k
    except Exception as e:  # noqa: BLE001 - an optimisation: the plain loop writes the same
        log.warning("the prefetching write kernel is unavailable (%s: %s); using the plain loop", type(e).__name__, e)
        return compiled(_write_all)


def write_whole(flat: np.ndarray, indices: np.ndarray, bits: np.ndarray, xor: bool, jit: bool | None) -> bool:
    """``flat[indices] (^)= bits`` in one pass (the compiled kernel unless ``jit`` is off);
    False, having written nothing, when the first or last index falls outside ``flat``."""
    if flat.dtype != bits.dtype or flat.ndim != 1 or not flat.flags.writeable or indices.shape != bits.shape:
        raise ValueError(f"write: {flat.dtype} {flat.ndim}-d array for {bits.shape} {bits.dtype} values")
    if use_jit(jit):
        return bool(write_kernel()(flat, readonly(indices), readonly(bits), bool(xor)))
    return write_sorted(flat, 0, indices, bits, 0, indices.size, xor, False)


@functools.cache
def warm(bits: str, idx: str) -> None:
    """Compile (or load from numba's cache) the write kernel for these dtypes, once per process."""
    if not use_jit(None):
        return
    flat = np.zeros(2, dtype=bits)
    i = np.array([0, 1], dtype=idx)
    i.flags.writeable = False
    v = np.array([1, 2], dtype=bits)
    v.flags.writeable = False
    for xor in (False, True):
        write_whole(flat, i, v, xor, True)


def write_sorted(
    flat: np.ndarray,
    offset: int,
    indices: np.ndarray,
    bits: np.ndarray,
    klo: int,
    khi: int,
    xor: bool,
    jit: bool | None = None,
) -> bool:
    """One pass of sorted writes ``flat[indices[k] - offset] (^)= bits[k]``, k in ``[klo, khi)``.

    ``indices`` must be strictly increasing (what :func:`prepare_delta`
    checked); ``flat`` and ``bits`` unsigned of one width. Returns False,
    having written nothing, when the first or last index falls outside.
    """
    if flat.dtype != bits.dtype or flat.ndim != 1 or not flat.flags.writeable:
        raise ValueError(f"write_sorted: {flat.dtype} {flat.ndim}-d array for {bits.dtype} values")
    if not 0 <= klo <= khi <= indices.size:
        raise ValueError(f"write_sorted: range [{klo}, {khi}) of {indices.size} indices")
    if use_jit(jit):
        return bool(
            compiled(_write)(
                flat,
                np.int64(offset),
                readonly(indices),
                readonly(bits),
                np.int64(klo),
                np.int64(khi),
                bool(xor),
            )
        )
    if khi <= klo:
        return True
    if int(indices[klo]) < offset or int(indices[khi - 1]) - offset >= flat.size:
        return False
    at = indices[klo:khi].astype(np.int64) - offset
    if xor:
        flat[at] ^= bits[klo:khi]
    else:
        flat[at] = bits[klo:khi]
    return True


# ---------------------------------------------------------------------------
# the digest after the write
