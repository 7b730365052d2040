"""Compiled kernels for the codec's hot loops, each with an exact numpy twin.

Four loops dominate publishing and applying a delta, and none of them
vectorizes well in numpy (they are data-dependent: a scan that keeps the few
elements that changed, a byte stream of variable-length integers, a scatter).
One module per concern:

- :mod:`~aurora_store.codec.kernels.jit`: numba detection, ``AURORA_NO_JIT``,
  :func:`path`, lazy compilation;
- :mod:`~aurora_store.codec.kernels.scan`: :func:`scan_changes` /
  :func:`scan_blocks`, the changed indices with their new and old bits, in
  one pass over memory;
- :mod:`~aurora_store.codec.kernels.leb128`: :func:`leb128_indices` (the gap
  stream decoder, validating every rule of FORMAT.md §3), :func:`leb128_decode`,
  and the encoders :func:`leb128_encode` / :func:`leb128_encode_gaps` /
  :func:`leb128_size`;
- :mod:`~aurora_store.codec.kernels.scatter`: :func:`apply_bits`, overwrite or
  XOR values at indices of a flat array;
- :mod:`~aurora_store.codec.kernels.rice` and
  :mod:`~aurora_store.codec.kernels.huffman`: format 2's Rice-coded gaps and
  Huffman-coded byte planes (docs/FORMAT.md §3.1); their
  numpy-path twins are the kernel bodies run as plain Python (slow, exact);
- :mod:`~aurora_store.codec.kernels.warmup`: :func:`warm_up`.

Every kernel has a pure numpy twin, used when numba is not installed or
``AURORA_NO_JIT=1`` is set, and the tests run both and compare them bit for
bit. Importing this package does not import numba: each kernel is compiled
(or loaded from numba's cache) the first time it runs.

The kernels trust array shapes and dtypes (the wrappers check them) but
never trust values: every index a kernel writes through is bounds-checked
first, since compiled code has no bounds checks of its own.
"""

from __future__ import annotations

from aurora_store.codec.kernels.jit import (
    JIT_ENV,
    jit_available,
    jit_enabled,
    numba_version,
    path,
)
from aurora_store.codec.kernels.leb128 import (
    leb128_decode,
    leb128_encode,
    leb128_encode_gaps,
    leb128_indices,
    leb128_size,
)
from aurora_store.codec.kernels.scan import SCAN_CHUNK_ELEMS, scan_blocks, scan_changes
from aurora_store.codec.kernels.scatter import apply_bits
from aurora_store.codec.kernels.warmup import warm_up

__all__ = [
    "JIT_ENV",
    "SCAN_CHUNK_ELEMS",
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
