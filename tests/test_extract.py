"""Bitwise change extraction (aurora_store/extract.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.extract import bits_view, changed_indices, extract, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ModelMismatchError

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@given(
    dtype=st.sampled_from(list(DT)),
    n=st.integers(0, 300),
    offset=st.integers(0, 7),
    chunk=st.integers(1, 64),
    density=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_changed_indices_matches_bitwise_reference(dtype: str, n: int, offset: int, chunk: int, density: float, seed: int) -> None:
    """Views at any storage offset (misaligned to 8 bytes), any chunking."""
    g = torch.Generator().manual_seed(seed)
    big_a = torch.randn(n + 8, generator=g).to(DT[dtype])
    big_b = big_a.clone()
    rng = np.random.default_rng(seed)
    flips = np.flatnonzero(rng.random(n + 8) < density)
    ib = big_b.view(INT[big_b.dtype])
    ib[torch.from_numpy(flips)] ^= 1  # one-ulp change, invisible to some float compares
    a, b = big_a[offset : offset + n], big_b[offset : offset + n]
    want = torch.nonzero(a.view(INT[a.dtype]) != b.view(INT[b.dtype])).reshape(-1)
    got = changed_indices(a, b, chunk_elems=chunk)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)


def test_changed_indices_sees_signed_zero_and_nan_payload() -> None:
    a = torch.tensor([0.0, float("nan"), 1.0, 2.0], dtype=torch.bfloat16)
    b = a.clone()
    b[0] = -0.0
    b.view(torch.int16)[1] |= 1  # another NaN payload
    assert changed_indices(a, b).tolist() == [0, 1]
    assert changed_indices(a, a.clone()).tolist() == []


def test_changed_indices_refuses_mismatch() -> None:
    with pytest.raises(ModelMismatchError):
        changed_indices(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(ModelMismatchError):
        changed_indices(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float16))


def test_bits_view_is_a_view() -> None:
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    v = bits_view(t)
    v[4] = 0x3F80
    assert t[1, 1].item() == 1.0
    with pytest.raises(ValueError):
        bits_view(torch.zeros(3, 2, dtype=torch.bfloat16).t())


def test_spec_of() -> None:
    assert spec_of(torch.zeros(2, 3, dtype=torch.float16)) == ParamSpec((2, 3), "float16")
    with pytest.raises(ModelMismatchError, match="int64"):
        spec_of(torch.zeros(2, dtype=torch.int64), "x")


def test_extract_yields_every_param_with_fused_offsets_and_bits() -> None:
    w = {
        "l.self_attn.q_proj.weight": torch.randn(4, 2).bfloat16(),
        "l.self_attn.k_proj.weight": torch.randn(2, 2).bfloat16(),
        "l.self_attn.v_proj.weight": torch.randn(2, 2).bfloat16(),
        "n.weight": torch.randn(3).float(),
    }
    plan = FusionPlan.from_specs({k: spec_of(v) for k, v in w.items()})
    new = {k: v.clone() for k, v in w.items()}
    new["l.self_attn.v_proj.weight"][1, 1] += 1
    new["l.self_attn.q_proj.weight"][0, 0] += 1
    out = {d.name: d for d in extract(plan, w, new)}
    assert set(out) == {"l.self_attn.qkv_proj.weight", "n.weight"}
    d = out["l.self_attn.qkv_proj.weight"]
    assert d.indices.tolist() == [0, 8 + 4 + 3]
    assert d.nnz == 2 and d.new_bits.dtype == np.uint16
    qkv_old = torch.cat([w[f"l.self_attn.{x}_proj.weight"].reshape(-1) for x in "qkv"]).view(torch.int16)
    qkv_new = torch.cat([new[f"l.self_attn.{x}_proj.weight"].reshape(-1) for x in "qkv"]).view(torch.int16)
    assert d.old_bits.view(np.int16).tolist() == qkv_old[[0, 15]].tolist()
    assert d.new_bits.view(np.int16).tolist() == qkv_new[[0, 15]].tolist()
    # dense reads across the block boundary see the new weights
    assert d.read_new_range(6, 16).view(np.int16).tolist() == qkv_new[6:16].tolist()
    assert out["n.weight"].nnz == 0 and out["n.weight"].new_bits.dtype == np.uint32


def test_extract_refuses_missing_or_mismatched_tensors() -> None:
    w = {"a": torch.zeros(4, dtype=torch.bfloat16)}
    plan = FusionPlan.from_specs({"a": spec_of(w["a"])})
    with pytest.raises(ModelMismatchError, match="missing from the new"):
        list(extract(plan, w, {}))
    with pytest.raises(ModelMismatchError, match="missing from the base"):
        list(extract(plan, {}, w))
    with pytest.raises(ModelMismatchError, match="a: new weights"):
        list(extract(plan, w, {"a": torch.zeros(5, dtype=torch.bfloat16)}))
    with pytest.raises(ModelMismatchError, match="a: new weights"):
        list(extract(plan, w, {"a": torch.zeros(4, dtype=torch.float32)}))


def test_extract_accepts_non_contiguous_inputs() -> None:
    base = torch.randn(6, 4).bfloat16()
    new = base.clone()
    new[5, 0] += 1
    plan = FusionPlan.from_specs({"m": ParamSpec((4, 6), "bfloat16")})
    (d,) = extract(plan, {"m": base.t()}, {"m": new.t()})
    assert d.indices.tolist() == [0 * 6 + 5]
