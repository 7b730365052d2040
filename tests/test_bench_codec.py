"""``aurora bench codec`` on a tiny model: the JSON report is complete and sane.

The benchmark's figures are not asserted (a benchmark reports, it does not
pass or fail); this checks the program runs, checks losslessness itself,
and that the sizes it reports are ordered the way the formats dictate.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from aurora_store.codec import kernels
from aurora_tools.bench import codec as bench
from aurora_tools.synthetic.shapes import QWEN3_0_6B, shape_for_params


def _run(capsys: pytest.CaptureFixture[str], **kw: object) -> dict:
    args = argparse.Namespace(params=2e5, lr=None, seed=0, json=True)
    for k, v in kw.items():
        setattr(args, k, v)
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one JSON object on stdout, nothing else


def test_json_report_on_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    r = _run(capsys)
    assert torch.get_num_threads() == threads  # the one-thread setting does not leak

    for key in (
        "density",
        "bytes_per_changed",
        "scan_fraction_of_memcpy",
        "encode_elems_per_s",
        "decode_apply_elems_per_s",
        "lossless",
        "memcpy_gbps",
        "extract_encode_fraction_of_memcpy",
        "targets",
        "params",
    ):
        assert key in r, key
    assert r["params"] < 1e6
    assert 0.0 < r["density"] < 0.05
    assert r["changed"] > 0
    assert r["lossless"] is True
    assert all(r["lossless_by_encoding"].values())

    bpc = r["bytes_per_changed"]
    assert set(bpc) == {"leb128", "u32", "u64", "xor_zstd", "auto", "auto_v2", "zstd_u32"}
    # Format 1 and the default, format 2, measured in the same run.
    assert r["default_format"] == 2 and r["segment_format"]["auto_v2"] == 2
    assert {k: v for k, v in r["segment_format"].items() if k != "auto_v2"} == dict.fromkeys(
        ("u64", "u32", "leb128", "xor_zstd", "auto"), 1
    )
    assert r["decode_apply_elems_per_s_v2"] > 0 and r["extract_encode_fraction_of_memcpy_v2"] > 0
    assert r["decode_apply_elems_per_cpu_s_v2"] > 0 and r["extract_encode_fraction_of_memcpy_cpu_v2"] > 0
    assert all(isinstance(v, float) and v > 0 for v in bpc.values()), bpc
    # Naive sizes are exact: 8 + 2 and 4 + 2 bytes per changed bf16 element.
    assert bpc["u64"] == pytest.approx(10.0)
    assert bpc["u32"] == pytest.approx(6.0)
    assert bpc["u64"] > bpc["u32"] > bpc["leb128"]
    # auto may pick anything, including the paper's choice, so it is never larger.
    assert bpc["auto"] <= bpc["leb128"]

    for key in ("scan_fraction_of_memcpy", "encode_elems_per_s", "decode_apply_elems_per_s"):
        assert r[key] > 0, key
    assert {t["target"] for t in r["targets"]} and all(isinstance(t["met"], bool) for t in r["targets"])

    # Which kernels ran, and both paths side by side, agreeing bit for bit.
    assert r["kernel_path"] == kernels.path()
    assert r["paths_agree"] is True
    paths = {"jit", "numpy"} if kernels.jit_available() else {"numpy"}
    assert set(r["extract_s_by_path"]) == paths
    assert set(r["decode_apply_auto_elems_per_s_by_path"]) == paths
    assert all(v > 0 for v in r["scan_fraction_of_memcpy_by_path"].values())


def test_numpy_path_is_reported(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.JIT_ENV, "1")
    r = _run(capsys)
    assert r["kernel_path"] == "numpy"
    assert r["lossless"] is True and r["paths_agree"] is True
    assert kernels.path() == "numpy"  # the benchmark restores the variable it switches


def test_default_lr_when_none_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, lr=None)["lr"] == bench.DEFAULT_LR == 2e-7


def test_table_is_printed_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(params=2e5, lr=None, seed=1, json=False)
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "leb128 (paper)" in out and "targets" in out
    assert f"kernels: {kernels.path()}" in out and "by kernel path" in out
    assert not out.lstrip().startswith("{")


def test_params_scale_the_model_to_the_requested_size() -> None:
    for n in (2e5, 1e7, 1e8, 6e8, 4e9):
        got = shape_for_params(n).params
        assert 0.7 * n <= got <= 1.3 * n, (n, got)
    assert shape_for_params(QWEN3_0_6B.params) == QWEN3_0_6B
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            shape_for_params(bad)
