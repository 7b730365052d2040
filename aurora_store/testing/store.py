"""The store conformance suite: what every :class:`~aurora_store.storage.Store` backend promises.

Shipped in the package, as ``zarr.testing.store`` is, so that a new backend
(in this repository or outside it) is checked against the same promises as
the ones we ship. Subclass :class:`StoreConformance` in a test module and
override :meth:`~StoreConformance.make_store`::

    class TestLocalStore(StoreConformance):
        def make_store(self, request):
            return open_store(f"file://{request.getfixturevalue('tmp_path')}/run")

pytest collects the subclass (its name starts with ``Test``), never the base.
The promises: a create-only put, a retried create with the same bytes
succeeds, different bytes raise :class:`~aurora_store.errors.VersionConflict`
and leave the first object, ranged reads, recursive listing under a prefix,
writers' temporary files hidden from listing and lookup, a missing object
raises :class:`~aurora_store.errors.ObjectNotFound`, keys cannot leave the
run root, and concurrent creates of one key have one winner.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator

import pytest

from aurora_store.errors import ObjectNotFound, StoreError, VersionConflict
from aurora_store.storage import TEMP_PREFIX, Store

__all__ = ["StoreConformance"]


class StoreConformance:
    """Base class of each backend's conformance tests (pytest style)."""

    #: Writers racing on one key in :meth:`test_concurrent_creates_have_one_winner`.
    racers: int = 8

    def make_store(self, request: pytest.FixtureRequest) -> Store:
        """A fresh, empty run root on the backend under test. Override this;
        ``request.getfixturevalue`` reaches any fixture it needs (``tmp_path``,
        a server)."""
        raise NotImplementedError(f"{type(self).__name__} must override make_store")

    def destroy_store(self, store: Store) -> None:
        """Remove everything under the run root after a test."""
        with contextlib.suppress(FileNotFoundError):
            store.fs.rm(store.root, recursive=True)

    def leave_temp_file(self, store: Store, key: str) -> None:
        """Leave what a writer killed half-way through creating ``key`` would:
        a temporary file beside it (the local backend's kind; backends that
        write atomically on the server still hide such names)."""
        folder, _, _name = key.rpartition("/")
        name = f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        path = f"{store.root}/{folder}/{name}" if folder else f"{store.root}/{name}"
        store.fs.pipe_file(path, b"partial")

    @pytest.fixture
    def store(self, request: pytest.FixtureRequest) -> Iterator[Store]:
        s = self.make_store(request)
        yield s
        self.destroy_store(s)

    # ------------------------------------------------------------------
    # create-only writes

    def test_put_get_round_trip(self, store: Store) -> None:
        store.put("deltas/v0000000001/abc/seg-00000.safetensors", b"hello world")
        assert store.get("deltas/v0000000001/abc/seg-00000.safetensors") == b"hello world"
        assert store.exists("deltas/v0000000001/abc/seg-00000.safetensors")
        assert store.size("deltas/v0000000001/abc/seg-00000.safetensors") == 11
        assert not store.exists("deltas/v0000000001/abc/seg-00001.safetensors")

    def test_put_empty_object(self, store: Store) -> None:
        store.put("k/empty", b"")
        assert store.get("k/empty") == b"" and store.size("k/empty") == 0

    def test_create_retry_with_same_bytes_succeeds(self, store: Store) -> None:
        store.put("k/manifest.json", b"same")
        store.put("k/manifest.json", b"same")  # a retry whose first answer was lost
        assert store.get("k/manifest.json") == b"same"

    def test_create_with_different_bytes_conflicts(self, store: Store) -> None:
        store.put("k/manifest.json", b"first")
        with pytest.raises(VersionConflict) as ei:
            store.put("k/manifest.json", b"second")
        assert isinstance(ei.value, FileExistsError)
        assert "k/manifest.json" in str(ei.value) and ei.value.key.endswith("k/manifest.json")
        assert store.get("k/manifest.json") == b"first"

    def test_overwrite_mode_replaces(self, store: Store) -> None:
        store.put("k/x", b"first")
        store.put("k/x", b"second", mode="overwrite")
        assert store.get("k/x") == b"second"
        with pytest.raises(ValueError):
            store.put("k/x", b"third", mode="append")
        assert store.get("k/x") == b"second"

    def test_concurrent_creates_have_one_winner(self, store: Store) -> None:
        results: list[str] = []
        barrier = threading.Barrier(self.racers)

        def go(i: int) -> None:
            barrier.wait()
            try:
                store.put("race/manifest.json", f"writer {i}".encode())
                results.append("ok")
            except VersionConflict:
                results.append("conflict")

        threads = [threading.Thread(target=go, args=(i,)) for i in range(self.racers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results.count("ok") == 1 and results.count("conflict") == self.racers - 1
        assert store.get("race/manifest.json").startswith(b"writer ")

    # ------------------------------------------------------------------
    # reads

    def test_ranged_reads(self, store: Store) -> None:
        store.put("r/obj", bytes(range(100)))
        assert store.get_range("r/obj", 10, 20) == bytes(range(10, 20))
        assert store.get_range("r/obj", 0, 1) == b"\x00"
        assert store.get_range("r/obj", 90, 100) == bytes(range(90, 100))
        assert store.get_range("r/obj", 0, 100) == bytes(range(100))
        with pytest.raises(ValueError):
            store.get_range("r/obj", 20, 10)

    def test_missing_object_is_object_not_found(self, store: Store) -> None:
        calls = {
            "get": lambda: store.get("nope/x"),
            "get_range": lambda: store.get_range("nope/x", 0, 1),
            "size": lambda: store.size("nope/x"),
        }
        for name, call in calls.items():
            with pytest.raises(ObjectNotFound) as ei:
                call()
            assert isinstance(ei.value, FileNotFoundError), name
            assert isinstance(ei.value, StoreError), name
            assert "nope/x" in str(ei.value), name
        assert not store.exists("nope/x")
        assert store.modified("nope/x") is None

    def test_modified_time_of_an_object(self, store: Store) -> None:
        store.put("m/x", b"1")
        t = store.modified("m/x")
        assert t is None or t > 0

    # ------------------------------------------------------------------
    # listing

    def test_listing_is_recursive_under_a_prefix(self, store: Store) -> None:
        keys = [
            "deltas/v0000000002/manifest.json",
            "deltas/v0000000001/aaaa/seg-00001.safetensors",
            "deltas/v0000000001/aaaa/seg-00000.safetensors",
            "deltas/v0000000001/manifest.json",
            "snapshots/v0000000000/manifest.json",
        ]
        for k in keys:
            store.put(k, k.encode())
        assert store.list() == sorted(keys)
        assert store.list("deltas/v0000000001") == sorted(k for k in keys if k.startswith("deltas/v0000000001"))
        assert store.list("deltas/v0000000001/") == store.list("deltas/v0000000001")
        assert store.list("snapshots") == ["snapshots/v0000000000/manifest.json"]
        assert store.list("nothing/here") == []
        assert store.list_dirs("deltas") == ["v0000000001", "v0000000002"]
        assert store.list_dirs("missing") == []

    def test_empty_root_lists_nothing(self, store: Store) -> None:
        assert store.list() == []

    def test_delete(self, store: Store) -> None:
        store.put("d/a", b"a")
        store.put("d/b", b"b")
        store.delete("d/a")
        assert not store.exists("d/a")
        assert store.list("d") == ["d/b"]
        store.delete("d/a")  # idempotent
        store.delete("never/was")

    def test_temporary_files_are_hidden(self, store: Store) -> None:
        store.put("t/done", b"whole")
        self.leave_temp_file(store, "t/done")
        self.leave_temp_file(store, "t/half")  # a create that never finished
        assert store.list("t") == ["t/done"]
        assert store.list() == ["t/done"]
        assert not store.exists("t/half")
        with pytest.raises(ObjectNotFound):
            store.get("t/half")
        store.put("t/half", b"now whole")  # the name is free for the next writer
        assert store.list("t") == ["t/done", "t/half"]

    # ------------------------------------------------------------------
    # keys

    @pytest.mark.parametrize("key", ["../escape", "a/../../escape", "a/..", "/abs/path", "a/b/../../../c"])
    def test_keys_leaving_the_root_are_refused(self, store: Store, key: str) -> None:
        with pytest.raises(ValueError):
            store.put(key, b"x")
        with pytest.raises(ValueError):
            store.get(key)
        with pytest.raises(ValueError):
            store.exists(key)

    def test_where_names_the_object(self, store: Store) -> None:
        assert store.where("x/y").endswith("/x/y")
        assert store.where("x/y").startswith(store.url.rstrip("/"))
