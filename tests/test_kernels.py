"""Compiled kernels and their numpy twins (aurora_store/codec/kernels/).

Every test that exercises a kernel runs on both paths (``path`` fixture:
numba's compiled kernel, and numpy with ``AURORA_NO_JIT=1``) and compares
them with a plain reference, bit for bit. The decoders are also held to the
implementation that preceded the kernels (``original_*`` below, frozen
here as an oracle): same values on valid streams, same rejection, reason and
offset on malformed ones.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from conftest import index_ranges, uint64_arrays
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aurora_store.apply.sink import _scatter_torch, _write_flat
from aurora_store.codec import encodings as enc
from aurora_store.codec import kernels, varint
from aurora_store.codec.encodings import StreamError
from aurora_store.codec.extract import extract, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.codec.varint import VarintError
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

PATHS = [
    pytest.param(
        "jit",
        marks=pytest.mark.skipif(not kernels.jit_available(), reason="numba is not installed"),
    ),
    "numpy",
]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on one path, chosen the way a user would: ``AURORA_NO_JIT``."""
    if request.param == "numpy":
        monkeypatch.setenv(kernels.JIT_ENV, "1")
    else:
        monkeypatch.delenv(kernels.JIT_ENV, raising=False)
    assert kernels.path() == request.param
    return str(request.param)


#: For property tests that take the ``path`` fixture: it only sets an
#: environment variable, which holds for every example of the test.
path_settings = settings(
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ]
)


def both(fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(*args, jit=...)`` on each available path, results as a list."""
    return [fn(*args, jit=j) for j in ([True, False] if kernels.jit_available() else [False])]


# --- choosing the path -----------------------------------------------------------


def test_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.JIT_ENV, "1")
    assert kernels.path() == "numpy" and not kernels.jit_enabled()
    monkeypatch.setenv(kernels.JIT_ENV, "0")
    assert kernels.path() == ("jit" if kernels.jit_available() else "numpy")
    monkeypatch.delenv(kernels.JIT_ENV)
    assert kernels.jit_enabled() == kernels.jit_available()


def test_importing_the_codec_does_not_import_numba() -> None:
    """Compilation is lazy: numba (and its compile time) only on first use."""
    code = (
        "import sys; import aurora_store.codec.kernels, aurora_store.codec.varint, aurora_store.codec.encodings; "
        "print('numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- scan --------------------------------------------------------------------------


def reference_scan(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    i = np.flatnonzero(a != b).astype(np.int64)
    u = np.dtype(f"u{a.dtype.itemsize}")
    return i, b[i].view(u), a[i].view(u)


def assert_same(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        assert np.array_equal(g, w)


@given(
    dtype=st.sampled_from(["u2", "i2", "u4", "i4"]),
    n=st.integers(0, 400),
    offset=st.integers(0, 7),
    density=st.sampled_from([0.0, 0.01, 0.2, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_scan_matches_reference(dtype: str, n: int, offset: int, density: float, seed: int) -> None:
    """Any dtype width, any alignment (word views at odd offsets), any density."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 1 << 15, n + 8).astype(dtype)
    b = a.copy()
    flips = np.flatnonzero(rng.random(n + 8) < density)
    b[flips] ^= rng.integers(1, 1 << 14, flips.size).astype(dtype)
    a, b = a[offset : offset + n], b[offset : offset + n]
    want = reference_scan(a, b)
    for got in both(kernels.scan_changes, a, b):
        assert_same(got, want)


def test_scan_grows_its_output_past_the_first_guess() -> None:
    """Every element changed: far past the 1.5% the output is first sized for."""
    a = np.arange(200_003, dtype=np.uint16)
    b = a ^ np.uint16(0x8000)
    want = reference_scan(a, b)
    for got in both(kernels.scan_changes, a, b):
        assert_same(got, want)


@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    density=st.sampled_from([0.0, 0.05, 1.0]),
    seed=st.integers(0, 2**32 - 1),
)
def test_scan_blocks_concatenates_with_offsets(sizes: list[int], density: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    blocks, olds, news = [], [], []
    off = 0
    for n in sizes:
        a = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        b = a.copy()
        b[rng.random(n) < density] ^= 1
        blocks.append((off, a, b))
        olds.append(a)
        news.append(b)
        off += n
    want = reference_scan(np.concatenate(olds), np.concatenate(news))
    for got in both(kernels.scan_blocks, blocks):
        assert_same(got, want)


def test_scan_refuses_mismatched_inputs() -> None:
    with pytest.raises(ValueError):
        kernels.scan_changes(np.zeros(4, np.uint16), np.zeros(5, np.uint16))
    with pytest.raises(ValueError):
        kernels.scan_changes(np.zeros(4, np.uint16), np.zeros(4, np.uint32))
    with pytest.raises(ValueError):
        kernels.scan_changes(np.zeros(4, np.uint8), np.zeros(4, np.uint8))


def test_extract_is_the_same_on_both_paths(path: str) -> None:
    """The whole extraction (fused blocks, offsets, bits) on a tiny model."""
    w = make_weights(QWEN3_TINY, seed=5)
    new = MasterWeights(w, seed=5).step(lr=2e-6)
    plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in w.items()})
    for d in extract(plan, w, new):
        flat_old = torch.cat([w[b.source].reshape(-1) for b in plan.params[d.name].blocks])
        flat_new = torch.cat([new[b.source].reshape(-1) for b in plan.params[d.name].blocks])
        a = flat_old.view(torch.int16).numpy()
        b = flat_new.view(torch.int16).numpy()
        assert_same((d.indices, d.new_bits, d.old_bits), reference_scan(a, b))


# --- apply -------------------------------------------------------------------------


@given(
    width=st.sampled_from(["u2", "i2", "u4"]),
    n=st.integers(1, 500),
    density=st.sampled_from([0.01, 0.3, 1.0]),
    xor=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_apply_matches_reference(width: str, n: int, density: float, xor: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    flat = rng.integers(0, 1 << 15, n).astype(width)
    idx = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    bits = rng.integers(0, 1 << 15, idx.size).astype(width)
    want = flat.copy()
    for i, v in zip(idx.tolist(), bits.tolist(), strict=True):
        want[i] = (want[i] ^ v) if xor else v

    def applied(jit: bool) -> np.ndarray:
        f = flat.copy()
        kernels.apply_bits(f, idx, bits, xor, jit=jit)
        return f

    for got in both(applied):
        assert np.array_equal(got, want)
    # The accelerator path (torch index ops), run here on CPU tensors.
    t = torch.from_numpy(flat.astype(f"i{flat.dtype.itemsize}"))
    _scatter_torch(t, torch.from_numpy(idx), torch.from_numpy(bits.astype(t.numpy().dtype)), "xor" if xor else "new")
    assert np.array_equal(t.numpy().view(want.dtype), want)


@pytest.mark.parametrize("bad", [[0, 10], [-1], [3, 1 << 40]])
def test_apply_refuses_indices_outside_and_writes_nothing(path: str, bad: list[int]) -> None:
    flat = np.arange(10, dtype=np.uint16)
    idx = np.array(bad, dtype=np.int64)
    with pytest.raises(IndexError):
        kernels.apply_bits(flat, idx, np.ones(idx.size, np.uint16), True)
    assert np.array_equal(flat, np.arange(10, dtype=np.uint16))


def test_apply_checks_shapes() -> None:
    flat = np.zeros(8, np.uint16)
    with pytest.raises(ValueError):
        kernels.apply_bits(flat, np.arange(3), np.zeros(2, np.uint16), False)
    with pytest.raises(ValueError):
        kernels.apply_bits(flat, np.arange(3), np.zeros(3, np.uint32), False)
    ro = np.zeros(8, np.uint16)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        kernels.apply_bits(ro, np.arange(3), np.zeros(3, np.uint16), False)


def test_write_flat_in_place_through_torch(path: str) -> None:
    weights = torch.randn(64).bfloat16()
    flat = weights.view(torch.int16)
    before = flat.clone()
    idx = torch.tensor([1, 5, 63])
    vals = torch.tensor([7, 8, 9], dtype=torch.int16)
    _write_flat(flat, idx, 0, 64, vals, "xor")
    assert torch.equal(flat[idx], before[idx] ^ vals)
    _write_flat(flat, idx, 0, 64, vals, "new")
    assert torch.equal(flat[idx], vals)
    assert torch.equal(flat[2:5], before[2:5])


# --- LEB128 encoding -------------------------------------------------------------------


def py_encode(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


@given(uint64_arrays(max_size=300))
def test_leb128_encode_and_size(values: np.ndarray) -> None:
    want = b"".join(py_encode(int(v)) for v in values)
    for got in both(kernels.leb128_encode, values):
        assert got.dtype == np.uint8 and got.tobytes() == want
    assert all(size == len(want) for size in both(kernels.leb128_size, values))


@given(r=index_ranges())
def test_leb128_encode_gaps(r: tuple[int, int, np.ndarray]) -> None:
    start, _stop, idx = r
    gaps = np.diff(idx, prepend=np.int64(start))
    want = b"".join(py_encode(int(g)) for g in gaps)
    for got in both(kernels.leb128_encode_gaps, idx, start):
        assert got.tobytes() == want


# --- LEB128 decoding: the oracle ------------------------------------------------------


def original_decode(data: bytes, expected_count: int | None = None) -> np.ndarray:
    """varint.decode as it was before the kernels (np.repeat + reduceat)."""
    b = np.frombuffer(data, dtype=np.uint8)
    if b.size == 0:
        out = np.empty(0, dtype=np.uint64)
    else:
        last = (b & 0x80) == 0
        ends = np.flatnonzero(last)
        if ends.size == 0 or ends[-1] != b.size - 1:
            start = int(ends[-1]) + 1 if ends.size else 0
            raise VarintError("truncated varint (stream ends inside a varint)", start)
        starts = np.empty_like(ends)
        starts[0] = 0
        starts[1:] = ends[:-1] + 1
        lengths = ends - starts + 1
        if int(lengths.max()) > 10:
            bad = int(np.flatnonzero(lengths > 10)[0])
            raise VarintError("varint longer than 10 bytes", int(starts[bad]))
        pos = np.arange(b.size, dtype=np.int64) - np.repeat(starts, lengths)
        payload = (b & 0x7F).astype(np.uint64)
        tenth = pos == 9
        if bool((payload[tenth] > 1).any()):
            bad = int(np.flatnonzero(tenth & (payload > 1))[0])
            raise VarintError("varint value above 2^63", bad - 9)
        contrib = payload << (pos.astype(np.uint64) * np.uint64(7))
        out = np.add.reduceat(contrib, starts)
        if bool((out > np.uint64(1 << 63)).any()):
            bad = int(np.flatnonzero(out > np.uint64(1 << 63))[0])
            raise VarintError("varint value above 2^63", int(starts[bad]))
    if expected_count is not None and out.size != expected_count:
        raise VarintError(f"stream holds {out.size} varints, expected {expected_count}", int(b.size))
    return out


def original_decode_indices(data: bytes, start: int, stop: int, nnz: int) -> np.ndarray:
    """encodings.decode_indices("leb128", ...) as it was before the kernels."""
    try:
        gaps = original_decode(data, expected_count=nnz)
    except VarintError as e:
        raise StreamError(f"leb128 index stream: {e}") from None
    if nnz == 0:
        return np.empty(0, dtype=np.int64)
    span = np.uint64(stop - start)
    if bool((gaps >= span).any()):
        k = int(np.flatnonzero(gaps >= span)[0])
        raise StreamError(f"leb128 gap {int(gaps[k])} at position {k} leaves the range [{start}, {stop})")
    if nnz > 1 and bool((gaps[1:] == 0).any()):
        k = int(np.flatnonzero(gaps[1:] == 0)[0]) + 1
        raise StreamError(f"leb128 gap of 0 at position {k} (indices must be unique)")
    idx_u = np.cumsum(gaps, dtype=np.uint64) + np.uint64(start)
    if nnz > 1 and bool((idx_u[1:] <= idx_u[:-1]).any()):
        k = int(np.flatnonzero(idx_u[1:] <= idx_u[:-1])[0]) + 1
        raise StreamError(f"leb128 index at position {k} leaves the range [{start}, {stop}) (running sum overflows)")
    if int(idx_u[0]) < start or int(idx_u[-1]) >= stop:
        k = int(np.flatnonzero((idx_u >= np.uint64(stop)) | (idx_u < np.uint64(start)))[0])
        raise StreamError(f"index {int(idx_u[k])} at position {k} outside [{start}, {stop})")
    return idx_u.astype(np.int64)


def outcome(fn: Callable[..., np.ndarray], *args: Any) -> tuple[Any, ...]:
    """("ok", values) or (error type, message, offset): what a caller sees."""
    try:
        out = fn(*args)
    except (VarintError, StreamError) as e:
        return (type(e).__name__, str(e), getattr(e, "offset", None))
    return ("ok", out.dtype.str, out.tolist())


#: Bytes that make varints interesting: terminal, continuation, the 2^63 edge.
hostile_bytes = st.lists(
    st.one_of(st.sampled_from([0x00, 0x01, 0x02, 0x7F, 0x80, 0x81, 0xFF]), st.integers(0, 255)),
    max_size=40,
).map(bytes)


@given(data=hostile_bytes, count=st.one_of(st.none(), st.integers(0, 12)))
def test_varint_decode_agrees_with_the_oracle_on_any_bytes(data: bytes, count: int | None) -> None:
    want = outcome(original_decode, data, count)
    for jit in [True, False] if kernels.jit_available() else [False]:
        assert outcome(lambda d, c, j=jit: varint.decode(d, c, jit=j), data, count) == want


@path_settings
@given(
    gaps=st.lists(
        st.one_of(
            st.sampled_from([0, 1, 127, 128, 16383, 16384, (1 << 21), (1 << 63) - 1, 1 << 63]),
            st.integers(0, 1 << 63),
            st.integers(0, 300),
        ),
        max_size=12,
    ),
    start=st.one_of(st.integers(0, 1000), st.integers(0, (1 << 62))),
    span=st.one_of(st.integers(1, 2000), st.integers(1, 1 << 62)),
    nnz_delta=st.sampled_from([0, 0, 0, -1, 1]),
)
def test_leb128_indices_agree_with_the_oracle(path: str, gaps: list[int], start: int, span: int, nnz_delta: int) -> None:
    """Valid and invalid gap lists: same indices, or the same error text."""
    data = b"".join(py_encode(g) for g in gaps)
    nnz = max(0, len(gaps) + nnz_delta)
    want = outcome(original_decode_indices, data, start, start + span, nnz)
    got = outcome(enc.decode_indices, "leb128", data, start, start + span, nnz)
    assert got == want


@path_settings
@given(data=hostile_bytes, start=st.integers(0, 100), span=st.integers(1, 1 << 40), nnz=st.integers(0, 12))
def test_leb128_indices_agree_with_the_oracle_on_any_bytes(path: str, data: bytes, start: int, span: int, nnz: int) -> None:
    want = outcome(original_decode_indices, data, start, start + span, nnz)
    assert outcome(enc.decode_indices, "leb128", data, start, start + span, nnz) == want


@path_settings
@given(r=index_ranges())
def test_leb128_indices_round_trip(path: str, r: tuple[int, int, np.ndarray]) -> None:
    start, stop, idx = r
    data = enc.encode_indices("leb128", idx, start, stop)
    got = enc.decode_indices("leb128", data, start, stop, idx.size)
    assert got.dtype == np.int64 and np.array_equal(got, idx)


def test_leb128_kernel_refuses_without_allocating_for_an_absurd_count() -> None:
    if not kernels.jit_available():
        pytest.skip("numba is not installed")
    # nnz far beyond the stream: refused before an nnz-sized array exists.
    assert kernels.leb128_indices(np.frombuffer(b"\x01\x01", np.uint8), 0, 1 << 62, 1 << 60) is None


# --- zstd: the one-shot path and the streaming path agree --------------------------------


@pytest.mark.parametrize("content_size", [True, False])
def test_zstd_both_paths_round_trip(content_size: bool) -> None:
    raw = bytes(range(256)) * 300
    frame = zstandard.ZstdCompressor(level=1, write_content_size=content_size).compress(raw)
    assert enc.zstd_decompress(frame, len(raw), len(raw)) == raw
    assert enc.zstd_decompress(memoryview(frame), None, 10 * len(raw)) == raw


@pytest.mark.parametrize("lie", [100, 250])
def test_zstd_frame_that_misstates_its_size_is_refused(lie: int) -> None:
    frame = bytearray(enc.zstd_compress(bytes(range(200)), 1))
    frame[5] = lie  # single-segment frame: one content-size byte after the descriptor
    assert zstandard.get_frame_parameters(bytes(frame)).content_size == lie
    with pytest.raises(StreamError, match="corrupt"):
        enc.zstd_decompress(bytes(frame), None, 1000)


def test_zstd_declared_size_above_expected_is_refused_with_the_size() -> None:
    frame = enc.zstd_compress(b"y" * 80, 1)
    with pytest.raises(StreamError, match="decompresses to 80 bytes, expected 60"):
        enc.zstd_decompress(frame, 60, 100)
