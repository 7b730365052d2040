"""Publishing config, adaptive segment size, retention of held versions, torch-free read paths.

No server: stores are in memory, environments are plain dicts.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Sequence

import pytest
import torch

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import extract, fuse_weights, plan_of
from aurora_store.errors import ConfigError
from aurora_store.lineage.gc import plan_gc, run_gc
from aurora_store.lineage.interfaces import CommitRecords, HeldVersions, SegmentAnnouncements
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import plan_chain, scan_versions
from aurora_store.lineage.publish import (
    MIN_SEGMENT_BYTES,
    PublishConfig,
    estimate_delta_bytes,
    publish_delta,
    publish_snapshot,
    segment_bytes_for,
)
from aurora_store.lineage.report import read_lineage
from aurora_store.storage import Store, open_store
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

MIB = 1 << 20


# --- segment_bytes_for -------------------------------------------------------


def test_segment_size_cuts_a_delta_into_two_segments_per_stream() -> None:
    assert segment_bytes_for(64 * MIB, 8) == 4 * MIB
    assert segment_bytes_for(64 * MIB + 1, 8) == 4 * MIB + 1  # rounded up: never 2 x streams + 1
    assert segment_bytes_for(10 * MIB, 1) == 5 * MIB


def test_segment_size_is_clamped() -> None:
    assert segment_bytes_for(0, 8) == MIN_SEGMENT_BYTES == 64 << 10
    assert segment_bytes_for(100 << 10, 8) == 64 << 10
    assert segment_bytes_for(10 << 30, 8) == 16 * MIB
    assert segment_bytes_for(10 * MIB, 4, floor=4 * MIB, ceiling=8 * MIB) == 4 * MIB


@pytest.mark.parametrize("streams, floor, ceiling", [(0, 1 << 16, 1 << 24), (8, 512, 1 << 24), (8, 1 << 20, 1 << 16)])
def test_segment_size_refuses_nonsense(streams: int, floor: int, ceiling: int) -> None:
    with pytest.raises(ConfigError):
        segment_bytes_for(1 << 20, streams, floor, ceiling)


# --- PublishConfig -----------------------------------------------------------


def test_publish_config_defaults_read_nothing_and_adapt() -> None:
    cfg = PublishConfig.from_env({})
    assert cfg == PublishConfig() and cfg.streams == 8 and cfg.segment_bytes is None
    assert cfg.segment_bytes_for(64 * MIB) == 4 * MIB
    assert PublishConfig(segment_bytes=1 * MIB).segment_bytes_for(64 * MIB) == 1 * MIB


def test_publish_config_reads_streams_and_segment_mib() -> None:
    env = {"AURORA_STREAMS": "4", "AURORA_SEGMENT_MIB": "0.5", "AURORA_SHARD_MIB": "64"}
    cfg = PublishConfig.from_env(env)
    assert (cfg.streams, cfg.segment_bytes, cfg.shard_bytes) == (4, 512 << 10, 64 * MIB)
    assert PublishConfig.from_env({"AURORA_SEGMENT_MIB": "16"}).segment_bytes == 16 * MIB
    assert PublishConfig.from_env({"AURORA_SEGMENT_MIB": ""}).segment_bytes is None


def test_publish_config_overrides_win_and_none_means_not_given() -> None:
    env = {"AURORA_STREAMS": "4", "AURORA_SEGMENT_MIB": "2"}
    cfg = PublishConfig.from_env(env, streams=16, segment_bytes=None)
    assert cfg.streams == 16 and cfg.segment_bytes == 2 * MIB
    assert PublishConfig.from_env(env, streams=None).streams == 4


def test_publish_config_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AURORA_STREAMS", "3")
    monkeypatch.delenv("AURORA_SEGMENT_MIB", raising=False)
    assert PublishConfig.from_env() == PublishConfig(streams=3)


@pytest.mark.parametrize(
    "env, var",
    [
        ({"AURORA_STREAMS": "many"}, "AURORA_STREAMS"),
        ({"AURORA_SEGMENT_MIB": "big"}, "AURORA_SEGMENT_MIB"),
        ({"AURORA_STREAMS": "0"}, "streams"),
        ({"AURORA_SEGMENT_MIB": "0.0001"}, "segment_bytes"),
    ],
)
def test_publish_config_bad_values_name_the_variable(env: dict[str, str], var: str) -> None:
    with pytest.raises(ConfigError, match=var):
        PublishConfig.from_env(env)


# --- publishing with the adaptive size ---------------------------------------


class Run:
    """Snapshot 0 and deltas of the tiny model in a memory store."""

    def __init__(self, cfg: PublishConfig | None = None) -> None:
        self.store: Store = open_store(f"memory://aurora-{uuid.uuid4().hex}/run")
        self.cfg = cfg or PublishConfig(streams=2, segment_bytes=4096)
        w = make_weights(QWEN3_TINY, seed=0)
        self.plan = plan_of(w, tied=False)
        self.master = MasterWeights(w, seed=0)
        self.weights = {0: w}
        self.states = {0: publish_snapshot(self.store, "t", 0, fuse_weights(w, self.plan), None, self.cfg).state}

    def step(self, n: int = 1, lr: float = 2.5e-7) -> None:
        for _ in range(n):
            v = max(self.weights) + 1
            new = self.master.step(lr=lr)
            m = publish_delta(
                self.store,
                "t",
                v,
                extract(self.plan, self.weights[v - 1], new),
                self.states[v - 1],
                self.cfg,
                weights_digest=weights_digest(new, self.plan),
            )
            self.weights[v], self.states[v] = new, m.state

    def snapshot(self, v: int) -> None:
        publish_snapshot(self.store, "t", v, fuse_weights(self.weights[v], self.plan), self.states[v], self.cfg)


def test_adaptive_segments_use_every_stream() -> None:
    run = Run(PublishConfig(streams=2))
    new = run.master.step(lr=1e-3)  # a dense step: well above 2 x streams x 64 KiB
    deltas = list(extract(run.plan, run.weights[0], new))
    expect = segment_bytes_for(estimate_delta_bytes(deltas), 2)
    assert expect > MIN_SEGMENT_BYTES
    m = publish_delta(run.store, "t", 1, iter(deltas), run.states[0], run.cfg)  # a one-shot iterator is fine
    assert 3 <= len(m.segments) <= 8  # about 2 x streams (the estimate is within 2x)
    assert max(s.bytes for s in m.segments) <= expect * 1.1
    fixed = publish_delta(
        run.store, "t", 2, extract(run.plan, new, run.master.step(lr=1e-3)), m.state, PublishConfig(streams=2, segment_bytes=1 << 20)
    )
    assert len(fixed.segments) == 1  # a set size is used as is
    tensors, state = materialize(run.store, 1)
    assert state == m.state
    want = fuse_weights(new, run.plan)
    assert all(torch.equal(tensors[n], want[n]) for n in want)


def test_small_delta_is_one_segment() -> None:
    run = Run(PublishConfig(streams=8))
    run.step(1)
    assert len(read_lineage(run.store).manifests[("delta", 1)].segments) == 1


# --- retention and held versions ---------------------------------------------


class Held:
    def __init__(self, *versions: int) -> None:
        self.versions = frozenset(versions)

    def held_versions(self) -> frozenset[int]:
        return self.versions


def _gc_plan(store: Store, held: HeldVersions | None) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    p = plan_gc(read_lineage(store), 1, lambda key: 0.0, 0.0, held)
    return p.versions, p.kept_for_held


@pytest.fixture(scope="module")
def chain() -> Run:
    """Snapshots 0, 2, 4; deltas 1..5."""
    run = Run()
    run.step(2)
    run.snapshot(2)
    run.step(2)
    run.snapshot(4)
    run.step(1)
    return run


def test_gc_without_held_versions_is_unchanged(chain: Run) -> None:
    removed, kept = _gc_plan(chain.store, None)
    # Delta 4 stays: it binds snapshot 4 (FORMAT.md §4.1).
    assert removed == [("delta", 1), ("delta", 2), ("delta", 3), ("snapshot", 0), ("snapshot", 2)]
    assert kept == []
    assert _gc_plan(chain.store, Held()) == (removed, [])
    assert _gc_plan(chain.store, Held(4, 5)) == (removed, [])  # inside what retention keeps anyway


def test_gc_keeps_the_chain_of_a_held_version(chain: Run) -> None:
    removed, kept = _gc_plan(chain.store, Held(3))
    assert removed == [("delta", 1), ("snapshot", 0)]
    assert kept == [("delta", 2), ("delta", 3), ("snapshot", 2)]  # delta 2 binds snapshot 2
    removed, kept = _gc_plan(chain.store, Held(1))
    assert removed == [("snapshot", 2)]
    assert kept == [("delta", 1), ("delta", 2), ("delta", 3), ("snapshot", 0)]
    assert _gc_plan(chain.store, Held(0)) == (removed, kept)
    assert _gc_plan(chain.store, Held(9)) == _gc_plan(chain.store, None)  # not committed: nothing after it


def test_gc_with_held_version_leaves_it_reachable_and_catching_up() -> None:
    run = Run()
    run.step(2)
    run.snapshot(2)
    run.step(2)
    run.snapshot(4)
    run.step(1)
    lines: list[str] = []
    run_gc(run.store, keep_snapshots=1, apply=True, min_orphan_age_s=0, say=lines.append, held=Held(3))
    assert any("live Actors still need" in line for line in lines)
    index = scan_versions(run.store)
    assert index.snapshots == {2, 4} and index.deltas == {2, 3, 4, 5}
    assert plan_chain(index, 5, held=3).deltas == (4, 5)
    _, state = materialize(run.store, 3)
    assert state == run.states[3]


def test_interfaces_are_runtime_checkable() -> None:
    class Records:
        def commit_record(self, kind: str, version: int) -> str | None:
            return None

    class Announced:
        def announced_segments(self, kind: str, version: int) -> Sequence[tuple[str, int, str]]:
            return ()

    assert isinstance(Held(), HeldVersions) and not isinstance(Held(), CommitRecords)
    assert isinstance(Records(), CommitRecords) and isinstance(Announced(), SegmentAnnouncements)


# --- the read paths stay free of torch ---------------------------------------


def test_read_paths_import_no_torch() -> None:
    code = (
        "import sys\n"
        "import aurora_store.lineage, aurora_store.lineage.plan, aurora_store.lineage.fetch\n"
        "import aurora_store.lineage.report, aurora_store.lineage.verify, aurora_store.lineage.gc\n"
        "import aurora_store.lineage.interfaces\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'vllm', 'workers', 'aurora_tools'}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
