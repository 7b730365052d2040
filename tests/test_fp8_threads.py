"""Whole-model FP8 work on threads (aurora_store/quant/weights.py) and the kernels' prefetch hints.

A model's copy is quantized and requantized one weight per thread; the result
must be what one thread gives, bit for bit, and a refused weight must not stop
the others half-way or hide which one was refused.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from aurora_store.codec import kernels as codec_kernels
from aurora_store.codec.kernels.jit import compiled
from aurora_store.codec.kernels.prefetch import prefetch_read, prefetch_write
from aurora_store.errors import ModelMismatchError
from aurora_store.quant import weights as quant_weights
from aurora_store.quant.weights import Change, Fp8Weights, run_all
from aurora_tools.synthetic.shapes import QWEN3_TINY, make_weights

needs_numba = pytest.mark.skipif(not codec_kernels.jit_available(), reason="numba is not installed")


@pytest.fixture(autouse=True)
def always_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model's work is far below the threshold for threads: lift it, so threads run."""
    monkeypatch.setattr(quant_weights, "PARALLEL_MIN", 0)


def test_jobs_run_at_once_on_threads_and_small_work_stays_on_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    both = threading.Barrier(2, timeout=30)  # broken (an error) unless two jobs wait at once

    def job(i: int) -> tuple[int, str]:
        both.wait()
        return i, threading.current_thread().name

    got = run_all([(1, lambda i=i: job(i)) for i in range(4)], threads=2)
    assert [i for i, _ in got] == [0, 1, 2, 3]  # results in the given order
    assert {name for _, name in got} <= {f"aurora-quant_{k}" for k in range(2)} and len({n for _, n in got}) == 2
    monkeypatch.setattr(quant_weights, "PARALLEL_MIN", 100)
    here = threading.current_thread().name
    assert {n for n in run_all([(10, lambda: threading.current_thread().name)] * 3, threads=2)} == {here}


def _step(weights: dict[str, torch.Tensor], names: list[str], seed: int, density: float = 0.03) -> list[Change]:
    """Flip the lowest bit of a random ``density`` of each named weight's elements; the changes."""
    rng = np.random.default_rng(seed)
    out: list[Change] = []
    for n in names:
        t = weights[n]
        flat = t.view(-1).view(torch.int16)
        idx = np.unique(rng.integers(0, t.numel(), max(1, int(t.numel() * density))))
        old = flat[torch.from_numpy(idx)].numpy().view(np.uint16).copy()
        new = old ^ np.uint16(1)
        flat[torch.from_numpy(idx)] = torch.from_numpy(new.view(np.int16))
        out.append((n, t, idx, old, new))
    return out


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_give_the_one_thread_copy_bit_for_bit(threads: int) -> None:
    weights = make_weights(QWEN3_TINY, seed=5)
    copy = Fp8Weights.of(weights, threads=threads)
    one = Fp8Weights.of(weights, threads=1)
    assert copy.digest() == one.digest() and list(copy) == list(one)  # the names keep the model's order
    for step in range(3):
        changes = _step(weights, list(copy), seed=step)
        got = copy.requantize_all(changes, threads=threads)
        want = one.requantize_all(changes, threads=1)
        assert got == want and got.changed == sum(c[2].size for c in changes)
        assert copy.digest() == one.digest() == Fp8Weights.of(weights, threads=1).digest()


def test_a_refused_weight_is_reported_and_the_others_are_done() -> None:
    weights = make_weights(QWEN3_TINY, seed=6)
    copy = Fp8Weights.of(weights)
    names = sorted(copy)
    changes = _step(weights, names, seed=9)
    bad = 2
    n, t, idx, old, new = changes[bad]
    changes[bad] = (n, t, idx[::-1].copy(), old[::-1].copy(), new[::-1].copy())  # out of order: refused
    before = copy.blocks[n].copy()
    with pytest.raises(ModelMismatchError, match=f"{n}: change has indices out of order"):
        copy.requantize_all(changes, threads=2)
    assert np.array_equal(copy.blocks[n].q, before.q)  # the refused weight's copy left as it was
    fresh = Fp8Weights.of(weights)
    for other in names:
        if other != n:
            assert np.array_equal(copy.blocks[other].q, fresh.blocks[other].q), other
    with pytest.raises(ValueError, match="appears twice"):
        copy.requantize_all([changes[0], changes[0]])


@needs_numba
def test_prefetch_hints_compile_into_kernels_and_change_nothing() -> None:
    def kernel(a: np.ndarray, out: np.ndarray) -> int:
        s = 0
        for i in range(a.size):
            prefetch_read(a, i + 64)  # past the end: a hint never faults
            prefetch_write(out, i + 64)
            out[i] = a[i] + 1
            s += np.int64(a[i])
        return s

    a = np.arange(1000, dtype=np.uint16)
    out, plain = np.zeros_like(a), np.zeros_like(a)
    fn = compiled(kernel)
    assert fn(a, out) == kernel(a, plain) == int(a.sum())
    assert np.array_equal(out, plain) and np.array_equal(out, a + 1)
    assert "prefetch" in next(iter(fn.inspect_llvm().values()))


def test_refresh_requantizes_from_scratch_into_the_arrays_already_there() -> None:
    weights = make_weights(QWEN3_TINY, seed=7)
    copy = Fp8Weights.of(weights)
    arrays = {n: (b.q, b.scale_inv, b.peak, b.ties) for n, b in copy.blocks.items()}
    for b in copy.blocks.values():  # garbage in: refresh must not depend on what was there
        b.q.fill(0x7F)
        b.peak.fill(0)
        b.ties.fill(-1)
    _step(weights, list(copy), seed=1)
    copy.refresh(weights, threads=2)
    assert copy.digest() == Fp8Weights.of(weights).digest()
    for n, b in copy.blocks.items():
        assert all(x is y for x, y in zip((b.q, b.scale_inv, b.peak, b.ties), arrays[n], strict=True)), n
    with pytest.raises(ModelMismatchError, match="refresh: no weight for"):
        copy.refresh({})
