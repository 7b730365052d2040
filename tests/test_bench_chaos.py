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
import threading
from pathlib import Path
from typing import Any

import pytest

from aurora_store.format.manifest import Manifest
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
@pytest.mark.long
@pytest.mark.server
def test_chaos_smoke(tmp_path: Path) -> None:
    cfg = ChaosConfig(
        steps=20,
        faults=SMOKE_FAULTS,
        s3_pause_s=2.0,
        redis_down_s=1.0,
        actor_down_s=1.0,
        actor_stop_s=4.0,
        actor_slowdown=3.0,
        recover_timeout_s=90.0,
        timeout_s=240.0,
        outage_budget_s=60.0,
    )
    res = run_chaos(cfg, str(tmp_path))
    json.dumps(res)  # one JSON object
    assert set(METRICS) <= set(res)
    assert isinstance(res["redis_keys_before_after"], dict) and set(res["redis_keys_before_after"]) == {"before", "after"}
    logs = tmp_path / "logs"
    why = f"{res['evidence_missing']} {res['unexpected_exits']} {res['chain_problems']} (logs in {logs})\n{table(res)}"
    assert not res["timed_out"], why
    assert res["faults_injected"] == res["faults_planned"] == len(SMOKE_FAULTS), why
    assert res["steps_completed"] == res["steps_requested"] == 20, why
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


class _Stub:
    """Attributes only: the parts of a run the evidence functions read."""

    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


def _manifest(kind: str, v: int, state: str, base: str | None = None, epoch: int = 1) -> Manifest:
    return Manifest(
        kind=kind,
        run="chaos",
        version=v,
        segments=(),
        params={},
        state=state,
        base_version=v - 1 if kind == "delta" else None,
        base_state=base,
        producer={"step": v - 1, "epoch": epoch},
    )


def _evidence_run(records: list[dict[str, object]], steps: int = 2) -> Any:
    deltas = {1: _manifest("delta", 1, "s1", "s0"), 2: _manifest("delta", 2, "s2", "s1", epoch=2)}
    manifests = _Stub(
        lock=threading.Lock(), deltas=deltas, snapshots={0: _manifest("snapshot", 0, "s0")}, states=lambda: {0: "s0", 1: "s1", 2: "s2"}
    )
    fleet = _Stub(step_records=lambda: [(None, r) for r in records])
    return _Stub(manifests=manifests, fleet=fleet, open_prompts={}, cfg=ChaosConfig(steps=steps, faults=()))


def test_prompt_evidence_from_step_lines() -> None:
    from aurora_tools.bench.chaos.evidence import _chain, _prompts

    records = [
        {
            "step": 0,
            "version": 1,
            "gen_version": 0,
            "state": "s1",
            "prompts": ["a", "b", "c"],
            "used": [["a", "eu-0", 1, 0, "s0"], ["b", "us-0", 2, 0, "s0"]],
            "unreturned": ["c"],
            "accepted_twice": 0,
            "accepted_wrong_version": 0,
        },
        # A record of a Trainer killed before its manifest: another state, ignored.
        {"step": 1, "version": 2, "gen_version": 1, "state": "sX", "prompts": ["d", "e", "f"], "used": [], "unreturned": []},
        {
            "step": 1,
            "version": 2,
            "gen_version": 1,
            "state": "s2",
            "prompts": ["d", "e", "f", "g"],
            "used": [["d", "eu-0", 3, 1, "s1"], ["d", "eu-1", 4, 1, "s1"], ["e", "eu-0", 5, 0, "s1"], ["g", "eu-1", 6, 1, "sZ"]],
            "unreturned": [],
            "accepted_twice": 1,
            "accepted_wrong_version": 0,
        },
    ]
    run = _evidence_run(records)
    chain = _chain(run)
    assert chain["completed"] == 2 and chain["problems"] == [] and chain["epoch_regressions"] == 0
    got = _prompts(run, chain["completed"])
    assert got["prompts_lost"] == 1  # f: neither used nor unreturned
    assert got["prompts_unreturned"] == 1  # c
    assert got["accepted_twice"] == 2  # d twice, plus the Trainer's own count
    assert got["accepted_wrong_version"] == 1  # e, generated on v0 for a batch on v1
    assert got["accepted_wrong_state"] == 1  # g carried another state than v1's
    assert got["steps_unaccounted"] == 0


def test_prompt_evidence_missing_is_none_not_zero() -> None:
    from aurora_tools.bench.chaos.evidence import _prompts

    got = _prompts(_evidence_run([]), 2)
    assert got["prompts_lost"] is None and got["accepted_twice"] is None and got["accepted_wrong_state"] is None
    # Step lines without the state each result carried: that one metric is unknown.
    rec = {"step": 0, "version": 1, "gen_version": 0, "state": "s1", "prompts": ["a"], "used": [["a", "eu-0", 1, 0]], "unreturned": []}
    got = _prompts(_evidence_run([rec]), 1)
    assert got["prompts_lost"] == 0 and got["accepted_wrong_state"] is None


def test_a_fault_the_bench_ended_inside_reports_nothing_as_after_it() -> None:
    """The timeout hit while the resumed Trainer was starting: the old one was never woken, so its
    earlier step lines are not "published after waking" (which would fail ``fenced`` falsely)."""
    from aurora_tools.bench.chaos.evidence import _fault_json
    from aurora_tools.bench.chaos.faults import FaultRecord

    class OldTrainer:
        def lines_since(self, t: float, pattern: Any) -> list[tuple[float, str]]:
            lines = [(50.0, "trainer INFO step 18 -> v19: reward 0.5"), (90.0, "trainer INFO step 23 -> v24: reward 0.5")]
            return [(ts, ln) for ts, ln in lines if ts >= t and pattern.search(ln)]

    rec = FaultRecord("old-trainer", 24, injected=True, at_version=24, t_start=100.0, victims=[OldTrainer()])  # type: ignore[list-item]
    out = _fault_json(_Stub(fleet=_Stub(versions={v: (float(v), None, None) for v in range(25)})), rec, now=900.0)  # type: ignore[arg-type]
    assert "old_trainer_published" not in out and out["next_version"] is None
    assert out["outcome"].startswith("not lifted")
