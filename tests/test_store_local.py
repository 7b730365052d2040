"""What the serverless store backends do beyond the conformance suite
(aurora_store/storage/: local.py, memory.py, base.py): temporary files,
backend choice, retries on the injected clock, and StoreConfig's
environment. The promises every backend keeps (create-only, conflicts,
ranges, listing, missing objects) are in tests/test_store_conformance.py,
run by aurora_store/testing/store.py."""

from __future__ import annotations

import os
import uuid

import pytest

from aurora_store.errors import ConfigError, ObjectNotFound, StoreError, VersionConflict
from aurora_store.storage import (
    LocalStore,
    MemoryStore,
    RemoteStore,
    S3Store,
    Store,
    StoreConfig,
    open_store,
)
from aurora_store.storage import local as local_backend
from aurora_store.testing.clock import ManualClock


def test_file_store_leaves_no_temp_files(file_store: Store) -> None:
    file_store.put("a/b", b"1")
    file_store.put("a/b", b"1")
    with pytest.raises(VersionConflict):
        file_store.put("a/b", b"2")
    assert os.listdir(os.path.join(file_store.root, "a")) == ["b"]
    assert file_store.list() == ["a/b"]


def test_failed_local_write_leaves_no_temp_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store(f"file://{tmp_path}/run", config=StoreConfig(retries=0))
    store.put("a/first", b"1")

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "disk on fire")

    monkeypatch.setattr(local_backend.os, "fsync", broken_fsync)
    with pytest.raises(StoreError, match="a/b"):
        store.put("a/b", b"never")
    assert sorted(os.listdir(tmp_path / "run" / "a")) == ["first"]
    assert not store.exists("a/b")


def test_local_overwrite_is_all_or_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An overwrite (Redis-commit repair, the commit marker) that fails half-way leaves the old
    bytes whole, never a torn object, and no temporary file (issue 24, item 10)."""
    store = open_store(f"file://{tmp_path}/run", config=StoreConfig(retries=0))
    store.put("m/manifest.json", b"old bytes, whole")

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "disk on fire")

    with monkeypatch.context() as m:
        m.setattr(local_backend.os, "fsync", broken_fsync)
        with pytest.raises(StoreError, match="manifest.json"):
            store.put("m/manifest.json", b"new bytes that never land", mode="overwrite")
    assert store.get("m/manifest.json") == b"old bytes, whole"
    assert sorted(os.listdir(tmp_path / "run" / "m")) == ["manifest.json"]
    store.put("m/manifest.json", b"new", mode="overwrite")
    assert store.get("m/manifest.json") == b"new"
    assert sorted(os.listdir(tmp_path / "run" / "m")) == ["manifest.json"]


def test_local_create_syncs_the_folder(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the link, the folder itself is fsynced (the new name is durable), and so is the
    parent of each folder the write created (the new folders are durable too)."""
    store = open_store(f"file://{tmp_path}/run")
    synced: list[str] = []
    real = local_backend._fsync_dir

    def record(folder: str) -> None:
        synced.append(folder)
        real(folder)

    monkeypatch.setattr(local_backend, "_fsync_dir", record)
    store.put("x/y", b"z")
    # run/ and run/x/ were created: their entries in tmp_path and run/, then the link in run/x/.
    assert synced == [str(tmp_path), store.root, os.path.join(store.root, "x")]
    store.put("x/y", b"z")  # the same bytes again: nothing new to make durable
    assert len(synced) == 3
    store.put("x/w", b"z")  # an existing folder: only the new link
    assert synced[3:] == [os.path.join(store.root, "x")]


def test_file_store_plain_path_and_where(tmp_path) -> None:
    s = open_store(str(tmp_path / "run"))
    s.put("x/y", b"z")
    assert (tmp_path / "run" / "x" / "y").read_bytes() == b"z"
    assert s.where("x/y").endswith("run/x/y")


def test_memory_stores_are_separate_by_root() -> None:
    a = open_store(f"memory://t-{uuid.uuid4().hex}")
    b = open_store(f"memory://t-{uuid.uuid4().hex}")
    a.put("k", b"a")
    assert not b.exists("k")
    b.put("k", b"b")
    assert a.get("k") == b"a" and b.get("k") == b"b"
    a.fs.rm(a.root, recursive=True)
    b.fs.rm(b.root, recursive=True)


def test_two_memory_stores_on_one_root_have_one_winner() -> None:
    url = f"memory://t-{uuid.uuid4().hex}"
    a, b = open_store(url), open_store(url)
    a.put("k", b"a")
    with pytest.raises(VersionConflict):
        b.put("k", b"b")
    b.put("k", b"a")
    a.fs.rm(a.root, recursive=True)


def test_open_store_picks_the_backend_from_the_url(tmp_path) -> None:
    assert type(open_store(str(tmp_path))) is LocalStore
    assert type(open_store(f"file://{tmp_path}")) is LocalStore
    assert type(open_store(f"memory://t-{uuid.uuid4().hex}")) is MemoryStore
    s3 = open_store("s3://bucket/run", {"anon": True})
    assert type(s3) is S3Store and s3.root == "bucket/run" and s3.protocol == "s3"
    other = open_store(f"simplecache::file://{tmp_path}")
    assert type(other) is RemoteStore
    assert repr(open_store(str(tmp_path))) == f"Store({str(tmp_path)!r})"


def test_unknown_protocol_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cannot open store"):
        open_store("nosuchprotocol-aurora://x/y")


class FlakyCat:
    """An fsspec filesystem whose first ``fail`` reads raise a transient error."""

    def __init__(self, fs: object, fail: int, exc: BaseException) -> None:
        self._fs = fs
        self.fail = fail
        self.exc = exc
        self.calls = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._fs, name)

    def cat_file(self, *args: object, **kwargs: object) -> bytes:
        self.calls += 1
        if self.calls <= self.fail:
            raise self.exc
        return self._fs.cat_file(*args, **kwargs)  # type: ignore[attr-defined]


def test_transient_failures_are_retried_on_the_clock(memory_store: Store) -> None:
    clock = ManualClock(instant=True)
    cfg = StoreConfig(retries=3, backoff_s=0.5, backoff_max_s=1.5)
    store = open_store(memory_store.url, config=cfg, clock=clock)
    store.put("k", b"v")
    flaky = FlakyCat(store.fs, fail=3, exc=ConnectionError("reset"))
    store.fs = flaky
    assert store.get("k") == b"v"
    assert flaky.calls == 4 and len(clock.waited) == 3
    # Doubling from backoff_s, capped at backoff_max_s, jittered downwards by at most half.
    for wait, cap in zip(clock.waited, (0.5, 1.0, 1.5), strict=True):
        assert cap / 2 <= wait <= cap


def test_retries_give_up_with_a_store_error(memory_store: Store) -> None:
    clock = ManualClock(instant=True)
    store = open_store(memory_store.url, config=StoreConfig(retries=2), clock=clock)
    store.put("k", b"v")
    store.fs = FlakyCat(store.fs, fail=10, exc=TimeoutError("slow"))
    with pytest.raises(StoreError, match="failed after 3 attempts") as ei:
        store.get("k")
    assert isinstance(ei.value.__cause__, TimeoutError)
    assert len(clock.waited) == 2


def test_answers_are_not_retried(memory_store: Store) -> None:
    clock = ManualClock(instant=True)
    store = open_store(memory_store.url, clock=clock)
    store.fs = FlakyCat(store.fs, fail=10, exc=FileNotFoundError("gone"))
    with pytest.raises(ObjectNotFound):
        store.get("k")
    assert clock.waited == []


def test_store_config_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AURORA_STORE_RETRIES", "7")
    monkeypatch.setenv("AURORA_STORE_BACKOFF_S", "0.5")
    monkeypatch.setenv("AURORA_STORE_MAX_CONNECTIONS", "64")
    cfg = StoreConfig.from_env(retries=2, read_timeout_s=None)
    assert cfg == StoreConfig(retries=2, backoff_s=0.5, max_connections=64)
    assert cfg.backoff.initial_s == 0.5 and cfg.backoff.max_s == 10.0
    monkeypatch.setenv("AURORA_STORE_CONNECT_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="AURORA_STORE_CONNECT_TIMEOUT_S"):
        StoreConfig.from_env()
    monkeypatch.delenv("AURORA_STORE_CONNECT_TIMEOUT_S")
    monkeypatch.setenv("AURORA_STORE_RETRIES", "-1")
    with pytest.raises(ConfigError):
        StoreConfig.from_env()
    with pytest.raises(TypeError):
        StoreConfig.from_env(no_such_field=1)
