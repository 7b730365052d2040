"""Redis fixtures: a real ``redis-server`` on a free loopback port.

Registered by conftest.py (``pytest_plugins``): a test asks for them by name.
Nothing starts until a test does, so a run that never touches Redis never
starts a server.

- ``redis_server``: one server for the whole session (port 0 style: a free
  port the kernel handed out, never a fixed one).
- ``redis_url``: its URL.
- ``redis_client``: a command client on a server flushed before the test.
- ``run_name``: a run name unique to the test, so two tests never share keys
  even if a flush is skipped.
- ``own_redis_server``: a server of the test's own, for tests that restart
  Redis (a restart would break the session server under other tests).
- ``dead_redis_url``: a loopback URL nothing listens on (Redis away).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from aurora_store.coordination.redisconn import connect
from aurora_store.testing.servers import RedisServer, free_port


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[Any]:
    """A client of the session server, flushed before the test."""
    client = connect(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def run_name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A server only this test uses (and may restart)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def dead_redis_url() -> str:
    """A free loopback port: connecting is refused, as with a Redis that is down."""
    return f"redis://127.0.0.1:{free_port()}/0"
