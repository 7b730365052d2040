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

Free memory inside the heap is another matter: glibc gives back only its
top, and a step frees gigabytes in the middle of it (the gradients after the
update, the older version and the behaviour pass's activations before the
backward pass). Kept, those pages stay resident while nothing uses them, and
the step's peak (the backward pass) comes on top of them: measured with
``aurora bench trainer --params 2e8``, about 0.5 GB of free heap was still
resident at the peak. :func:`trim` (``malloc_trim(0)``) gives every free page
back at the two points of a step where most is free (:class:`~workers.trainer.policy.GrpoPolicy`:
after the behaviour pass, before the backward passes, and after the update); what is
allocated next faults fresh pages in, a fraction of a second per step for a 200 M model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

__all__ = ["ARENAS", "MMAP_BYTES", "TRIM_BYTES", "trim", "tune_allocator"]

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
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def trim() -> bool:
    """Give the free pages of the C heap back to the system (glibc's ``malloc_trim(0)``); False where
    there is no such call (not glibc). Only free memory goes: nothing live moves or changes."""
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None) if libc is not None else None
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    fn(0)
    return True


@functools.cache
def tune_allocator() -> bool:
    """Apply the settings above (once per process); False where they do not apply (not Linux with
    glibc). A setting the environment gives is left to it."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:  # not Linux, or musl and others: no mallopt, nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    for param, env, value in _SETTINGS:
        if env not in os.environ and mallopt(param, value) != 1:
            log.debug("mallopt(%d, %d) refused", param, value)
    return True
