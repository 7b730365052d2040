"""Server fixtures: a real S3-protocol server (moto) on a free loopback port.

Imported by conftest.py; kept apart so the server section stays readable.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from aurora_store.storage import Store, open_store
from aurora_store.testing.servers import S3Server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket per test."""
    return s3_server.new_bucket()


@pytest.fixture
def s3_store(s3_server: S3Server, s3_bucket: str) -> Store:
    return open_store(f"s3://{s3_bucket}/runs/run-{uuid.uuid4().hex[:6]}", s3_server.storage_options())


@pytest.fixture(params=["memory", "file", "s3"])
def any_store(request: pytest.FixtureRequest, tmp_path) -> Store:  # type: ignore[no-untyped-def]
    """The same run root API on every backend."""
    if request.param == "memory":
        return open_store(f"memory://aurora-{uuid.uuid4().hex}/run")
    if request.param == "file":
        return open_store(f"file://{tmp_path}/run")
    server: S3Server = request.getfixturevalue("s3_server")
    return open_store(f"s3://{server.new_bucket()}/prefix/run", server.storage_options())
