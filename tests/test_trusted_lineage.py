"""Trusted facts come from trusted places; memory bounded by what exists (issue 24, holes 2-5).

Someone who can write objects into the bucket (or run a mirror) plants
manifests under free names: far-future snapshots, the next version, a
snapshot with the true ``state`` copied in. None of them may move the
retention floor, stop a fresh Actor, be activated from a mirror, be recorded
by Redis-commit mode, or make a reader's memory grow with the number in its
name. Real stores (memory, ``file://``), a real Redis where one is needed,
and the real command line in a subprocess under an address-space limit.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from trainer_fixtures import FakeTrainer

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import extract, fuse_weights, plan_of
from aurora_store.coordination.commit import RedisCommitLog, prepare_commit
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.records import record_expected_state
from aurora_store.errors import AuroraError, FencedOut
from aurora_store.format.manifest import manifest_key
from aurora_store.lineage.gc import retain
from aurora_store.lineage.plan import VersionIndex, plan_chain, scan_versions
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.lineage.report import gap_ranges, read_lineage
from aurora_store.lineage.trusted import chain_of, committed_versions, fact_of
from aurora_store.storage import Store, open_store
from aurora_store.testing.clock import ManualClock
from aurora_tools.cli.main import main
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

CFG = PublishConfig(streams=2, segment_bytes=4096)
FAR = (9999999998, 9999999999)


def _plant_empty_snapshot(store: Store, v: int) -> None:
    """An empty, self-consistent snapshot manifest at ``v``: what anyone with PutObject can write."""
    publish_snapshot(store, "t", v, {}, None, CFG)


@pytest.fixture
def mem() -> Store:
    return open_store(f"memory://trusted-{uuid.uuid4().hex}/run")


def _versions(store: Store) -> VersionIndex:
    return scan_versions(store)


# -- the chain rule, pure ---------------------------------------------------------------------


def test_far_future_plants_are_named_and_never_count(mem: Store) -> None:
    run = FakeTrainer(mem, config=CFG)
    run.steps(4)
    run.snapshot(3)
    for v in FAR:
        _plant_empty_snapshot(mem, v)
    c = committed_versions(mem)
    assert c.index.deltas == {1, 2, 3, 4} and c.index.snapshots == {0, 3} and (c.root, c.head) == (0, 4)
    assert [(k, v) for k, v, _ in c.ignored] == [("snapshot", v) for v in FAR]
    assert "delta 5 is missing" in c.ignored[0][2]
    lin = read_lineage(mem)
    assert [r.version for r in lin.rows] == [0, 1, 2, 3, 3, 4] and not lin.problems
    assert [(k, v) for k, v, _ in lin.ignored] == [("snapshot", v) for v in FAR] and lin.gaps == [[5, FAR[0] - 1]]
    # With the Trainer's head as the ceiling, the plants are not even read.
    c = committed_versions(mem, ceiling=4)
    assert c.head == 4 and all("above the run's head 4" in why for _, _, why in c.ignored)


def test_root_without_version_0_is_a_bound_snapshot_or_the_oldest_delta(mem: Store) -> None:
    run = FakeTrainer(mem, config=CFG)
    run.steps(5)
    run.snapshot(2)
    facts = {(k, v): fact_of(m) for (k, v), m in run.manifests.items() if (k, v) != ("snapshot", 0)}
    c = chain_of(facts)
    assert c.root == 1 and c.index.deltas == {1, 2, 3, 4, 5} and c.index.snapshots == {2}
    facts = {kv: f for kv, f in facts.items() if kv != ("delta", 1)}  # retention collected v0 and v1
    c = chain_of(facts)
    assert c.root == 2 and c.index.snapshots == {2} and c.index.deltas == {2, 3, 4, 5}
    # A collection cut short (an older release deleted deltas first): version 0 left, delta 1 gone.
    facts[("snapshot", 0)] = fact_of(run.manifests[("snapshot", 0)])
    c = chain_of(facts)
    assert c.root == 2 and c.index.deltas == {2, 3, 4, 5} and [(k, v) for k, v, _ in c.ignored] == [("snapshot", 0)]


def test_a_snapshot_only_run_counts_its_snapshots(mem: Store) -> None:
    w = make_weights(QWEN3_TINY, seed=1)
    plan = plan_of(w, tied=False)
    for v in range(3):
        publish_snapshot(mem, "t", v, fuse_weights(w, plan), None, CFG)
    c = committed_versions(mem)
    assert c.snapshot_only and c.index.snapshots == {0, 1, 2} and not c.ignored


def test_gaps_are_ranges_and_plans_never_walk_version_numbers() -> None:
    assert gap_ranges([0, 1, 2, 9999999999]) == [[3, 9999999998]]
    assert gap_ranges([]) == [] and gap_ranges([5]) == []
    index = VersionIndex(frozenset({1, 2}), frozenset({0, 9999999999}))
    t0 = time.perf_counter()
    with pytest.raises(AuroraError):
        plan_chain(index.without({("snapshot", 9999999999)}), 9999999999)
    with pytest.raises(AuroraError):
        plan_chain(VersionIndex(frozenset({9999999999}), frozenset({0})), 9999999999, held=2)
    assert time.perf_counter() - t0 < 1.0


# -- hole 3: planted far-future snapshots and retention -------------------------------------------


def test_planted_far_future_snapshots_do_not_move_the_floor(mem: Store) -> None:
    run = FakeTrainer(mem, config=CFG)
    run.steps(4)
    for v in FAR:
        _plant_empty_snapshot(mem, v)
    plan = retain(mem, 1, grace_s=0)
    assert not plan.versions, plan.summary()
    idx = _versions(mem)
    assert idx.deltas == {1, 2, 3, 4} and idx.snapshots == {0, *FAR}  # the plants are left for an operator
    assert [v for _, v in plan.not_committed] == list(FAR)
    assert plan.kept_snapshots == [0]


def test_the_trainers_retention_keeps_every_real_version(mem: Store) -> None:
    from workers.trainer.versions import VersionPublisher

    run = FakeTrainer(mem, config=CFG)
    run.steps(4)
    run.snapshot(4)
    for v in FAR:
        _plant_empty_snapshot(mem, v)
    vp = VersionPublisher.__new__(VersionPublisher)
    vp.raw_store, vp.cfg, vp.signer = mem, SimpleNamespace(keep_snapshots=2), None
    vp.held_versions = lambda: frozenset()
    vp.publisher = None  # no snapshot in flight
    vp.states = dict(run.states)
    vp.retain()
    idx = _versions(mem)
    assert idx.deltas == {1, 2, 3, 4} and {0, 4} <= idx.snapshots


def _cli_store(tmp_path: Path, n: int = 3) -> tuple[str, list[str]]:
    """A run written by `aurora snapshot create` and `aurora delta create` (unsigned, no Redis)."""
    w = make_weights(QWEN3_TINY, seed=1)
    master = MasterWeights(w, seed=1)
    files = []
    for i, t in enumerate([w] + [master.step(lr=1e-6) for _ in range(n)]):
        p = tmp_path / f"w{i}.safetensors"
        save_file(t, str(p))
        files.append(str(p))
    url = f"file://{tmp_path / 'run'}"
    assert main(["snapshot", "create", files[0], "--version", "0", "--store", url]) == 0
    for i in range(1, n + 1):
        assert main(["delta", "create", files[i - 1], files[i], "--version", str(i), "--store", url]) == 0
    return url, files


def test_gc_apply_keeps_every_real_version_beside_planted_snapshots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = _cli_store(tmp_path)
    store = open_store(url)
    for v in FAR:
        _plant_empty_snapshot(store, v)
    capsys.readouterr()
    assert main(["gc", url, "--keep-snapshots", "1", "--apply", "--grace-s", "0"]) == 0
    out = capsys.readouterr().out
    idx = _versions(store)
    assert idx.deltas == {1, 2, 3} and 0 in idx.snapshots, out
    assert "not committed" in out and "9999999999" in out


# -- hole 4: memory bounded by what exists ---------------------------------------------------------


def _limited_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command line in a child process under an 8 GiB address-space limit."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.run(
        [sys.executable, "-m", "aurora_tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
        cwd=cwd,
        env=env,
    )


def test_lineage_and_gc_of_a_store_with_a_manifest_at_v9999999999_stay_small(tmp_path: Path) -> None:
    url, _ = _cli_store(tmp_path, n=2)
    _plant_empty_snapshot(open_store(url), 9999999999)
    r = _limited_cli(["lineage", url], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "snapshot 9999999999" in r.stdout and "not committed" in r.stdout.lower(), r.stdout
    r = _limited_cli(["lineage", url, "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["gaps"] == [[3, 9999999998]] and [n["version"] for n in doc["not_committed"]] == [9999999999]
    r = _limited_cli(["gc", url, "--keep-snapshots", "1"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "9999999999" in r.stdout
    r = _limited_cli(["verify", url], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr


# -- hole 5: the listing and commit parts ----------------------------------------------------------


def test_delta_apply_materializes_every_real_version_beside_plants(tmp_path: Path) -> None:
    url, files = _cli_store(tmp_path, n=3)
    store = open_store(url)
    for v in FAR:
        _plant_empty_snapshot(store, v)
    # A forged "delta 5" after a gap, and a snapshot at 2 no delta binds.
    w = load_file(files[3])
    plan = plan_of(w, tied=False)
    publish_snapshot(store, "t", 2, fuse_weights({n: t + 1 for n, t in w.items()}, plan), "sha256:" + "0" * 64, CFG)
    for v in range(4):
        out = str(tmp_path / f"out{v}.safetensors")
        assert main(["delta", "apply", "--version", str(v), "--store", url, "--out", out]) == 0
        got, want = load_file(out), fuse_weights(load_file(files[v]), plan)
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want), v


@pytest.mark.server
def test_enable_records_only_the_chain_and_never_a_plant(mem: Store, redis_client: Any, run_name: str) -> None:
    run = FakeTrainer(mem, config=CFG)
    run.steps(3)
    _plant_empty_snapshot(mem, 9999999999)
    log_ = RedisCommitLog(redis_client, run_name)
    log_.enable(mem)  # the run switches to Redis-commit mode: its chain is recorded
    assert all(log_.record(k, v) is not None for k, v in run.manifests)
    assert log_.record("snapshot", 9999999999) is None
    # A writer's later start records nothing it did not write, not even a plant on the chain.
    w = MasterWeights(run.weights[3], seed=5).step(lr=1e-6)
    publish_delta(mem, "t", 4, extract(run.plan, run.weights[3], w), run.states[3], CFG)
    log_.enable(mem)
    assert log_.record("delta", 4) is None


@pytest.mark.server
def test_repair_rewrites_an_overwritten_manifest_from_its_record(
    mem: Store, redis_client: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AURORA_REDIS_PERSISTENT", "1")
    run = FakeTrainer(mem, config=CFG)
    run.steps(2)
    prepare_commit(mem, redis_client, run_name, "redis")
    good = mem.get(manifest_key("delta", 1))
    mem.put(manifest_key("delta", 1), good[: len(good) // 2], mode="overwrite")  # torn
    prepare_commit(mem, redis_client, run_name, "redis")
    assert mem.get(manifest_key("delta", 1)) == good


# -- hole 5: publishing at a planted next version ---------------------------------------------------


@pytest.mark.server
def test_a_plant_at_the_next_version_stops_publishing_with_one_clear_line(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str
) -> None:
    from trainer_fixtures import TinyWorkload

    from aurora_store.coordination.records import RunRecords
    from workers.common import Endpoints
    from workers.trainer import TrainerConfig
    from workers.trainer.trainer import Trainer

    work = TinyWorkload()
    cfg = TrainerConfig(steps=3, batch=2, group=2, checkpoint_every=0, eval_every=0, snapshot_every=0, poll_s=0.01)
    tr = Trainer(Endpoints(f"file://{tmp_path}/run", redis_server.url, run_name), cfg, steps=work, weights=work)
    tr.setup()
    tr.store.put(manifest_key("delta", 1), b"anything at all", mode="create")
    work.train(work.rollouts({}), work.current)
    with pytest.raises(AuroraError) as ei:
        tr.versions.publish(1, work.weights(), tr.producer(0))
    assert not isinstance(ei.value, FencedOut)
    msg = str(ei.value)
    assert "deltas/v0000000001/manifest.json" in msg and "delete" in msg and "\n" not in msg, msg
    # A real fencing still reads as one.
    RunRecords(redis_client, run_name).enter_epoch(tr.epoch + 1)
    with pytest.raises(FencedOut):
        tr.versions.publish(1, work.weights(), tr.producer(0))
    tr.stop.set()


# -- hole 5: a fresh Actor and far-future plants; hole 2: a mirror-only snapshot --------------------


@pytest.fixture
def origin(tmp_path: Path) -> Store:
    return open_store(f"file://{tmp_path}/origin")


@pytest.fixture
def trainer(origin: Store, redis_server: Any, redis_client: Any, run_name: str) -> Any:
    from actor_fixtures import TinyRun

    run = TinyRun(origin, redis_server.url, run_name)
    run.record_states = True
    run.start()
    yield run
    run.close()


@pytest.mark.server
def test_far_future_plants_do_not_stop_a_fresh_actors_bootstrap(trainer: Any, origin: Store) -> None:
    from workers.actor import Actor, ActorConfig
    from workers.common import Endpoints

    trainer.step(3)
    for v in range(9999999999 - 17, 9999999999 + 1):
        _plant_empty_snapshot(origin, v)
    a = Actor.from_endpoints(Endpoints(origin.url, trainer.redis_url, trainer.run), ActorConfig(actor_id="a"), clock=ManualClock())
    t = threading.Thread(target=a.bootstrap, daemon=True)
    t.start()
    t.join(120)
    if t.is_alive():
        a.ctx.stop.set()
        t.join(30)
        pytest.fail("the Actor never bootstrapped: it aimed at the planted versions")
    assert (a.active, a.active_state) == (3, trainer.states[3])


@pytest.mark.server
def test_a_mirror_serving_only_a_forged_snapshot_is_never_activated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_client: Any, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from aurora_store.coordination.keys import mirror_token
    from aurora_tools.bench.hostile.workers import SourceRecorder
    from aurora_tools.synthetic.engine import SyntheticEngine
    from aurora_tools.synthetic.workload import SyntheticSpec, base_weights, sparse_update
    from workers.actor import Actor, ActorConfig
    from workers.common import Endpoints
    from workers.model import fusion_plan_for

    monkeypatch.setenv("AURORA_SYNTHETIC_CACHE", str(tmp_path / "cache"))
    spec = SyntheticSpec(QWEN3_TINY, seed=7)
    origin, mirror = open_store(f"file://{tmp_path}/origin"), open_store(f"file://{tmp_path}/mirror")
    base = base_weights(spec.shape, spec.seed)
    plan = fusion_plan_for(base, tied=True)
    states, w = {0: spec.base_state}, base
    for v in range(1, 4):
        new = {n: t.clone() for n, t in w.items()}
        sparse_update(new, spec.density, spec.seed, v)
        states[v] = publish_delta(origin, "r", v, extract(plan, w, new), states[v - 1], CFG, weights_digest=weights_digest(new, plan)).state
        w = new
    # The mirror serves only snapshots/v3: forged weights under the true state, its own digest.
    forged = {n: t + 0.25 for n, t in fuse_weights(w, plan).items()}
    publish_snapshot(mirror, "r", 3, forged, states[3], CFG)
    name = f"t{time.monotonic_ns()}"
    eng = SyntheticEngine(spec, hold=True, digests=True)
    eng.load_base()
    rec = SourceRecorder()
    a = Actor.from_endpoints(
        Endpoints(origin.url, redis_server.url, name),
        ActorConfig(actor_id="a", region="r1", mirror=mirror.url, mirror_grace_s=0.0),
        ManualClock(),
        engine=eng,
        observers=[rec],
    )
    a.holding.start_at(0, spec.base_state)
    a.fetcher.full_bytes = 1  # as after a bootstrap from a snapshot: a catch-up plan is weighed
    keys = RunKeys(name)
    for v, st in states.items():
        record_expected_state(redis_client, keys, v, st)
    redis_client.hset(keys.trainer, mapping={"head": 3})
    redis_client.set(keys.relay("r1"), mirror_token(mirror.url))
    with caplog.at_level(logging.WARNING):
        a.stager.stage_once()
    assert (3, True) not in rec.sources, rec.sources  # never the mirror's snapshot
    assert [e.state for e in a.staged] == [states[v] for v in range(1, 4)]
    assert all(not from_mirror for _, from_mirror in rec.sources)


@pytest.mark.server
def test_the_relay_mirrors_and_keeps_what_origin_counts_beside_plants(
    redis_server: Any, redis_client: Any, run_name: str, tmp_path: Path
) -> None:
    from relay_helpers import describe_model, make_relay, running

    from aurora_store.coordination.bus import Bus
    from aurora_store.testing.wait import wait_until

    origin, mirror = open_store(f"file://{tmp_path}/origin"), open_store(f"file://{tmp_path}/mirror")
    describe_model(origin)
    trainer = FakeTrainer(origin, run_name, Bus(redis_client, run_name))
    for v in range(1, 6):
        trainer.step()
        if v == 3:
            trainer.snapshot(3)
    for v in FAR:
        _plant_empty_snapshot(origin, v)  # at origin: they must not move the floor the Relay copies by
    _plant_empty_snapshot(mirror, FAR[1])  # in the mirror itself: nor the mirror's own retention
    relay = make_relay(origin, mirror, redis_server.url, run_name, keep_snapshots=1, gc_every_s=0.05, grace_s=0.0, resync_s=0.05)
    with running(relay):
        wait_until(relay.caught_up.is_set, "the first listing")
        listings = relay.stats().listings
        wait_until(lambda: relay.stats().listings >= listings + 3, "a few listings and clean-ups")
        idx = scan_versions(mirror)
        assert idx.deltas == {3, 4, 5} and {3} <= idx.snapshots and FAR[0] not in idx.snapshots, idx
