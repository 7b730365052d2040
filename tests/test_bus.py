"""Announcements on Redis streams against a real redis-server."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis.exceptions

from aurora_store.coordination.bus import COMMIT, SEGMENT, VERSION, Bus, BusGap
from aurora_store.coordination.redisconn import RedisConfig, connect
from aurora_store.errors import AuroraError, CoordinationError, RedisUnavailable
from aurora_store.testing.servers import RedisServer

pytestmark = pytest.mark.server


@pytest.fixture
def bus(redis_client: Any, run_name: str) -> Bus:
    return Bus(redis_client, run_name)


def test_announce_read_round_trip(bus: Bus) -> None:
    eid = bus.announce(SEGMENT, 3, key="runs/x/v3/seg-0", bytes=1234, sha256="ab" * 32, index=0)
    assert isinstance(eid, str) and "-" in eid
    (ev,) = bus.read()
    assert (ev.id, ev.type, ev.version) == (eid, SEGMENT, 3)
    assert ev.get("key") == "runs/x/v3/seg-0"
    assert ev.get("bytes") == "1234" and ev.get("index") == "0"  # flat string maps
    assert ev.get("sha256") == "ab" * 32
    assert ev.get("missing", "dflt") == "dflt"


def test_resume_from_the_last_id(bus: Bus) -> None:
    ids = [bus.announce(SEGMENT, 5, index=i) for i in range(3)]
    first = bus.read()
    assert [e.id for e in first] == ids
    more = [bus.announce(VERSION, 5, kind="delta", state="s5"), bus.announce(COMMIT, 5)]
    later = bus.read(first[-1].id)
    assert [e.id for e in later] == more
    assert [e.type for e in later] == [VERSION, COMMIT]
    assert bus.read(later[-1].id) == []
    # count bounds one read; resuming after it picks up the rest
    part = bus.read(count=2)
    assert [e.id for e in part] == ids[:2]
    assert [e.id for e in bus.read(part[-1].id)] == ids[2:] + more


def test_block_returns_empty_on_timeout(redis_server: RedisServer, run_name: str) -> None:
    client = connect(redis_server.url, block_s=2.0)
    bus = Bus(client, run_name)
    last = bus.announce(VERSION, 1)
    t0 = time.monotonic()
    assert bus.read(last, block_ms=150) == []
    assert time.monotonic() - t0 >= 0.1
    client.close()


def test_block_wakes_on_an_announcement(redis_server: RedisServer, run_name: str) -> None:
    reader = Bus(connect(redis_server.url, block_s=10.0), run_name)
    writer = Bus(connect(redis_server.url), run_name)
    last = writer.announce(VERSION, 1)
    timer = threading.Timer(0.1, lambda: writer.announce(COMMIT, 2))
    timer.start()
    try:
        t0 = time.monotonic()
        evs = reader.read(last, block_ms=10_000)
        assert time.monotonic() - t0 < 5
    finally:
        timer.join()
    assert [(e.type, e.version) for e in evs] == [(COMMIT, 2)]


def test_entries_that_are_not_announcements_are_skipped(bus: Bus, redis_client: Any) -> None:
    redis_client.xadd(bus.stream(), {"type": "junk"})
    redis_client.xadd(bus.stream(), {"type": "junk", "version": "x"})
    eid = bus.announce(COMMIT, 4)
    assert [e.id for e in bus.read()] == [eid]


def test_region_streams_are_separate(bus: Bus) -> None:
    o = bus.announce(VERSION, 1, kind="delta")
    eu = bus.announce(VERSION, 1, region="eu", kind="delta")
    us = bus.announce(COMMIT, 1, region="us")
    assert bus.stream() != bus.stream("eu") != bus.stream("us")
    assert [e.id for e in bus.read()] == [o]
    assert [e.id for e in bus.read(region="eu")] == [eu]
    assert [e.id for e in bus.read(region="us")] == [us]
    assert bus.read(eu, region="eu") == []
    assert bus.read(region="ap") == []


def test_gap_after_exact_trimming(bus: Bus, redis_client: Any) -> None:
    ids = [bus.announce(SEGMENT, 9, index=i) for i in range(10)]
    redis_client.xtrim(bus.stream(), maxlen=2, approximate=False)
    with pytest.raises(BusGap) as e:
        bus.read(ids[3])
    assert isinstance(e.value, AuroraError) and isinstance(e.value, LookupError)
    # a consumer whose next entry is still there has lost nothing
    assert [x.id for x in bus.read(ids[8])] == [ids[9]]
    assert bus.read(ids[9]) == []
    # from the start, it reads what is left
    assert [x.id for x in bus.read()] == ids[8:]


def test_gap_after_the_bus_own_maxlen_trimming(redis_client: Any, run_name: str) -> None:
    small = Bus(redis_client, run_name, maxlen=10)
    first = small.announce(SEGMENT, 1, index=0)
    for i in range(1, 400):  # approximate MAXLEN drops whole stream nodes (100 entries each)
        small.announce(SEGMENT, 1, index=i)
    assert redis_client.xlen(small.stream()) < 400
    with pytest.raises(BusGap):
        small.read(first)


def test_gap_after_trimming_to_empty(bus: Bus, redis_client: Any) -> None:
    # No first entry to compare with: the newest id generated tells that entries were lost.
    ids = [bus.announce(SEGMENT, 9, index=i) for i in range(5)]
    redis_client.xtrim(bus.stream(), maxlen=0, approximate=False)
    with pytest.raises(BusGap):
        bus.read(ids[1])
    assert bus.read(ids[4]) == []  # a consumer that had seen everything lost nothing


def test_gap_after_redis_restart(own_redis_server: RedisServer, run_name: str) -> None:
    client = connect(own_redis_server.url)
    bus = Bus(client, run_name)
    bus.announce(VERSION, 1)
    last = bus.announce(VERSION, 2)
    own_redis_server.restart()  # no data kept
    with pytest.raises(BusGap):  # the stream is gone
        bus.read(last)
    with pytest.raises(BusGap):  # gone, and the region streams too
        bus.read(last, region="eu")
    fresh = bus.announce(VERSION, 3)  # someone announces again on the new Redis
    with pytest.raises(BusGap):  # the stream exists, but entries after `last` never will
        bus.read(last)
    assert [e.id for e in bus.read()] == [fresh]  # after resyncing from the store, start over
    assert bus.read(fresh) == []
    client.close()


def test_gap_when_a_recreated_stream_is_behind_the_consumer(bus: Bus, redis_client: Any) -> None:
    last = bus.announce(VERSION, 7)
    redis_client.delete(bus.stream())
    redis_client.xadd(bus.stream(), {"type": VERSION, "version": "1"}, id="1-1")
    with pytest.raises(BusGap):
        bus.read(last)


# ---------------------------------------------------------------------------
# redis-py's errors stop at the bus


def test_redis_away_is_redis_unavailable(dead_redis_url: str, run_name: str) -> None:
    bus = Bus(connect(dead_redis_url, RedisConfig(connect_timeout_s=1.0)), run_name)
    for op, call in (("Bus.announce", lambda: bus.announce(VERSION, 1)), ("Bus.read", bus.read), ("Bus.tail_id", bus.tail_id)):
        with pytest.raises(RedisUnavailable) as e:
            call()
        assert e.value.op == op
        assert isinstance(e.value, ConnectionError) and isinstance(e.value, AuroraError)
        assert isinstance(e.value.__cause__, redis.exceptions.ConnectionError)


def test_a_read_longer_than_the_socket_timeout_is_redis_unavailable(redis_server: RedisServer, run_name: str) -> None:
    client = connect(redis_server.url, RedisConfig(command_timeout_s=0.2))  # a command client, not a blocking one
    bus = Bus(client, run_name)
    last = bus.announce(VERSION, 1)
    with pytest.raises(RedisUnavailable) as e:
        bus.read(last, block_ms=2_000)
    assert isinstance(e.value.__cause__, redis.exceptions.TimeoutError)
    client.close()


def test_a_key_of_the_wrong_type_is_a_coordination_error(bus: Bus, redis_client: Any) -> None:
    redis_client.set(bus.stream(), "not a stream")
    with pytest.raises(CoordinationError) as e:
        bus.announce(VERSION, 1)
    assert not isinstance(e.value, RedisUnavailable)
    assert isinstance(e.value.__cause__, redis.exceptions.ResponseError)
