"""The safe point's write loop, with a software prefetch running ahead of it.

A prepared delta writes strictly increasing indices into weights far larger
than any cache: at RL densities (about 1 % of elements) consecutive writes
fall a few cache lines apart, so nearly every write misses and waits for its
line, one after another. Asking for the line of the write ``AHEAD`` places
later (LLVM's ``llvm.prefetch``, with write intent) keeps that many misses in
flight instead of one: the loop then runs at about the memory's throughput
rather than its latency. On this project's 2-core test machine, 6.4 M sorted
writes into one 1.2 GB array took 25-28 ms without it and 21-23 ms with it;
``aurora bench activate`` at 1 B parameters went from 0.053-0.056 s to
0.045-0.049 s (docs/BENCHMARKS.md, "Activation").

This module imports numba at import: it is imported only when a compiled
kernel is about to be built (aurora_store.apply.prepare).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["AHEAD", "write_all"]

AHEAD = 64
"""Writes the prefetch runs ahead: about as many lines as a core keeps misses in flight for."""


@intrinsic
def _prefetch_for_write(typingctx: Any, arr: Any, i: Any) -> Any:
    """Hint the cache line of ``arr[i]`` in, to be written (no effect on results; never faults)."""
    if not isinstance(arr, types.Array) or not isinstance(i, types.Integer):
        return None
    sig = types.void(arr, i)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        aty = signature.args[0]
        a, idx = args
        data = context.make_array(aty)(context, builder, a).data
        ptr = builder.gep(data, [idx])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [i8p], ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]))
        # rw=1 (write), locality=3 (keep in all levels), cache type=1 (data)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


def write_all(flat: Any, idx: Any, bits: Any, xor: Any) -> Any:
    """``flat[idx] (^)= bits`` for every index; False (nothing written) if the first or last index
    is outside ``flat`` (the indices are strictly increasing, as prepared). The prefetch reads an
    index ``AHEAD`` places on, which the same bounds cover."""
    m = idx.size
    if m == 0:
        return True
    if idx[0] < 0 or idx[m - 1] >= flat.size:
        return False
    near = max(0, m - AHEAD)
    # Unsigned positions (all >= 0, checked above): no negative-index wrap-around per element.
    if xor:
        for k in range(near):
            _prefetch_for_write(flat, np.uint64(idx[k + AHEAD]))
            flat[np.uint64(idx[k])] ^= bits[k]
        for k in range(near, m):
            flat[np.uint64(idx[k])] ^= bits[k]
    else:
        for k in range(near):
            _prefetch_for_write(flat, np.uint64(idx[k + AHEAD]))
            flat[np.uint64(idx[k])] = bits[k]
        for k in range(near, m):
            flat[np.uint64(idx[k])] = bits[k]
    return True
