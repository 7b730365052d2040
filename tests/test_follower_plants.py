"""The Follower API aims at the versions that count, never at the newest listed (issue 24, hole 5)."""

from __future__ import annotations

import json
from pathlib import Path

from trainer_fixtures import FakeTrainer

from aurora_store.api.follower import Follower
from aurora_store.format.manifest import manifest_key
from aurora_store.lineage.publish import PublishConfig
from aurora_store.storage import LocalStore


def _plant(store: LocalStore, kind: str, v: int, like: int) -> None:
    """A well-formed manifest of ``kind`` at ``v``: a copy of version ``like``'s, renumbered."""
    d = json.loads(store.get(manifest_key(kind, like)))
    d["version"] = v
    if kind == "delta":
        d["base_version"] = v - 1
    store.put(manifest_key(kind, v), json.dumps(d).encode())


def test_latest_ignores_far_future_plants_and_the_chain_decides(tmp_path: Path) -> None:
    store = LocalStore(f"file://{tmp_path / 'run'}")
    chain = FakeTrainer(store, config=PublishConfig(streams=2, segment_bytes=16 << 10))
    chain.steps(2)
    for v in range(9_999_999_983, 10_000_000_000):  # 17 far-future deltas, each a true copy renumbered
        _plant(store, "delta", v, 2)
    _plant(store, "snapshot", 9_999_999_999, 0)
    with Follower(store, poll_s=0.05) as f:
        assert f.latest() == 2
        chain.step()
        assert f.latest() == 3  # the chain grows; the plants still do not count
        assert f.wait(after=2, timeout=5) == 3
