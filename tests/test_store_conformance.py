"""Every store backend against the conformance suite (aurora_store/testing/store.py).

Local files and memory need no server; S3 runs against a real S3-protocol
server on a loopback port (moto, ``server`` marker). No torch here.
"""

from __future__ import annotations

import socket
import uuid

import pytest

from aurora_store.errors import ObjectNotFound, StoreError
from aurora_store.storage import LocalStore, MemoryStore, S3Store, Store, StoreConfig, open_store
from aurora_store.testing.servers import S3Server
from aurora_store.testing.store import StoreConformance


class TestLocalStore(StoreConformance):
    def make_store(self, request: pytest.FixtureRequest) -> Store:
        store = open_store(f"file://{request.getfixturevalue('tmp_path')}/run")
        assert isinstance(store, LocalStore)
        return store


class TestLocalStorePlainPath(StoreConformance):
    def make_store(self, request: pytest.FixtureRequest) -> Store:
        store = open_store(str(request.getfixturevalue("tmp_path") / "run"))
        assert isinstance(store, LocalStore)
        return store


class TestMemoryStore(StoreConformance):
    def make_store(self, request: pytest.FixtureRequest) -> Store:
        # The memory filesystem is process-wide: a unique root per test.
        store = open_store(f"memory://aurora-conformance-{uuid.uuid4().hex}/run")
        assert isinstance(store, MemoryStore)
        return store


@pytest.mark.server
class TestS3Store(StoreConformance):
    def make_store(self, request: pytest.FixtureRequest) -> Store:
        server: S3Server = request.getfixturevalue("s3_server")
        store = open_store(f"s3://{server.new_bucket()}/prefix/run", server.storage_options())
        assert isinstance(store, S3Store)
        return store


# --- S3 error translation (botocore/s3fs -> aurora_store.errors) ------------------


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_s3_unreachable_endpoint_is_retried_then_a_store_error() -> None:
    """botocore's connection errors are transient: retried, then a StoreError."""
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{_closed_port()}", "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    cfg = StoreConfig(retries=1, backoff_s=0.0, backoff_max_s=0.0, connect_timeout_s=2.0)
    store = open_store("s3://bucket/run", options, config=cfg)
    with pytest.raises(StoreError, match="failed after 2 attempts") as ei:
        store.get("k")
    assert isinstance(ei.value.__cause__, ConnectionError)


@pytest.mark.server
def test_s3_missing_bucket_is_object_not_found(s3_server: S3Server) -> None:
    store = open_store(f"s3://aurora-missing-{uuid.uuid4().hex[:8]}/run", s3_server.storage_options())
    with pytest.raises(ObjectNotFound):
        store.get("k")
    assert store.list() == []
