"""``aurora bench trainer``: its window, its figures from step records, the model's shape, the memory it reads, one smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from aurora_tools.bench.trainer import parse_params
from aurora_tools.bench.trainer.memory import TreeMemory, descendants
from aurora_tools.bench.trainer.shape import VOCAB, shape_for
from aurora_tools.bench.trainer.window import KEYS, figures, window_for


@pytest.mark.parametrize(("ck", "snap"), [(5, 10), (1, 1), (5, 0), (0, 10), (3, 4), (10, 10), (2, 7)])
def test_the_window_holds_a_checkpoint_and_a_snapshot(ck: int, snap: int) -> None:
    w = window_for(ck, snap)
    assert w.periods >= ck + 1 and w.first >= 2
    # Memory through the step after the window (a snapshot's upload runs in it), then a last step whose final checkpoint is not timed.
    assert w.memory_end == w.last + 2 and w.steps == w.last + 3
    # period b publishes version b + 1 and starts its checkpoint; the next period waits for it
    if ck:
        assert w.checkpoints and all(w.first < v <= w.last and v % ck == 0 for v in w.checkpoints)
    if snap:
        assert w.snapshots and all(w.first < v <= w.last + 1 and v % snap == 0 for v in w.snapshots)


def _records(times_ms: dict[int, int], **extra: float) -> dict[int, dict[str, float]]:
    return {b: {"time_ms": t, "step_s": 0.5, "publish_s": 0.3, "train_s": 0.2, "wait_s": 0.0, **extra} for b, t in times_ms.items()}


def test_figures_are_means_over_the_periods_and_split_publishing() -> None:
    w = window_for(1, 1)  # periods 2 and 3
    recs = _records({1: 1000, 2: 2000, 3: 4000}, publish_wait_s=0.1, digest_s=0.2, checkpoint_wait_s=0.05)
    f = figures(recs, w)
    assert f["step_s"] == pytest.approx(1.5)  # (1 s + 2 s) / 2
    assert f["publish_s"] == pytest.approx(0.1) and f["digest_s"] == pytest.approx(0.2)
    assert f["checkpoint_wait_s"] == pytest.approx(0.05) and f["checkpoint_wait_recorded"] is True
    assert f["overhead_fraction"] == pytest.approx(0.35 / 1.5)
    assert [p["step"] for p in f["per_step"]] == [2, 3]


def test_without_a_recorded_wait_the_checkpoint_is_the_period_outside_the_step() -> None:
    w = window_for(1, 1)
    f = figures(_records({1: 1000, 2: 2000, 3: 4000}), w)
    # no split: the whole publish; the checkpoint: period - the step's own record (0.5 s and 1.5 s)
    assert f["publish_s"] == pytest.approx(0.3) and f["digest_s"] == 0.0
    assert f["checkpoint_wait_s"] == pytest.approx(1.0) and f["checkpoint_wait_recorded"] is False


def test_a_missing_or_hostile_record_is_an_error_not_a_figure() -> None:
    w = window_for(1, 1)
    with pytest.raises(ValueError, match=r"steps \[1\]"):
        figures(_records({2: 2000, 3: 4000}), w)
    bad = _records({1: 1000, 2: 2000, 3: 4000})
    bad[2]["time_ms"] = float("nan")
    with pytest.raises(ValueError, match=r"steps \[2\]"):
        figures(bad, w)
    neg = _records({1: 1000, 2: 2000, 3: 4000}, publish_wait_s=-5.0)
    assert figures(neg, w)["publish_s"] == pytest.approx(0.3)  # a negative split is ignored: the whole publish


@pytest.mark.parametrize("n", [5e6, 2e8, 5e8, 1e9, 7e9])
def test_the_shape_has_about_the_asked_parameters_and_the_family_proportions(n: float) -> None:
    s = shape_for(n)
    assert abs(s.params() - n) / n < 0.03
    assert s.vocab_size == VOCAB and s.intermediate_size == 3 * s.hidden_size
    assert s.num_attention_heads % s.num_key_value_heads == 0
    assert VOCAB * s.hidden_size * 2 < s.params()


def test_params_takes_forms_like_2e8() -> None:
    assert parse_params("2e8") == 2e8 and parse_params("500000000") == 5e8
    import argparse

    for bad in ("two", "1e3", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_params(bad)


def test_params_is_the_benchmarks_alone() -> None:
    argv = [sys.executable, "-m", "aurora_tools.cli", "trainer", "--store", "file:///nowhere", "--redis", "redis://x", "--run", "r"]
    p = subprocess.run([*argv, "--params", "2e8"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unrecognized arguments: --params 2e8" in p.stderr and "Traceback" not in p.stderr


def test_tree_memory_sees_a_childs_peak_inside_the_window() -> None:
    code = textwrap.dedent(
        """
        import sys, time
        sys.stdin.readline()            # the window has started
        a = bytearray(200 << 20)        # touched: resident
        del a
        print("done", flush=True)
        sys.stdin.readline()
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)
        assert p.pid in descendants(p.pid)
        mem = TreeMemory(p.pid, interval_s=1.0)  # slower than the allocation: only the reset high-water mark sees it
        mem.start()
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"
        peaks = mem.stop()
        if mem.exact:
            assert peaks[p.pid] >= 200 << 20
        p.stdin.write("\n")
        p.stdin.flush()
    finally:
        p.wait(10)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.server
def test_smoke_run_reports_the_contract_keys() -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "aurora_tools.cli",
            "bench",
            "trainer",
            "--params",
            "5e6",
            "--checkpoint-every",
            "2",
            "--snapshot-every",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0 and "Traceback" not in p.stdout + p.stderr, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert list(r)[: len(KEYS)] == list(KEYS)
    assert 4e6 < r["params"] < 6e6 and r["peak_bytes_per_param"] > 0 and r["peak_bytes"] > r["baseline_bytes"]
    assert r["steps"] >= r["checkpoint_every"] + 1 == 3
    assert r["checkpoints_in_window"] and r["snapshots_in_window"]
    assert r["step_s"] > 0 and r["step_s"] >= r["publish_s"] >= 0 and r["digest_s"] >= 0 and r["checkpoint_wait_s"] >= 0
    assert r["settled"] >= r["steps"] * 2  # every batch came from the stand-in Actor


def test_step_records_carry_the_split_timings_the_benchmark_reads() -> None:
    from types import SimpleNamespace

    from aurora_store.metrics import step_record

    base: dict[str, Any] = dict(
        step=3, version=4, reward=0.5, wait_s=0.1, train_s=1.0, extract_publish_s=0.4, step_s=1.6, delta_bytes=10, changed=2, tokens=8
    )
    base.update(tokens_per_s=5.0, by_actor={})
    plain = json.loads(step_record(SimpleNamespace(**base))[1])
    assert plain["publish_s"] == 0.4 and not {"publish_wait_s", "digest_s", "checkpoint_wait_s"} & set(plain)
    split = SimpleNamespace(**base, publish_s=0.1, digest_s=0.3, checkpoint_wait_s=0.25)
    body = json.loads(step_record(split)[1])
    assert body["publish_s"] == 0.4  # the whole publish call, as before
    assert (body["publish_wait_s"], body["digest_s"], body["checkpoint_wait_s"]) == (0.1, 0.3, 0.25)


def test_disk_needed_follows_the_model_and_the_kept_checkpoints() -> None:
    from aurora_tools.bench.trainer.run import disk_needed

    w = window_for(5, 10)
    small, big = disk_needed(1e8, w, 10, 2), disk_needed(5e8, w, 10, 2)
    assert big > 4 * small
    assert disk_needed(5e8, w, 10, 3) - big >= 14 * 5e8  # one more checkpoint of 14 bytes per parameter
    assert big >= (2 + 14 * 3) * 5e8  # at least the model and three checkpoints


def test_a_run_the_disk_cannot_hold_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    from aurora_tools.bench.trainer.run import BenchError, Options, run_bench

    with pytest.raises(BenchError, match=r"GB is free there"):
        run_bench(Options(params=1e14, keep=str(tmp_path / "run")))
    assert not (tmp_path / "run" / "model").exists()
