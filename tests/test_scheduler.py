"""The scheduler's pure pieces (paper Algorithm 1), no server needed."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aurora_store.coordination.scheduler import (
    ActorView,
    SchedulerConfig,
    decay,
    eligibility,
    ema,
    lease_ms,
    plan_step,
    split,
)
from aurora_store.errors import ConfigError

# Realistic throughput estimates: from the decay floor up to far beyond any GPU.
taus_st = st.dictionaries(
    st.text("abcdefgh", min_size=1, max_size=4),
    st.floats(min_value=1e-6, max_value=1e9, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=12,
)


# ---------------------------------------------------------------------------
# split


@given(taus=taus_st, total=st.integers(0, 100_000))
def test_split_sums_to_batch_exactly(taus: dict[str, float], total: int) -> None:
    parts = split(total, taus)
    assert set(parts) == set(taus)
    assert sum(parts.values()) == total
    assert all(n >= 0 for n in parts.values())


@given(taus=taus_st, total=st.integers(0, 100_000))
def test_split_is_proportional_within_one(taus: dict[str, float], total: int) -> None:
    parts = split(total, taus)
    T = math.fsum(taus.values())
    for a, t in taus.items():
        exact = total * t / T
        # floor, plus at most one of the leftovers
        assert math.floor(exact) - 1e-9 <= parts[a] <= math.floor(exact) + 1 + 1e-9
        assert abs(parts[a] - exact) < 1 + 1e-9


@given(taus=taus_st, total=st.integers(0, 10_000))
def test_split_does_not_depend_on_insertion_order(taus: dict[str, float], total: int) -> None:
    backwards = dict(reversed(list(taus.items())))
    assert split(total, taus) == split(total, backwards)


def test_split_paper_example() -> None:
    # §5.3: an H100 at 5,000 tokens/s and an A100 at 2,500 split 300 into 200 and 100.
    assert split(300, {"h100": 5000.0, "a100": 2500.0}) == {"h100": 200, "a100": 100}


def test_split_largest_remainder_with_name_tie_break() -> None:
    # Equal remainders: the leftovers go to the names that sort first.
    assert split(1, {"c": 1.0, "a": 1.0, "b": 1.0}) == {"a": 1, "b": 0, "c": 0}
    assert split(2, {"c": 1.0, "a": 1.0, "b": 1.0}) == {"a": 1, "b": 1, "c": 0}
    assert split(4, {"c": 1.0, "a": 1.0, "b": 1.0}) == {"a": 2, "b": 1, "c": 1}
    # The largest remainder wins over the name: 2 * (1/5, 4/5) = 0.4, 1.6 -> floors 0, 1
    assert split(2, {"a": 1.0, "z": 4.0}) == {"a": 0, "z": 2}
    # 7 * (1/6, 2/6, 3/6) = 1.1667, 2.333, 3.5: floors 1, 2, 3; the one left goes to the .5
    assert split(7, {"a": 1.0, "b": 2.0, "c": 3.0}) == {"a": 1, "b": 2, "c": 4}
    # and the same call always gives the same answer
    assert all(split(7, {"x": 1.0, "y": 1.0, "z": 1.0}) == {"x": 3, "y": 2, "z": 2} for _ in range(5))


def test_split_errors() -> None:
    assert split(0, {}) == {}
    with pytest.raises(ValueError):
        split(1, {})
    with pytest.raises(ValueError):
        split(-1, {"a": 1.0})
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            split(10, {"a": 1.0, "b": bad})


# ---------------------------------------------------------------------------
# eligibility


def _v(actor: str, active: int | None, staged: int | None = None, tau: float = 1.0, alive: bool = True) -> ActorView:
    return ActorView(actor=actor, active=active, staged=staged, tau=tau, alive=alive)


def test_eligibility_classes() -> None:
    v = 10
    actors = [
        _v("on_v", 10),
        _v("on_v_staged_next", 10, staged=11),
        _v("prev_staged", 9, staged=10),
        _v("prev_staged_ahead", 9, staged=11),
        _v("prev_unstaged", 9, staged=None),
        _v("prev_staged_old", 9, staged=9),
        _v("two_behind", 8, staged=9),
        _v("two_behind_staged_v", 8, staged=10),  # would need two activations
        _v("dead_on_v", 10, alive=False),
        _v("bootstrapping", None, staged=10),
        _v("ahead", 11),
    ]
    el = eligibility(actors, v)
    assert el.version == v
    assert el.ready == ("on_v", "on_v_staged_next")
    assert el.needs_commit == ("prev_staged", "prev_staged_ahead")
    assert set(el.excluded) == {
        "prev_unstaged",
        "prev_staged_old",
        "two_behind",
        "two_behind_staged_v",
        "dead_on_v",
        "bootstrapping",
        "ahead",
    }
    assert el.eligible == el.ready + el.needs_commit
    # every Actor is in exactly one class
    everyone = el.ready + el.needs_commit + el.excluded
    assert sorted(everyone) == sorted(a.actor for a in actors)


def test_eligibility_is_sorted_and_order_independent() -> None:
    actors = [_v("b", 5), _v("a", 5), _v("c", 4, staged=5)]
    assert eligibility(actors, 5) == eligibility(list(reversed(actors)), 5)
    assert eligibility(actors, 5).ready == ("a", "b")


# ---------------------------------------------------------------------------
# plan_step, ema, decay, lease_ms


def test_plan_step_splits_among_eligible_and_decays_excluded() -> None:
    cfg = SchedulerConfig(alpha=0.5)
    actors = [
        _v("h100", 7, tau=5000.0),
        _v("a100", 6, staged=7, tau=2500.0),
        _v("old", 5, tau=4000.0),
        _v("dead", 7, tau=800.0, alive=False),
    ]
    plan = plan_step(actors, 7, 300, cfg)
    assert plan.version == 7
    assert plan.quotas == {"h100": 200, "a100": 100}
    assert sum(plan.quotas.values()) == 300
    assert plan.taus["h100"] == 5000.0 and plan.taus["a100"] == 2500.0
    assert plan.taus["old"] == pytest.approx(2000.0)
    assert plan.taus["dead"] == pytest.approx(400.0)
    assert plan.eligibility.needs_commit == ("a100",)


def test_plan_step_with_nobody_eligible_assigns_nothing() -> None:
    plan = plan_step([_v("x", 1, tau=10.0)], 5, 64, SchedulerConfig())
    assert plan.quotas == {}
    assert plan.taus["x"] == pytest.approx(5.0)


def test_plan_step_repeated_exclusion_decays_to_floor() -> None:
    cfg = SchedulerConfig(alpha=0.1, min_tau=1e-3)
    tau = 1000.0
    for _ in range(20):
        tau = plan_step([_v("slow", 0, tau=tau), _v("fast", 50, tau=1.0)], 50, 10, cfg).taus["slow"]
    assert tau == pytest.approx(1e-3)


def test_decay() -> None:
    assert decay(100.0, 0.5) == 50.0
    assert decay(1e-7, 0.5, floor=1e-6) == 1e-6
    assert decay(10.0, 1.0) == 10.0


def test_ema() -> None:
    assert ema(100.0, 200.0, 0.3) == pytest.approx(130.0)
    assert ema(100.0, 100.0, 0.3) == pytest.approx(100.0)
    assert ema(100.0, 0.0, 1.0) == 0.0
    # converges to a steady observation
    tau = 0.0
    for _ in range(100):
        tau = ema(tau, 42.0, 0.3)
    assert tau == pytest.approx(42.0)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            ema(1.0, bad, 0.3)


def test_lease_ms_is_k_times_median_with_clamps() -> None:
    cfg = SchedulerConfig(lease_k=2.5, min_lease_ms=2_000, max_lease_ms=100_000)
    assert lease_ms([], cfg) == 2_000
    assert lease_ms([4_000.0], cfg) == 10_000
    assert lease_ms([1_000.0, 4_000.0, 9_000.0], cfg) == 10_000  # odd: the middle one
    assert lease_ms([9_000.0, 1_000.0, 3_000.0, 5_000.0], cfg) == 10_000  # even: mean of the middle two
    assert lease_ms([100.0, 200.0, 300.0], cfg) == 2_000  # floor
    assert lease_ms([1e6, 1e6], cfg) == 100_000  # ceiling
    # one outlier moves the median by nothing
    assert lease_ms([4_000.0] * 9 + [1e9], cfg) == 10_000


@given(xs=st.lists(st.floats(0, 1e7, allow_nan=False), min_size=1, max_size=50))
def test_lease_ms_stays_within_clamps(xs: list[float]) -> None:
    cfg = SchedulerConfig()
    ms = lease_ms(xs, cfg)
    assert cfg.min_lease_ms <= ms <= cfg.max_lease_ms


@pytest.mark.parametrize(
    "kw",
    [
        {"alpha": 0.0},
        {"alpha": 1.5},
        {"beta": 0.0},
        {"beta": -0.1},
        {"lease_k": 0.0},
        {"min_lease_ms": 0},
        {"min_lease_ms": 10, "max_lease_ms": 5},
        {"initial_tau": 0.0},
        {"min_tau": -1.0},
    ],
)
def test_config_validation(kw: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        SchedulerConfig(**kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError):  # ConfigError is also a ValueError
        SchedulerConfig(**kw)  # type: ignore[arg-type]


def test_config_defaults_are_the_papers() -> None:
    cfg = SchedulerConfig()
    assert 2.0 <= cfg.lease_k <= 3.0
    assert 0 < cfg.alpha <= 1 and 0 < cfg.beta <= 1


def test_split_min_each_gives_every_part_a_probe_then_splits_the_rest() -> None:
    assert split(10, {"fast": 1000.0, "decayed": 1e-6}) == {"fast": 10, "decayed": 0}
    assert split(10, {"fast": 1000.0, "decayed": 1e-6}, min_each=1) == {"fast": 9, "decayed": 1}
    assert split(7, {"a": 1.0, "b": 2.0, "c": 3.0}, min_each=2) == {"a": 2, "b": 2, "c": 3}
    # Not enough for everyone: plain proportional split, still summing to the total.
    assert split(2, {"a": 1.0, "b": 1.0, "c": 5.0}, min_each=1) == {"a": 0, "b": 0, "c": 2}
    with pytest.raises(ValueError, match="min_each"):
        split(4, {"a": 1.0}, min_each=-1)


def test_plan_step_decayed_actor_gets_a_probe_prompt_when_eligible_again() -> None:
    # An Actor excluded for a while has a tiny estimate; once it is back on the
    # version it must get work, or it is never measured again and never recovers.
    cfg = SchedulerConfig(alpha=0.1)
    tau = 50.0
    for _ in range(6):
        tau = plan_step([_v("back", 0, tau=tau), _v("fast", 9, tau=50.0)], 9, 16, cfg).taus["back"]
    plan = plan_step([_v("back", 9, tau=tau), _v("fast", 9, tau=50.0)], 9, 16, cfg)
    assert plan.quotas == {"back": 1, "fast": 15}
    assert plan_step([_v("back", 9, tau=tau), _v("fast", 9, tau=50.0)], 9, 16, SchedulerConfig(min_prompts=0)).quotas["back"] == 0
    with pytest.raises(ConfigError):
        SchedulerConfig(min_prompts=-1)
