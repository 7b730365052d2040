"""``aurora bench chaos`` on a short schedule: the same program, few steps, short faults.

The smoke run checks the contract of ``--json`` (issue 12's keys) and the
zero-loss invariants on a schedule that still covers Redis lost with and
without its data, the store away, the Trainer killed mid-publish and
resumed, an Actor killed and one stopped past its lease. The full schedule
(60 s S3 pause, old-epoch Trainer, Relay, corrupted object) is the
benchmark itself: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from aurora_tools.bench.chaos import FAULTS, ChaosConfig, add_arguments, run_chaos
from aurora_tools.bench.chaos.report import METRICS, table
from aurora_tools.cli.main import build_parser

SMOKE_FAULTS = ("redis-aof", "actor-kill", "s3-pause", "trainer-kill", "redis-empty", "actor-stop")


def test_schedule_is_fixed_and_follows_progress() -> None:
    cfg = ChaosConfig()
    assert [f for f, _ in cfg.schedule] == list(FAULTS)
    triggers = [t for _, t in cfg.schedule]
    assert triggers == sorted(triggers) and triggers[0] >= 1 and triggers[-1] < cfg.steps
    sub = ChaosConfig(steps=14, faults=("s3-pause", "redis-aof"))
    assert [f for f, _ in sub.schedule] == ["redis-aof", "s3-pause"]  # schedule order, whatever the order asked


def test_cli_declares_chaos() -> None:
    args = build_parser(["bench", "chaos"]).parse_args(["bench", "chaos", "--faults", "s3-pause,corrupt", "--s3-pause-s", "5", "--json"])
    assert args.faults == ("s3-pause", "corrupt") and args.s3_pause_s == 5 and args.json
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    with pytest.raises(SystemExit):
        ap.parse_args(["--faults", "meteor"])


@pytest.mark.slow
@pytest.mark.server
def test_chaos_smoke(tmp_path: Path) -> None:
    cfg = ChaosConfig(
        steps=14, faults=SMOKE_FAULTS, s3_pause_s=2.0, redis_down_s=1.0, actor_down_s=1.0, actor_stop_s=4.0,
        actor_slowdown=3.0, recover_timeout_s=90.0, timeout_s=240.0, outage_budget_s=60.0,
    )
    res = run_chaos(cfg, str(tmp_path))
    json.dumps(res)  # one JSON object
    assert set(METRICS) <= set(res)
    assert isinstance(res["redis_keys_before_after"], dict) and set(res["redis_keys_before_after"]) == {"before", "after"}
    logs = tmp_path / "logs"
    why = f"{res['evidence_missing']} {res['unexpected_exits']} {res['chain_problems']} (logs in {logs})\n{table(res)}"
    assert not res["timed_out"], why
    assert res["faults_injected"] == res["faults_planned"] == len(SMOKE_FAULTS), why
    assert res["steps_completed"] == res["steps_requested"] == 14, why
    assert res["trainer_resumes"] >= 1, why
    # Zero loss: nothing lost, nothing twice, nothing on a wrong version or state.
    assert res["prompts_lost"] == 0, why
    assert res["accepted_twice"] == 0, why
    assert res["accepted_wrong_version"] == 0, why
    assert res["accepted_wrong_state"] == 0, why
    assert res["steps_unaccounted"] == 0, why
    assert res["bit_identical"] is True, why
    assert res["activations_compared"] >= res["targets"]["activations_compared_min"], why
    assert not res["unexpected_exits"], why
    assert res["epoch_regressions"] == 0 and len(res["epochs"]) >= 2, why
    assert res["max_stall_s"] is not None and res["max_stall_s"] > 0
