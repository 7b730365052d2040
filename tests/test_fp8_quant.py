"""FP8 block quantization (aurora_store/quant/): the recipe, and incremental requantization equal to it bit for bit.

Every test that runs a kernel runs on both paths (``path``: numba's compiled
kernels, and their numpy twins under ``AURORA_NO_JIT=1``). The recipe is
checked against torch's own float8 cast, against a plain torch statement of
the recipe written here, and (slow) against vLLM's ``per_block_cast_to_fp8``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aurora_store.codec import kernels as codec_kernels
from aurora_store.codec.kernels.jit import compiled
from aurora_store.errors import ConfigError, ModelMismatchError
from aurora_store.quant import BlockFP8, Requant, check_format, is_quantized, quantize, requantize, scale_shape
from aurora_store.quant.kernels import _fp8
from aurora_store.quant.twins import fp8_bits
from aurora_store.quant.weights import Fp8Weights

PATHS = [
    pytest.param("jit", marks=pytest.mark.skipif(not codec_kernels.jit_available(), reason="numba is not installed")),
    "numpy",
]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numpy":
        monkeypatch.setenv(codec_kernels.JIT_ENV, "1")
    else:
        monkeypatch.delenv(codec_kernels.JIT_ENV, raising=False)
    assert codec_kernels.path() == request.param
    return str(request.param)


path_settings = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)


def bits_of(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def recipe(w: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The recipe as issue 27 states it, in torch: 128 x 128 blocks over the last two dims, per expert."""
    x = w if w.dim() == 3 else w[None]
    e, r, c = x.shape
    nbr, nbc = -(-r // 128), -(-c // 128)
    pad = torch.zeros(e, nbr * 128, nbc * 128, dtype=torch.bfloat16)
    pad[:, :r, :c] = x
    v = pad.view(e, nbr, 128, nbc, 128)
    amax = v.abs().float().amax(dim=(2, 4), keepdim=True).clamp(min=1e-4)
    scale = amax / 448.0
    q = (v.float() * (1.0 / scale)).to(torch.float8_e4m3fn).view(e, nbr * 128, nbc * 128)[:, :r, :c]
    s = scale.view(e, nbr, nbc)
    if w.dim() == 2:
        q, s = q[0], s[0]
    return q.contiguous().view(torch.uint8).numpy(), s.contiguous().numpy()


def same(a: BlockFP8, b: BlockFP8) -> None:
    assert np.array_equal(a.q, b.q), f"{np.count_nonzero(a.q != b.q)} FP8 bytes differ"
    assert np.array_equal(a.scale_inv.view(np.uint32), b.scale_inv.view(np.uint32)), "scales differ"
    assert np.array_equal(a.peak, b.peak), "peaks differ"
    assert np.array_equal(a.ties, b.ties), "ties differ"


def change(w: np.ndarray, idx: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Write ``new`` at ``idx`` of ``w`` (sorted, unique); returns (indices, old bits) as a delta gives them."""
    flat = w.reshape(-1)
    old = flat[idx].copy()
    flat[idx] = new
    return idx, old


# ---------------------------------------------------------------------------
# The recipe


def test_the_fp8_rounding_is_torchs_cast_to_float8_e4m3fn() -> None:
    rng = np.random.default_rng(0)
    every_bf16 = (np.arange(0, 0x7F80, dtype=np.uint32) << 16).view(np.float32)
    samples = [
        (rng.random(1 << 20, dtype=np.float32) * 2 - 1) * np.float32(448),
        (rng.random(1 << 20, dtype=np.float32) * 2 - 1) * np.float32(2.0**-5),  # the subnormal range and its edge
        np.concatenate([every_bf16, -every_bf16]) * np.float32(1e-3),
        np.concatenate([every_bf16[:0x4380], -every_bf16[:0x4380]]) * np.float32(3.0),  # magnitudes up to 3 x 256
    ]
    for x in samples:
        x = x[np.abs(x) <= 448]
        want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(fp8_bits(x), want)
        if codec_kernels.jit_available():  # the scalar helper both kernels inline, compiled as they see it
            got = np.empty(x.size, np.uint8)
            compiled(_round_each)(x, got)
            assert np.array_equal(got, want)


def _round_each(x: np.ndarray, out: np.ndarray) -> None:
    """A kernel body over :func:`aurora_store.quant.kernels._fp8`, compiled the way the kernels are."""
    for i in range(x.size):
        out[i] = _fp8(x[i])


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (5, 7), (256, 129), (3, 130, 260), (2, 128, 256)])
def test_quantize_is_the_recipe_with_partial_edge_blocks_and_per_expert_blocks(path: str, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    w.view(-1)[:40] = 0
    w[..., :3, :] *= 1e-4  # some blocks under the 1e-4 floor
    if w.dim() == 2 and shape[0] > 128:
        w[128:, :128] = 0  # an all-zero block: ties are the whole (partial) block
    f = quantize(bits_of(w))
    q, s = recipe(w)
    assert f.scale_inv.shape == scale_shape(shape) == s.shape
    assert np.array_equal(f.q, q)
    assert np.array_equal(f.scale_inv.view(np.uint32), s.view(np.uint32))


def test_a_stack_of_experts_is_blocked_per_expert(path: str) -> None:
    w = (torch.randn(3, 100, 130, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    w[1] *= 64
    f = quantize(bits_of(w))
    for e in range(3):
        one = quantize(bits_of(w[e]))
        assert np.array_equal(f.q[e], one.q) and np.array_equal(f.scale_inv[e], one.scale_inv)


def test_the_compiled_kernels_and_their_numpy_twins_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    if not codec_kernels.jit_available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    w = bits_of((torch.randn(260, 300, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16))
    a, b = quantize(w, jit=True), quantize(w, jit=False)
    same(a, b)
    for _ in range(5):
        idx = np.unique(rng.integers(0, w.size, 800))
        new = bits_of((torch.randn(idx.size, generator=torch.Generator().manual_seed(int(idx[0]))) * 0.03).to(torch.bfloat16))
        idx, old = change(w, idx, new)
        ra, rb = requantize(a, w, idx, old, jit=True), requantize(b, w, idx, old, new, jit=False)
        same(a, b)
        assert ra == rb


# ---------------------------------------------------------------------------
# Incremental requantization == quantization from scratch


SHAPES = [(300, 200), (129, 257), (128, 128), (5, 7), (2, 140, 130), (1, 256, 384)]


@st.composite
def deltas(draw: Callable[..., object]) -> tuple[tuple[int, ...], int, list[tuple[str, float, int]]]:
    shape = draw(st.sampled_from(SHAPES))
    seed = draw(st.integers(0, 2**16))
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["ulp", "fresh", "shrink_peaks", "raise", "zero", "floor"]),
                st.floats(0.0005, 0.3),
                st.integers(0, 2**16),
            ),
            min_size=1,
            max_size=4,
        )
    )
    return shape, seed, steps  # type: ignore[return-value]


def _new_values(kind: str, w: np.ndarray, idx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    cur = w.reshape(-1)[idx]
    mag, sign = cur & 0x7FFF, cur & 0x8000
    if kind == "ulp":  # RL-like: one unit in the last place either way (never through zero or to inf)
        step = rng.choice(np.array([-1, 1]), idx.size)
        return np.where(mag == 0, 1, np.clip(mag.astype(np.int32) + step, 1, 0x7F7F)).astype(np.uint16) | sign
    if kind == "fresh":
        return bits_of((torch.from_numpy(rng.standard_normal(idx.size).astype(np.float32)) * 0.05).to(torch.bfloat16))
    if kind == "shrink_peaks":  # large elements get smaller: largest elements leave their blocks
        return np.where(mag > 0x3C00, mag - 0x200, mag).astype(np.uint16) | sign
    if kind == "raise":
        return np.minimum(mag.astype(np.int32) + 0x100, 0x7F7F).astype(np.uint16) | sign
    if kind == "zero":
        return np.zeros(idx.size, np.uint16)
    # floor: magnitudes around 1e-4 (bf16 0x38D1), so block peaks cross it both ways
    return (rng.integers(0x38B0, 0x38F0, idx.size).astype(np.uint16)) | sign


@settings(path_settings, max_examples=60)
@given(deltas())
def test_incremental_requantization_equals_quantization_from_scratch(
    path: str, case: tuple[tuple[int, ...], int, list[tuple[str, float, int]]]
) -> None:
    shape, seed, steps = case
    rng = np.random.default_rng(seed)
    w = bits_of((torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) * 0.02).to(torch.bfloat16))
    if seed % 3 == 0:
        w[...] = (w & 0x80FF) | 0x3800  # every block near the floor
    fp8 = quantize(w)
    total = Requant()
    for kind, density, s in steps:
        r = np.random.default_rng(s)
        idx = np.unique(r.integers(0, w.size, max(1, int(density * w.size))))
        idx = idx.astype(np.int32) if s % 2 else idx
        new = _new_values(kind, w, idx, r)
        idx, old = change(w, idx, new)
        total = total + requantize(fp8, w, idx, old, new if s % 3 else None)  # new values given, or read from the weight
        same(fp8, quantize(w))
    assert total.changed <= total.work <= 2 * w.size * len(steps)
    assert total.whole_blocks >= total.shrunk


def test_a_block_whose_largest_element_grows_changes_its_scale_and_is_requantized_whole(path: str) -> None:
    w = bits_of((torch.randn(256, 256, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16))
    fp8 = quantize(w)
    i = int(np.argmax(w[:128, :128] & 0x7FFF))  # the top-left block's largest element
    flat = i // 128 * 256 + i % 128
    idx, old = change(w, np.array([flat]), np.array([(w.reshape(-1)[flat] & 0x8000) | 0x3F00], np.uint16))  # 0.5
    r = requantize(fp8, w, idx, old)
    same(fp8, quantize(w))
    assert (r.scales_changed, r.whole_blocks, r.shrunk) == (1, 1, 0)
    assert r.work == 1 + 128 * 128  # the change, then its block


def test_a_block_whose_largest_element_shrinks_is_rescanned(path: str) -> None:
    w = bits_of((torch.randn(200, 300, generator=torch.Generator().manual_seed(6)) * 0.02).to(torch.bfloat16))
    fp8 = quantize(w)
    flat = w.reshape(-1)
    blk = flat.reshape(200, 300)[128:, 256:] & 0x7FFF  # the partial corner block: 72 x 44
    r0, c0 = np.unravel_index(int(np.argmax(blk)), blk.shape)
    at = (128 + int(r0)) * 300 + 256 + int(c0)
    idx, old = change(w, np.array([at]), np.array([0], np.uint16))
    r = requantize(fp8, w, idx, old)
    same(fp8, quantize(w))
    assert (r.shrunk, r.whole_blocks, r.scales_changed) == (1, 1, 1)
    assert r.work == 1 + 72 * 44


def test_a_largest_element_that_shrinks_with_a_tie_left_keeps_the_scale(path: str) -> None:
    w = bits_of((torch.randn(128, 128, generator=torch.Generator().manual_seed(7)) * 0.01).to(torch.bfloat16))
    flat = w.reshape(-1)
    flat[[10, 500]] = 0x3E80, 0xBE80  # +-0.25: two elements at the peak
    fp8 = quantize(w)
    assert int(fp8.ties[0, 0]) == 2
    idx, old = change(w, np.array([10, 11, 12]), np.array([0x3E00, 0x3C00, 0], np.uint16))
    r = requantize(fp8, w, idx, old)
    same(fp8, quantize(w))
    assert (r.scales_changed, r.whole_blocks, r.work) == (0, 0, 3)
    idx, old = change(w, np.array([500]), np.array([0x3E00], np.uint16))  # the last one at the peak goes
    r = requantize(fp8, w, idx, old)
    same(fp8, quantize(w))
    assert (r.shrunk, r.scales_changed, r.whole_blocks) == (1, 1, 1)


def test_amax_crossing_the_floor_changes_the_scale_only_when_it_crosses(path: str) -> None:
    w = np.full((128, 200), 0x3800, np.uint16)  # 2**-15, far under 1e-4: every scale at the floor
    fp8 = quantize(w)
    floor_scale = fp8.scale_inv.copy()
    # Up, but still under the floor: the peak moves, the scale stays.
    idx, old = change(w, np.array([3]), np.array([0x38C0], np.uint16))  # 9.16e-5
    r = requantize(fp8, w, idx, old)
    same(fp8, quantize(w))
    assert (r.scales_changed, r.whole_blocks, r.work) == (0, 0, 1) and np.array_equal(fp8.scale_inv, floor_scale)
    # Over the floor: the scale changes.
    idx, old = change(w, np.array([3, 130]), np.array([0x3900, 0xB8D8], np.uint16))  # 1.22e-4, -1.03e-4
    r = requantize(fp8, w, idx, old)
    same(fp8, quantize(w))
    assert r.scales_changed == 2
    # Back under it: rescanned, and the scale returns to the floor's.
    idx, old = change(w, np.array([3, 130]), np.array([0x3800, 0x3800], np.uint16))
    r = requantize(fp8, w, idx, old)
    same(fp8, quantize(w))
    assert r.shrunk == 2 and np.array_equal(fp8.scale_inv, floor_scale)


# ---------------------------------------------------------------------------
# Bad input: one clear error, nothing written


def test_bad_changes_are_refused_with_the_copy_untouched(path: str) -> None:
    w = bits_of((torch.randn(130, 140, generator=torch.Generator().manual_seed(8)) * 0.02).to(torch.bfloat16))
    fp8 = quantize(w)
    before = fp8.copy()
    for idx, new in (
        (np.array([5, 3]), np.array([1, 2], np.uint16)),  # out of order
        (np.array([5, 5]), np.array([1, 2], np.uint16)),  # twice
        (np.array([-1]), np.array([1], np.uint16)),
        (np.array([w.size]), np.array([1], np.uint16)),
    ):
        old = w.reshape(-1)[np.clip(idx, 0, w.size - 1)].copy()
        for new_arg in (new, None):  # new values given, or read from the weight
            with pytest.raises(ModelMismatchError, match="out of order or out of bounds"):
                requantize(fp8, w, idx, old, new_arg)
            same(fp8, before)
    for inf in (0x7F80, 0xFFC0):  # +inf, a NaN
        idx, old = change(w, np.array([7, 9000]), np.array([0x3F00, inf], np.uint16))
        with pytest.raises(ModelMismatchError, match="infinite or NaN"):
            requantize(fp8, w, idx, old)
        same(fp8, before)
        w.reshape(-1)[idx] = old
    with pytest.raises(ModelMismatchError, match="infinite or NaN"):
        quantize(np.full((4, 4), 0x7FC0, np.uint16))
    with pytest.raises(ModelMismatchError, match="the weight is"):
        requantize(fp8, w[:128], np.array([1]), np.array([0], np.uint16))


def test_weights_that_are_not_bf16_or_not_a_matrix_are_refused_in_one_line() -> None:
    with pytest.raises(ModelMismatchError, match="bfloat16"):
        quantize(np.zeros((4, 4), np.float32))
    with pytest.raises(ModelMismatchError, match="not shape"):
        quantize(np.zeros(16, np.uint16))
    with pytest.raises(ModelMismatchError, match="already quantized checkpoint cannot be its base"):
        Fp8Weights.of({"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)})
    with pytest.raises(ConfigError, match="unknown quantization format 'fp8-block64'"):
        check_format("fp8-block64")


# ---------------------------------------------------------------------------
# Which weights, and a model's copy


@pytest.mark.parametrize(
    ("name", "shape", "quantized"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (64, 64), True),
        ("model.layers.0.self_attn.qkv_proj.weight", (96, 64), True),
        ("model.layers.0.mlp.gate_up_proj.weight", (384, 64), True),
        ("model.layers.0.mlp.down_proj.weight", (64, 192), True),
        ("model.layers.0.mlp.experts.gate_up_proj", (8, 256, 64), True),
        ("model.layers.0.mlp.experts.3.down_proj.weight", (64, 128), True),
        ("model.layers.0.mlp.gate.weight", (8, 64), False),  # the router
        ("model.layers.0.block_sparse_moe.gate.weight", (8, 64), False),
        ("model.layers.0.mlp.shared_expert_gate.weight", (1, 64), False),
        ("model.embed_tokens.weight", (512, 64), False),
        ("lm_head.weight", (512, 64), False),
        ("model.layers.0.input_layernorm.weight", (64,), False),
        ("model.layers.0.self_attn.q_norm.weight", (16,), False),
        ("model.layers.0.self_attn.q_proj.bias", (64,), False),
    ],
)
def test_linear_weights_are_quantized_and_embeddings_norms_routers_and_the_head_are_not(
    name: str, shape: tuple[int, ...], quantized: bool
) -> None:
    assert is_quantized(name, shape) is quantized


def test_a_models_copy_follows_its_weights_shares_memory_with_torch_and_digests_like_a_fresh_one(path: str) -> None:
    from aurora_tools.synthetic.shapes import QWEN3_TINY, make_weights

    weights = make_weights(QWEN3_TINY, seed=3)
    copy = Fp8Weights.of(weights)
    assert "model.embed_tokens.weight" not in copy and "model.layers.1.mlp.down_proj.weight" in copy
    served = copy.tensors()
    name = "model.layers.0.self_attn.k_proj.weight"
    assert served[name].dtype == torch.float8_e4m3fn and served[name + "_scale_inv"].shape == (1, 1)
    rng = np.random.default_rng(4)
    for n in sorted(copy):
        t = weights[n]
        flat = t.view(-1).view(torch.int16)
        idx = np.unique(rng.integers(0, t.numel(), t.numel() // 50))
        old = flat[torch.from_numpy(idx)].numpy().view(np.uint16).copy()
        flat[torch.from_numpy(idx)] = torch.from_numpy((old ^ 1).view(np.int16))
        copy.requantize(n, t, idx, old)
    fresh = Fp8Weights.of(weights)
    assert copy.digest() == fresh.digest()
    assert torch.equal(served[name].view(torch.uint8), fresh.tensors()[name].view(torch.uint8))  # the torch view saw it


# ---------------------------------------------------------------------------
# vLLM's reference


@pytest.mark.slow
def test_quantize_equals_vllms_per_block_cast_to_fp8_on_2d_weights(path: str) -> None:
    try:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8
    except Exception as e:  # noqa: BLE001 - any reason vLLM cannot be imported here
        pytest.skip(f"vLLM's per_block_cast_to_fp8 is not importable: {type(e).__name__}: {e}")
    g = torch.Generator().manual_seed(11)
    for shape in [(256, 384), (300, 200), (129, 1000)]:
        w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        w[:128, :128] *= 1e-3  # a block under the 1e-4 floor
        w[-1, -1] = 0.75
        q, s = per_block_cast_to_fp8(w)
        f = quantize(bits_of(w))
        assert np.array_equal(f.q, q.view(torch.uint8).numpy()), shape
        assert np.array_equal(f.scale_inv.view(np.uint32), s.float().numpy().view(np.uint32)), shape
