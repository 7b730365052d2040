"""Publishing and fetching versions on every backend, with a real S3 server.

The store is the source of truth: these tests check that what an Actor
applies is exactly what the Trainer committed, and that every way of getting
it wrong (crash mid-publish, racing writers, damaged objects, wrong base) is
caught, named and leaves nothing half-applied.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from aurora_store.apply.sink import FusedWeights, apply_delta, weights_digest
from aurora_store.codec.extract import extract, fuse_weights, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ChainError, IntegrityError, ObjectNotFound, VersionConflict
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.lineage.fetch import fetch_delta, read_manifest
from aurora_store.lineage.gc import run_gc
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import plan_chain, scan_versions
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.lineage.report import read_lineage
from aurora_store.lineage.verify import verify_run
from aurora_store.storage import Store, open_store
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

pytestmark = pytest.mark.server

CFG = PublishConfig(streams=4, segment_bytes=8 << 10)


def fused(plan: FusionPlan, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return fuse_weights(w, plan)


class Run:
    """A Trainer's view: weights per version, published as it goes."""

    def __init__(self, store: Store, seed: int = 0) -> None:
        self.store = store
        self.weights = {0: make_weights(QWEN3_TINY, seed=seed)}
        self.plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in self.weights[0].items()})
        self.master = MasterWeights(self.weights[0], seed=seed)
        self.states = {0: publish_snapshot(store, "t", 0, fused(self.plan, self.weights[0]), None, CFG).state}

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            v = max(self.weights) + 1
            new = self.master.step(lr=2.5e-7)
            m = publish_delta(
                self.store,
                "t",
                v,
                extract(self.plan, self.weights[v - 1], new),
                self.states[v - 1],
                CFG,
                weights_digest=weights_digest(new, self.plan),
            )
            self.weights[v], self.states[v] = new, m.state

    def snapshot(self, v: int) -> None:
        publish_snapshot(self.store, "t", v, fused(self.plan, self.weights[v]), self.states[v], CFG)

    def digest(self, v: int) -> str:
        return weights_digest(self.weights[v], self.plan)


def test_round_trip_versions_and_snapshots(any_store: Store) -> None:
    run = Run(any_store)
    run.step(3)
    run.snapshot(3)
    run.step(2)
    index = scan_versions(any_store)
    assert index.deltas == {1, 2, 3, 4, 5} and index.snapshots == {0, 3}
    plan = plan_chain(index, 5)
    assert plan.snapshot == 3 and plan.deltas == (4, 5)
    for v in (2, 5):
        tensors, state = materialize(any_store, v)
        assert state == run.states[v]
        assert weights_digest(tensors) == run.digest(v)
    rep = verify_run(any_store, deep=True)
    assert rep.ok, rep.problems
    assert rep.checked_versions == 7


def test_catch_up_replays_missed_deltas_from_held_version(any_store: Store) -> None:
    run = Run(any_store)
    run.step(4)
    held = fused(run.plan, run.weights[1])
    sink = FusedWeights(held)
    plan = plan_chain(scan_versions(any_store), 4, held=1)
    assert plan.snapshot is None and plan.deltas == (2, 3, 4)
    state = run.states[1]
    for v in plan.deltas:
        m, staged = fetch_delta(any_store, v, sink.specs(), expect_base_state=state)
        apply_delta(staged, sink)
        state = m.state
    assert weights_digest(held) == run.digest(4)


def _put_race_script(url: str, opts: dict, key: str, payload: str, start_at: float) -> str:
    return textwrap.dedent(
        f"""
        import json, sys, time
        from aurora_store.storage import open_store
        from aurora_store.errors import VersionConflict
        store = open_store({url!r}, json.loads({json.dumps(json.dumps(opts))}))
        while time.time() < {start_at}:
            pass
        try:
            store.put({key!r}, {payload!r}.encode(), mode="create")
            print("WON")
        except VersionConflict as e:
            print("CONFLICT", e)
        """
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["file", "s3"])
def test_concurrent_manifest_creates_have_one_winner(backend: str, tmp_path, request) -> None:  # type: ignore[no-untyped-def]
    if backend == "file":
        url, opts = f"file://{tmp_path}/run", {}
    else:
        server = request.getfixturevalue("s3_server")
        url, opts = f"s3://{server.new_bucket()}/run", server.storage_options()
    key = manifest_key("delta", 7)
    n = 6
    start_at = time.time() + 4.0  # every process is past its imports by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _put_race_script(url, opts, key, f"writer-{i}", start_at)], stdout=subprocess.PIPE, text=True
        )
        for i in range(n)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    winners = [o for o in outs if o == "WON"]
    losers = [o for o in outs if o.startswith("CONFLICT")]
    assert len(winners) == 1, outs
    assert len(losers) == n - 1, outs
    assert all(key in o for o in losers)  # every loser is told which key
    body = open_store(url, opts).get(key).decode()
    assert body == f"writer-{outs.index('WON')}"


def test_retry_of_same_bytes_is_success_different_bytes_conflict(any_store: Store) -> None:
    any_store.put("deltas/v0000000001/manifest.json", b"same")
    any_store.put("deltas/v0000000001/manifest.json", b"same")  # a retry whose first answer was lost
    with pytest.raises(VersionConflict, match="v0000000001/manifest.json"):
        any_store.put("deltas/v0000000001/manifest.json", b"other")
    assert any_store.get("deltas/v0000000001/manifest.json") == b"same"


_KILLED_PUBLISHER = """
import sys, time
from aurora_store.storage import open_store
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights
from aurora_store.codec.fusion import FusionPlan
from aurora_store.codec.extract import extract, spec_of
from aurora_store.lineage.publish import PublishConfig, publish_delta
import json
store = open_store(sys.argv[1], json.loads(sys.argv[2]))
w = make_weights(QWEN3_TINY, seed=0)
plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in w.items()})
new = MasterWeights(w, seed=0).step(lr=2.5e-7)
def slow(ev):
    print("SEGMENT", ev.index, flush=True)
    time.sleep(0.5)
publish_delta(store, "t", 1, extract(plan, w, new), sys.argv[3], PublishConfig(streams=1, segment_bytes=4096), on_segment=slow)
print("COMMITTED", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["file", "s3"])
def test_publisher_killed_midway_leaves_invisible_version(backend: str, tmp_path, request) -> None:  # type: ignore[no-untyped-def]
    if backend == "file":
        url, opts = f"file://{tmp_path}/run", {}
    else:
        server = request.getfixturevalue("s3_server")
        url, opts = f"s3://{server.new_bucket()}/run", server.storage_options()
    store = open_store(url, opts)
    run = Run(store)  # snapshot 0, same seed as the killed publisher
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_PUBLISHER, url, json.dumps(opts), run.states[0]], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("SEGMENT"), line
    proc.send_signal(signal.SIGKILL)  # spot preemption: no cleanup at all
    proc.wait(timeout=30)

    assert scan_versions(store).deltas == frozenset()  # the version is invisible
    lin = read_lineage(store)
    assert lin.orphans and all(k.startswith(version_dir("delta", 1)) for k in lin.orphans)
    with pytest.raises(Exception, match="not committed"):
        fetch_delta(store, 1, run.plan.specs())

    run.step(1)  # the retry publishes under a new attempt id
    tensors, state = materialize(store, 1)
    assert state == run.states[1] and weights_digest(tensors) == run.digest(1)
    rep = verify_run(store, deep=True)
    assert rep.ok, rep.problems
    assert any("orphan" in w for w in rep.warnings)

    spared = run_gc(store, keep_snapshots=1, apply=True, say=lambda s: None)  # default age: young orphans kept
    assert not spared.orphans and spared.young_orphans == len(lin.orphans)
    plan = run_gc(store, keep_snapshots=1, apply=True, min_orphan_age_s=0, say=lambda s: None)
    assert sorted(plan.orphans) == sorted(lin.orphans)
    assert read_lineage(store).orphans == []
    assert verify_run(store).ok and verify_run(store).warnings == []


def _one_segment_key(store: Store, v: int) -> str:
    return next(k for k in store.list(version_dir("delta", v)) if k.endswith(".safetensors"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_segment_is_named_and_nothing_applied(any_store: Store, damage: str) -> None:
    run = Run(any_store)
    run.step(2)
    key = _one_segment_key(any_store, 2)
    data = any_store.get(key)
    if damage == "flip":
        any_store.put(key, data[:100] + bytes([data[100] ^ 1]) + data[101:], mode="overwrite")
    elif damage == "truncate":
        any_store.put(key, data[: len(data) // 2], mode="overwrite")
    else:
        any_store.delete(key)
    held = fused(run.plan, run.weights[1])
    before = weights_digest(held)
    expected = ObjectNotFound if damage == "delete" else IntegrityError
    with pytest.raises(expected) as ei:
        m, staged = fetch_delta(any_store, 2, FusedWeights(held).specs(), expect_base_state=run.states[1])
        apply_delta(staged, FusedWeights(held))
    assert key in str(ei.value)
    assert weights_digest(held) == before
    rep = verify_run(any_store)
    assert not rep.ok and any(key in p for p in rep.problems)


def test_wrong_base_is_refused(any_store: Store) -> None:
    run = Run(any_store)
    run.step(2)
    with pytest.raises(ChainError, match="base_state"):
        fetch_delta(any_store, 2, run.plan.specs(), expect_base_state=run.states[0])


def test_forged_manifest_with_wrong_base_state_fails_verify(any_store: Store) -> None:
    """A delta whose base_state is not the state of V-1: verify names it."""
    run = Run(any_store)
    run.step(1)
    bogus = "sha256:" + "0" * 64
    w2 = run.master.step(lr=2.5e-7)
    publish_delta(any_store, "t", 2, extract(run.plan, run.weights[1], w2), bogus, CFG)
    rep = verify_run(any_store)
    assert not rep.ok
    assert any(manifest_key("delta", 2) in p and "base_state" in p for p in rep.problems)


def test_bucket_prefix_with_other_runs(s3_server, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    opts = s3_server.storage_options()
    a = open_store(f"s3://{s3_bucket}/runs/r1", opts)
    b = open_store(f"s3://{s3_bucket}/runs/r10", opts)  # a sibling sharing the string prefix
    ra, rb = Run(a, seed=1), Run(b, seed=2)
    ra.step(2)
    rb.step(4)
    rb.snapshot(4)
    assert scan_versions(a).deltas == {1, 2} and scan_versions(a).snapshots == {0}
    assert [r.version for r in read_lineage(a).rows] == [0, 1, 2]
    assert read_lineage(a).orphans == []
    run_gc(a, keep_snapshots=1, apply=True, min_orphan_age_s=0, say=lambda s: None)
    assert scan_versions(b).deltas == {1, 2, 3, 4}
    tensors, state = materialize(b, 4)
    assert state == rb.states[4] and weights_digest(tensors) == rb.digest(4)


def test_gc_keeps_what_retained_chains_need(any_store: Store) -> None:
    run = Run(any_store)
    run.step(2)
    run.snapshot(2)
    run.step(2)
    run.snapshot(4)
    run.step(1)
    plan = run_gc(any_store, keep_snapshots=1, apply=False, min_orphan_age_s=0, say=lambda s: None)
    # Delta 4 stays: it binds snapshot 4 (FORMAT.md §4.1).
    assert sorted(plan.versions) == [("delta", 1), ("delta", 2), ("delta", 3), ("snapshot", 0), ("snapshot", 2)]
    assert scan_versions(any_store).deltas == {1, 2, 3, 4, 5}  # dry run removed nothing
    run_gc(any_store, keep_snapshots=2, apply=True, min_orphan_age_s=0, say=lambda s: None)
    index = scan_versions(any_store)
    assert index.snapshots == {2, 4} and index.deltas == {2, 3, 4, 5}
    tensors, state = materialize(any_store, 5)
    assert state == run.states[5] and weights_digest(tensors) == run.digest(5)
    assert verify_run(any_store).ok


def test_cli_on_s3_never_leaks_credentials(s3_server, s3_bucket, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    from aurora_tools.cli import main

    w0 = make_weights(QWEN3_TINY, seed=3)
    master = MasterWeights(w0, seed=3)
    files = [tmp_path / f"w{i}.safetensors" for i in range(3)]
    save_file(w0, str(files[0]))
    save_file(master.step(lr=2.5e-7), str(files[1]))
    save_file(master.step(lr=2.5e-7), str(files[2]))
    secret = s3_server.storage_options()["secret"]
    url = f"s3://{s3_bucket}/cli-run"
    so = [
        "--storage-option",
        f"endpoint_url={s3_server.endpoint}",
        "--storage-option",
        "key=testing",
        "--storage-option",
        f"secret={secret}",
    ]
    assert main(["snapshot", "create", str(files[0]), "--store", url, "--version", "0", *so]) == 0
    for v in (1, 2):
        assert main(["delta", "create", str(files[v - 1]), str(files[v]), "--store", url, "--version", str(v), *so]) == 0
    out = tmp_path / "v2.safetensors"
    assert main(["delta", "apply", "--store", url, "--version", "2", "--out", str(out), *so]) == 0
    plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in w0.items()})
    assert weights_digest(load_file(str(out))) == weights_digest(load_file(str(files[2])), plan)
    capsys.readouterr()
    assert main(["lineage", url, "--json", *so]) == 0
    lin = json.loads(capsys.readouterr().out)
    assert [r["version"] for r in lin["versions"]] == [0, 1, 2]
    assert all(0.001 < r["density"] < 0.05 for r in lin["versions"] if r["kind"] == "delta")
    assert main(["verify", url, "--deep", *so]) == 0
    store = open_store(url, s3_server.storage_options())
    for key in store.list():
        assert secret.encode() not in store.get(key), key


def test_verify_cli_exit_status_names_object(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from aurora_tools.cli import main

    store = open_store(f"file://{tmp_path}/run")
    run = Run(store)
    run.step(2)
    assert main(["verify", store.url]) == 0
    key = _one_segment_key(store, 1)
    os.remove(f"{tmp_path}/run/{key}")
    capsys.readouterr()
    assert main(["verify", store.url, "--from", "1", "--to", "2"]) == 1
    out = capsys.readouterr().out
    assert key in out and "FAILED" in out


def test_memory_store_is_isolated_per_root() -> None:
    a = open_store(f"memory://aurora-{uuid.uuid4().hex}/run")
    b = open_store(f"memory://aurora-{uuid.uuid4().hex}/run")
    a.put("x", b"1")
    assert not b.exists("x") and a.list() == ["x"]


def test_materialize_plans_around_a_damaged_snapshot(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    run = Run(store)
    run.step(3)
    run.snapshot(3)
    run.step(1)
    m = read_manifest(store, "snapshot", 3)
    shard = tmp_path / "run" / version_dir("snapshot", 3) / m.segments[0].key
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.chmod(0o644)
    shard.write_bytes(bytes(data))
    notes: list[str] = []
    tensors, state = materialize(store, 4, progress=notes.append)
    assert state == run.states[4] and weights_digest(tensors) == run.digest(4)
    assert any("snapshot 3 is unusable" in n for n in notes) and any(n.startswith("snapshot 0:") for n in notes)


def test_read_ahead_keeps_order_raises_in_place_and_stops_its_producer() -> None:
    """Extraction runs ahead of encoding on its own thread (publish_delta with a set segment size):
    items come in order, a producer's error comes after the items before it, and a consumer that
    stops early stops the producer and closes its iterator."""
    import threading

    from aurora_store.lineage.publish import read_ahead

    threads: set[str] = set()

    def numbers(n: int, fail_at: int | None = None) -> Iterator[int]:
        for i in range(n):
            threads.add(threading.current_thread().name)
            if i == fail_at:
                raise RuntimeError(f"scan failed at {i}")
            yield i

    assert list(read_ahead(numbers(50), 3, "t-ahead")) == list(range(50))
    assert threads == {"t-ahead"}

    got: list[int] = []
    with pytest.raises(RuntimeError, match="scan failed at 7"):
        for x in read_ahead(numbers(50, fail_at=7), 2, "t-ahead"):
            got.append(x)
    assert got == list(range(7))

    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()

    it = read_ahead(endless(), 2, "t-ahead")
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    it.close()  # the consumer stops: the producer is stopped, its generator closed, the thread joined
    assert closed.is_set()
    assert not any(t.name == "t-ahead" for t in threading.enumerate())
    with pytest.raises(ValueError):
        next(read_ahead([], 0, "t-ahead"))
