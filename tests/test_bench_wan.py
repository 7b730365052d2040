"""``aurora bench wan``: the sweep's pure logic, the synthetic workload's weights, and one small run."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from aurora_store.coordination.scheduler import ActorView, SchedulerConfig, plan_step
from aurora_tools.bench.wan_sweep import (
    HEADLINE,
    MODES,
    Link,
    RunConfig,
    SweepOptions,
    attach_ideal,
    build_sweep,
    gen_version,
    headline,
    summarize,
    targets,
    uniform_split_gain,
)

# ---------------------------------------------------------------------------
# sweep construction


def test_quick_sweep_has_every_mode_once_and_the_targets_runs() -> None:
    cs = build_sweep(SweepOptions(quick=True))
    assert len({c.key() for c in cs}) == len(cs)
    assert {c.mode for c in cs if "modes" in c.experiments} == set(MODES)
    relayed = {c.actors for c in cs if "relay" in c.experiments and c.uses_relay}
    assert relayed == {2, 4, 8}
    assert {c.conns for c in cs if "streams" in c.experiments} == {1, 4}
    assert {c.split for c in cs if "hetero" in c.experiments} == {"uniform", "proportional"}
    churn = [c for c in cs if "churn" in c.experiments]
    assert len(churn) == 1 and churn[0].kill_at is not None and churn[0].join_at is not None
    assert churn[0].kill_at < churn[0].join_at < churn[0].steps
    full = build_sweep(SweepOptions())
    assert len(full) > len(cs)


def test_warmup_covers_the_batches_that_wait_for_no_transfer() -> None:
    for c in build_sweep(SweepOptions(quick=True)):
        k = c.spec.max_lag
        if c.kill_at is None:
            assert c.warmup == k + 1, c.name
        assert c.steps > c.warmup


def test_modes_map_onto_worker_settings() -> None:
    assert MODES["ideal"].transfer == "none"
    assert [MODES[m].max_lag for m in ("full", "full-async2", "full-async4")] == [1, 2, 4]
    c = RunConfig("full-multistream", HEADLINE, 2, True, 4, 4, 1)
    assert c.conns == 4 and not c.uses_relay  # the broadcast baselines never use a Relay
    assert RunConfig("delta-1stream", HEADLINE, 2, True, 4, 4, 1).conns == 1
    assert RunConfig("delta", HEADLINE, 2, True, 4, 4, 1).uses_relay
    with pytest.raises(ValueError):
        RunConfig("delta", HEADLINE, 2, True, 4, 2, 2)
    with pytest.raises(ValueError):
        RunConfig("nope", HEADLINE, 2, True, 4, 4, 1)


def test_shared_runs_carry_every_experiment() -> None:
    cs = build_sweep(SweepOptions(quick=True))
    d = [c for c in cs if c.mode == "delta" and c.actors == 2 and c.uses_relay and c.link == HEADLINE]
    assert len(d) == 1 and {"modes", "relay", "scaling"} <= set(d[0].experiments)


# ---------------------------------------------------------------------------
# lag bound and split


@pytest.mark.parametrize(("b", "k", "v"), [(0, 1, 0), (1, 1, 0), (2, 1, 1), (5, 1, 4), (2, 2, 0), (3, 2, 1), (4, 4, 0), (9, 4, 5)])
def test_lag_bound_rule(b: int, k: int, v: int) -> None:
    assert gen_version(b, k) == v


def test_lag_bound_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        gen_version(3, 0)


def test_uniform_split_gain_of_a_2x_spread() -> None:
    # uniform: B/4 on the slowest (x2) = B/2; proportional: B / (1 + 1 + 1/2 + 1/2) = B/3
    assert uniform_split_gain((1, 1, 2, 2)) == pytest.approx(1.5)
    assert uniform_split_gain((1, 1, 1)) == pytest.approx(1.0)


def test_scheduler_uniform_and_proportional_split() -> None:
    views = [ActorView("fast", 3, 3, 2.0), ActorView("slow", 3, 3, 1.0)]
    prop = plan_step(views, 3, 30, SchedulerConfig(min_prompts=0))
    uni = plan_step(views, 3, 30, SchedulerConfig(min_prompts=0, split="uniform"))
    assert prop.quotas == {"fast": 20, "slow": 10}
    assert uni.quotas == {"fast": 15, "slow": 15}
    with pytest.raises(Exception, match="split"):
        SchedulerConfig(split="random")


# ---------------------------------------------------------------------------
# summary math


def _steps(n: int, step_s: float, tokens: int = 1000) -> list[dict[str, object]]:
    return [
        {"step": b, "version": b + 1, "step_s": step_s, "tokens": tokens, "tokens_per_s": tokens / step_s, "by_actor": {}} for b in range(n)
    ]


def test_summarize_measures_after_the_warmup() -> None:
    cfg = RunConfig("delta", Link(1.0, 20.0), 2, True, 4, 5, 2, experiments=("modes",))
    steps = _steps(5, 2.0)
    steps[0]["step_s"] = steps[1]["step_s"] = 10.0  # warm-up: left out
    published = {v: {"start_ms": 1000.0 * v, "end_ms": 1000.0 * v + 50, "bytes": 1_000_000, "kind": "delta"} for v in range(1, 6)}
    staged = {(a, v): {"t_ms": 1000.0 * v + (300 if a == "a1" else 100)} for a in ("a0", "a1") for v in range(1, 6)}
    counters = {
        b: {"down": 2_000_000 * (b + 1), "up": 0, "veth_down": 0, "s3_down": 1_100_000 * (b + 1), "redis_down": 0} for b in range(-1, 5)
    }
    r = summarize(cfg, steps, published, staged, counters, 2 * 10**8)
    assert r["step_s"] == pytest.approx(2.0)
    assert r["tokens_per_s"] == pytest.approx(500.0)
    assert r["transfer_s"] == pytest.approx(0.3)  # the last Actor to stage, from the start of publishing
    assert r["cross_region_bytes_per_version"] == pytest.approx(2_000_000)
    assert r["cross_over_version"] == pytest.approx(1.1)
    assert r["wire_floor_s"] == pytest.approx(0.008)
    assert r["steps_measured"] == 3


def test_regions_deal_actors_round_robin_and_count_bytes_per_region() -> None:
    far = Link(0.25, 60.0)
    cfg = RunConfig("delta", Link(1.0, 20.0), 4, True, 4, 4, 2, experiments=("regions",), extra_regions=(far,))
    assert [cfg.region_of(i) for i in range(5)] == ["r1", "r2", "r1", "r2", "r1"]
    assert cfg.links == (Link(1.0, 20.0), far)
    assert "+r2:0.25G/60ms" in cfg.name
    assert cfg.key() != RunConfig("delta", Link(1.0, 20.0), 4, True, 4, 4, 2).key()
    with pytest.raises(ValueError, match="cannot fill 2 regions"):
        RunConfig("delta", Link(1.0, 20.0), 1, True, 4, 4, 2, extra_regions=(far,))
    published = {v: {"start_ms": 1000.0 * v, "end_ms": 1000.0 * v + 50, "bytes": 1_000_000, "kind": "delta"} for v in range(1, 5)}
    before = {"down": 0, "up": 0, "veth_down": 0, "s3_down": 0, "redis_down": 0, "s3_down@r1": 0, "s3_down@r2": 0}
    after = {**before, "down": 9_000_000, "s3_down": 8_400_000, "s3_down@r1": 4_000_000, "s3_down@r2": 4_400_000}
    r = summarize(cfg, _steps(4, 2.0), published, {}, {}, 2 * 10**8, (before, after))
    assert r["regions"] == ["1G/20ms", "0.25G/60ms"]
    assert r["object_bytes_per_version_by_region"] == {"r1": 1_000_000, "r2": 1_100_000}
    assert r["cross_over_version_by_region"] == {"r1": pytest.approx(1.0), "r2": pytest.approx(1.1)}
    assert r["cross_over_version"] == pytest.approx(2.1)  # both boundaries together


def test_sweep_has_a_two_region_experiment() -> None:
    cs = [c for c in build_sweep(SweepOptions(quick=True)) if "regions" in c.experiments]
    assert {(c.mode, c.uses_relay) for c in cs} == {("delta", True), ("delta", False), ("ideal", False)}
    assert all(len(c.links) == 2 for c in cs if c.mode == "delta")


def test_ideal_ratios_headline_and_targets() -> None:
    link = Link(1.0, 20.0)
    cfgs = [RunConfig(m, link, 2, True, 4, 4, 2, experiments=("modes",)) for m in ("ideal", "full", "delta")]
    res = [{"tokens_per_s": t, "experiments": ["modes"], "mode": c.mode} for c, t in zip(cfgs, (1000.0, 200.0, 950.0), strict=True)]
    attach_ideal(cfgs, res)
    assert [r["throughput_vs_ideal"] for r in res] == pytest.approx([1.0, 0.2, 0.95])
    h = headline(res)
    assert h["delta_vs_ideal"] == pytest.approx(0.95) and h["full_vs_ideal"] == pytest.approx(0.2)
    t = targets(res)
    assert t["delta_within_10pct_of_ideal"]["met"] is True
    assert t["delta_within_10pct_of_ideal"]["full_slowdown"] == pytest.approx(5.0)


# ---------------------------------------------------------------------------
# the synthetic workload's weights


def test_sparse_update_moves_about_density_elements_by_one_ulp() -> None:
    from aurora_tools.synthetic.shapes import QWEN3_TINY
    from aurora_tools.synthetic.workload import base_weights, sparse_update

    w = base_weights(QWEN3_TINY, seed=3, cache=False)
    before = {n: t.clone() for n, t in w.items()}
    sparse_update(w, 0.01, seed=3, version=1)
    changed = total = 0
    for n, t in w.items():
        a, b = before[n].view(torch.int16).int(), t.view(torch.int16).int()
        diff = a != b
        changed += int(diff.sum())
        total += t.numel()
        assert bool(((a - b).abs()[diff] == 1).all()), n
    assert 0.008 < changed / total < 0.0101
    again = {n: t.clone() for n, t in before.items()}
    sparse_update(again, 0.01, seed=3, version=1)
    assert all(torch.equal(again[n], w[n]) for n in w)


@pytest.mark.parametrize("transfer", ["delta", "full"])
def test_synthetic_actor_weights_equal_the_trainers(tmp_path: object, transfer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the Trainer publishes, staged and applied by a weight-holding SyntheticEngine, digests equal."""
    from aurora_store.apply.sink import weights_digest
    from aurora_store.codec.extract import extract, fuse_weights, plan_of
    from aurora_store.lineage.fetch import fetch_delta, fetch_snapshot
    from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
    from aurora_store.storage import open_store
    from aurora_tools.synthetic.engine import SyntheticEngine
    from aurora_tools.synthetic.shapes import QWEN3_TINY
    from aurora_tools.synthetic.workload import SyntheticSpec, base_weights, sparse_update

    monkeypatch.setenv("AURORA_SYNTHETIC_CACHE", f"{tmp_path}/cache")
    spec = SyntheticSpec(QWEN3_TINY, seed=5)
    store = open_store(f"file://{tmp_path}/run")
    published = base_weights(spec.shape, spec.seed)  # writes the base file
    plan = plan_of(published, tied=True)
    eng = SyntheticEngine(spec, hold=True, digests=True)
    eng.load_base()  # reads it: the base on the Actor's disk
    assert eng.digest() == weights_digest(published, plan)
    state = spec.base_state
    cfg = PublishConfig(streams=2, segment_bytes=4096)
    for v in (1, 2, 3):
        new = {n: t.clone() for n, t in published.items()}
        sparse_update(new, spec.density, spec.seed, v)
        if transfer == "delta":
            m = publish_delta(store, "r", v, extract(plan, published, new), state, cfg)
            _, staged = fetch_delta(store, v, eng.param_specs(), 2, expect_base_state=state)
            eng.apply(staged)
        else:
            m = publish_snapshot(store, "r", v, fuse_weights(new, plan), None, cfg)
            _, tensors = fetch_snapshot(store, v, 2)
            eng.load_weights(tensors, version=v)
        state, published = m.state, new
        assert eng.digest() == weights_digest(published, plan), f"v{v}"
        assert eng.version == v


def test_spec_round_trips_through_the_model_description() -> None:
    from aurora_tools.synthetic.shapes import QWEN3_TINY, shape_for_params
    from aurora_tools.synthetic.workload import SyntheticSpec

    s = SyntheticSpec(QWEN3_TINY, seed=2, gen_s_per_prompt=0.25, tokens=7)
    assert SyntheticSpec.from_json(s.to_json()) == s
    assert s.base_state.startswith("sha256:") and len(s.base_state) == 71
    assert 0.95e9 < shape_for_params(1e9).params < 1.05e9


# ---------------------------------------------------------------------------
# one small run of the whole harness (real processes, loopback proxies)


@pytest.mark.slow
@pytest.mark.long
def test_small_run_end_to_end(tmp_path: object) -> None:
    from aurora_tools.bench.wan import add_arguments, run_benchmark

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(
        [
            "--experiments",
            "modes",
            "--modes",
            "ideal,delta,full",
            "--actors",
            "1",
            "--params",
            "2e6",
            "--net",
            "loopback",
            "--measure",
            "1",
            "--json",
            "--digests",
            "--gen-window-s",
            "0.3",
            "--workdir",
            f"{tmp_path}/work",
            "--config-timeout",
            "120",
        ]
    )
    out = run_benchmark(args, lambda m: None)
    json.dumps(out)  # one JSON object
    assert out["failed"] == 0, [c["error"] for c in out["configs"]]
    keys = {
        "mode",
        "link_gbps",
        "rtt_ms",
        "streams",
        "actors",
        "relay",
        "step_s",
        "transfer_s",
        "throughput_vs_ideal",
        "cross_region_bytes_per_version",
    }
    for c in out["configs"]:
        assert keys <= c.keys()
    by = {c["mode"]: c for c in out["configs"]}
    assert set(by) == {"ideal", "delta", "full"}
    assert out["delta_vs_ideal"] is not None and out["full_vs_ideal"] is not None
    assert by["delta"]["version_bytes"] < by["full"]["version_bytes"]
    assert by["delta"]["object_bytes_per_version"] < by["full"]["object_bytes_per_version"]
    assert by["delta"]["digests_match"] and by["full"]["digests_match"]


@pytest.mark.slow
@pytest.mark.long
def test_two_region_run_counts_each_boundary(tmp_path: object) -> None:
    """Two Actor regions, each behind its own Relay: each boundary carries about one delta per version."""
    from aurora_tools.bench.wan import add_arguments, run_benchmark

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(
        [
            "--experiments",
            "regions",
            "--modes",
            "delta",
            "--params",
            "2e6",
            "--net",
            "loopback",
            "--measure",
            "1",
            "--json",
            "--gen-window-s",
            "0.3",
            "--workdir",
            f"{tmp_path}/work",
            "--config-timeout",
            "180",
            "--plot",
            f"{tmp_path}/img",
        ]
    )
    out = run_benchmark(args, lambda m: None)
    assert out["failed"] == 0, [c["error"] for c in out["configs"]]
    by = {c["relay"]: c for c in out["configs"]}
    relayed, direct = by[True], by[False]
    assert relayed["regions"] == direct["regions"] == ["1G/20ms", "0.25G/60ms"]
    assert set(relayed["cross_over_version_by_region"]) == {"r1", "r2"}
    # Behind a Relay a region pays for a version about once (manifests on top); without one, once per Actor.
    assert all(0.9 < x < 1.5 for x in relayed["cross_over_version_by_region"].values()), relayed["cross_over_version_by_region"]
    assert all(1.8 < x < 2.7 for x in direct["cross_over_version_by_region"].values()), direct["cross_over_version_by_region"]
    assert relayed["staged_from_mirror"] == 1.0
    assert [p.rsplit("/", 1)[-1] for p in out["plots"]] == ["wan_regions.png"]
