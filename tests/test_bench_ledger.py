"""``aurora bench ledger`` on a tiny configuration: it runs, checks itself, and prints one JSON object."""

from __future__ import annotations

import argparse
import json

import pytest

from aurora_tools.bench.ledger import add_arguments, main

pytestmark = pytest.mark.server


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    return ap.parse_args(list(argv))


def test_bench_ledger_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(_args("--actors", "2", "3", "--prompts", "40", "--claim", "4", "--workers", "2", "--settle", "single", "--json"))
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)  # exactly one JSON object, nothing else on stdout
    for key in ("settled_per_s", "p50_settle_ms", "p99_settle_ms", "round_trips_per_prompt", "actors", "sweep"):
        assert key in result
    assert result["actors"] == 3  # the headline is the largest configuration
    assert result["ok"] is True
    assert [r["actors"] for r in result["sweep"]] == [2, 3]
    for r in result["sweep"]:
        assert r["settled"] == 40 and r["ok"] and r["refused"] == 0
        assert r["settled_per_s"] > 0
        assert 0 < r["p50_settle_ms"] <= r["p99_settle_ms"]
        # one settle per prompt, plus a claim (two round trips) per 4 prompts and a last empty claim per Actor
        assert 1.0 <= r["round_trips_per_prompt"] <= 2.0
        assert r["server_commands_per_prompt"] > r["commands_per_prompt"]  # the scripts' own commands


def test_bench_ledger_table_with_settle_many(capsys: pytest.CaptureFixture[str]) -> None:
    ns = argparse.Namespace(actors=2, prompts=30, claim=5, workers=1, settle="many", json=False)
    assert main(ns) == 0
    out = capsys.readouterr().out
    assert "settled/s" in out and "targets:" in out
    assert "NO" not in out.split("targets:")[0]
