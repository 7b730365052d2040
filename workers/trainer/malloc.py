"""The C allocator's settings for a Trainer process (glibc's malloc; nothing elsewhere).

Why: tensors on the host are ``malloc``'d, and what glibc does by default
costs a Trainer about 3 bytes per parameter of resident memory beyond what
is live (measured with ``aurora bench trainer``, docs/BENCHMARKS.md):

- each thread that allocates gets an arena of its own, up to eight per core,
  and memory freed in one arena is kept for that arena's next allocations,
  usable by no other: the main thread (master weights, gradients, versions)
  and the publishing, hashing and checkpoint threads each keep what they once
  needed. One arena (:data:`ARENAS`) makes every freed block reusable by every
  thread; the other threads allocate little, so sharing its lock costs nothing
  measurable;
- where a block comes from moves with the workload: glibc maps blocks from
  128 KiB up with ``mmap`` and raises that threshold (up to 32 MiB) as such
  blocks are freed, so the same tensor comes from the heap one step and from a
  fresh mapping the next. Fixed at :data:`MMAP_BYTES`, a block below it always
  comes from the heap (a version's blocks, :mod:`~workers.trainer.held`, are
  sized to fit) and is reused there, never given back and faulted in again;
  free memory at the heap's top is given back past :data:`TRIM_BYTES`, where
  glibc's own adjustment would take it (fixing one threshold stops both).

The settings are the process's own (``mallopt``), made once before the model
is built; one the environment sets (``MALLOC_ARENA_MAX``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

__all__ = ["ARENAS", "MMAP_BYTES", "TRIM_BYTES", "tune_allocator"]

log = logging.getLogger("aurora.trainer")

ARENAS = 1
"""Arenas a Trainer process allocates from (glibc's ``M_ARENA_MAX``)."""
MMAP_BYTES = 32 << 20
"""Blocks of at least this size are mapped on their own (``M_MMAP_THRESHOLD``; glibc's largest)."""
TRIM_BYTES = 2 * MMAP_BYTES
"""Free memory at the heap's top beyond which it is given back (``M_TRIM_THRESHOLD``)."""

# From glibc's malloc.h, with the variable that sets each from the environment.
_SETTINGS = (
    (-8, "MALLOC_ARENA_MAX", ARENAS),  # M_ARENA_MAX
    (-3, "MALLOC_MMAP_THRESHOLD_", MMAP_BYTES),  # M_MMAP_THRESHOLD
    (-1, "MALLOC_TRIM_THRESHOLD_", TRIM_BYTES),  # M_TRIM_THRESHOLD
)


@functools.cache
def tune_allocator() -> bool:
    """Apply the settings above (once per process); False where they do not apply (not Linux with
    glibc). A setting the environment gives is left to it."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt, nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    for param, env, value in _SETTINGS:
        if env not in os.environ and mallopt(param, value) != 1:
            log.debug("mallopt(%d, %d) refused", param, value)
    return True
