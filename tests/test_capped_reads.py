"""Every untrusted object is read as a range capped one byte past its allowed size (issue 24, hole 6).

A manifest of hundreds of MB, or a segment or shard far above the size its
manifest lists, must be refused without being read whole: from origin, from a
mirror, and by the Relay's copier. Local stores hold the giants as sparse
files (no disk, any size); the bytes a reader got are counted by wrapping the
store's read verbs, and one subprocess measures its peak resident memory.
The S3 case runs moto in a child process, so the reader's own allocations
(``tracemalloc``) are all that is measured.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
import uuid
from pathlib import Path

import pytest
import torch

from aurora_store.clock import SYSTEM_CLOCK
from aurora_store.codec.extract import extract, fuse_weights, plan_of
from aurora_store.coordination.evals import MAX_EVAL_BYTES, read_store_evals
from aurora_store.errors import IntegrityError, ManifestError, ObjectNotFound, ObjectTooLarge, VersionConflict
from aurora_store.format.limits import MAX_MANIFEST_BYTES
from aurora_store.format.manifest import Manifest, manifest_key, version_dir
from aurora_store.lineage.fetch import fetch_delta, fetch_snapshot, read_manifest
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.storage import Store, open_store
from aurora_store.testing.servers import S3Server
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights
from workers.common import MAX_MODEL_FILE_BYTES, _checked_model_file
from workers.relay.copier import COPIED, REJECTED, Copier, Traffic
from workers.relay.mirror import VersionMirror

MIB = 1 << 20
GIANT = 512 * MIB
"""A planted object's size on a local store (a sparse file: no disk used)."""


class Counted:
    """Counts the bytes a store's read verbs hand back (``get``, ``get_range`` and what is built on them)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.bytes = 0
        self._lock = threading.Lock()
        get, get_range = store.get, store.get_range

        def counted_get(key: str) -> bytes:
            return self._count(get(key))

        def counted_range(key: str, start: int, stop: int) -> bytes:
            return self._count(get_range(key, start, stop))

        store.get = counted_get  # type: ignore[method-assign]
        store.get_range = counted_range  # type: ignore[method-assign]

    def _count(self, data: bytes) -> bytes:
        with self._lock:
            self.bytes += len(data)
        return data


def plant_sparse(store: Store, key: str, size: int) -> None:
    """A file of ``size`` bytes (zeros, sparse) at ``key`` of a local store, replacing what is there."""
    path = Path(store._path(key))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


class LocalRun:
    """Snapshot 0 and delta 1 of the tiny model in a local store."""

    def __init__(self, root: Path) -> None:
        self.store = open_store(f"file://{root}")
        cfg = PublishConfig(streams=2, segment_bytes=4096)
        w = make_weights(QWEN3_TINY, seed=0)
        plan = plan_of(w, tied=False)
        self.snapshot = publish_snapshot(self.store, "t", 0, fuse_weights(w, plan), None, cfg)
        new = MasterWeights(w, seed=0).step(lr=2.5e-7)
        self.delta = publish_delta(self.store, "t", 1, extract(plan, w, new), self.snapshot.state, cfg)

    def object_key(self, m: Manifest, i: int = 0) -> str:
        return f"{version_dir(m.kind, m.version)}/{m.segments[i].key}"


# -- the verb ---------------------------------------------------------------------------------


def test_get_capped_reads_what_fits_and_refuses_one_byte_more(any_store: Store) -> None:
    any_store.put("a", b"hello")
    any_store.put("empty", b"")
    assert any_store.get_capped("a", 5) == b"hello"
    assert any_store.get_capped("a", 500) == b"hello"
    assert any_store.get_capped("empty", 0) == b""  # a ranged read of an empty object (S3 answers 416)
    with pytest.raises(ObjectTooLarge) as e:
        any_store.get_capped("a", 4, "the test's limit")
    assert e.value.limit == 4 and any_store.where("a") in str(e.value) and "the test's limit" in str(e.value)
    assert isinstance(e.value, IntegrityError)
    with pytest.raises(ObjectNotFound):
        any_store.get_capped("nothing", 10)


def test_get_capped_reads_no_more_than_the_limit_from_a_local_file(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    plant_sparse(store, "big", GIANT)
    counted = Counted(store)
    with pytest.raises(ObjectTooLarge):
        store.get_capped("big", 1000)
    assert counted.bytes == 1001


def test_a_create_that_meets_a_giant_reads_it_capped(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    plant_sparse(store, "k", GIANT)
    counted = Counted(store)
    with pytest.raises(VersionConflict):
        store.put("k", b"ours")
    assert counted.bytes == 5


# -- origin: manifests, segments, shards -------------------------------------------------------


def test_a_giant_manifest_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    run = LocalRun(tmp_path / "run")
    plant_sparse(run.store, manifest_key("delta", 2), GIANT)
    counted = Counted(run.store)
    with pytest.raises(ManifestError, match="limit"):
        read_manifest(run.store, "delta", 2)
    assert counted.bytes <= MAX_MANIFEST_BYTES + 1


def test_a_segment_far_above_its_listed_size_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    run = LocalRun(tmp_path / "run")
    ref = run.delta.segments[0]
    plant_sparse(run.store, run.object_key(run.delta), GIANT)
    counted = Counted(run.store)
    with pytest.raises(IntegrityError, match=str(ref.bytes)):
        fetch_delta(run.store, 1, None, streams=2, manifest=run.delta)
    # Every other segment whole, the planted one capped: never the giant.
    assert counted.bytes <= run.delta.total_bytes + 1


def test_a_shard_far_above_its_listed_size_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    run = LocalRun(tmp_path / "run")
    plant_sparse(run.store, run.object_key(run.snapshot), GIANT)
    counted = Counted(run.store)
    with pytest.raises(ObjectTooLarge):
        fetch_snapshot(run.store, 0, streams=2, manifest=run.snapshot)
    assert counted.bytes <= run.snapshot.total_bytes + 1


def test_s3_reads_a_range_not_the_whole_object() -> None:
    """moto in its own process: what this process allocates is the reader's alone."""
    with S3Server(process=True) as server:
        store = open_store(f"s3://{server.new_bucket()}/run", server.storage_options())
        big = MAX_MANIFEST_BYTES + 32 * MIB
        store.put(manifest_key("delta", 1), b" " * big)
        store.put("seg", os.urandom(1000))
        tracemalloc.start()
        try:
            with pytest.raises(ManifestError, match="limit"):
                read_manifest(store, "delta", 1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < MAX_MANIFEST_BYTES + 8 * MIB, f"{peak >> 20} MiB allocated to refuse a {big >> 20} MiB manifest"
        with pytest.raises(ObjectTooLarge):
            store.get_capped("seg", 999)


def test_peak_memory_of_a_reader_refusing_a_giant_manifest(tmp_path: Path) -> None:
    """A subprocess's peak resident memory: reading a normal manifest, then a 2 GiB one."""
    run = LocalRun(tmp_path / "run")
    plant_sparse(run.store, manifest_key("delta", 2), 4 * GIANT)
    script = textwrap.dedent(
        """
        import resource, sys
        from aurora_store.errors import ManifestError
        from aurora_store.lineage.fetch import read_manifest
        from aurora_store.storage import open_store
        store = open_store(sys.argv[1])
        try:
            read_manifest(store, "delta", int(sys.argv[2]))
        except ManifestError:
            pass
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        """
    )

    def peak_kib(version: int) -> int:
        out = subprocess.run([sys.executable, "-c", script, run.store.url, str(version)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.strip())

    normal, giant = peak_kib(1), peak_kib(2)
    assert giant - normal < 100 * 1024, f"{(giant - normal) >> 10} MiB more to refuse the giant manifest"


# -- a mirror, and the Relay's copier ------------------------------------------------------------


def test_a_giant_object_in_a_mirror_is_refused_by_a_reader(tmp_path: Path) -> None:
    run = LocalRun(tmp_path / "run")
    mirror = open_store(f"file://{tmp_path}/mirror")
    for key in run.store.list():
        mirror.put(key, run.store.get(key))
    plant_sparse(mirror, run.object_key(run.delta), GIANT)
    plant_sparse(mirror, manifest_key("delta", 2), GIANT)
    counted = Counted(mirror)
    with pytest.raises(IntegrityError):
        fetch_delta(mirror, 1, None, streams=2)
    with pytest.raises(ManifestError):
        read_manifest(mirror, "delta", 2)
    assert counted.bytes <= 2 * MAX_MANIFEST_BYTES + run.delta.total_bytes + 2


def _copier(origin: Store, mirror: Store) -> tuple[Copier, Traffic]:
    traffic = Traffic()
    return Copier(origin, mirror, 2, "eu", threading.Lock(), traffic, SYSTEM_CLOCK, lambda *a: None), traffic


def test_the_relay_copier_refuses_a_giant_object_at_origin_without_reading_it_whole(tmp_path: Path) -> None:
    run = LocalRun(tmp_path / "run")
    mirror = open_store(f"file://{tmp_path}/mirror")
    ref = run.delta.segments[0]
    key = run.object_key(run.delta)
    plant_sparse(run.store, key, GIANT)
    counted = Counted(run.store)
    copier, traffic = _copier(run.store, mirror)
    try:
        assert copier.copy_async(key, ref.bytes, ref.sha256).result(timeout=60) == REJECTED
    finally:
        copier.shutdown()
    assert counted.bytes <= ref.bytes + 1 and traffic.bytes_fetched <= ref.bytes + 1
    assert not mirror.exists(key) and traffic.segments_rejected == 1


def test_the_relay_copier_checks_a_giant_object_already_in_the_mirror_without_reading_it_whole(tmp_path: Path) -> None:
    run = LocalRun(tmp_path / "run")
    mirror = open_store(f"file://{tmp_path}/mirror")
    ref = run.delta.segments[0]
    key = run.object_key(run.delta)
    plant_sparse(mirror, key, GIANT)
    counted = Counted(mirror)
    copier, _ = _copier(run.store, mirror)
    try:
        assert copier.copy_async(key, ref.bytes, ref.sha256).result(timeout=60) == REJECTED
        other = run.snapshot.segments[0]  # an object the mirror lacks is still copied
        assert copier.copy_async(run.object_key(run.snapshot), other.bytes, other.sha256).result(timeout=60) == COPIED
    finally:
        copier.shutdown()
    assert counted.bytes <= ref.bytes + 1


def test_the_relay_does_not_copy_a_giant_model_file(tmp_path: Path) -> None:
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    plant_sparse(origin, "model/config.json", GIANT)
    counted = Counted(origin)
    copier, _ = _copier(origin, mirror)
    try:
        copier.copy_plain("model/config.json")  # refused, logged: the Relay goes on
    finally:
        copier.shutdown()
    assert counted.bytes == MAX_MODEL_FILE_BYTES + 1 and not mirror.exists("model/config.json")


def test_the_relay_refuses_a_giant_manifest_at_origin_without_reading_it_whole(tmp_path: Path) -> None:
    run = LocalRun(tmp_path / "run")
    mirror = open_store(f"file://{tmp_path}/mirror")
    plant_sparse(run.store, manifest_key("delta", 2), GIANT)
    counted = Counted(run.store)
    lock, traffic = threading.Lock(), Traffic()
    copier = Copier(run.store, mirror, 2, "eu", lock, traffic, SYSTEM_CLOCK, lambda *a: None)
    vm = VersionMirror(run.store, mirror, copier, "eu", 0.1, lock, traffic, SYSTEM_CLOCK, lambda *a, **k: None, lambda *a: None)
    try:
        assert vm.mirror_version("delta", 2) is False
    finally:
        copier.shutdown()
    assert counted.bytes <= MAX_MANIFEST_BYTES + 1
    assert not mirror.exists(manifest_key("delta", 2))


# -- the other readers ---------------------------------------------------------------------------


def test_a_giant_model_file_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    plant_sparse(store, "model/config.json", GIANT)
    counted = Counted(store)
    with pytest.raises(ObjectTooLarge):
        _checked_model_file(store, "model/config.json", None, "nowhere")
    assert counted.bytes == MAX_MODEL_FILE_BYTES + 1


def test_a_giant_evaluation_record_is_skipped_without_reading_it_whole(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    store.put("eval/v1.json", b'{"accuracy": 0.5}')
    plant_sparse(store, "eval/v2.json", GIANT)
    counted = Counted(store)
    # Replaced by a giant between its listing and its read: the size check alone would not catch it.
    size = store.size
    store.size = lambda key: 10 if key.endswith("v2.json") else size(key)  # type: ignore[method-assign]
    assert list(read_store_evals(store)) == [1]
    assert counted.bytes <= 2 * (MAX_EVAL_BYTES + 1)


def test_the_lineage_report_refuses_a_giant_manifest_without_reading_it_whole(tmp_path: Path) -> None:
    from aurora_store.lineage.report import read_lineage

    run = LocalRun(tmp_path / "run")
    plant_sparse(run.store, manifest_key("delta", 2), GIANT)
    counted = Counted(run.store)
    lin = read_lineage(run.store)
    assert any("limit" in p for p in lin.problems)
    assert counted.bytes <= 3 * (MAX_MANIFEST_BYTES + 1)


def test_a_checkpoint_shard_far_above_its_listed_size_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    from workers.trainer.checkpoint import CHECKPOINTS, Checkpoint, load_checkpoint, save_checkpoint

    store = open_store(f"file://{tmp_path}/run")
    save_checkpoint(store, Checkpoint(step=3, epoch=1, tensors={"w": torch.ones(64)}))
    shard = next(k for k in store.list(CHECKPOINTS) if k.endswith(".bin"))
    listed = len(store.get(shard))
    plant_sparse(store, shard, GIANT)
    counted = Counted(store)
    with pytest.raises(IntegrityError):
        load_checkpoint(store, 3)
    assert counted.bytes <= MAX_MANIFEST_BYTES + listed + 2


def test_redis_commit_repair_reads_a_giant_manifest_capped(tmp_path: Path) -> None:
    from aurora_store.coordination.commit import _stored_manifest

    store = open_store(f"file://{tmp_path}/run-{uuid.uuid4().hex[:6]}")
    plant_sparse(store, manifest_key("delta", 1), GIANT)
    counted = Counted(store)
    assert _stored_manifest(store, "delta", 1) == b""
    assert counted.bytes == MAX_MANIFEST_BYTES + 1


def test_the_commit_marker_is_read_capped(tmp_path: Path) -> None:
    from aurora_store.storage.probe import COMMIT_MARKER_KEY, read_commit_marker

    store = open_store(f"file://{tmp_path}/run")
    plant_sparse(store, COMMIT_MARKER_KEY, GIANT)
    counted = Counted(store)
    assert read_commit_marker(store) == "?"
    assert counted.bytes <= 4096
