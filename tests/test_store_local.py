"""The object store on serverless backends: ``memory://`` and ``file://``
(aurora_store/store.py). S3 runs against a real server in the server tests."""

from __future__ import annotations

import os
import threading

import pytest

from aurora_store.errors import ObjectNotFound, StoreError, VersionConflict
from aurora_store.storage.store import open_store


def test_put_get_round_trip(local_store) -> None:
    local_store.put("deltas/v0000000001/abc/seg-00000.safetensors", b"hello world")
    assert local_store.get("deltas/v0000000001/abc/seg-00000.safetensors") == b"hello world"
    assert local_store.exists("deltas/v0000000001/abc/seg-00000.safetensors")
    assert local_store.size("deltas/v0000000001/abc/seg-00000.safetensors") == 11
    assert not local_store.exists("deltas/v0000000001/abc/seg-00001.safetensors")


def test_create_is_idempotent_for_same_bytes(local_store) -> None:
    local_store.put("k/manifest.json", b"same")
    local_store.put("k/manifest.json", b"same")  # a retry whose first answer was lost
    assert local_store.get("k/manifest.json") == b"same"


def test_create_refuses_different_bytes(local_store) -> None:
    local_store.put("k/manifest.json", b"first")
    with pytest.raises(VersionConflict) as ei:
        local_store.put("k/manifest.json", b"second")
    assert isinstance(ei.value, FileExistsError)
    assert "k/manifest.json" in str(ei.value)
    assert local_store.get("k/manifest.json") == b"first"


def test_overwrite_mode_replaces(local_store) -> None:
    local_store.put("k/x", b"first")
    local_store.put("k/x", b"second", mode="overwrite")
    assert local_store.get("k/x") == b"second"
    with pytest.raises(ValueError):
        local_store.put("k/x", b"third", mode="append")


def test_concurrent_creates_one_winner(local_store) -> None:
    results: list[str] = []
    barrier = threading.Barrier(8)

    def go(i: int) -> None:
        barrier.wait()
        try:
            local_store.put("race/manifest.json", f"writer {i}".encode())
            results.append("ok")
        except VersionConflict:
            results.append("conflict")

    threads = [threading.Thread(target=go, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("ok") == 1 and results.count("conflict") == 7
    assert local_store.get("race/manifest.json").startswith(b"writer ")


def test_get_range(local_store) -> None:
    local_store.put("r/obj", bytes(range(100)))
    assert local_store.get_range("r/obj", 10, 20) == bytes(range(10, 20))
    assert local_store.get_range("r/obj", 0, 1) == b"\x00"
    assert local_store.get_range("r/obj", 90, 100) == bytes(range(90, 100))


def test_missing_objects(local_store) -> None:
    for call in (
        lambda: local_store.get("nope/x"),
        lambda: local_store.get_range("nope/x", 0, 1),
        lambda: local_store.size("nope/x"),
    ):
        with pytest.raises(ObjectNotFound) as ei:
            call()
        assert isinstance(ei.value, FileNotFoundError) and isinstance(ei.value, StoreError)
        assert "nope/x" in str(ei.value)


def test_list_and_delete(local_store) -> None:
    keys = [
        "deltas/v0000000002/manifest.json",
        "deltas/v0000000001/aaaa/seg-00001.safetensors",
        "deltas/v0000000001/aaaa/seg-00000.safetensors",
        "deltas/v0000000001/manifest.json",
        "snapshots/v0000000000/manifest.json",
    ]
    for k in keys:
        local_store.put(k, k.encode())
    assert local_store.list() == sorted(keys)
    assert local_store.list("deltas/v0000000001") == sorted(
        k for k in keys if k.startswith("deltas/v0000000001")
    )
    assert local_store.list("deltas/v0000000001/") == local_store.list("deltas/v0000000001")
    assert local_store.list("nothing/here") == []
    assert local_store.list_dirs("deltas") == ["v0000000001", "v0000000002"]
    assert local_store.list_dirs("missing") == []
    local_store.delete("deltas/v0000000001/aaaa/seg-00000.safetensors")
    assert not local_store.exists("deltas/v0000000001/aaaa/seg-00000.safetensors")
    assert "deltas/v0000000001/aaaa/seg-00000.safetensors" not in local_store.list()
    local_store.delete("deltas/v0000000001/aaaa/seg-00000.safetensors")  # idempotent


@pytest.mark.parametrize(
    "key", ["../escape", "a/../../escape", "a/..", "/abs/path", "a/b/../../../c"]
)
def test_keys_leaving_the_root_refused(local_store, key: str) -> None:
    with pytest.raises(ValueError):
        local_store.put(key, b"x")
    with pytest.raises(ValueError):
        local_store.get(key)
    with pytest.raises(ValueError):
        local_store.exists(key)


def test_file_store_leaves_no_temp_files(file_store) -> None:
    file_store.put("a/b", b"1")
    file_store.put("a/b", b"1")
    with pytest.raises(VersionConflict):
        file_store.put("a/b", b"2")
    assert os.listdir(os.path.join(file_store.root, "a")) == ["b"]
    assert file_store.list() == ["a/b"]


def test_file_store_plain_path_and_where(tmp_path) -> None:
    s = open_store(str(tmp_path / "run"))
    s.put("x/y", b"z")
    assert (tmp_path / "run" / "x" / "y").read_bytes() == b"z"
    assert s.where("x/y").endswith("run/x/y")


def test_memory_stores_are_separate_by_root() -> None:
    import uuid

    a = open_store(f"memory://t-{uuid.uuid4().hex}")
    b = open_store(f"memory://t-{uuid.uuid4().hex}")
    a.put("k", b"a")
    assert not b.exists("k")
    b.put("k", b"b")
    assert a.get("k") == b"a" and b.get("k") == b"b"
    a.fs.rm(a.root, recursive=True)
    b.fs.rm(b.root, recursive=True)
