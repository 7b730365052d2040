"""``measured_batches_unassigned``: the measured steps whose batch the Trainer made with no Actor eligible."""

from __future__ import annotations

from aurora_tools.bench.wan_sweep import Link, RunConfig, headline, summarize, unassigned_batches


def _steps(eligible: list[list[str]]) -> list[dict[str, object]]:
    return [
        {"step": s, "version": s + 1, "step_s": 1.0, "tokens": 100, "tokens_per_s": 100.0, "by_actor": {}, "eligible": e}
        for s, e in enumerate(eligible)
    ]


def test_a_measured_batch_made_with_nobody_eligible_is_counted() -> None:
    # K = 1: the batch of step s is made at the end of step s - 2; steps 2 and 3 are measured.
    steps = _steps([["a0", "a1"], [], [], []])  # batch 3 made at step 1 with nobody; steps 2-3 make none
    assert unassigned_batches(steps[2:], steps, 1) == 1
    steps = _steps([["a0", "a1"], ["a0"], [], []])
    assert unassigned_batches(steps[2:], steps, 1) == 0
    # Batches made before the first step (at setup) and logs without the field count as assigned.
    assert unassigned_batches(steps[:2], steps, 1) == 0
    old = [{k: v for k, v in s.items() if k != "eligible"} for s in _steps([[], [], [], []])]
    assert unassigned_batches(old[2:], old, 1) == 0


def test_summarize_and_the_headline_carry_it() -> None:
    cfg = RunConfig("delta", Link(1.0, 20.0), 2, True, 4, 4, 2, experiments=("modes",))
    r = summarize(cfg, _steps([["a0", "a1"], [], [], []]), {}, {}, {}, 2 * 10**8)
    assert r["measured_batches_unassigned"] == 1
    assert r["timeline"][1]["eligible"] == []
    r.update(tokens_per_s=50.0, throughput_vs_ideal=0.5)
    assert headline([r])["delta_measured_batches_unassigned"] == 1
    assert headline([])["delta_measured_batches_unassigned"] is None
