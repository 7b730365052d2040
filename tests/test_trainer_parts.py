"""The Trainer as parts: the real loop, batches, publishing and records around a workload plugged in through Protocols.

A tiny workload (:class:`trainer_fixtures.TinyWorkload`) replaces the model;
an Actor that only settles closes the batches. What the run leaves in Redis
is read back through the records module, as every reader does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from trainer_fixtures import TinyWorkload, settling_actor

from aurora_store.apply.sink import tree_weights_digest, weights_digest
from aurora_store.codec.extract import plan_of
from aurora_store.coordination.records import RunRecords
from aurora_store.errors import FencedOut
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import scan_versions
from workers.common import Endpoints
from workers.trainer import TrainerConfig
from workers.trainer.trainer import Trainer
from workers.trainer.versions import VersionEvent

pytestmark = pytest.mark.server

STEPS = 3


def _trainer(tmp_path: Path, redis_url: str, run: str, work: TinyWorkload, events: list[VersionEvent]) -> Trainer:
    cfg = TrainerConfig(steps=STEPS, batch=2, group=2, checkpoint_every=0, eval_every=0, snapshot_every=0, poll_s=0.01)
    return Trainer(Endpoints(f"file://{tmp_path}/run", redis_url, run), cfg, steps=work, weights=work, on_version=events.append)


def test_a_workload_plugged_in_runs_the_real_loop_and_every_version_is_recorded(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str
) -> None:
    work, events = TinyWorkload(), []
    tr = _trainer(tmp_path, redis_server.url, run_name, work, events)
    with settling_actor(redis_client, run_name):
        logs = tr.run()
    assert [(lg.step, lg.version, lg.gen_version) for lg in logs] == [(0, 1, 0), (1, 2, 0), (2, 3, 1)]
    assert all(lg.changed == 1 and sum(lg.by_actor.values()) == 2 for lg in logs)
    plan = plan_of(work.current, tied=False)
    rec = RunRecords(redis_client, run_name)
    trainer_digests, _ = rec.digests()
    # Hashed only where something binds to the digest: here (no snapshots, no checkpoints) version 0 alone.
    assert trainer_digests == {0: tree_weights_digest(work.made[0], plan)}
    # Each step trained against the weights of the version its batch was generated on.
    assert [weights_digest(b, plan) for b in work.behaviours] == [weights_digest(work.made[lg.gen_version], plan) for lg in logs]
    index = scan_versions(tr.store)
    assert index.latest == STEPS and set(index.deltas) == {1, 2, 3}
    t = rec.trainer()
    assert (t.head, t.commit, t.status, t.epoch, t.step) == (STEPS, STEPS, "done", 1, STEPS - 1)
    for v in range(STEPS + 1):
        _, state = materialize(tr.store, v)
        assert rec.expected_state(v) == state == tr.states[v]
    assert [(e.version, e.kind) for e in events] == [(0, "snapshot"), (1, "delta"), (2, "delta"), (3, "delta")]
    assert all(e.started_ms <= e.recorded_ms for e in events)


def test_a_trainer_of_an_older_epoch_publishes_nothing_more(tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str) -> None:
    work, events = TinyWorkload(), []
    tr = _trainer(tmp_path, redis_server.url, run_name, work, events)
    tr.setup()
    RunRecords(redis_client, run_name).enter_epoch(tr.epoch + 1)  # a newer Trainer took the run
    work.train(work.rollouts({}), work.current)
    with pytest.raises(FencedOut):
        tr.versions.publish(1, work.weights(), tr.producer(0))
    with pytest.raises(FencedOut):
        tr.records.record_commit(0)
    assert scan_versions(tr.store).latest == 0 and RunRecords(redis_client, run_name).head() == 0
    tr.stop.set()


def test_a_step_source_without_a_weights_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="both a step source and a weights source"):
        Trainer(Endpoints(f"file://{tmp_path}/run", "redis://127.0.0.1:1/0", "r"), TrainerConfig(), steps=TinyWorkload())
