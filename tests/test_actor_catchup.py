"""An Actor that is behind, or whose chain is broken, or that meets a bad version.

The real Actor (torch engine, a tiny Qwen3), a ``file://`` origin and a real
Redis; the Trainer's side is written by hand (:class:`actor_fixtures.TinyRun`).
The stager is driven directly (``Stager.stage_once``) on a
:class:`ManualClock`, so back-offs pass when the test says so, and the
origin counts every request that reaches it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from actor_fixtures import Counting, TinyRun

from aurora_store.coordination.status import collect_status, render
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.lineage.gc import run_gc
from aurora_store.storage import Store, open_store
from aurora_store.testing.clock import ManualClock
from workers.actor import Actor, ActorConfig
from workers.actor.quarantine import StagedFull
from workers.common import Endpoints

pytestmark = pytest.mark.server


@pytest.fixture
def origin(tmp_path: Path) -> Store:
    return open_store(f"file://{tmp_path}/origin")


@pytest.fixture
def trainer(origin: Store, redis_server: Any, redis_client: Any, run_name: str) -> Any:
    run = TinyRun(origin, redis_server.url, run_name)
    run.start()
    yield run
    run.close()


def _bootstrapped(trainer: TinyRun, origin: Store, clock: ManualClock) -> tuple[Actor, Counting]:
    counting = Counting(open_store(origin.url))
    a = Actor.from_endpoints(Endpoints(origin.url, trainer.redis_url, trainer.run), ActorConfig(actor_id="a"), clock, origin=counting)
    a.bootstrap()
    assert a.active == trainer.head
    counting.gets.clear()  # count what staging reads, from here on
    counting.lists = 0
    return a, counting


def _activate_to(a: Actor, trainer: TinyRun, v: int) -> None:
    """What the main loop does at a safe point once a step needs ``v``."""
    trainer.open_step(100 + v, v, prompts=2)
    a.safepoint.activate()
    assert a.active == v
    assert a.engine.digest() == trainer.digest(v), "the Actor's weights differ from the Trainer's"


def test_a_fresh_actor_starts_at_the_oldest_version_an_open_step_still_needs(trainer: TinyRun, origin: Store) -> None:
    # Step 7 was generated on v1 and its only Actor died; the run is at v3 since. An Actor
    # that started at v3 could never go back to serve it: the Trainer would wait for ever.
    trainer.step(3)
    prompts = trainer.open_step(7, 1, prompts=2)
    a = Actor.from_endpoints(Endpoints(origin.url, trainer.redis_url, trainer.run), ActorConfig(actor_id="late"), clock=ManualClock())
    a.bootstrap()
    assert a.active == 1
    assert a.engine.digest() == trainer.digest(1)
    status, leases = a.ctx.ledger.claim("late", 7, 4)
    assert status == "ok" and sorted(lease.prompt for lease in leases) == sorted(prompts)
    # Nothing left to serve on v1: the next fresh Actor starts at the newest version.
    for lease in leases:
        assert a.ctx.ledger.settle("late", lease, 1, trainer.states[1], b"{}").reason == "accepted"
    b = Actor.from_endpoints(Endpoints(origin.url, trainer.redis_url, trainer.run), ActorConfig(actor_id="later"), clock=ManualClock())
    b.bootstrap()
    assert b.active == trainer.head == 3


def test_a_needed_version_the_store_no_longer_reaches_leaves_the_newest_for_bootstrap(trainer: TinyRun, origin: Store) -> None:
    trainer.step(3)
    trainer.snapshot(3)
    trainer.open_step(7, 1, prompts=2)
    run_gc(origin, keep_snapshots=1, apply=True, min_orphan_age_s=0, say=lambda *_: None)
    assert not origin.exists(manifest_key("delta", 1))
    a = Actor.from_endpoints(Endpoints(origin.url, trainer.redis_url, trainer.run), ActorConfig(actor_id="late"), clock=ManualClock())
    a.bootstrap()
    assert a.active == 3


def test_far_behind_an_actor_takes_the_snapshot_when_it_fetches_fewer_bytes(trainer: TinyRun, origin: Store) -> None:
    a, counting = _bootstrapped(trainer, origin, ManualClock())
    trainer.step(6, density=0.3)  # dense deltas: each a good part of a snapshot
    trainer.snapshot(5)
    trainer.step(1, density=0.3)
    a.stager.stage_once()
    full = a.staged[0].item
    assert isinstance(full, StagedFull) and (full.version, full.snapshot) == (7, 5)
    assert len(a.staged) == 1 and a.staged_version == 7
    # The replayed path's deltas were weighed (manifests), never downloaded.
    assert all(counting.segments_read("delta", v) == [] for v in range(1, 6))
    replay = sum(trainer.manifests[("delta", v)].total_bytes for v in range(1, 8))
    assert full.nbytes < replay
    _activate_to(a, trainer, 7)
    assert a.stats.rebootstraps == 1


def test_behind_by_small_deltas_an_actor_replays_them(trainer: TinyRun, origin: Store) -> None:
    a, counting = _bootstrapped(trainer, origin, ManualClock())
    trainer.step(3, density=0.002)
    trainer.snapshot(3)
    trainer.step(1, density=0.002)
    a.stager.stage_once()
    assert [type(e.item).__name__ for e in a.staged] == ["PreparedDelta"] * 4  # deltas (prepared by the torch engine)
    assert counting.segments_read("snapshot", 3) == []
    # The manifests read to weigh the replay served the replay too.
    assert sum(k == manifest_key("delta", 2) for k in counting.gets) == 1
    _activate_to(a, trainer, 4)
    assert a.stats.rebootstraps == 0


def test_after_gc_removed_the_next_delta_the_actor_rebootstraps_from_the_newest_snapshot(trainer: TinyRun, origin: Store) -> None:
    a, _ = _bootstrapped(trainer, origin, ManualClock())
    trainer.step(3)
    trainer.snapshot(3)
    trainer.step(2)
    run_gc(origin, keep_snapshots=1, apply=True, min_orphan_age_s=0, say=lambda *_: None)
    assert not origin.exists(manifest_key("delta", 1))
    a.stager.stage_once()
    full = a.staged[0].item
    assert isinstance(full, StagedFull) and (full.version, full.snapshot) == (5, 3)
    _activate_to(a, trainer, 5)


def test_with_no_way_through_the_actor_looks_again_only_after_a_back_off(
    trainer: TinyRun, origin: Store, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    a, counting = _bootstrapped(trainer, origin, clock)
    trainer.step(3)
    origin.fs.rm(f"{origin.root}/{manifest_key('delta', 2)}")  # lost, and no snapshot after it
    with caplog.at_level(logging.WARNING, logger="aurora.actor"):
        a.stager.stage_once()
        assert a.staged_version == 1
        reads, lists = len(counting.gets), counting.lists
        for _ in range(20):  # the stager wakes twice a second
            a.stager.stage_once()
        assert (len(counting.gets), counting.lists) == (reads, lists), "a stuck Actor must not poll the store"
    assert sum("stuck at v1" in r.getMessage() for r in caplog.records) == 1
    trainer.snapshot(3)  # the Trainer (or an operator) publishes a way through
    clock.advance(a.cfg.quarantine.max_s)
    a.stager.stage_once()
    full = a.staged[-1].item
    assert isinstance(full, StagedFull) and full.version == 3
    _activate_to(a, trainer, 3)


def test_a_corrupt_version_is_quarantined_with_back_off_reported_and_staged_once_repaired(
    trainer: TinyRun, origin: Store, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    a, counting = _bootstrapped(trainer, origin, clock)
    trainer.step(2)
    seg = f"{version_dir('delta', 1)}/{trainer.manifests[('delta', 1)].segments[0].key}"
    good = origin.get(seg)
    origin.put(seg, good[:-1] + bytes([good[-1] ^ 0xFF]), mode="overwrite")

    def attempts() -> int:
        return sum(k == seg for k in counting.gets)

    with caplog.at_level(logging.DEBUG, logger="aurora.actor"):
        a.stager.stage_once()
        assert a.staged_version == 0 and attempts() == 1
        for _ in range(20):
            a.stager.stage_once()
        assert attempts() == 1, "a quarantined version must not be fetched on every loop"
        a.membership.heartbeat()
        assert trainer.redis.hget(trainer.keys.actor("a"), "quarantined") == b"[1]"
        assert "quarantined: v1 (a)" in render(collect_status(trainer.redis, trainer.run))  # what `aurora status` shows
        clock.advance(a.cfg.quarantine.initial_s)  # the first back-off is over
        a.stager.stage_once()
        assert attempts() == 2 and a.staged_version == 0
        clock.advance(a.cfg.quarantine.initial_s)  # not yet: the second wait is longer
        a.stager.stage_once()
        assert attempts() == 2
        origin.put(seg, good, mode="overwrite")  # repaired at origin
        clock.advance(2 * a.cfg.quarantine.initial_s)
        a.stager.stage_once()
    assert attempts() == 3 and a.staged_version == 2
    quarantined = [r for r in caplog.records if "quarantined" in r.getMessage() and r.levelno >= logging.ERROR]
    assert len(quarantined) == 1, [r.getMessage() for r in quarantined]
    assert any("valid again" in r.getMessage() for r in caplog.records)
    a.membership.heartbeat()
    assert trainer.redis.hget(trainer.keys.actor("a"), "quarantined") == b"[]"
    _activate_to(a, trainer, 2)


def test_staged_data_is_bounded(trainer: TinyRun, origin: Store) -> None:
    a = Actor.from_endpoints(
        Endpoints(origin.url, trainer.redis_url, trainer.run), ActorConfig(actor_id="a", max_staged_bytes=1), clock=ManualClock()
    )
    a.bootstrap()
    trainer.step(4, density=0.02)
    a.stager.stage_once()
    assert a.staged_version == 1 and len(a.staged) == 1, "past the bound the stager fetches no further (one version always fits)"
    a.stager.stage_once()
    assert a.staged_version == 1
    _activate_to(a, trainer, 1)  # activation frees the room
    a.stager.stage_once()
    assert a.staged_version == 2
