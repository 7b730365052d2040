"""Large FP8 copies in transparent huge pages, where the system offers them.

An FP8 copy is written where a delta moved a byte and read whole where a
block is redone: both are scattered over arrays of hundreds of megabytes.
With 4 KiB pages every row of a 128 x 128 block of a wide weight sits in
its own page, so a scattered pass pays a TLB walk per row on top of the
cache miss; 2 MiB pages cover a whole band of rows. Linux hands out huge
pages for an anonymous mapping that asks for them (``madvise(MADV_HUGEPAGE)``,
honoured when ``/sys/kernel/mm/transparent_hugepage/enabled`` is
``madvise`` or ``always``). Elsewhere, or for a small array, it is
:func:`numpy.empty`: the same array, only the page size differs.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

__all__ = ["HUGE", "empty"]

#: Arrays at least this large get their own mapping (several huge pages: below that the rounding wastes memory).
HUGE = 8 << 20
_PAGE = 2 << 20


def empty(shape: tuple[int, ...], dtype: type | np.dtype) -> np.ndarray:
    """An uninitialised array of ``shape`` and ``dtype``, in huge pages when it is at least :data:`HUGE` bytes."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if n < HUGE or advise is None:
        return np.empty(shape, dt)
    # One page more than needed, so the array can start on a huge-page boundary (an anonymous map
    # starts on a 4 KiB one). The array holds the mapping: it is unmapped when the array goes.
    m = mmap.mmap(-1, n + _PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: ordinary pages
        m.madvise(advise)
    base = np.frombuffer(m, np.uint8)
    skip = (-base.ctypes.data) % _PAGE
    return base[skip : skip + n].view(dt).reshape(shape)
