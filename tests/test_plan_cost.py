"""plan_chain by bytes: replay or snapshot, whichever fetches less, reading few manifests. Pure: no store."""

from __future__ import annotations

import pytest

from aurora_store.errors import ChainError
from aurora_store.lineage.plan import VersionIndex, plan_chain


class Costs:
    """Bytes per (kind, version); counts what a planner asked about (each ask is a manifest read)."""

    def __init__(self, delta: int, snapshot: int, missing: frozenset[tuple[str, int]] = frozenset()) -> None:
        self.delta, self.snapshot, self.missing = delta, snapshot, missing
        self.asked: list[tuple[str, int]] = []

    def __call__(self, kind: str, version: int) -> int | None:
        self.asked.append((kind, version))
        if (kind, version) in self.missing:
            return None
        return self.delta if kind == "delta" else self.snapshot


def _index(deltas: range, snapshots: set[int]) -> VersionIndex:
    return VersionIndex(frozenset(deltas), frozenset(snapshots))


def test_many_dense_deltas_lose_to_the_newest_snapshot() -> None:
    index = _index(range(1, 11), {0, 8})
    plan = plan_chain(index, 10, held=2, cost=Costs(delta=10, snapshot=50))
    assert (plan.snapshot, plan.deltas, plan.bytes) == (8, (9, 10), 70)  # replay would fetch 80


def test_small_deltas_are_replayed() -> None:
    index = _index(range(1, 11), {0, 8})
    plan = plan_chain(index, 10, held=2, cost=Costs(delta=5, snapshot=50))
    assert (plan.snapshot, plan.deltas, plan.bytes) == (None, tuple(range(3, 11)), 40)


def test_equal_bytes_favour_replay() -> None:
    index = _index(range(1, 5), {0, 3})
    plan = plan_chain(index, 4, held=1, cost=Costs(delta=10, snapshot=20))  # 30 either way
    assert plan.snapshot is None


def test_nothing_at_or_below_the_held_version_is_read() -> None:
    index = _index(range(1, 11), {0, 5, 8})
    costs = Costs(delta=10, snapshot=50)
    plan = plan_chain(index, 10, held=7, cost=costs)
    assert plan.snapshot is None and plan.deltas == (8, 9, 10)
    assert all(v > 7 for _, v in costs.asked)


def test_the_walk_stops_once_the_deltas_alone_cost_more_than_the_best_path() -> None:
    index = _index(range(1, 101), set(range(0, 101, 10)))
    costs = Costs(delta=100, snapshot=150)
    plan = plan_chain(index, 100, held=0, cost=costs)
    assert plan.snapshot == 100 and plan.deltas == () and plan.bytes == 150
    assert len(costs.asked) <= 4  # not a read per version of the run


def test_a_missing_delta_breaks_replay_and_a_snapshot_past_it_is_taken_however_dear() -> None:
    index = _index(range(1, 11), {0, 8})
    plan = plan_chain(index.without({("delta", 3)}), 10, held=1, cost=Costs(delta=1, snapshot=1000))
    assert plan.snapshot == 8 and plan.deltas == (9, 10)


def test_an_unreadable_manifest_counts_as_missing() -> None:
    index = _index(range(1, 11), {0, 8})
    plan = plan_chain(index, 10, held=1, cost=Costs(delta=1, snapshot=1000, missing=frozenset({("delta", 5)})))
    assert plan.snapshot == 8


def test_with_no_way_through_the_error_names_the_gap() -> None:
    index = _index(range(1, 11), {0, 8}).without({("delta", 3), ("snapshot", 8)})
    with pytest.raises(ChainError, match=r"delta\(s\) \[3\] missing after version 1"):
        plan_chain(index, 10, held=1, cost=Costs(delta=1, snapshot=1))


def test_without_a_cost_the_plan_is_as_before() -> None:
    index = _index(range(1, 11), {0, 8})
    assert plan_chain(index, 10, held=2) == plan_chain(index, 10, held=2)
    plan = plan_chain(index, 10, held=2)
    assert plan.snapshot is None and plan.bytes is None
    assert plan_chain(index, 10).snapshot == 8


def test_without_a_held_version_the_newest_usable_snapshot_is_priced() -> None:
    index = _index(range(1, 11), {0, 8})
    plan = plan_chain(index, 10, cost=Costs(delta=3, snapshot=50, missing=frozenset({("snapshot", 8)})))
    assert (plan.snapshot, plan.bytes) == (0, 50 + 30)
