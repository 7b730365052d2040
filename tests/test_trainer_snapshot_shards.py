"""The Trainer's snapshot shards are sized for the model: the shards an upload keeps in memory beside
the version hold about an eighth of it, never the whole version in one shard (workers.trainer.versions)."""

from __future__ import annotations

from aurora_store.lineage.publish import DEFAULT_SHARD_BYTES
from workers.trainer.versions import SNAPSHOT_SHARD_FLOOR, snapshot_shard_bytes


def test_shards_in_flight_hold_an_eighth_of_the_version() -> None:
    streams = 8
    for params in (10**6, 2 * 10**8, 5 * 10**8, 8 * 10**9, 7 * 10**10):
        version = 2 * params  # bf16
        shard = snapshot_shard_bytes(version, streams)
        assert SNAPSHOT_SHARD_FLOOR <= shard <= DEFAULT_SHARD_BYTES
        assert streams * shard <= max(streams * SNAPSHOT_SHARD_FLOOR, version // 8), params
        if version >= 16 * streams * SNAPSHOT_SHARD_FLOOR:
            assert shard < version // streams  # never the whole version in a few shards
    assert snapshot_shard_bytes(1 << 40, 8) == DEFAULT_SHARD_BYTES  # the library's cap for huge models
    assert snapshot_shard_bytes(1 << 20, 0) == SNAPSHOT_SHARD_FLOOR
