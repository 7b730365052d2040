"""``aurora bench fp8``: the FP8 delta's size, and a smoke run of each workload that must come out exact."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from aurora_tools.bench.fp8 import KEYS, add_arguments, fp8_delta_bytes, run, table


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_an_fp8_delta_takes_the_smallest_of_the_codecs_streams() -> None:
    rng = np.random.default_rng(0)
    numel = 1 << 20
    assert fp8_delta_bytes(np.array([], np.int64), np.array([], np.uint8), np.array([], np.uint8), numel) == 0
    idx = np.unique(rng.integers(0, numel, numel // 1000))
    old = rng.integers(0, 256, idx.size).astype(np.uint8)
    new = old ^ np.uint8(1)  # one unit in the last place, the usual FP8 change
    got = fp8_delta_bytes(idx, new, old, numel)
    # Below u32 indices and raw values (5 B per change), above the gaps' entropy alone (about 1.4 B here).
    assert 1.2 * idx.size < got < 5 * idx.size
    everything = rng.integers(0, 256, numel).astype(np.uint8)
    all_idx = np.arange(numel)
    assert fp8_delta_bytes(all_idx, everything, everything ^ np.uint8(3), numel, everything) <= numel + 64  # dense: no index stream


def test_the_synthetic_workload_reports_each_key_per_step_and_requantizes_exactly() -> None:
    r = run(_args("--params", "3e6", "--steps", "2", "--demo-steps", "0", "--reps", "2", "--threads", "2"), lambda _: None)
    json.dumps(r)  # one JSON object
    assert r["threads"] == 2
    for key in KEYS:
        assert list(r[key]) == ["synthetic"] and len(r[key]["synthetic"]) == 2, key
    assert r["exact"]["synthetic"] == [True, True]
    assert isinstance(r["synthetic_params"], int) and r["synthetic_params"] > 2e6
    for i in range(2):
        g = {k: r[k]["synthetic"][i] for k in KEYS}
        assert 0.005 < g["bf16_density"] < 0.02  # the workload's 1.07 %
        # One bf16 ulp moves an FP8 byte only when it crosses a rounding boundary of 3 mantissa bits.
        assert 0 < g["fp8_element_density"] < g["bf16_density"]
        assert 0 <= g["scale_change_density"] <= g["fp8_block_density"] <= 1 and g["fp8_block_density"] > 0
        assert g["bytes_bf16_delta_quantized"] < g["bytes_bf16_delta"] and g["bytes_fp8_delta"] > 0
        assert 0.9 * g["bf16_density"] <= g["work_fraction"] < 1  # every changed element, and the blocks redone
        assert g["target_s"] == pytest.approx(2 * g["work_fraction"] * g["full_quant_s"] + 0.005)
        assert g["floor_moved_s"] > 0 and g["floor_s"] > 0  # measured, both passes
    assert "synthetic     1" in table(r)


@pytest.mark.long
@pytest.mark.server
def test_the_demo_workload_is_the_demos_real_steps_and_comes_first(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = run(_args("--steps", "1", "--params", "2e6", "--demo-steps", "2", "--reps", "1"), lambda _: None)
    assert not list(tmp_path.glob("aurora-bench-fp8-*"))  # the demo's run root is not left behind
    assert list(r["bf16_density"]) == ["demo", "synthetic"]
    assert r["exact"]["demo"] == [True, True]
    assert all(0 < d < 0.5 for d in r["bf16_density"]["demo"])
    assert r["demo_params"] > 1e6  # the demo's width (hidden 256)
