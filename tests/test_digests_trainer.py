"""The Trainer hashes weights only where something binds to them, and its steps do not wait for snapshots.

A tiny workload (:class:`trainer_fixtures.TinyWorkload`) runs the real loop;
an Actor that only settles closes the batches. Version 0, snapshot versions
(every ``snapshot_every``) and checkpoint versions (every
``checkpoint_every``) carry a tree digest (FORMAT.md §4.1) in their delta and
in the run's records; the others carry none. A snapshot is uploaded on a
thread after its delta is committed; retention waits for its commit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from trainer_fixtures import TinyWorkload, settling_actor

import aurora_store.api.publisher as publisher_mod
import aurora_store.apply.sink as sink_mod
import workers.trainer.versions as versions_mod
from aurora_store.apply.sink import TREE_PREFIX, tree_weights_digest
from aurora_store.codec.extract import plan_of
from aurora_store.coordination.records import RunRecords
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.lineage.binding import WEIGHTS_DIGEST_FIELD
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import scan_versions
from aurora_store.testing.wait import wait_until
from workers.common import Endpoints
from workers.trainer import TrainerConfig
from workers.trainer.trainer import Trainer

pytestmark = pytest.mark.server


def _trainer(tmp_path: Path, redis_url: str, run: str, work: TinyWorkload, **over: Any) -> Trainer:
    cfg = TrainerConfig(
        **{
            "steps": 5,
            "batch": 2,
            "group": 2,
            "checkpoint_every": 3,
            "eval_every": 0,
            "snapshot_every": 2,
            "keep_snapshots": 0,
            "poll_s": 0.01,
            **over,
        }
    )
    return Trainer(Endpoints(f"file://{tmp_path}/run", redis_url, run), cfg, steps=work, weights=work)


def _delta_digest(tr: Trainer, v: int, kind: str = "delta") -> str | None:
    d = read_manifest(tr.raw_store, kind, v).extra.get(WEIGHTS_DIGEST_FIELD)
    return None if d is None else str(d)


def test_only_version_0_snapshot_and_checkpoint_versions_are_hashed(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hashed: list[int] = []
    real = publisher_mod.tree_weights_digest

    def counted(*a: Any, **k: Any) -> str:
        hashed.append(1)
        return real(*a, **k)

    def serial(*a: Any, **k: Any) -> str:
        raise AssertionError("the Trainer computed the serial sha256 digest")

    monkeypatch.setattr(publisher_mod, "tree_weights_digest", counted)
    monkeypatch.setattr(sink_mod, "weights_digest", serial)
    monkeypatch.setattr(versions_mod, "weights_digest", serial)
    monkeypatch.setattr(versions_mod, "tree_weights_digest", serial)  # the Publisher's digest is reused, never recomputed
    work = TinyWorkload()
    tr = _trainer(tmp_path, redis_server.url, run_name, work)
    with settling_actor(redis_client, run_name):
        logs = tr.run()
    plan = plan_of(work.current, tied=False)
    bound = {0, 2, 3, 4}  # version 0, snapshots at 2 and 4, a checkpoint at 3
    assert len(hashed) == len(bound)
    want = {v: tree_weights_digest(work.made[v], plan) for v in bound}
    assert all(d.startswith(TREE_PREFIX) for d in want.values())
    assert RunRecords(redis_client, run_name).digests()[0] == want
    assert tr.versions.digests == want and tr.versions.digest_of(3) == want[3]
    for v in (1, 5):
        assert _delta_digest(tr, v) is None
    for v in (2, 3, 4):
        assert _delta_digest(tr, v) == want[v]
    for v in (2, 4):
        assert _delta_digest(tr, v, "snapshot") == want[v]  # the snapshot's digest, bound by its delta
    assert sorted(scan_versions(tr.store).snapshots) == [0, 2, 4]
    # The chain's states are recorded at every version, digest or not.
    rec = RunRecords(redis_client, run_name)
    assert all(rec.expected_state(v) == materialize(tr.store, v)[1] for v in range(6))
    # The step's time split for `aurora bench trainer`: hashing only at the bound versions.
    assert [lg.digest_s > 0 for lg in logs] == [lg.version in bound for lg in logs]
    assert all(lg.publish_s >= 0 and lg.publish_s + lg.digest_s <= lg.extract_publish_s for lg in logs)


def test_a_step_does_not_wait_for_its_snapshot_and_retention_waits_for_the_commit(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str
) -> None:
    import threading

    work = TinyWorkload()
    tr = _trainer(tmp_path, redis_server.url, run_name, work, steps=6, checkpoint_every=0, keep_snapshots=1)
    release, holding = threading.Event(), threading.Event()
    held = version_dir("snapshot", 2) + "/"
    real_put = tr.raw_store.put

    def put(key: str, data: bytes, mode: str = "create") -> None:
        if key.startswith(held):
            holding.set()
            assert release.wait(60), "the test never released the snapshot"
        real_put(key, data, mode)

    tr.raw_store.put = put  # type: ignore[method-assign]
    store = tr.raw_store
    try:
        with settling_actor(redis_client, run_name):
            tr.setup()
            tr.train_step(0)
            tr.train_step(1)  # v2: its snapshot's shards are held, the step returned
            wait_until(holding.is_set, "the snapshot's upload to start", timeout=30)
            assert store.exists(manifest_key("delta", 2)) and not store.exists(manifest_key("snapshot", 2))
            assert _delta_digest(tr, 2) is not None
            tr.train_step(2)  # v3 goes on meanwhile; nothing is retained away before the snapshot at 2 commits
            assert store.exists(manifest_key("snapshot", 0)) and store.exists(manifest_key("delta", 1))
            release.set()
            assert tr.versions.publisher is not None and tr.versions.publisher.wait_snapshots(timeout=30)
            assert _delta_digest(tr, 2, "snapshot") == _delta_digest(tr, 2)
            tr.train_step(3)  # the step after the commit runs retention: keep the newest snapshot and what follows
            assert not store.exists(manifest_key("snapshot", 0)) and not store.exists(manifest_key("delta", 1))
            assert store.exists(manifest_key("snapshot", 2)) and store.exists(manifest_key("delta", 2))
    finally:
        release.set()
        tr.stop.set()
