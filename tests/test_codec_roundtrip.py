"""extract -> encode_segments -> stage_segments -> apply_delta is bit-exact.

Realistic cases use the Qwen3-shaped synthetic model and Adam-sized steps;
edge cases use hand-made tensors. Every encoder option set must round-trip,
into fused (vLLM) and split (Hugging Face) weight holders alike.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from codec_helpers import (
    assert_bit_identical,
    encode_delta,
    fuse,
    int_view,
    roundtrip,
    segment_entries,
)
from conftest import index_ranges
from hypothesis import given, settings
from hypothesis import strategies as st

from aurora_store.apply.sink import FusedWeights, SplitWeights, apply_delta
from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entries import NAIVE, PAPER, EncodeOptions, ParamSpec, encode_entry
from aurora_store.codec.extract import extract, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ConfigError
from aurora_store.format.checkpoint import encode_segments, stage_segments
from aurora_store.format.segment import decode_segment, encode_segment
from aurora_tools.synthetic.shapes import MasterWeights

OPTIONS: dict[str, EncodeOptions] = {
    "auto": EncodeOptions(),
    "paper": PAPER,
    "naive": NAIVE,
    "xor-only": EncodeOptions(value_modes=("xor",)),
    "no-zstd": EncodeOptions(codecs=("none",)),
    "zstd-only": EncodeOptions(codecs=("zstd",)),
    "dense-only": EncodeOptions(index_encodings=("dense",)),
    "dense-new-raw": EncodeOptions(index_encodings=("dense",), value_modes=("new",), codecs=("none",)),
    "bitmask-xor-zstd": EncodeOptions(index_encodings=("bitmask",), value_modes=("xor",), codecs=("zstd",)),
    "u64-level-19": EncodeOptions(index_encodings=("u64",), zstd_level=19),
}

TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BITS = {"bfloat16": torch.int16, "float16": torch.int16, "float32": torch.int32}


def plan_of(w: dict[str, torch.Tensor]) -> FusionPlan:
    return FusionPlan.from_specs({n: spec_of(t, n) for n, t in w.items()})


def random_tensor(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(TORCH[dtype])


def with_bits(t: torch.Tensor, idx: np.ndarray, bits: np.ndarray) -> torch.Tensor:
    """A copy of ``t`` with raw bit patterns written at flat indices."""
    out = t.clone()
    flat = out.view(-1).view(BITS[TORCH_NAME[t.dtype]])
    flat[torch.from_numpy(idx)] = torch.from_numpy(bits.astype(np.int64)).to(flat.dtype)
    return out


TORCH_NAME = {v: k for k, v in TORCH.items()}


def entry_params(segs: list[tuple[str, bytes]]) -> list[str]:
    return [e["param"] for _, d in segs for e in segment_entries(d)]


# --- realistic: Qwen3-shaped model, Adam-sized steps --------------------------


@pytest.fixture(scope="module")
def qwen_steps() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    from aurora_tools.synthetic.shapes import QWEN3_TINY, make_weights

    w = make_weights(QWEN3_TINY, seed=3)
    master = MasterWeights(w, seed=3)
    return w, [master.step(lr=1e-6) for _ in range(3)]


@pytest.mark.parametrize("sink", ["fused", "split"])
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_realistic_step_round_trips(qwen_steps, opt: str, sink: str) -> None:
    base, steps = qwen_steps
    plan = plan_of(base)
    new = steps[0]
    held, segs = roundtrip(plan, base, new, OPTIONS[opt], sink=sink)
    assert segs, "an Adam step changes some elements"
    assert_bit_identical(held, fuse(plan, new) if sink == "fused" else new)


@pytest.mark.parametrize("opt", ["auto", "xor-only", "paper"])
def test_realistic_chain_of_versions(qwen_steps, opt: str) -> None:
    """XOR deltas are only right on the exact base: chain three versions."""
    base, steps = qwen_steps
    plan = plan_of(base)
    fused_held = fuse(plan, base)
    split_held = {n: t.clone() for n, t in base.items()}
    prev = base
    for v, new in enumerate(steps, start=1):
        segs, params = encode_delta(plan, prev, new, v, OPTIONS[opt])
        staged = stage_segments(segs, v, plan.specs())
        assert staged.version == v and staged.base_version == v - 1
        assert staged.nnz == sum(int(p["nnz"]) for p in params.values())
        apply_delta(staged, FusedWeights(fused_held))
        apply_delta(staged, SplitWeights(split_held, plan))
        assert_bit_identical(fused_held, fuse(plan, new))
        assert_bit_identical(split_held, new)
        prev = new


def test_realistic_params_table_counts_changes(qwen_steps) -> None:
    base, steps = qwen_steps
    plan = plan_of(base)
    _, params = encode_delta(plan, base, steps[0])
    fb, fn = fuse(plan, base), fuse(plan, steps[0])
    want = {n: int((int_view(fb[n]) != int_view(fn[n])).sum()) for n in fb if not torch.equal(fb[n], fn[n])}
    assert {n: p["nnz"] for n, p in params.items()} == want
    for n, p in params.items():
        assert p["shape"] == list(plan.params[n].spec.shape) and p["dtype"] == "bfloat16"


def test_realistic_large_params_split_across_segments(qwen_steps) -> None:
    base, _ = qwen_steps
    plan = plan_of(base)
    # every element of every tensor changes: tens of thousands of changes per matrix
    new = {n: (t.float() * 1.01 + 1e-3).to(t.dtype) for n, t in base.items()}
    segs, _ = encode_delta(plan, base, new, 1, EncodeOptions(), segment_bytes=2048)
    staged = stage_segments(segs, 1, plan.specs())
    fused_held, split_held = fuse(plan, base), {n: t.clone() for n, t in base.items()}
    apply_delta(staged, FusedWeights(fused_held))
    apply_delta(staged, SplitWeights(split_held, plan))
    assert_bit_identical(fused_held, fuse(plan, new))
    assert_bit_identical(split_held, new)
    params = entry_params(segs)
    assert len(segs) > 10
    assert params.count("model.embed_tokens.weight") > 1  # one parameter, several entries
    # entries of one parameter tile its whole flat range, in order
    by_param: dict[str, list[tuple[int, int]]] = {}
    for _, d in segs:
        for e in segment_entries(d):
            by_param.setdefault(e["param"], []).append((e["start"], e["stop"]))
    for name, ranges in by_param.items():
        assert ranges[0][0] == 0 and ranges[-1][1] == plan.params[name].spec.numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


# --- hand-made edge cases -----------------------------------------------------


def edge_model(dtype: str = "bfloat16") -> dict[str, torch.Tensor]:
    return {
        "w": random_tensor((37,), dtype, 1),
        "m": random_tensor((5, 7), dtype, 2),
    }


@pytest.mark.parametrize("dtype", list(TORCH))
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_empty_delta_has_no_segments(dtype: str, opt: str) -> None:
    base = edge_model(dtype)
    plan = plan_of(base)
    segs, params = encode_delta(plan, base, {n: t.clone() for n, t in base.items()}, 1, OPTIONS[opt])
    assert segs == [] and params == {}
    staged = stage_segments(segs, 1, plan.specs())
    assert staged.entries == () and staged.nnz == 0
    held = fuse(plan, base)
    apply_delta(staged, FusedWeights(held))
    assert_bit_identical(held, base)


@pytest.mark.parametrize("dtype", list(TORCH))
@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("case", ["single-first", "single-last", "all", "half"])
def test_edge_cases_round_trip(dtype: str, opt: str, case: str) -> None:
    base = edge_model(dtype)
    plan = plan_of(base)
    new = {n: t.clone() for n, t in base.items()}
    if case == "single-first":
        new["w"].view(-1)[0] += 1
    elif case == "single-last":
        new["m"].view(-1)[-1] *= -2
    elif case == "all":
        new = {n: (t.float() * 3 + 1).to(t.dtype) for n, t in base.items()}
    else:
        new["m"].view(-1)[::2] += 0.5
    held, segs = roundtrip(plan, base, new, OPTIONS[opt])
    assert_bit_identical(held, new)
    nnz = sum(int((int_view(base[n]) != int_view(new[n])).sum()) for n in base)
    assert sum(e["nnz"] for _, d in segs for e in segment_entries(d)) == nnz
    for _, d in segs:
        for e in segment_entries(d):
            assert e["dtype"] == dtype


@pytest.mark.parametrize("dtype", list(TORCH))
def test_signed_zero_and_nan_payloads_are_changes(dtype: str) -> None:
    width = DTYPES[dtype].width * 8
    sign = 1 << (width - 1)
    qnan = {"bfloat16": 0x7FC0, "float16": 0x7E00, "float32": 0x7FC00000}[dtype]
    base = {"w": torch.zeros(16, dtype=TORCH[dtype])}
    base_bits = np.zeros(16, dtype=np.int64)
    base_bits[4] = qnan
    base_bits[5] = qnan
    base = {"w": with_bits(base["w"], np.arange(16), base_bits)}
    # +0.0 -> -0.0, NaN -> NaN with another payload, NaN -> -NaN
    idx = np.array([0, 4, 5])
    newbits = np.array([sign, qnan | 1, qnan | sign])
    if width == 16:
        newbits = newbits.astype(np.uint16).astype(np.int16)
    else:
        newbits = newbits.astype(np.uint32).astype(np.int32)
    new = {"w": with_bits(base["w"], idx, newbits)}
    # float equality would call these "unchanged"
    assert bool((base["w"][0] == new["w"][0]).item())
    plan = plan_of(base)
    (d,) = list(extract(plan, base, new))
    assert d.indices.tolist() == [0, 4, 5]
    for opt in ("auto", "paper", "xor-only", "dense-only"):
        held, segs = roundtrip(plan, base, new, OPTIONS[opt])
        assert_bit_identical(held, new)


def test_fused_qkv_and_gate_up_with_split_sink() -> None:
    """A small model with q/k/v biases (Qwen2-style): changes in every block."""
    w = {
        "model.layers.0.self_attn.q_proj.weight": random_tensor((8, 4), "bfloat16", 1),
        "model.layers.0.self_attn.k_proj.weight": random_tensor((4, 4), "bfloat16", 2),
        "model.layers.0.self_attn.v_proj.weight": random_tensor((4, 4), "bfloat16", 3),
        "model.layers.0.self_attn.q_proj.bias": random_tensor((8,), "bfloat16", 4),
        "model.layers.0.self_attn.k_proj.bias": random_tensor((4,), "bfloat16", 5),
        "model.layers.0.self_attn.v_proj.bias": random_tensor((4,), "bfloat16", 6),
        "model.layers.0.mlp.gate_proj.weight": random_tensor((6, 4), "bfloat16", 7),
        "model.layers.0.mlp.up_proj.weight": random_tensor((6, 4), "bfloat16", 8),
        "model.norm.weight": random_tensor((4,), "bfloat16", 9),
    }
    plan = plan_of(w)
    assert set(plan.params) == {
        "model.layers.0.self_attn.qkv_proj.weight",
        "model.layers.0.self_attn.qkv_proj.bias",
        "model.layers.0.mlp.gate_up_proj.weight",
        "model.norm.weight",
    }
    new = {n: t.clone() for n, t in w.items()}
    new["model.layers.0.self_attn.k_proj.weight"].view(-1)[[0, 15]] += 1
    new["model.layers.0.self_attn.v_proj.bias"][3] += 1
    new["model.layers.0.mlp.up_proj.weight"][5, 3] += 1
    new["model.layers.0.self_attn.q_proj.weight"][7, 3] += 1
    for opt in OPTIONS:
        held, segs = roundtrip(plan, w, new, OPTIONS[opt], sink="split")
        assert_bit_identical(held, new)
        held, _ = roundtrip(plan, w, new, OPTIONS[opt], sink="fused")
        assert_bit_identical(held, fuse(plan, new))
    # fused flat indices: k block starts at numel(q) = 32
    (d,) = [d for d in extract(plan, w, new) if d.name.endswith("qkv_proj.weight")]
    assert d.indices.tolist() == [31, 32, 47]


# --- property: random tensors, random changes, random options -----------------


@st.composite
def model_and_changes(draw: st.DrawFn):
    n_params = draw(st.integers(1, 3))
    base, new = {}, {}
    for k in range(n_params):
        dtype = draw(st.sampled_from(list(TORCH)))
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=2)))
        t = random_tensor(shape, dtype, draw(st.integers(0, 1000)))
        numel = t.numel()
        _, _, idx = draw(index_ranges(max_start=0, max_span=numel))
        idx = idx[idx < numel]
        width = DTYPES[dtype].width * 8
        seed = draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        flip = rng.integers(1, 1 << width, size=idx.size, dtype=np.uint64)  # any nonzero xor
        old = int_view(t).view(-1).numpy().astype(np.int64)[idx] & ((1 << width) - 1)
        nb = (old.astype(np.uint64) ^ flip).astype(np.uint16 if width == 16 else np.uint32)
        nb = nb.view(np.int16 if width == 16 else np.int32)
        base[f"p{k}"] = t
        new[f"p{k}"] = with_bits(t, idx, nb)
    return base, new


@settings(max_examples=30)
@given(
    mc=model_and_changes(),
    opt=st.sampled_from(list(OPTIONS)),
    segment_bytes=st.sampled_from([1024, 2048, 1 << 20]),
    sink=st.sampled_from(["fused", "split"]),
)
def test_property_round_trip(mc, opt: str, segment_bytes: int, sink: str) -> None:
    base, new = mc
    plan = plan_of(base)
    held, segs = roundtrip(plan, base, new, OPTIONS[opt], segment_bytes, sink)
    assert_bit_identical(held, new)
    for _, d in segs:
        seg = decode_segment(d, "x", plan.specs())
        assert seg.version == 1 and seg.base_version == 0


# --- the encoder picks the smallest -------------------------------------------


RAW_SINGLE = [
    EncodeOptions(index_encodings=(e,), value_modes=(v,), codecs=("none",))
    for e in ("leb128", "bitmask", "dense", "u32", "u64")
    for v in ("new", "xor")
]


def encode_one(
    options: EncodeOptions,
    start: int,
    stop: int,
    idx: np.ndarray,
    seed: int,
    dtype: str = "bfloat16",
):
    info = DTYPES[dtype]
    rng = np.random.default_rng(seed)
    full_new = rng.integers(0, 1 << (8 * info.width), size=stop, dtype=np.uint64).astype(info.bits)
    old = full_new[idx] ^ info.bits.type(1)  # one-ulp-like changes
    spec = ParamSpec((stop,), dtype)
    return encode_entry(
        "p",
        spec,
        start,
        stop,
        idx,
        full_new[idx],
        old,
        options,
        lambda a, b: full_new[a:b],
    )


@given(r=index_ranges(max_start=2000, max_span=3000, min_nnz=1), seed=st.integers(0, 1000))
def test_auto_never_larger_than_any_raw_choice(r, seed: int) -> None:
    start, stop, idx = r
    auto = encode_one(EncodeOptions(), start, stop, idx, seed)
    for o in [PAPER, NAIVE, *RAW_SINGLE]:
        other = encode_one(o, start, stop, idx, seed)
        assert auto.nbytes <= other.nbytes, (o, auto.encoding, other.encoding)


@pytest.mark.parametrize("dtype", list(TORCH))
def test_all_changed_norm_vector_costs_at_most_dense(dtype: str) -> None:
    n = 1024
    w = {"model.norm.weight": (1 + 0.05 * torch.randn(n)).to(TORCH[dtype])}
    new = {"model.norm.weight": (w["model.norm.weight"].float() + 0.01).to(TORCH[dtype])}
    assert bool((int_view(w["model.norm.weight"]) != int_view(new["model.norm.weight"])).all())
    plan = plan_of(w)
    segs, _ = encode_delta(plan, w, new)
    (entry,) = [e for s in encode_segments(extract(plan, w, new), 1) for e in s.entries]
    dense_raw = n * DTYPES[dtype].width
    assert entry.nbytes <= dense_raw
    # the sparse paper choice pays for index bytes on top of the values
    (paper,) = [e for s in encode_segments(extract(plan, w, new), 1, PAPER) for e in s.entries]
    assert paper.nbytes > dense_raw and entry.nbytes < paper.nbytes


def test_auto_beats_paper_on_realistic_updates(qwen_steps) -> None:
    base, steps = qwen_steps
    plan = plan_of(base)
    prev = base
    for new in steps:
        auto = {e.param: e.nbytes for s in encode_segments(extract(plan, prev, new), 1, EncodeOptions()) for e in s.entries}
        paper = {e.param: e.nbytes for s in encode_segments(extract(plan, prev, new), 1, PAPER) for e in s.entries}
        assert auto.keys() == paper.keys()
        for name in auto:
            assert auto[name] <= paper[name], name
        # XOR of one-ulp moves compresses well (FORMAT.md §3)
        assert sum(auto.values()) < 0.85 * sum(paper.values())
        prev = new


# --- encoder options and configuration errors ---------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"index_encodings": ()},
        {"value_modes": ()},
        {"codecs": ()},
        {"index_encodings": ("rle",)},
        {"value_modes": ("add",)},
        {"codecs": ("gzip",)},
        {"zstd_level": 0},
        {"zstd_level": 23},
    ],
)
def test_encode_options_validated(kw: dict) -> None:
    with pytest.raises(ConfigError):
        EncodeOptions(**kw)


def test_encode_options_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Resolved by the publishing side (the codec layer reads no environment) and passed in.
    from aurora_store.lineage.publish import encode_options_from_env

    monkeypatch.setenv("AURORA_INDEX_ENCODINGS", "leb128, bitmask")
    monkeypatch.setenv("AURORA_VALUE_MODES", "new")
    monkeypatch.setenv("AURORA_CODECS", "none")
    monkeypatch.setenv("AURORA_ZSTD_LEVEL", "7")
    o = encode_options_from_env()
    assert o == EncodeOptions(("leb128", "bitmask"), ("new",), ("none",), 7)
    monkeypatch.setenv("AURORA_ZSTD_LEVEL", "high")
    with pytest.raises(ConfigError, match="AURORA_ZSTD_LEVEL"):
        encode_options_from_env()
    monkeypatch.setenv("AURORA_ZSTD_LEVEL", "1")
    monkeypatch.setenv("AURORA_CODECS", "lz4")
    with pytest.raises(ConfigError):
        encode_options_from_env()


def test_dense_new_without_new_values_is_a_config_error() -> None:
    spec = ParamSpec((10,), "bfloat16")
    idx = np.array([2], dtype=np.int64)
    opts = EncodeOptions(index_encodings=("dense",), value_modes=("new",))
    with pytest.raises(ConfigError, match=r"\[0, 10\)"):
        encode_entry("p", spec, 0, 10, idx, np.array([1], np.uint16), np.array([0], np.uint16), opts)


def test_segment_bytes_floor() -> None:
    with pytest.raises(ValueError):
        list(encode_segments([], 1, None, 100))


def slice_of(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return a[lo:hi]


@pytest.mark.parametrize(
    "combo",
    list(itertools.product(("leb128", "bitmask", "dense", "u32", "u64"), ("new", "xor"), ("none", "zstd"))),
)
def test_every_single_combination_round_trips_through_a_segment(combo) -> None:
    e_, v_, c_ = combo
    opts = EncodeOptions(index_encodings=(e_,), value_modes=(v_,), codecs=(c_,))
    for dtype in TORCH:
        info = DTYPES[dtype]
        rng = np.random.default_rng(7)
        full_old = rng.integers(0, 1 << (8 * info.width), size=300, dtype=np.uint64).astype(info.bits)
        full_new = full_old.copy()
        idx = np.array([3, 4, 5, 100, 200, 250, 251], dtype=np.int64)
        full_new[idx] ^= info.bits.type(3)
        spec = ParamSpec((300,), dtype)
        entry = encode_entry(
            "p",
            spec,
            2,
            260,
            idx,
            full_new[idx],
            full_old[idx],
            opts,
            functools.partial(slice_of, full_new),
        )
        assert (entry.encoding, entry.values, entry.val_codec) == (e_, v_, c_)
        if e_ != "dense":
            assert entry.idx_codec == c_
        seg = decode_segment(encode_segment([entry], 5, 4), "s", {"p": spec})
        (d,) = seg.entries
        got = full_old.copy()
        pos = np.arange(d.start, d.stop) if d.indices is None else d.indices
        if d.values == "xor":
            got[pos] ^= d.bits
        else:
            got[pos] = d.bits
        assert np.array_equal(got, full_new)
        assert d.nnz == idx.size
