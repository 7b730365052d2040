"""The memory floor of ``aurora bench fp8``: its passes write exactly the moved bytes, on both paths."""

from __future__ import annotations

import numpy as np
import pytest

from aurora_store.codec.kernels.jit import jit_available
from aurora_tools.bench.fp8_floor import floors, traffic

PATHS = [
    pytest.param(True, id="jit", marks=pytest.mark.skipif(not jit_available(), reason="numba is not installed")),
    pytest.param(False, id="numpy"),
]


def _case(seed: int, n: int = 1 << 16) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    before = rng.integers(0, 256, n).astype(np.uint8)
    idx = np.unique(rng.integers(0, n, n // 100)).astype(np.int32)
    old = rng.integers(0, 1 << 16, idx.size).astype(np.uint16)
    new = old ^ np.uint16(1)
    moved = idx[rng.random(idx.size) < 0.15]
    after = before.copy()
    after[moved] ^= np.uint8(1)
    return before, after, idx, old, new, moved, after[moved]


@pytest.mark.parametrize("jit", PATHS)
def test_a_floor_pass_writes_the_moved_bytes_and_nothing_else(jit: bool) -> None:
    before, after, idx, old, new, moved, moved_q = _case(1)
    q = before.copy()
    traffic(q, idx, old, new, moved, moved_q, jit)
    assert np.array_equal(q, after)
    q = before.copy()
    traffic(q, idx[:0], old[:0], new[:0], moved[:0], moved_q[:0], jit)  # nothing to do
    assert np.array_equal(q, before)


@pytest.mark.parametrize("jit", PATHS)
def test_floors_time_both_passes_over_every_weight_from_the_state_before(jit: bool) -> None:
    cases = [_case(s, 1 << (12 + s)) for s in range(3)]
    qs = [c[0].copy() for c in cases]
    resets = []

    def reset() -> None:
        resets.append(1)
        for q, c in zip(qs, cases, strict=True):
            np.copyto(q, c[0])

    got = floors([(q, *c[2:]) for q, c in zip(qs, cases, strict=True)], reset, reps=2, threads=2, jit=jit)
    assert set(got) == {"floor_s", "floor_moved_s"} and all(v > 0 for v in got.values())
    assert len(resets) == 4  # before every run of each pass
    for q, c in zip(qs, cases, strict=True):
        assert np.array_equal(q, c[1])  # the last run wrote every weight's moved bytes
