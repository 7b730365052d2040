"""The memory floor of an incremental FP8 requantization: its traffic with no arithmetic.

``aurora bench fp8`` compares ``requant_s`` with a target that scales with
the work (``2 x work_fraction x full_quant_s + 5 ms``). On a model that does
not fit in the caches, part of that work is memory traffic no arithmetic can
shorten, and this module measures it on the same arrays, threads and cold
caches as the requantization, side by side:

- ``floor_moved_s``: every moved FP8 byte written into the copy in place.
  The moved bytes lie far apart (0.14 % of the elements at RL densities),
  so each one reads and writes back a 64-byte line of its own: any design
  that keeps the serving copy in memory and current pays this.
- ``floor_s``: that, plus one streaming read of what the change pass is given
  for every changed element (its index, old and new bf16 bits).

Neither computes an FP8 byte: the moved bytes come from the from-scratch
copy, listed beforehand. The kernel is numba's, with a numpy path where
numba is absent (the same traffic, in numpy's passes).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from aurora_store.codec.kernels.jit import compiled, readonly, use_jit
from aurora_store.quant.weights import run_all

__all__ = ["Traffic", "floors", "traffic"]

#: One weight's traffic: (its FP8 bytes, flat, written in place; the changes' indices, old and new
#: bits; the moved bytes' flat indices and their new values).
Traffic = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _traffic(q: Any, idx: Any, old: Any, new: Any, moved: Any, moved_q: Any) -> Any:
    """Read ``idx``/``old``/``new`` once (a checksum, so the reads stay), then write ``moved_q`` at ``moved``."""
    acc = np.uint32(0)
    for j in range(idx.size):
        acc = np.uint32(acc + np.uint32(np.uint32(idx[j]) ^ np.uint32(old[j]) ^ np.uint32(np.uint32(new[j]) << np.uint32(16))))
    for j in range(moved.size):
        q[np.uint64(moved[j])] = moved_q[j]
    return acc


def traffic(
    q: np.ndarray, idx: np.ndarray, old: np.ndarray, new: np.ndarray, moved: np.ndarray, moved_q: np.ndarray, jit: bool | None = None
) -> int:
    """One weight's floor pass (see the module docstring): ``q[moved] = moved_q`` after reading the changes once.

    Returns the checksum of the reads (it only keeps them from being
    optimized away). ``moved`` must be in bounds; the benchmark lists it.
    """
    if use_jit(jit):
        return int(compiled(_traffic)(q, readonly(idx), readonly(old), readonly(new), readonly(moved), readonly(moved_q)))
    acc = (
        np.bitwise_xor.reduce(idx.astype(np.uint32, copy=False)) if idx.size else 0,
        np.bitwise_xor.reduce(old) if old.size else 0,
        np.bitwise_xor.reduce(new) if new.size else 0,
    )
    q[moved] = moved_q
    return int(sum(int(a) for a in acc)) & 0xFFFFFFFF


def _timed(reps: int, reset: Callable[[], None], fn: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(reps):
        reset()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def floors(weights: Sequence[Traffic], reset: Callable[[], None], reps: int, threads: int, jit: bool | None = None) -> Mapping[str, float]:
    """``{"floor_s", "floor_moved_s"}``: the best of ``reps`` runs of each pass over every weight, on
    ``threads`` threads, largest first; ``reset`` runs before each (it puts the copy back as it was
    before the change, as the requantization's runs do, which also leaves the caches as cold)."""

    def over(with_changes: bool) -> Callable[[], Any]:
        jobs = []
        for q, idx, old, new, moved, moved_q in weights:
            if not with_changes:
                idx, old, new = idx[:0], old[:0], new[:0]
            jobs.append((int(idx.size + moved.size), functools.partial(traffic, q, idx, old, new, moved, moved_q, jit)))
        return lambda: run_all(jobs, threads)

    return {"floor_s": _timed(reps, reset, over(True)), "floor_moved_s": _timed(reps, reset, over(False))}
