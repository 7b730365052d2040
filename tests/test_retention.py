"""Safe retention (issue 12, point 6): ``retain`` and ``aurora gc --redis``.

The rule keeps the newest K snapshots and everything after the oldest of
them; what live Actors hold or stage (the ledger) and what live Relays
mirror (their ``relay-held`` key) is kept unless ``--force``; orphans and
``.tmp-*`` files go once older than the grace, fresh ones stay. The server
tests use a real ``redis-server`` and the real Ledger, Relay heartbeat and
CLI.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from trainer_fixtures import FakeTrainer

from aurora_store.codec.extract import extract
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.retention import (
    LedgerHeldVersions,
    RelayHeldVersions,
    parse_relay_held,
    relay_held_value,
    run_held_versions,
)
from aurora_store.errors import ConfigError
from aurora_store.format.manifest import version_dir
from aurora_store.lineage.gc import plan_gc, retain, retained, retention_floor
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import scan_versions
from aurora_store.lineage.publish import PublishConfig, publish_delta
from aurora_store.lineage.report import read_lineage
from aurora_store.outage import Dependency
from aurora_store.storage import Store, open_store
from aurora_store.storage.base import TEMP_PREFIX
from aurora_store.testing.wait import wait_until
from aurora_tools.cli import main
from workers.relay.heartbeat import Heartbeat

CFG = PublishConfig(streams=2, segment_bytes=4096)


def chain(tmp_path: Path) -> FakeTrainer:
    """Snapshots 0, 3, 6; deltas 1..7. Keeping one snapshot leaves snapshot 6 and delta 7."""
    run = FakeTrainer(open_store(f"file://{tmp_path}/run-{uuid.uuid4().hex[:6]}"), config=CFG)
    run.steps(3)
    run.snapshot(3)
    run.steps(3)
    run.snapshot(6)
    run.steps(1)
    return run


def versions(store: Store) -> tuple[set[int], set[int]]:
    """(snapshots, deltas) committed in ``store``."""
    index = scan_versions(store)
    return set(index.snapshots), set(index.deltas)


def age(path: Path, seconds: float) -> None:
    """Make ``path`` look ``seconds`` old."""
    t = time.time() - seconds
    os.utime(path, (t, t))


# --- pure rules -----------------------------------------------------------------


def test_the_floor_and_what_it_keeps() -> None:
    assert retention_floor([0, 3, 6], 1) == 6
    assert retention_floor([6, 0, 3], 2) == 3
    assert retention_floor([0, 3], 3) is None  # fewer snapshots than asked: keep everything
    with pytest.raises(ConfigError):
        retention_floor([0], 0)
    assert retained("snapshot", 6, 6) and retained("delta", 7, 6)
    assert retained("delta", 6, 6)  # its weights_digest binds the snapshot there (FORMAT.md §4.1)
    assert not retained("snapshot", 3, 6) and retained("delta", 1, None)


def test_force_removes_what_holders_need_and_says_so(tmp_path: Path) -> None:
    run = chain(tmp_path)
    lin = read_lineage(run.store)
    kept = plan_gc(lin, 1, lambda key: 0.0, 0.0, frozenset({4}))
    # Delta 3 binds snapshot 3 (FORMAT.md §4.1); delta 6 binds the floor snapshot, so the rule keeps it.
    assert kept.kept_for_held == [("delta", 3), ("delta", 4), ("delta", 5), ("snapshot", 3)]
    assert kept.versions == [("delta", 1), ("delta", 2), ("snapshot", 0)]
    forced = plan_gc(lin, 1, lambda key: 0.0, 0.0, frozenset({4}), force=True)
    assert forced.forced == kept.kept_for_held and forced.kept_for_held == []
    assert sorted(forced.versions) == sorted(kept.versions + kept.kept_for_held)


def test_relay_held_values_and_hostile_ones() -> None:
    assert parse_relay_held(relay_held_value([5, 3, 3, -1])) == {3, 5}
    assert parse_relay_held(relay_held_value([]).encode()) == frozenset()
    for bad in (
        b"",
        b"not json",
        b"[1, 2]",
        b'{"versions": "1"}',
        b'{"versions": [1.5]}',
        b'{"versions": [true]}',
        b'{"versions": [-1]}',
        b'{"versions": [1099511627776]}',
        b"\xff\xfe",
        b'{"versions": [' + b"1," * 5000 + b"1]}",
    ):
        assert parse_relay_held(bad) is None, bad
    assert parse_relay_held(None) is None


# --- garbage: orphans and temporary files ---------------------------------------------


def test_old_orphans_and_temp_files_go_fresh_ones_stay(tmp_path: Path) -> None:
    run = FakeTrainer(open_store(f"file://{tmp_path}/run"), config=CFG)
    run.steps(2)
    root = Path(run.store.root)
    # A publish that died an hour ago, and one in flight now (no manifest yet).
    dead = f"{version_dir('delta', 3)}/{'a' * 16}/seg-00000.safetensors"
    alive = f"{version_dir('delta', 3)}/{'b' * 16}/seg-00000.safetensors"
    run.store.put(dead, b"half a publish")
    run.store.put(alive, b"a publish in flight")
    age(root / dead, 7200)
    # Temporary files of writers killed long ago, and of one writing now.
    old_tmp = root / version_dir("delta", 1) / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    old_tmp.write_bytes(b"killed writer")
    age(old_tmp, 7200)
    model_tmp = root / "model" / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    model_tmp.parent.mkdir()
    model_tmp.write_bytes(b"killed writer")
    age(model_tmp, 7200)
    fresh_tmp = root / version_dir("delta", 2) / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    fresh_tmp.write_bytes(b"writing")

    dry = retain(run.store, 1, grace_s=3600, dry_run=True)
    assert dry.orphans == [dead] and dry.young_orphans == 1
    assert sorted(dry.temp_files) == sorted(str(p.relative_to(root)) for p in (old_tmp, model_tmp))
    assert dry.young_temp_files == 1 and old_tmp.exists()

    lines: list[str] = []
    plan = retain(run.store, 1, grace_s=3600, say=lines.append)
    assert plan.removed == 3 and not plan.dry_run
    assert not old_tmp.exists() and not model_tmp.exists() and not (root / dead).exists()
    assert fresh_tmp.exists() and run.store.exists(alive)
    assert not (root / dead).parent.exists()  # the dead attempt's folder went with it
    assert any("1 orphan object(s) younger than 3600s" in line for line in lines)
    assert any("1 temporary file(s) younger than 3600s" in line for line in lines)
    assert versions(run.store) == ({0}, {1, 2})  # one snapshot: nothing to retire
    _, state = materialize(run.store, 2)
    assert state == run.states[2]


# --- with Redis: live Actors and Relays ------------------------------------------------


@pytest.mark.server
def test_held_versions_from_the_ledger_by_region_and_liveness(redis_client: Any, run_name: str) -> None:
    ledger = Ledger(redis_client, run_name)
    ledger.register("a1", region="eu")
    ledger.heartbeat("a1", active=4, staged=6)
    ledger.register("a2", region="us")
    ledger.heartbeat("a2", active=2, staged=2)
    ledger.register("a3", region="eu")
    ledger.heartbeat("a3", active=1, staged=1)
    ledger.leave("a3")  # gone: holds nothing
    assert LedgerHeldVersions(ledger).held_versions() == {2, 4, 5, 6}
    assert LedgerHeldVersions(ledger, region="eu").held_versions() == {4, 5, 6}
    assert LedgerHeldVersions(ledger, region="ap").held_versions() == frozenset()
    keys = RunKeys(run_name)
    redis_client.set(keys.relay_held("eu"), relay_held_value([9]), px=60_000)
    redis_client.set(keys.relay_held("us"), b"garbage", px=60_000)
    redis_client.set(keys.relay("eu"), "file:///mirror", px=60_000)  # the mirror key is not a held key
    assert RelayHeldVersions(redis_client, run_name).held_versions() == {9}
    assert run_held_versions(redis_client, run_name).held_versions() == {2, 4, 5, 6, 9}


@pytest.mark.server
def test_gc_keeps_what_a_live_actor_holds_until_forced(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = chain(tmp_path)
    url = run.store.url
    ledger = Ledger(redis_client, run_name)
    ledger.register("a1", region="eu")
    ledger.heartbeat("a1", active=4, staged=5)  # serving 4, staging 5
    gc = ["gc", url, "--redis", redis_server.url, "--run", run_name, "--keep-snapshots", "1", "--grace-s", "0"]

    assert main(gc) == 0  # a dry run
    out = capsys.readouterr()
    assert "would delete snapshot 0" in out.out and "live Actors still need" in out.out
    assert out.err == ""  # with --redis, no note that gc cannot see live Actors (or any other)
    assert versions(run.store) == ({0, 3, 6}, set(range(1, 8)))

    assert main([*gc, "--apply"]) == 0
    # a1 still reaches 4 and 5 (snapshot 3, bound by delta 3, + deltas) and catches up delta by delta.
    assert versions(run.store) == ({3, 6}, {3, 4, 5, 6, 7})
    for v in (4, 5, 7):
        _, state = materialize(run.store, v)
        assert state == run.states[v]

    assert main([*gc, "--apply", "--force"]) == 0
    assert versions(run.store) == ({6}, {6, 7})  # delta 6 binds snapshot 6
    assert "--force" in capsys.readouterr().out


@pytest.mark.server
def test_gc_keeps_what_a_live_relay_mirrors_until_its_heartbeat_is_gone(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = chain(tmp_path)
    gc = ["gc", run.store.url, "--redis", redis_server.url, "--run", run_name, "--keep-snapshots", "1", "--grace-s", "0", "--apply"]
    # The Relay's own heartbeat, for a Relay whose mirror is at version 2 (behind).
    dep = Dependency("Redis", logging.getLogger("test"), budget_s=60)
    beat = Heartbeat(redis_client, run_name, "eu", "file:///mirror-eu", 0.1, 30.0, lambda: [2], dep)
    beat.start()
    try:
        assert RelayHeldVersions(redis_client, run_name).held_versions() == {2}
        assert main(gc) == 0
        # The Relay still catches up from 2: deltas 3.. stay (and snapshot 0 + deltas 1, 2 reach 2).
        assert versions(run.store) == ({0, 6}, {1, 2, 3, 4, 5, 6, 7})
    finally:
        beat.stop()
        beat.release()  # a graceful stop deletes the key
    assert RelayHeldVersions(redis_client, run_name).held_versions() == frozenset()
    assert main(gc) == 0
    assert versions(run.store) == ({6}, {6, 7})  # delta 6 binds snapshot 6
    capsys.readouterr()


@pytest.mark.server
def test_relay_key_expires_with_its_ttl(redis_client: Any, run_name: str) -> None:
    """A killed Relay holds nothing once its heartbeat's TTL has run out."""
    dep = Dependency("Redis", logging.getLogger("test"), budget_s=60)
    beat = Heartbeat(redis_client, run_name, "eu", "file:///m", 0.1, 0.5, lambda: [1], dep)
    beat.start()
    beat.stop()  # no release: as if killed
    held = RelayHeldVersions(redis_client, run_name)
    assert held.held_versions() == {1}
    wait_until(lambda: held.held_versions() == frozenset(), "the held key to expire")


def test_gc_without_redis_says_it_cannot_see_live_actors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = chain(tmp_path)
    assert main(["gc", run.store.url, "--keep-snapshots", "1", "--min-orphan-age", "0"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len([e for e in err if "cannot see live Actors" in e]) == 1
    assert versions(run.store) == ({0, 3, 6}, set(range(1, 8)))  # a dry run by default
    assert main(["gc", run.store.url, "--redis", "redis://127.0.0.1:1/0"]) == 1  # --run missing
    assert "--run" in capsys.readouterr().err


@pytest.mark.server
def test_gc_with_redis_away_deletes_nothing(tmp_path: Path, dead_redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    run = chain(tmp_path)
    rc = main(["gc", run.store.url, "--redis", dead_redis_url, "--run", "r", "--keep-snapshots", "1", "--apply"])
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aurora: error:") and "Traceback" not in err[0]
    assert versions(run.store) == ({0, 3, 6}, set(range(1, 8)))


def test_retain_is_safe_to_run_beside_a_publish(tmp_path: Path) -> None:
    """The Trainer's periodic call: a publish in flight (its attempt objects, no manifest yet)
    survives a retention run with the default grace, and commits afterwards."""
    run = FakeTrainer(open_store(f"file://{tmp_path}/run"), config=CFG)
    run.steps(2)
    run.snapshot(2)
    go, done = threading.Event(), threading.Event()
    plans = []

    def on_segment(ev: Any) -> None:
        if ev.index == 0 and not go.is_set():
            go.set()
            plans.append(retain(run.store, 1))  # mid-publish
            done.set()

    new = run.master.step(lr=2.5e-7)
    publish_delta(run.store, "t", 3, extract(run.plan, run.weights[2], new), run.states[2], CFG, on_segment=on_segment)
    assert done.is_set()
    (plan,) = plans
    assert plan.young_orphans >= 1 and plan.orphans == []
    assert versions(run.store) == ({2}, {2, 3})  # delta 2 binds snapshot 2
    _, state = materialize(run.store, 3)
    assert state is not None
