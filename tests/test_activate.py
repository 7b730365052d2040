"""Prepared activation (aurora_store.apply.prepared, TorchEngine.prepare, the swap option) and ``aurora bench activate``.

A delta prepared in the stager lands bit for bit where the plain path puts
it, in place or through the spare copy, along chains of versions and with
deltas prepared ahead of the version they land on; the digest it predicts
is the digest of the weights it leaves; a failure before the write (or the
swap) leaves the held weights as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import numpy as np
import pytest
import torch

from aurora_store.apply.prepare import prepare_delta
from aurora_store.apply.prepared_delta import PreparedDelta, layout_of_plan
from aurora_store.apply.sink import weights_digest
from aurora_store.apply.write_kernel import write_sorted
from aurora_store.codec.entries import EncodeOptions
from aurora_store.codec.extract import extract
from aurora_store.errors import ChainError, ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta, encode_segments, stage_segments
from workers.engine import torch_engine
from workers.engine.torch_engine import EngineConfig, TorchEngine
from workers.model import hf_weights, tiny_qwen3
from workers.tokenizer import CharTokenizer

TOK = CharTokenizer()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(activation: str = "in-place") -> TorchEngine:
    e = TorchEngine(TOK, EngineConfig(activation=activation))
    e.load(tiny_qwen3(TOK.vocab_size, seed=0), version=0)
    return e


def _step(weights: dict[str, torch.Tensor], rng: np.random.Generator, density: float) -> dict[str, torch.Tensor]:
    """New weights: ``density`` of each tensor's elements get random new bits (mostly +-1 ulp, some further)."""
    out = {}
    for n, t in weights.items():
        bits = t.clone().view(torch.int16).view(-1)
        k = max(1, int(bits.numel() * density))
        idx = torch.from_numpy(rng.choice(bits.numel(), size=min(k, bits.numel()), replace=False))
        old = bits[idx]
        ulp = torch.from_numpy(rng.choice([-1, 1], size=idx.numel()).astype(np.int16))
        far = torch.from_numpy(rng.integers(-60, 60, size=idx.numel(), dtype=np.int16))
        step = torch.where(torch.from_numpy(rng.random(idx.numel()) < 0.9), ulp, far).to(torch.int32)
        # Move the magnitude (sign kept), staying finite: no NaN for the model to sample from.
        o = old.to(torch.int32) & 0xFFFF
        mag = ((o & 0x7FFF) + step).clamp(1, 0x7F00)
        bits[idx] = ((o & 0x8000) | mag).to(torch.int32).sub(torch.where(o & 0x8000 > 0, 0x10000, 0)).to(torch.int16)
        out[n] = bits.view(torch.bfloat16).view(t.shape)
    return out


def _chain(engine: TorchEngine, versions: int, seed: int) -> list[tuple[StagedDelta, str]]:
    """Deltas 1..versions on the engine's version 0 (densities from sparse to dense), with each target digest."""
    plan = engine.fusion_plan()
    rng = np.random.default_rng(seed)
    cur = {n: t.clone() for n, t in hf_weights(engine.model).items() if n in {b.source for p in plan for b in p.blocks}}
    out = []
    for v in range(1, versions + 1):
        new = _step(cur, rng, [0.002, 0.01, 0.05, 1.0][v % 4])
        # Formats 1 and 2 in turn: format 1 still picks ``new`` values where they are smaller.
        opts = EncodeOptions(format=1 if v % 2 else 2)
        segs = [(f"seg-{s.index}", s.data) for s in encode_segments(extract(plan, cur, new), v, opts, segment_bytes=4096)]
        out.append((stage_segments(segs, v, engine.param_specs()), weights_digest(new, plan)))
        cur = new
    return out


def _bits(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: t.view(torch.int16).clone() for n, t in hf_weights(engine.model).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("activation", ["in-place", "swap"])
def test_prepared_chain_is_bit_exact(activation: str) -> None:
    plain, fast = _engine(), _engine(activation)
    chain = _chain(plain, 7, seed=1)
    assert any(e.indices is None for s, _ in chain for e in s.entries), "a dense entry is covered"
    assert {e.values for s, _ in chain for e in s.entries} == {"new", "xor"}
    for staged, want in chain:
        plain.apply(staged)
        p = fast.prepare(staged)
        assert isinstance(p, PreparedDelta) and p.nnz == staged.nnz
        assert p.digest == want  # predicted (in place) or hashed off the spare (swap)
        fast.apply(p)
        assert fast.version == plain.version == staged.version
        assert _same(_bits(fast), _bits(plain))
        assert fast.digest() == plain.digest() == want
        assert weights_digest(hf_weights(fast.model), fast.fusion_plan()) == want  # not a cached answer
    # The model generates with what it holds (a swapped-in copy included).
    prompts = [[1, 5, 6, 7]]
    assert plain.generate(prompts, 2, 6, seed=3).completions == fast.generate(prompts, 2, 6, seed=3).completions


def test_prepared_on_the_numpy_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AURORA_NO_JIT", "1")
    plain, fast = _engine(), _engine()
    for staged, want in _chain(plain, 4, seed=6):
        plain.apply(staged)
        fast.apply(fast.prepare(staged))
        assert _same(_bits(fast), _bits(plain)) and fast.digest() == want


@pytest.mark.parametrize("activation", ["in-place", "swap"])
def test_prepared_ahead_of_its_base(activation: str) -> None:
    """The stager prepares v2 and v3 while v0 is held: no digest predicted for them, still exact."""
    plain, fast = _engine(), _engine(activation)
    chain = _chain(plain, 4, seed=2)
    preps = [fast.prepare(s) for s, _ in chain[:3]]
    assert preps[0].digest == chain[0][1] and preps[1].digest is None and preps[2].digest is None
    for (staged, want), p in zip(chain[:3], preps, strict=True):
        plain.apply(staged)
        fast.apply(p)
        assert _same(_bits(fast), _bits(plain)) and fast.digest() == want
    # Then the usual rhythm again: prepared on the held version, activated.
    staged, want = chain[3]
    p = fast.prepare(staged)
    assert p.digest == want
    fast.apply(p)
    plain.apply(staged)
    assert _same(_bits(fast), _bits(plain)) and fast.digest() == want


def test_swap_replays_instead_of_copying(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = _engine("swap")
    chain = _chain(fast, 4, seed=3)
    fast.apply(fast.prepare(chain[0][0]))  # the first: a full copy into the spare
    ptr = {n: t.data_ptr() for n, t in hf_weights(fast.model).items()}
    copies = []
    real = torch.Tensor.copy_

    def counting(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        copies.append(self.numel())
        return real(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    for staged, want in chain[1:]:
        fast.apply(fast.prepare(staged))
        assert fast.digest() == want
    assert not copies, "the spare is brought up to date by replaying deltas, not by copying"
    now = {n: t.data_ptr() for n, t in hf_weights(fast.model).items()}
    assert now != ptr  # the parameters moved between the two copies


def test_failures_before_the_write_leave_weights_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    for activation in ("in-place", "swap"):
        e = _engine(activation)
        (s1, _), (s2, _) = _chain(e, 2, seed=4)
        before, digest = _bits(e), e.digest()
        # A delta on another base: refused before anything is written.
        p2 = e.prepare(s2)
        with pytest.raises(ChainError):
            e.apply(p2)
        # A prepared delta whose target tensor is gone (the model changed since).
        p1 = e.prepare(s1)
        bad = dataclasses.replace(p1.sparse[-1], numel=p1.sparse[-1].numel + 1)
        broken = PreparedDelta(p1.version, p1.base_version, p1.nnz, (*p1.sparse[:-1], bad), p1.dense)
        with pytest.raises(ModelMismatchError):
            e.apply(broken)
        assert _same(_bits(e), before) and e.digest() == digest and e.version == 0
        # A delta that does not fit is refused by prepare itself, nothing written.
        k = max(range(len(s1.entries)), key=lambda i: s1.entries[i].bits.size)
        e0 = s1.entries[k]
        assert e0.indices is not None and e0.indices.size > 1
        idx = e0.indices.copy()
        idx[-1] = idx[0]  # an element twice (the last one first): out of order
        entries = list(s1.entries)
        entries[k] = dataclasses.replace(e0, indices=idx)
        unsorted = StagedDelta(1, 0, tuple(entries))
        with pytest.raises(ModelMismatchError):
            e.prepare(unsorted)
        assert _same(_bits(e), before)
    # The swap fails halfway through pointing parameters at the spare: all of them go back.
    e = _engine("swap")
    (s1, want), _ = _chain(e, 2, seed=5)
    before, digest = _bits(e), e.digest()
    p1 = e.prepare(s1)
    assert p1.digest == want

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("injected before the swap completes")

    monkeypatch.setattr(torch_engine, "SplitWeights", boom)
    with pytest.raises(RuntimeError, match="injected"):
        e.apply(p1)
    monkeypatch.undo()
    assert _same(_bits(e), before) and e.digest() == digest and e.version == 0
    e.apply(e.prepare(s1))  # and it recovers: in place, or through a fresh spare
    assert e.digest() == want and e.version == 1


def test_write_sorted_refuses_outside_indices() -> None:
    flat = np.zeros(8, dtype=np.uint16)
    idx = np.array([1, 3, 9], dtype=np.int32)
    bits = np.array([5, 6, 7], dtype=np.uint16)
    for jit in (False, None):
        assert not write_sorted(flat, 0, idx, bits, 0, 3, False, jit)
        assert not flat.any()
        assert write_sorted(flat, 0, idx, bits, 0, 2, True, jit)
        assert flat.tolist() == [0, 5, 0, 6, 0, 0, 0, 0]
        flat[:] = 0
    assert layout_of_plan is not None


def test_bench_activate_json_at_a_tiny_size() -> None:
    from aurora_tools.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "activate", "--params", "300000", "--reps", "1", "--json"])
    assert rc == 0
    r = json.loads(out.getvalue())
    for key in (
        "safe_point_s",
        "bare_scatter_s",
        "full_copy_s",
        "params",
        "changed",
        "swap_safe_point_s",
        "prepare_s",
        "verify_s",
        "safe_point_with_verify_s",
    ):
        assert key in r
    assert "safe_point_digest_s" not in r  # the safe point no longer hashes: verification is timed apart
    assert r["verify_s"] > 0 and r["safe_point_with_verify_s"] >= r["safe_point_s"]
    assert r["exact"] is True
    assert 200_000 < r["params"] < 400_000
    assert 0 < r["changed"] < r["params"] * 0.05
    assert all(r[k] >= 0 for k in ("safe_point_s", "bare_scatter_s", "full_copy_s", "plain_safe_point_s"))


def test_synthetic_engine_prepares_too() -> None:
    """The WAN benchmark's engine takes the prepared form as well, bit for bit (the Actor hands it one)."""
    from aurora_tools.synthetic.engine import SyntheticEngine
    from aurora_tools.synthetic.shapes import QWEN3_TINY
    from aurora_tools.synthetic.workload import SyntheticSpec, sparse_update

    spec = SyntheticSpec(QWEN3_TINY, seed=1)
    plain, fast = (
        SyntheticEngine(spec, hold=True, digests=True),
        SyntheticEngine(spec, hold=True, digests=True),
    )
    plain.load_base()
    fast.load_base()
    plan = plain.fusion_plan()
    cur = {n: t.clone() for n, t in plain._weights.items()}
    for v in (1, 2, 3):
        new = {n: t.clone() for n, t in cur.items()}
        sparse_update(new, 0.02, seed=1, version=v)
        segs = [(f"s{s.index}", s.data) for s in encode_segments(extract(plan, cur, new), v)]
        staged = stage_segments(segs, v, plain.param_specs())
        plain.apply(staged)
        p = fast.prepare(staged)
        assert isinstance(p, PreparedDelta)
        fast.apply(p)
        assert fast.digest() == plain.digest() == weights_digest(new, plan)
        cur = new
    with pytest.raises(ChainError):
        fast.apply(p)  # its base is behind what the engine holds now


def test_swap_spare_is_dropped_after_writes_it_did_not_see() -> None:
    plain, e = _engine(), _engine("swap")
    (s1, w1), (s2, w2), (s3, w3) = _chain(plain, 3, seed=7)
    e.prepare(s1)  # the spare now holds v1 ...
    e.apply(s1)  # ... but v1 lands in place from the decoded delta
    p2 = e.prepare(s2)
    stale = e.prepare(s2)  # prepared twice: the spare is ready for the second object only
    e.apply(p2)  # in place: the spare (written for v2) no longer says what it holds
    assert e.digest() == w2
    p3 = e.prepare(s3)
    e.apply(p3)
    for s in (s1, s2, s3):
        plain.apply(s)
    assert _same(_bits(e), _bits(plain)) and e.digest() == w3
    assert stale.version == 2


def test_a_write_that_misses_its_prediction_is_caught_off_the_safe_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """The predicted digest speaks for old weights plus the delta; ``verify_predicted`` checks the real ones."""
    engine = _engine()
    (staged, want), (staged2, want2) = _chain(engine, 2, seed=5)
    p = engine.prepare(staged)
    assert p.digest == want
    engine.apply(p)
    assert engine.verify_predicted() is True and engine.digest() == want
    assert engine.verify_predicted() is True  # nothing written since: the same answer

    p2 = engine.prepare(staged2)
    assert p2.digest == want2
    real_write = PreparedDelta.write

    def broken_write(self: PreparedDelta, tensors: dict[str, torch.Tensor]) -> None:
        real_write(self, tensors)
        t = next(iter(tensors.values()))
        t.view(-1)[0] = -t.view(-1)[0] - 1.0  # one element the delta never named

    monkeypatch.setattr(PreparedDelta, "write", broken_write)
    engine.apply(p2)
    assert engine.digest() == want2  # the prediction, until someone checks
    assert engine.verify_predicted() is False
    real = weights_digest(hf_weights(engine.model), engine.fusion_plan())
    assert real != want2 and engine.digest() == real  # from now on the weights' own hash
    assert engine.verify_predicted() is None  # nothing predicted any more


def _segments(engine: TorchEngine, seed: int, density: float = 0.4) -> tuple[list[tuple[str, bytes]], str]:
    """Delta 1 on the engine's version 0, cut into small segments (parameters split across them), and its target digest."""
    plan = engine.fusion_plan()
    cur = {n: t.clone() for n, t in hf_weights(engine.model).items() if n in {b.source for p in plan for b in p.blocks}}
    new = _step(cur, np.random.default_rng(seed), density)
    segs = [(f"seg-{s.index}", s.data) for s in encode_segments(extract(plan, cur, new), 1, segment_bytes=1024)]
    return segs, weights_digest(new, plan)


def _sparse(p: PreparedDelta) -> list[tuple[str, bool, bytes, bytes]]:
    return [(w.source, w.xor, w.indices.astype(np.int64).tobytes(), w.bits.tobytes()) for w in p.sparse]


def test_segments_prepared_as_they_are_decoded_join_to_the_same_delta() -> None:
    """Per-segment preparation (the stager's download threads) joins into exactly what preparing
    the whole delta at once gives, and lands bit for bit; parts made for another holder are not used."""
    from aurora_store.apply.prepare import prepare_part
    from aurora_store.apply.prepared_delta import parts_of
    from aurora_store.format.limits import VersionGuard
    from aurora_store.format.segment import decode_segment

    e = _engine()
    segs, digest = _segments(e, seed=3)
    assert len(segs) > 4
    specs = e.param_specs()
    guard = VersionGuard.for_model(specs)
    decoded = [(w, decode_segment(d, w, specs, guard)) for w, d in segs]
    split = [n for n in specs if sum(any(x.param == n for x in s.entries) for _, s in decoded) > 1]
    assert split, "a parameter should span two segments here"
    whole = stage_segments(segs, 1, specs)
    staged = dataclasses.replace(whole, parts=tuple(e.prepare_segment(s) for _, s in decoded))
    assert parts_of(staged, e.fusion_plan()) is not None
    assert parts_of(staged, object()) is None  # another holder's parts: prepared from the entries instead
    joined = e.prepare(staged)
    assert _sparse(joined) == _sparse(e.prepare(whole))
    assert joined.nnz == whole.nnz
    e.apply(joined)
    assert e.digest() == digest

    # Parts that do not cover the delta's entries are refused, not half used.
    plan = e.fusion_plan()
    short = dataclasses.replace(whole, parts=staged.parts[:-1])
    with pytest.raises(ValueError, match="do not cover"):
        prepare_delta(short, specs, layout_of_plan(plan), parts=list(short.parts))
    # Two parts writing the same element (one segment's entries twice) are caught in the join.
    first = decoded[0][1]
    twice = [prepare_part(1, first.entries, specs, layout_of_plan(plan))] * 2
    fake = StagedDelta(1, 0, tuple(first.entries) * 2)
    with pytest.raises(ModelMismatchError, match="out of order or written twice"):
        prepare_delta(fake, specs, layout_of_plan(plan), parts=twice)


def test_fetch_prepares_each_segment_in_its_download_thread(tmp_path: pytest.TempPathFactory) -> None:
    """``fetch_delta(prepare=...)``: one call per segment, its result in the staged delta's parts in segment
    order; an error from it fails the fetch (the delta is never half prepared)."""
    import threading

    from aurora_store.lineage.fetch import fetch_delta
    from aurora_store.lineage.publish import PublishConfig, publish_delta
    from aurora_store.storage import open_store

    e = _engine()
    plan = e.fusion_plan()
    cur = {n: t.clone() for n, t in hf_weights(e.model).items() if n in {b.source for p in plan for b in p.blocks}}
    new = _step(cur, np.random.default_rng(5), 0.05)
    store = open_store(f"file://{tmp_path}")
    m = publish_delta(store, "t", 1, extract(plan, cur, new), "sha256:" + "0" * 64, PublishConfig(segment_bytes=1024))
    assert len(m.segments) > 2
    seen: list[tuple[int, str]] = []

    def each(seg: object) -> object:
        seen.append((len(seg.entries), threading.current_thread().name))  # type: ignore[attr-defined]
        return e.prepare_segment(seg)  # type: ignore[arg-type]

    got, staged = fetch_delta(store, 1, e.param_specs(), 2, prepare=each)
    assert len(seen) == len(m.segments) == len(staged.parts)
    assert sum(p.entries for p in staged.parts) == len(staged.entries) == sum(n for n, _ in seen)
    assert all(name != threading.current_thread().name for _, name in seen)
    e.apply(e.prepare(staged))
    assert e.digest() == weights_digest(new, plan)

    def broken(seg: object) -> object:
        raise ModelMismatchError("refused by the holder")

    with pytest.raises(ModelMismatchError, match="refused by the holder"):
        fetch_delta(store, 1, e.param_specs(), 2, prepare=broken)


@pytest.mark.parametrize("m", [0, 1, 63, 64, 65, 1000])
@pytest.mark.parametrize("xor", [False, True])
def test_the_prefetching_write_kernel_writes_what_numpy_writes(m: int, xor: bool) -> None:
    """The safe point's compiled loop (prefetching ``AHEAD`` writes on) is the one in use, and writes
    exactly numpy's result on either side of its prefetch window; it refuses outside indices untouched."""
    from aurora_store.apply.write_kernel import write_kernel
    from aurora_store.codec.kernels import sorted_write
    from aurora_store.codec.kernels.jit import readonly

    kernel = write_kernel()
    assert kernel.py_func is sorted_write.write_all  # not the plain fallback
    rng = np.random.default_rng(m)
    flat = rng.integers(0, 1 << 16, 5000, dtype=np.uint16)
    idx = np.sort(rng.choice(flat.size, m, replace=False)).astype(np.int32)
    bits = rng.integers(0, 1 << 16, m, dtype=np.uint16)
    want = flat.copy()
    if xor:
        want[idx] ^= bits
    else:
        want[idx] = bits
    assert kernel(flat, readonly(idx), readonly(bits), xor)
    assert np.array_equal(flat, want)
    if m:
        before = flat.copy()
        bad = idx.copy()
        bad[-1] = flat.size
        assert not kernel(flat, readonly(bad), readonly(bits), xor)
        assert np.array_equal(flat, before)
