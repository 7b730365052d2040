"""Compile (or load from numba's cache) every kernel ahead of a timed section."""

from __future__ import annotations

import time

import numpy as np

from aurora_store.codec.kernels import huffman, rice
from aurora_store.codec.kernels.jit import jit_enabled
from aurora_store.codec.kernels.leb128 import (
    leb128_decode,
    leb128_encode,
    leb128_encode_gaps,
    leb128_indices,
    leb128_size,
)
from aurora_store.codec.kernels.scan import scan_changes
from aurora_store.codec.kernels.scatter import apply_bits

__all__ = ["warm_up"]


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
    # Format 2 (rice gaps, Huffman planes), strided outputs included.
    r = np.frombuffer(rice.rice_encode_gaps(idx, 0), np.uint8)
    rice.rice_indices(r, 0, 70001, 3)
    rice.rice_size(idx, 0, 3)
    plane = np.array([1, 3, 1, 7, 1], np.uint8)
    huffman.byte_histograms(np.array([1, 3, 0x8001], np.uint16))
    huffman.byte_histograms(np.array([1, 3], np.uint32))
    h = np.frombuffer(huffman.huffman_encode(plane), np.uint8)
    huffman.huffman_encode(np.zeros((5, 2), np.uint8)[:, 0])
    huffman.huffman_decode_into(h, np.empty(5, np.uint8))
    huffman.huffman_decode_into(h, np.empty((5, 2), np.uint8)[:, 0])
    huffman.huffman_decode_into(h, np.empty((5, 4), np.uint8)[:, 1])
    return time.perf_counter() - t0
