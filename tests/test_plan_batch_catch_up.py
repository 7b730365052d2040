"""A batch made while no Actor is within one version of it is split over those catching up (issue 25, item 7)."""

from __future__ import annotations

from aurora_store.coordination.scheduler import ActorView, SchedulerConfig
from workers.trainer.scheduling import CATCH_UP_VERSIONS, plan_batch


def _v(name: str, active: int | None, tau: float = 100.0, alive: bool = True) -> ActorView:
    return ActorView(name, active, None, tau, alive)


def test_nobody_close_splits_over_the_actors_catching_up() -> None:
    # Batch 3 is made on v2 right after v2 is published; both Actors are still applying v1 (on v0).
    plan = plan_batch([_v("a", 0, 300.0), _v("b", 0, 100.0)], 2, 32, SchedulerConfig(min_prompts=0))
    assert plan is not None
    assert plan.quotas == {"a": 24, "b": 8}
    assert sum(plan.quotas.values()) == 32
    assert set(plan.eligibility.eligible) == {"a", "b"}


def test_stale_dead_and_booting_actors_stay_out() -> None:
    views = [
        _v("stale", 5 - CATCH_UP_VERSIONS - 1, 100.0),
        _v("dead", 4, 100.0, alive=False),
        _v("booting", None, 100.0),
    ]
    plan = plan_batch(views, 5, 10, SchedulerConfig(min_prompts=0))
    assert plan is not None
    assert plan.quotas == {}
    views.append(_v("catching", 5 - CATCH_UP_VERSIONS, 100.0))
    plan = plan_batch(views, 5, 10, SchedulerConfig(min_prompts=0))
    assert plan is not None
    assert plan.quotas == {"catching": 10}


def test_when_one_actor_is_close_the_others_catching_up_are_not_lifted() -> None:
    plan = plan_batch([_v("near", 1), _v("behind", 0)], 2, 12, SchedulerConfig(min_prompts=0))
    assert plan is not None
    assert plan.quotas == {"near": 12}
    assert "behind" in plan.eligibility.excluded


def test_nobody_in_the_window_leaves_the_batch_in_the_pool() -> None:
    plan = plan_batch([_v("stale", 0), _v("dead", 5, alive=False)], 5, 8, SchedulerConfig(min_prompts=0))
    assert plan is not None
    assert plan.quotas == {}
