"""The Relay survives (issue 12, points 1, 5 and 6 for the Relay), against real servers.

- started before the Trainer, it waits for the run to appear, saying so once;
- Redis killed and restarted, and the S3 origin paused (SIGSTOP of the
  server's process) for longer than the store's own retries: the Relay
  logs one line when each outage starts and one when it ends, keeps
  running, and catches up; an outage past ``outage_budget_s`` ends it with
  :class:`~aurora_store.errors.OutageTooLong`;
- a version that fails verification at origin is quarantined: fetched
  again with doubling waits (counted on a manual clock), logged once, and
  mirrored as soon as origin is repaired;
- the mirror's retention keeps the newest snapshots and what the region's
  live Actors hold; the Relay advertises what it mirrors for origin's retention.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relay_helpers import REPO, describe_model, make_relay, mirrored, running
from trainer_fixtures import FakeTrainer

from aurora_store.coordination.bus import Bus
from aurora_store.coordination.keys import mirror_token
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.redisconn import connect
from aurora_store.coordination.retention import RelayHeldVersions
from aurora_store.errors import OutageTooLong
from aurora_store.format.manifest import manifest_key
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import scan_versions
from aurora_store.lineage.publish import SegmentEvent
from aurora_store.storage import Store, StoreConfig, open_store
from aurora_store.testing.clock import ManualClock
from aurora_store.testing.servers import RedisServer, S3Server
from aurora_store.testing.wait import wait_until
from workers.relay import add_arguments, config_from_args


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[Any]:
    client = connect(redis_server.url)
    yield client
    client.close()


def messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def versions(store: Store) -> tuple[set[int], set[int]]:
    index = scan_versions(store)
    return set(index.snapshots), set(index.deltas)


# --- start in any order ---------------------------------------------------------


@pytest.mark.server
def test_a_relay_started_before_the_trainer_waits_for_the_run(
    redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aurora.relay")
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    relay = make_relay(origin, mirror, redis_server.url, run_name, retry_s=0.05)
    with running(relay):
        # Several listings find nothing; the wait is said once, and the mirror is not advertised.
        wait_until(lambda: relay.stats().listings >= 5, "a few listings")
        assert not relay.caught_up.is_set() and redis.get(relay.heartbeat_key) is None
        describe_model(origin)
        trainer = FakeTrainer(origin, run_name, Bus(redis, run_name))
        trainer.step()
        wait_until(relay.caught_up.is_set, "the mirror caught up once the run appeared")
        wait_until(mirrored(relay, ("snapshot", 0), ("delta", 1)), "versions 0 and 1")
        assert mirror.get("model/config.json") == origin.get("model/config.json")
        assert redis.get(relay.heartbeat_key) == mirror_token(mirror.url).encode()
    assert len(messages(caplog, "waiting for the run to appear")) == 1
    assert len(messages(caplog, "the run appeared")) == 1


# --- outages ----------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.slow
def test_the_relay_rides_out_redis_killed_and_restarted(
    own_redis_server: RedisServer, run_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aurora.relay")
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    redis = connect(own_redis_server.url)
    describe_model(origin)
    trainer = FakeTrainer(origin, run_name, Bus(redis, run_name))
    relay = make_relay(origin, mirror, own_redis_server.url, run_name, retry_s=0.2, resync_s=0.5)
    with running(relay):
        wait_until(mirrored(relay, ("snapshot", 0)), "snapshot 0")
        own_redis_server.stop()  # killed: every connection refused
        wait_until(lambda: relay.redis_dep.away, "the Relay to notice Redis is gone")
        trainer.step(announce=False)  # published at origin while Redis is down
        trainer.step(announce=False)
        wait_until(lambda: relay.redis_dep.away_for_s() > 1.0 or not relay.redis_dep.away, "a while away")
        own_redis_server.start()  # back, empty (no stream, no keys)
        wait_until(lambda: not relay.redis_dep.away, "the Relay to see Redis again")
        wait_until(mirrored(relay, ("delta", 1), ("delta", 2)), "deltas 1 and 2 found by listing")
        wait_until(lambda: redis.get(relay.heartbeat_key) == mirror_token(mirror.url).encode(), "the heartbeat back")
        trainer.step()  # announced on the new stream
        wait_until(mirrored(relay, ("delta", 3)), "delta 3")
    assert len(messages(caplog, "Redis unreachable")) == 1  # one line when it went...
    assert len(messages(caplog, "Redis reachable again")) == 1  # ...and one when it came back
    assert not [r for r in caplog.records if r.exc_info]  # no traceback
    tensors, state = materialize(mirror, 3)
    assert state == trainer.states[3]
    redis.close()


@pytest.mark.server
@pytest.mark.slow
def test_the_relay_rides_out_a_paused_s3_origin(
    redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aurora.relay")
    with S3Server(process=True) as s3:
        assert s3.pid is not None
        opts = {**s3.storage_options(), "config_kwargs": {"retries": {"total_max_attempts": 1}}}
        url = f"s3://{s3.new_bucket()}/runs/{run_name}"
        # The Relay's view of origin: short timeouts, one retry of its own; past that, the Relay waits.
        fast = StoreConfig(retries=1, backoff_s=0.05, connect_timeout_s=1.0, read_timeout_s=1.0)
        origin = open_store(url, opts, config=fast)
        publisher = open_store(url, s3.storage_options())
        mirror = open_store(f"file://{tmp_path}/mirror")
        bus = Bus(redis, run_name)
        describe_model(publisher)
        trainer = FakeTrainer(publisher, run_name, bus)
        relay = make_relay(origin, mirror, redis_server.url, run_name, retry_s=0.2)
        with running(relay):
            wait_until(mirrored(relay, ("snapshot", 0)), "snapshot 0", timeout=30)
            trainer.step(announce=False)  # committed at origin; announced while S3 is paused
            os.kill(s3.pid, signal.SIGSTOP)
            try:
                trainer.announce(trainer.manifests[("delta", 1)])
                wait_until(lambda: relay.origin_dep.away, "the Relay to wait for origin", timeout=60)
                assert not relay.versions.quarantine.failures()  # an outage is not damage
            finally:
                os.kill(s3.pid, signal.SIGCONT)
            wait_until(mirrored(relay, ("delta", 1)), "delta 1 once origin is back", timeout=60)
            assert not relay.origin_dep.away
            trainer.step()
            wait_until(mirrored(relay, ("delta", 2)), "delta 2", timeout=30)
        assert s3.problem() is None
    assert len(messages(caplog, "the origin store (eu Relay) unreachable")) == 1
    assert len(messages(caplog, "the origin store (eu Relay) reachable again")) == 1
    tensors, state = materialize(mirror, 2)
    assert state == trainer.states[2]


@pytest.mark.server
def test_an_outage_past_the_budget_ends_the_relay(own_redis_server: RedisServer, run_name: str, tmp_path: Path) -> None:
    origin = open_store(f"file://{tmp_path}/origin")
    describe_model(origin)
    relay = make_relay(origin, open_store(f"file://{tmp_path}/mirror"), own_redis_server.url, run_name, outage_budget_s=0.5)
    stop = threading.Event()
    errors: list[BaseException] = []

    def body() -> None:
        try:
            relay.run(stop)
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    try:
        wait_until(relay.caught_up.is_set, "the first listing")
        own_redis_server.stop()
        t.join(30)
    finally:
        stop.set()
        t.join(10)
        relay.close()
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], OutageTooLong), errors
    assert "Redis" in str(errors[0])


@pytest.mark.server
def test_aurora_relay_exits_with_one_line_past_the_budget(dead_redis_url: str, tmp_path: Path) -> None:
    args = [
        sys.executable,
        "-m",
        "workers.relay",
        "--store",
        f"file://{tmp_path}/origin",
        "--mirror",
        f"file://{tmp_path}/mirror",
        "--redis",
        dead_redis_url,
        "--run",
        "r",
        "--region",
        "eu",
        "--outage-budget-s",
        "1",
    ]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if line.startswith("aurora relay: error:")]
    assert len(errors) == 1 and "Redis" in errors[0]
    assert len([line for line in out.splitlines() if "WARNING Redis unreachable" in line]) == 1  # said once


# --- a version that fails verification ------------------------------------------------


@pytest.mark.server
@pytest.mark.slow
def test_a_damaged_version_is_quarantined_with_back_off(
    redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Listings every second (clock time); the damaged delta is fetched 1, 2, 4, 8, 16 s apart."""
    caplog.set_level(logging.DEBUG, logger="aurora.relay")
    clock = ManualClock()
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    describe_model(origin)
    bus = Bus(redis, run_name)
    trainer = FakeTrainer(origin, run_name, bus)
    relay = make_relay(origin, mirror, redis_server.url, run_name, clock, block_ms=20, retry_s=1.0, resync_s=1.0, quarantine_max_s=64.0)
    damaged: dict[str, bytes] = {}

    def damage(ev: SegmentEvent) -> None:
        if ev.index == 0:
            good = origin.get(ev.key)
            damaged[ev.key] = good
            origin.put(ev.key, bytes([good[0] ^ 1]) + good[1:], mode="overwrite")

    with running(relay):
        wait_until(relay.caught_up.is_set, "the first listing")
        trainer.step()
        wait_until(mirrored(relay, ("delta", 1)), "delta 1")
        trainer.step(before=damage)
        wait_until(lambda: relay.stats().quarantined == {("delta", 2): 1}, "delta 2 quarantined")
        first = relay.stats()
        trainer.step()  # the run goes on: delta 3 is mirrored while delta 2 waits
        wait_until(mirrored(relay, ("delta", 3)), "delta 3")
        for _ in range(40):  # 40 s of clock time, one listing per second
            n = relay.stats().listings
            clock.advance(1.0)
            wait_until(lambda n=n: relay.stats().listings > n, "the next listing")  # type: ignore[misc]
        st = relay.stats()
        # Attempts at +1, +3, +7, +15, +31 s after the first failure: 6 failures in all,
        # one fetch each, over 40 listings; a fetch per listing would have been 40.
        assert st.quarantined == {("delta", 2): 6}
        assert st.segments_rejected - first.segments_rejected == 5
        assert st.listings - first.listings >= 40
        assert relay.quarantine.delay_after(6) == 32.0
        assert ("delta", 2) not in st.mirrored and not mirror.exists(manifest_key("delta", 2))

        (key,) = damaged
        origin.put(key, damaged[key], mode="overwrite")  # repaired at origin
        clock.advance(32.0)  # the next attempt is due
        wait_until(mirrored(relay, ("delta", 2)), "delta 2 after the repair")
        # The Relay lifts the quarantine just after the version is complete: wait for that too.
        wait_until(lambda: relay.stats().quarantined == {}, "delta 2 out of quarantine")
        assert relay.stats().quarantined == {}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len([m for m in errors if "delta 2 not mirrored" in m and "quarantined" in m]) == 1  # logged once
    assert len([m for m in errors if key in m]) <= 2  # the object named once by the copy, once by the version
    assert len(messages(caplog, "delta 2 mirrored after 6 failed attempt(s)")) == 1
    tensors, state = materialize(mirror, 3)
    assert state == trainer.states[3]


# --- retention of the mirror, and what the Relay holds at origin ---------------------


@pytest.mark.server
def test_the_mirror_keeps_the_newest_snapshots_and_what_region_actors_hold(
    redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path
) -> None:
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    describe_model(origin)
    ledger = Ledger(redis, run_name)
    ledger.register("eu-1", region="eu")
    ledger.heartbeat("eu-1", active=4, staged=4)
    ledger.register("us-1", region="us")
    ledger.heartbeat("us-1", active=1, staged=1)  # another region's: not the mirror's concern
    trainer = FakeTrainer(origin, run_name, Bus(redis, run_name))
    relay = make_relay(origin, mirror, redis_server.url, run_name, keep_snapshots=1, gc_every_s=0.1, grace_s=0.0, resync_s=0.1)
    with running(relay):
        wait_until(relay.caught_up.is_set, "the first listing")
        for v in range(1, 8):
            trainer.step()
            if v in (3, 6):
                trainer.snapshot(v)
        wait_until(mirrored(relay, ("snapshot", 6), ("delta", 7)), "the head")
        # Newest snapshot (6) and after, plus what eu-1 on 4 needs: snapshot 3, deltas 4.. (and
        # the deltas at each kept snapshot, which bind them: FORMAT.md §4.1).
        wait_until(lambda: versions(mirror) == ({3, 6}, {3, 4, 5, 6, 7}), "the mirror cleaned")
        # What it mirrors, for origin's retention: its head, from the next heartbeat on.
        wait_until(lambda: RelayHeldVersions(redis, run_name).held_versions() == {7}, "the Relay to hold its head")
        ledger.heartbeat("eu-1", active=7, staged=7)
        wait_until(lambda: versions(mirror) == ({6}, {6, 7}), "the mirror cleaned again")
        fetched = relay.stats().bytes_fetched
        listings = relay.stats().listings
        wait_until(lambda: relay.stats().listings >= listings + 3, "a few more listings")
        assert versions(mirror) == ({6}, {6, 7}) and relay.stats().bytes_fetched == fetched  # nothing copied back
        assert relay.stats().removed > 0
        trainer.step()
        wait_until(mirrored(relay, ("delta", 8)), "delta 8")
    assert versions(origin) == ({0, 3, 6}, set(range(1, 9)))  # origin is not the Relay's to clean
    _, state = materialize(mirror, 8)
    assert state == trainer.states[8]


@pytest.mark.server
def test_a_late_relay_copies_only_what_retention_keeps(redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path) -> None:
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    describe_model(origin)
    trainer = FakeTrainer(origin, run_name, Bus(redis, run_name))
    for v in range(1, 6):
        trainer.step()
        if v == 3:
            trainer.snapshot(3)
    relay = make_relay(origin, mirror, redis_server.url, run_name, keep_snapshots=1)
    with running(relay):
        wait_until(relay.caught_up.is_set, "the first listing")
        assert versions(mirror) == ({3}, {3, 4, 5})  # delta 3 binds snapshot 3 (FORMAT.md §4.1)
        kept = [("snapshot", 3), ("delta", 3), ("delta", 4), ("delta", 5)]
        assert relay.stats().bytes_fetched == sum(trainer.version_bytes(*vid) for vid in kept) + len(origin.get("model/config.json"))


def test_relay_flags() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--store", "file:///o", "--mirror", "file:///m", "--redis", "redis://h/0", "--run", "r", "--region", "eu"]
    cfg = config_from_args(
        p.parse_args([*base, "--outage-budget-s", "30", "--keep-snapshots", "0", "--gc-every-s", "5", "--grace-s", "60"])
    )
    assert (cfg.outage_budget_s, cfg.keep_snapshots, cfg.gc_every_s, cfg.grace_s) == (30.0, 0, 5.0, 60.0)
    cfg = config_from_args(p.parse_args(base))
    assert cfg.outage_budget_s >= 600 and cfg.keep_snapshots == 2
