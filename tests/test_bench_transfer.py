"""``aurora bench transfer``: the program runs end to end and reports what it promises.

The benchmark's numbers are not checked (they depend on the machine); its
shape is, and so is the one claim it must never get wrong: the staged delta,
applied to the base, gives the new weights bit for bit.
"""

from __future__ import annotations

import argparse
import json

import pytest

from aurora_tools.bench.transfer import TimedStore, add_arguments, main
from aurora_tools.synthetic.shapes import QWEN3_0_6B, shape_for_params


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(list(argv))


def test_defaults() -> None:
    a = _args()
    assert (a.streams, a.seed, a.json, a.params) == (8, 0, False, None)


@pytest.mark.parametrize("params", [2e5, 1e6, 5e6, 3e7, 2.5e8, 6e8])
def test_shape_for_params_is_close_and_qwen3_shaped(params: float) -> None:
    s = shape_for_params(params)
    assert s.layers >= 1 and s.intermediate == 3 * s.hidden and s.tied
    if params >= 2.5e8:
        assert (s.hidden, s.vocab, s.heads, s.kv_heads) == (1024, 151936, 16, 8)
        assert abs(s.params - params) / params < 0.05
    else:
        assert abs(s.params - params) / params < 0.6
    assert shape_for_params(6e8).layers == QWEN3_0_6B.layers


def test_timed_store_busy_is_the_union_of_intervals() -> None:
    from aurora_tools.bench.transfer.timing import Op

    t = TimedStore(object())
    t.ops += [
        Op("put", "a/seg-0", 1, 0.0, 2.0),
        Op("put", "a/seg-1", 1, 1.0, 3.0),  # overlaps the first
        Op("put", "a/seg-2", 1, 5.0, 6.0),
        Op("put", "deltas/v1/manifest.json", 1, 6.0, 6.5),
        Op("get", "a/seg-0", 1, 7.0, 8.0),
    ]
    assert t.busy("put") == pytest.approx(4.0)
    assert t.busy("put", manifest=True) == pytest.approx(0.5)
    assert t.busy("get") == pytest.approx(1.0)


@pytest.mark.server
@pytest.mark.slow
def test_bench_transfer_json_on_a_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(_args("--params", "1e6", "--streams", "4", "--repeats", "1", "--json"))
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, "--json prints exactly one JSON object"
    r = json.loads(out[0])
    assert rc == 0

    for key in (
        "seconds_1_stream",
        "seconds_s_streams",
        "streams",
        "speedup_streams",
        "pipeline_over_raw",
        "bytes_delta",
        "bytes_full",
        "phases",
        "raw_mb_s_put_1",
        "raw_mb_s_get_1",
        "raw_mb_s_put_s",
        "raw_mb_s_get_s",
        "density",
        "lossless",
    ):
        assert key in r, key
    assert r["streams"] == 4
    for phase in ("encode", "upload", "fetch", "decode", "verify", "commit", "extract"):
        assert r["phases"][phase] >= 0, phase
    assert r["seconds_1_stream"] > 0 and r["seconds_s_streams"] > 0
    assert r["speedup_streams"] == pytest.approx(r["seconds_1_stream"] / r["seconds_s_streams"], rel=0.01)
    assert min(r["raw_mb_s_put_1"], r["raw_mb_s_get_1"], r["raw_mb_s_put_s"], r["raw_mb_s_get_s"]) > 0
    assert 0.002 < r["density"] < 0.05  # an Adam-sized step changes about 1.5 %
    assert 0 < r["bytes_delta"] < r["bytes_full"] / 10
    assert r["bytes_full"] >= 2 * r["params"]  # bf16, plus safetensors headers

    # The staged delta applied to the base gave the new weights bit for bit,
    # over one connection and over S; the fetched snapshot equals them too.
    assert r["lossless"] is True
    assert r["delta"]["lossless_1"] is True and r["delta"]["lossless_s"] is True
    assert r["full"]["lossless"] is True
    for section in ("delta", "full"):
        sec = r[section]
        assert sec["objects"] >= 1
        assert set(sec["runs"]) >= {
            "pipeline_1",
            "pipeline_s",
            "raw_1",
            "raw_s",
            "boto3_1",
            "boto3_s",
        }
        assert sec["pipeline_over_raw"] > 0 and sec["cpu_over_raw"] > 0


@pytest.mark.server
@pytest.mark.slow
def test_bench_transfer_through_the_wan_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    """``--rtt-ms``: every request pays the round trip, so one connection takes at least a round trip per object each way."""
    rtt = 0.04
    rc = main(
        _args(
            "--params",
            "1e6",
            "--streams",
            "4",
            "--repeats",
            "1",
            "--no-full",
            "--no-boto3",
            "--segment-mib",
            "0.004",
            "--rtt-ms",
            str(rtt * 1000),
            "--json",
        )
    )
    r = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert r["rtt_ms"] == rtt * 1000 and "WAN proxy (40 ms RTT)" in r["server"]
    n = r["delta"]["objects"]  # segments
    assert n >= 4
    # Publishing then staging over one connection: a request per object up, one down, one after another.
    assert r["seconds_1_stream"] >= 2 * n * rtt
    assert r["lossless"] is True
