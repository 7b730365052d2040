"""``aurora bench ledger`` on tiny configurations: it runs, checks itself, and prints one JSON object."""

from __future__ import annotations

import argparse
import json

import pytest

from aurora_tools.bench.ledger import add_arguments, main

pytestmark = pytest.mark.server

# Every key `aurora bench ledger --json` printed before the step simulation, and the new one.
HEADLINE_KEYS = (
    "benchmark",
    "actors",
    "prompts",
    "settle_mode",
    "claim",
    "workers",
    "settled_per_s",
    "p50_settle_ms",
    "p99_settle_ms",
    "round_trips_per_prompt",
    "commands_per_prompt",
    "server_commands_per_prompt",
    "round_trips_per_s",
    "redis_capacity_per_s",
    "min_settled_per_s",
    "max_round_trips_per_prompt",
    "targets",
    "targets_met",
    "ok",
    "redis_version",
    "cpus",
    "sweep",
    "redis_cpu_us_per_settle",
)


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(list(argv))


def test_bench_ledger_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = (
        "--actors",
        "2",
        "3",
        "--step-prompts",
        "40",
        "--steps",
        "2",
        "--claim",
        "4",
        "--workers",
        "2",
        "--settle",
        "single",
    )
    rc = main(_args(*argv, "--expire", "0", "--churn", "0", "--json"))
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)  # exactly one JSON object, nothing else on stdout
    for key in HEADLINE_KEYS:
        assert key in result, key
    assert result["actors"] == 3  # the headline is the largest configuration
    assert result["ok"] is True
    assert [r["actors"] for r in result["sweep"]] == [2, 3]
    for r in result["sweep"]:
        assert r["settled"] == 80 and r["steps"] == 2 and r["ok"] and r["refused"] == 0
        assert r["settled_per_s"] > 0
        assert 0 < r["p50_settle_ms"] <= r["p99_settle_ms"]
        # one settle per prompt, a claim per 4, a heartbeat per Actor and step, a few claims for leftovers
        assert 1.0 <= r["round_trips_per_prompt"] < 10.0
        assert r["server_commands_per_prompt"] > r["commands_per_prompt"]  # the scripts' own commands
        assert r["redis_cpu_us_per_settle"] > 0 and r["heartbeats"] >= 2 * r["actors"]
        assert (r["leaves"], r["joins"], r["abandoned"]) == (0, 0, 0)


def test_bench_ledger_expiries_leaves_and_joins(capsys: pytest.CaptureFixture[str]) -> None:
    argv = (
        "--actors",
        "6",
        "--step-prompts",
        "60",
        "--steps",
        "3",
        "--claim",
        "5",
        "--workers",
        "2",
        "--lease-ms",
        "100",
    )
    rc = main(_args(*argv, "--expire", "0.25", "--churn", "0.5", "--regions", "2", "--json"))
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["ok"] is True
    (r,) = result["sweep"]
    assert r["settled"] == 180 and r["regions"] == 2
    assert r["leaves"] == r["joins"] >= 1  # each Actor that left was replaced
    assert r["abandoned"] >= 1 and r["expired"] >= r["abandoned"]  # every lease left alone expired and was done again


def test_bench_ledger_table_with_settle_many(capsys: pytest.CaptureFixture[str]) -> None:
    ns = argparse.Namespace(
        actors=2,
        prompts=30,
        step_prompts=30,
        steps=2,
        claim=5,
        workers=1,
        settle="many",
        json=False,
    )
    assert main(ns) == 0
    out = capsys.readouterr().out
    assert "settled/s" in out and "targets:" in out
    assert "NO" not in out.split("targets:")[0]


@pytest.mark.slow
def test_bench_ledger_on_a_redis_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    argv = (
        "--cluster",
        "--actors",
        "4",
        "--step-prompts",
        "40",
        "--steps",
        "2",
        "--claim",
        "4",
        "--workers",
        "1",
        "--json",
    )
    rc = main(_args(*argv))
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["ok"] is True and result["cluster"] is True
    (r,) = result["sweep"]
    assert r["settled"] == 80 and r["redis_cpu_us_per_settle"] > 0
