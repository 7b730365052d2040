"""``aurora bench activate --shape``: the mixture-of-experts shapes and the benchmark on the tiny one.

The 2.2 B ``qwen3-30b-a3b-mini`` run is too large for the test suite (the
lead runs it for docs/BENCHMARKS.md); here its dimensions are checked
against Qwen3-30B-A3B's, and the benchmark runs end to end on
``qwen3-moe-tiny``: the engine holds the experts packed (two tensors per
layer where a checkpoint has 3 x E), every path lands the delta exactly,
and the keys the issue names are there.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from aurora_tools.synthetic.shapes import (
    NAMED_SHAPES,
    QWEN3_30B_A3B,
    QWEN3_30B_A3B_MINI,
    QWEN3_MOE_TINY,
    QWEN3_TINY,
    make_weights,
    param_shapes,
    shape_named,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def run_cli(*argv: str) -> tuple[int, str]:
    from aurora_tools.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "activate", *argv])
    return rc, out.getvalue()


def test_mini_shape_is_qwen3_30b_a3b_at_a_quarter_width() -> None:
    full, mini = QWEN3_30B_A3B, shape_named("qwen3-30b-a3b-mini")
    assert mini is QWEN3_30B_A3B_MINI
    # Qwen3-30B-A3B: 48 layers, 128 experts, 8 active, 32 query and 4 KV heads of 128, vocab 151936, untied.
    assert (full.layers, full.experts, full.active, full.heads, full.kv_heads, full.head_dim) == (48, 128, 8, 32, 4, 128)
    assert (full.vocab, full.hidden, full.moe_intermediate, full.tied) == (151936, 2048, 768, False)
    assert 30.4e9 < full.params < 30.6e9  # the published 30.5 B
    same = ("vocab", "layers", "experts", "active", "heads", "kv_heads", "head_dim", "tied")
    assert all(getattr(mini, k) == getattr(full, k) for k in same)
    assert (mini.hidden * 4, mini.moe_intermediate * 4) == (full.hidden, full.moe_intermediate)
    assert 2.1e9 < mini.params < 2.3e9  # 4.4 GB a bf16 copy
    # A checkpoint names every expert's three projections: 3 x 128 per layer, plus 9 others per layer and 3 more.
    assert mini.hf_tensors == full.hf_tensors == 48 * (3 * 128 + 9) + 3 == 18867
    # In memory the experts are two packed tensors per layer.
    packed = param_shapes(mini)
    assert packed["model.layers.47.mlp.experts.gate_up_proj"] == (128, 2 * 192, 512)
    assert packed["model.layers.47.mlp.experts.down_proj"] == (128, 512, 192)
    assert len(packed) == 48 * 11 + 3


def test_unknown_shape_is_one_line() -> None:
    with pytest.raises(ValueError, match="^unknown shape 'qwen9': one of .*qwen3-moe-tiny") as info:
        shape_named("qwen9")
    assert "\n" not in str(info.value)
    assert {"qwen3-moe-tiny", "qwen3-30b-a3b-mini", "qwen3-tiny"} <= NAMED_SHAPES.keys()
    assert shape_named("qwen3-tiny") is QWEN3_TINY


def test_packed_and_per_expert_weights_are_the_same_weights() -> None:
    """``tensors_hf`` counts a checkpoint of the very weights the engine holds packed: same format tensors, same digest."""
    from aurora_store.apply.sink import weights_digest
    from aurora_store.codec.extract import plan_of

    packed = make_weights(QWEN3_MOE_TINY, seed=3)
    per_expert = make_weights(QWEN3_MOE_TINY, seed=3, packed=False)
    assert len(per_expert) == QWEN3_MOE_TINY.hf_tensors == 2 * (3 * 8 + 9) + 3
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in per_expert
    assert sum(t.numel() for t in per_expert.values()) == sum(t.numel() for t in packed.values()) == QWEN3_MOE_TINY.params
    a = plan_of(packed, tied=False, family="qwen3_moe")
    b = plan_of(per_expert, tied=False, family="qwen3_moe")
    assert a.specs() == b.specs()
    assert "model.layers.0.mlp.experts.w13_weight" in a.params
    assert weights_digest(packed, a) == weights_digest(per_expert, b)
    # Another seed is other weights.
    assert weights_digest(make_weights(QWEN3_MOE_TINY, seed=4), a) != weights_digest(packed, a)


def test_bench_activate_on_the_tiny_moe_shape() -> None:
    rc, out = run_cli("--shape", "qwen3-moe-tiny", "--reps", "1", "--json")
    assert rc == 0
    r = json.loads(out)
    for key in (
        "safe_point_s",
        "bare_scatter_s",
        "full_copy_s",
        "params",
        "changed",
        "tensors_hf",
        "tensors_engine",
        "peak_rss_gb",
        "swap_safe_point_s",
        "verify_s",
    ):
        assert key in r, key
    assert r["exact"] is True
    assert r["shape"] == "qwen3-moe-tiny" and r["experts"] == 8 and r["layers"] == 2
    assert r["params"] == QWEN3_MOE_TINY.params
    assert r["tensors_hf"] == 69
    assert r["tensors_engine"] == 2 * 11 + 3  # the experts packed: two tensors a layer
    assert r["tensors_format"] == 2 * 9 + 3  # q, k and v fused; w13 and w2 per layer
    assert 0.005 * r["params"] < r["changed"] < 0.0107 * r["params"]
    assert r["swap_skipped"] is None and r["swap_safe_point_s"] is not None
    assert r["peak_rss_gb"] > 0
    assert all(r[k] >= 0 for k in ("safe_point_s", "bare_scatter_s", "full_copy_s"))


def test_swap_is_skipped_when_three_copies_would_not_fit() -> None:
    from aurora_tools.bench.activate import measure

    r = measure(shape="qwen3-moe-tiny", reps=1, swap_max_bytes=1 << 20)
    assert r["exact"] is True
    assert r["swap_safe_point_s"] is None and r["swap_prepare_s"] is None
    assert "three copies of the weights" in r["swap_skipped"]
    assert r["safe_point_s"] >= 0 and r["bare_scatter_s"] >= 0


def test_params_and_shape_together_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from aurora_tools.bench.activate import measure

    with pytest.raises(SystemExit) as info:
        run_cli("--shape", "qwen3-moe-tiny", "--params", "300000")
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(ValueError, match="give --params or --shape, not both"):
        measure(params=3e5, shape="qwen3-moe-tiny")
    with pytest.raises(SystemExit):
        run_cli("--shape", "qwen9")
    assert "invalid choice: 'qwen9'" in capsys.readouterr().err
