"""Weights digests only where something binds to them, and snapshots uploaded after their delta, off the step.

The Publisher hashes (the tree digest of FORMAT.md §4.1) version 0, each
snapshot's version and the versions asked for; a delta elsewhere carries no
digest, and readers still follow the chain by its states. With
``background_snapshots`` the delta at V is committed first and
:meth:`Publisher.publish` returns while the snapshot's shards are still being
written; its manifest comes last. A store wrapper holds the snapshot's writes
on an event, so every check waits on a condition, never on time.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import aurora_store.api.publisher as publisher_mod
import aurora_store.apply.sink as sink_mod
from aurora_store import Follower, Publisher
from aurora_store.api.snapshots import SnapshotResult
from aurora_store.apply.sink import TREE_PREFIX, tree_weights_digest
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.lineage.binding import WEIGHTS_DIGEST_FIELD
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.plan import scan_versions
from aurora_store.storage import Store, open_store
from aurora_store.testing.wait import wait_until


def _weights(v: int) -> dict[str, torch.Tensor]:
    w = {"a": torch.arange(96, dtype=torch.float32).reshape(12, 8), "b": torch.ones(5, dtype=torch.float32)}
    w["a"].view(-1)[: v + 1] += 1.0  # every version changes a few elements
    w["b"][v % 5] += float(v)
    return {n: t.to(torch.bfloat16) for n, t in w.items()}


def _digest_field(store: Store, kind: str, v: int) -> str | None:
    d = read_manifest(store, kind, v).extra.get(WEIGHTS_DIGEST_FIELD)
    return None if d is None else str(d)


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count tree digests the Publisher computes; any streamed (serial) digest fails the test."""
    calls: list[int] = []
    real = publisher_mod.tree_weights_digest

    def counted(*a: Any, **k: Any) -> str:
        calls.append(1)
        return real(*a, **k)

    def forbidden(*a: Any, **k: Any) -> str:
        raise AssertionError("the serial sha256 digest was computed")

    monkeypatch.setattr(publisher_mod, "tree_weights_digest", counted)
    monkeypatch.setattr(sink_mod, "weights_digest", forbidden)
    return calls


def test_only_snapshot_versions_and_those_asked_for_are_hashed_and_the_chain_still_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_hashes(monkeypatch)
    store = open_store(f"file://{tmp_path}/run")
    published = []
    with Publisher(store, snapshot_every=3) as pub:
        for v in range(6):
            p = pub.publish(_weights(v), digest=(v == 5))
            assert p is not None and p.version == v
            published.append(p)
    hashed = [p.version for p in published if p.weights_digest is not None]
    assert hashed == [0, 3, 5] and len(calls) == 3  # version 0, the snapshot at 3, the one asked for: nothing else
    assert all(p.digest_s == 0 for p in published if p.weights_digest is None)
    for v in (1, 2, 4):
        assert _digest_field(store, "delta", v) is None
    # The delta at a snapshot's version carries the tree digest of the weights it makes, equal to the snapshot's.
    d3 = published[3].weights_digest
    assert d3 is not None and d3.startswith(TREE_PREFIX) and d3 == tree_weights_digest(_weights(3))
    assert _digest_field(store, "delta", 3) == _digest_field(store, "snapshot", 3) == d3
    assert _digest_field(store, "delta", 5) == published[5].weights_digest
    assert sorted(scan_versions(store).snapshots) == [0, 3]
    # Readers follow versions with no digest by their states: from v0 through every delta, and from the bound snapshot.
    for start in (None, 3):
        held = {n: torch.zeros_like(t) for n, t in _weights(0).items()}
        with Follower(store) as f:
            if start is not None:
                assert f.update(held, version=start).path == "snapshot"
            assert f.update(held).version == 5
        assert all(torch.equal(held[n], t) for n, t in _weights(5).items())


def test_digest_every_hashes_every_nth_version(tmp_path: Path) -> None:
    with Publisher(f"file://{tmp_path}/run", digest_every=2) as pub:
        got = [pub.publish(_weights(v)) for v in range(5)]
    assert [p is not None and p.weights_digest is not None for p in got] == [True, False, True, False, True]


class _HeldStore:
    """Writes under ``prefix`` wait for ``release``; those under ``fail`` raise a connection error."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.real_put = store.put
        self.release = threading.Event()
        self.holding = threading.Event()
        self.prefix: str | None = None
        self.fail: str | None = None
        store.put = self.put  # type: ignore[method-assign]

    def put(self, key: str, data: bytes, mode: str = "create") -> None:
        if self.fail is not None and key.startswith(self.fail):
            raise ConnectionResetError("the store went away")
        if self.prefix is not None and key.startswith(self.prefix):
            self.holding.set()
            assert self.release.wait(60), "the test never released the snapshot"
        self.real_put(key, data, mode)


def test_a_snapshot_uploads_after_its_delta_off_the_step_and_a_failed_one_is_logged_and_the_next_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(f"file://{tmp_path}/run")
    held = _HeldStore(store)
    ended: list[SnapshotResult] = []
    pub = Publisher(store, snapshot_every=2, background_snapshots=True, on_snapshot=ended.append, outage_budget=0.2)
    try:
        pub.publish(_weights(0))
        pub.publish(_weights(1))
        held.prefix = version_dir("snapshot", 2) + "/"
        p2 = pub.publish(_weights(2))
        # publish() returned with the snapshot's shards held: the delta at 2 is committed (and binds it), the snapshot is not.
        assert p2 is not None and p2.snapshot and p2.snapshot_bytes == 0
        wait_until(held.holding.is_set, "the snapshot's upload to start", timeout=30)
        assert pub.snapshot_in_flight == 2
        assert store.exists(manifest_key("delta", 2)) and not store.exists(manifest_key("snapshot", 2))
        assert _digest_field(store, "delta", 2) == p2.weights_digest
        with Follower(store) as f:  # readers go on meanwhile, by the deltas
            assert f.update({n: torch.zeros_like(t) for n, t in _weights(0).items()}).version == 2
        held.release.set()
        wait_until(lambda: [r.version for r in ended] == [2], "the snapshot at 2 to be committed", timeout=30)
        assert ended[0].ok and ended[0].bytes > 0 and pub.snapshot_in_flight is None
        assert _digest_field(store, "snapshot", 2) == p2.weights_digest  # bound: the delta came first with the same digest
        # The store fails the next snapshot's shards: logged, nothing visible at 4, and the snapshot at 6 is written.
        held.fail = version_dir("snapshot", 4) + "/"
        with caplog.at_level(logging.ERROR, logger="aurora.publisher"):
            pub.publish(_weights(3))
            pub.publish(_weights(4))
            wait_until(lambda: len(ended) == 2, "the snapshot at 4 to fail", timeout=30)
        assert not ended[1].ok and ended[1].version == 4
        assert any("snapshot 4 was not written" in r.getMessage() for r in caplog.records)
        assert 4 not in scan_versions(store).snapshots and store.exists(manifest_key("delta", 4))
        pub.publish(_weights(5))
        pub.publish(_weights(6))
        assert pub.wait_snapshots(timeout=30)
        assert [r.version for r in ended] == [2, 4, 6] and ended[2].ok
        assert sorted(scan_versions(store).snapshots) == [0, 2, 6]
        with Follower(store) as f:  # a late joiner starts at the newest bound snapshot
            u = f.update({n: torch.zeros_like(t) for n, t in _weights(0).items()}, version=6)
            assert u.path == "snapshot" and u.deltas == 0
    finally:
        held.release.set()
        pub.close()


def test_close_waits_for_the_snapshot_in_flight(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    held = _HeldStore(store)
    pub = Publisher(store, snapshot_every=1, background_snapshots=True)
    pub.publish(_weights(0))
    held.prefix = version_dir("snapshot", 1) + "/"
    pub.publish(_weights(1))
    wait_until(held.holding.is_set, "the snapshot's upload to start", timeout=30)
    assert not pub.wait_snapshots(timeout=0.01)
    closer = threading.Thread(target=pub.close)
    closer.start()
    held.release.set()
    closer.join(30)
    assert not closer.is_alive() and store.exists(manifest_key("snapshot", 1))


def test_a_background_snapshot_reads_nothing_while_its_reads_are_paused(tmp_path: Path) -> None:
    """What a Trainer's parking relies on: inside ``snapshot_reads_paused`` the snapshot thread builds no
    shard from the weights (they may read zeros meanwhile); after it, the snapshot holds the version."""
    store = open_store(f"file://{tmp_path}/run")
    ended: list[SnapshotResult] = []
    pub = Publisher(store, snapshot_every=2, background_snapshots=True, on_snapshot=ended.append)
    gate = pub._snapshot_gate
    try:
        pub.publish(_weights(0))
        pub.publish(_weights(1))
        with pub.snapshot_reads_paused():
            p2 = pub.publish(_weights(2))
            assert p2 is not None and p2.snapshot and pub.snapshot_in_flight == 2
            wait_until(lambda: gate.state()[2] == 1, "the snapshot's first shard to wait", timeout=30)
            held = pub._base
            assert held is not None
            saved = {n: t.clone() for n, t in held.items()}
            for t in held.values():
                t.zero_()  # as parked pages read
            assert not store.list(version_dir("snapshot", 2) + "/")
            for n, t in held.items():
                t.copy_(saved[n])
        assert pub.wait_snapshots(timeout=30) and ended and ended[0].ok
        got = {n: torch.zeros_like(t) for n, t in _weights(0).items()}
        with Follower(store) as f:
            assert f.update(got, version=2).path == "snapshot"
        for n, t in _weights(2).items():
            assert torch.equal(got[n].to(torch.bfloat16), t.to(torch.bfloat16)), n
    finally:
        pub.close()
