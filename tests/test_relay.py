"""The Relay against real servers: moto's S3 server and redis-server on loopback.

A test Trainer publishes versions at origin with the library and announces
them as the Trainer does (segments from ``on_segment``, the version after its
manifest). A Relay runs in a thread; the tests check what reaches the mirror,
when, how many times, and what the region hears.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from relay_helpers import (
    MODEL_CONFIG,
    REGION,
    REPO,
    describe_model,
    make_relay,
    mirrored,
    region_events,
    running,
)
from trainer_fixtures import FakeTrainer

from aurora_store.apply.sink import weights_digest
from aurora_store.coordination.bus import COMMIT, SEGMENT, VERSION, Bus
from aurora_store.coordination.keys import RunKeys, mirror_token
from aurora_store.coordination.redisconn import connect
from aurora_store.errors import ConfigError
from aurora_store.format.manifest import manifest_key
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import scan_versions
from aurora_store.lineage.publish import SegmentEvent
from aurora_store.storage import open_store
from aurora_store.testing.servers import RedisServer, S3Server
from aurora_store.testing.wait import wait_until
from workers.relay import RelayConfig, add_arguments, config_from_args, relay_key


@pytest.fixture
def redis(redis_server: RedisServer) -> Iterator[Any]:
    client = connect(redis_server.url)
    yield client
    client.close()


# ---------------------------------------------------------------------------


@pytest.mark.server
def test_cut_through_mirror_and_region_announcements(
    s3_server: S3Server, redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path
) -> None:
    """S3 origin -> file mirror: every version arrives, segments before the manifest exists at origin."""
    origin = open_store(f"s3://{s3_server.new_bucket()}/runs/{run_name}", s3_server.storage_options())
    mirror = open_store(f"file://{tmp_path}/mirror")
    describe_model(origin)  # the Relay starts before the Trainer's first version
    relay = make_relay(origin, mirror, redis_server.url, run_name)
    seen: dict[int, tuple[bool, bool, bool]] = {}

    def cut_through(ev: SegmentEvent) -> None:
        # The Trainer's publish cannot write its manifest until this returns:
        # if segment 0 shows up in the mirror now, it was copied before the commit.
        if ev.index == 0:
            wait_until(lambda: mirror.exists(ev.key), f"cut-through copy of {ev.key}")
            seen[ev.version] = (
                mirror.exists(ev.key),
                origin.exists(manifest_key("delta", ev.version)),
                mirror.exists(manifest_key("delta", ev.version)),
            )

    bus = Bus(redis, run_name)
    with running(relay):
        wait_until(relay.caught_up.is_set, "the first listing")
        assert redis.get(relay_key(run_name, REGION)) == mirror_token(mirror.url).encode()
        trainer = FakeTrainer(origin, run_name, bus)
        m1 = trainer.step(after=cut_through)
        m2 = trainer.step()
        assert len(m1.segments) > 1 and len(m2.segments) > 1
        wait_until(mirrored(relay, ("snapshot", 0), ("delta", 1), ("delta", 2)), "versions 0-2 in the mirror")
        assert seen[1] == (True, False, False)  # in the mirror; no manifest at origin nor mirror yet
        tensors, state = materialize(mirror, 2)
        assert state == trainer.states[2]
        assert weights_digest(tensors) == trainer.digest(2)
        stats = relay.stats()
        for kind, v in (("snapshot", 0), ("delta", 1), ("delta", 2)):
            assert stats.bytes_by_version[(kind, v)] == trainer.version_bytes(kind, v)
        assert stats.bytes_fetched == stats.bytes_copied == sum(stats.bytes_by_version.values()) + len(MODEL_CONFIG)
        bus.announce(COMMIT, 2)
        wait_until(lambda: any(e.type == COMMIT for e in region_events(redis, run_name)), "commit re-announced")

    assert redis.get(relay_key(run_name, REGION)) is None  # graceful stop
    evs = region_events(redis, run_name)
    versions = [(e.get("kind"), e.version) for e in evs if e.type == VERSION]
    assert versions == [("snapshot", 0), ("delta", 1), ("delta", 2)]
    v1 = next(e for e in evs if e.type == VERSION and e.version == 1)
    assert v1.get("state") == trainer.states[1] and int(v1.get("segments")) == len(m1.segments)
    # Segments were re-announced as they landed, each before its version's announcement.
    for m in (m1, m2):
        pos = [i for i, e in enumerate(evs) if e.type == SEGMENT and e.version == m.version]
        vpos = next(i for i, e in enumerate(evs) if e.type == VERSION and e.version == m.version)
        keys = {evs[i].get("key") for i in pos}
        assert keys == {f"deltas/v{m.version:010d}/{r.key}" for r in m.segments}
        assert max(pos) < vpos
    assert [e.type for e in evs][-1] == COMMIT


@pytest.mark.server
@pytest.mark.slow
def test_late_relay_catches_up_and_restarts_without_copying_again(
    s3_server: S3Server, redis_server: RedisServer, redis: Any, run_name: str
) -> None:
    """S3 -> S3: a Relay started late lists origin; a restarted one brings only what is new."""
    origin = open_store(f"s3://{s3_server.new_bucket()}/runs/{run_name}", s3_server.storage_options())
    mirror = open_store(f"s3://{s3_server.new_bucket()}/eu/{run_name}", s3_server.storage_options())
    bus = Bus(redis, run_name)
    trainer = FakeTrainer(origin, run_name, bus)
    for _ in range(3):
        trainer.step()
    trainer.snapshot(3)
    # An attempt that never committed, and was never announced: an orphan.
    orphan = f"deltas/v{4:010d}/{uuid.uuid4().hex[:16]}/seg-00000.safetensors"
    origin.put(orphan, b"half a publish")
    model = {"model/config.json": b'{"model_type": "qwen3"}', "model/tokenizer.json": b'{"chars": "ab"}'}
    for k, data in model.items():
        origin.put(k, data)

    relay = make_relay(origin, mirror, redis_server.url, run_name)
    with running(relay):
        wait_until(relay.caught_up.is_set, "the first listing")
        assert scan_versions(mirror) == scan_versions(origin)
        assert not mirror.exists(orphan) and mirror.list("deltas/v0000000004") == []
        assert all(mirror.get(k) == data for k, data in model.items())
        assert redis.get(relay_key(run_name, REGION)) == mirror_token(mirror.url).encode()
        trainer.step()  # v4 arrives while the Relay follows
        wait_until(mirrored(relay, ("delta", 4)), "delta 4")
        first = relay.stats()
    assert redis.get(relay_key(run_name, REGION)) is None
    assert first.versions_mirrored == 6
    model_bytes = sum(len(d) for d in model.values())
    assert first.bytes_fetched == sum(trainer.version_bytes(k, v) for k, v in trainer.manifests) + model_bytes

    trainer.step()  # v5 is published and announced while no Relay runs
    relay2 = make_relay(origin, mirror, redis_server.url, run_name)
    with running(relay2):
        wait_until(relay2.caught_up.is_set, "the second Relay's listing")
        assert relay2.stats().bytes_fetched == trainer.version_bytes("delta", 5)  # nothing old crossed again
        trainer.step()
        wait_until(mirrored(relay2, ("delta", 6)), "delta 6")
    tensors, state = materialize(mirror, 6)
    assert state == trainer.states[6] and weights_digest(tensors) == trainer.digest(6)
    announced = [e.version for e in region_events(redis, run_name) if e.type == VERSION and e.get("kind") == "delta"]
    assert announced == [1, 2, 3, 4, 5, 6]


@pytest.mark.server
def test_duplicate_announcements_copy_each_object_once(redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path) -> None:
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    describe_model(origin)  # the Relay starts before the Trainer's first version
    relay = make_relay(origin, mirror, redis_server.url, run_name)
    with running(relay):
        wait_until(relay.caught_up.is_set, "the first listing")
        trainer = FakeTrainer(origin, run_name, Bus(redis, run_name), repeat=3)
        for _ in range(3):
            trainer.step()
        wait_until(mirrored(relay, *trainer.manifests), "every version")
        stats = relay.stats()
    for vid in trainer.manifests:
        assert stats.bytes_by_version[vid] == trainer.version_bytes(*vid), vid
    assert stats.segments_copied == sum(len(m.segments) for m in trainer.manifests.values())
    assert stats.versions_mirrored == len(trainer.manifests)
    evs = region_events(redis, run_name)
    assert sorted(e.version for e in evs if e.type == VERSION) == [0, 1, 2, 3]
    seg_keys = [e.get("key") for e in evs if e.type == SEGMENT]
    assert len(seg_keys) == len(set(seg_keys)) == stats.segments_copied - 1  # the snapshot shard is not announced


@pytest.mark.server
def test_untrusted_bytes_are_never_mirrored(
    redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A wrong announced digest, then a damaged origin object: neither lands in the mirror."""
    caplog.set_level(logging.INFO, logger="aurora.relay")
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    describe_model(origin)  # the Relay starts before the Trainer's first version
    relay = make_relay(origin, mirror, redis_server.url, run_name)
    bus = Bus(redis, run_name)
    with running(relay):
        wait_until(relay.caught_up.is_set, "the first listing")
        trainer = FakeTrainer(origin, run_name, bus)

        # 1. A forged announcement (digest of other bytes) for a good object: refused at
        #    once, then fetched again and checked against the manifest when it commits.
        forged_keys: list[str] = []

        def forged(ev: SegmentEvent) -> None:
            if ev.index == 0:
                forged_keys.append(ev.key)
                bus.announce(SEGMENT, ev.version, index=0, key=ev.key, bytes=ev.bytes, sha256=hashlib.sha256(b"x").hexdigest())
                wait_until(lambda: relay.stats().segments_rejected == 1, "the forged segment refused")
                assert not mirror.exists(ev.key)

        trainer.step(after=forged, announce=False)
        trainer.announce(trainer.manifests[("delta", 1)])
        wait_until(mirrored(relay, ("delta", 1)), "delta 1 from its manifest")
        assert any(forged_keys[0] in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)

        # 2. The origin object itself is damaged after it was announced.
        damaged: dict[str, bytes] = {}

        def damage(ev: SegmentEvent) -> None:
            if ev.index == 0:
                good = origin.get(ev.key)
                damaged[ev.key] = good
                origin.put(ev.key, bytes([good[0] ^ 1]) + good[1:], mode="overwrite")

        m2 = trainer.step(before=damage)
        (key,) = damaged
        wait_until(
            lambda: any(key in r.getMessage() and "delta 2 not mirrored" in r.getMessage() for r in caplog.records),
            "the failed delta 2 reported",
        )
        assert not mirror.exists(key) and not mirror.exists(manifest_key("delta", 2))
        assert ("delta", 2) not in relay.stats().mirrored
        assert all(e.version != 2 for e in region_events(redis, run_name) if e.type == VERSION)
        assert any(key in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)

        # Repaired at origin: the Relay's retry listing picks it up.
        origin.put(key, damaged[key], mode="overwrite")
        wait_until(mirrored(relay, ("delta", 2)), "delta 2 after the repair")
    assert hashlib.sha256(mirror.get(key)).hexdigest() == next(r.sha256 for r in m2.segments if key.endswith(r.key))
    tensors, _ = materialize(mirror, 2)
    assert weights_digest(tensors) == trainer.digest(2)
    assert [e.version for e in region_events(redis, run_name) if e.type == VERSION] == [0, 1, 2]


@pytest.mark.server
def test_bus_gap_relists_origin(redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path) -> None:
    """The stream vanishes (Redis lost it): the Relay lists origin, then follows the new stream."""
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    bus = Bus(redis, run_name)
    trainer = FakeTrainer(origin, run_name, bus)
    relay = make_relay(origin, mirror, redis_server.url, run_name)
    with running(relay):
        wait_until(mirrored(relay, ("snapshot", 0)), "snapshot 0")
        trainer.step()
        wait_until(mirrored(relay, ("delta", 1)), "delta 1")
        trainer.step(announce=False)  # committed, but its announcements are lost with the stream
        redis.delete(bus.stream())
        wait_until(mirrored(relay, ("delta", 2)), "delta 2 found by listing")
        trainer.step()  # announced on a fresh stream
        wait_until(mirrored(relay, ("delta", 3)), "delta 3 from the new stream")
    tensors, _ = materialize(mirror, 3)
    assert weights_digest(tensors) == trainer.digest(3)


@pytest.mark.server
def test_redis_restart_loses_stream_and_heartbeat(own_redis_server: RedisServer, run_name: str, tmp_path: Path) -> None:
    """Redis restarts empty: the Relay rides out the errors, lists origin and beats again."""
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    redis = connect(own_redis_server.url)
    trainer = FakeTrainer(origin, run_name, Bus(redis, run_name))
    relay = make_relay(origin, mirror, own_redis_server.url, run_name)
    key = relay_key(run_name, REGION)
    with running(relay):
        wait_until(mirrored(relay, ("snapshot", 0)), "snapshot 0")
        trainer.step()
        wait_until(mirrored(relay, ("delta", 1)), "delta 1")
        trainer.step(announce=False)  # its announcements die with Redis's state
        own_redis_server.restart()
        wait_until(mirrored(relay, ("delta", 2)), "delta 2 found by listing after the restart")
        wait_until(lambda: redis.get(key) == mirror_token(mirror.url).encode(), "the heartbeat key back")
        trainer.step()
        wait_until(mirrored(relay, ("delta", 3)), "delta 3 from the new stream")
    assert redis.get(key) is None
    redis.close()


def _relay_process(origin: str, mirror: str, redis_url: str, run: str, region: str) -> subprocess.Popen[str]:
    args = [
        sys.executable,
        "-m",
        "workers.relay",
        "--store",
        origin,
        "--mirror",
        mirror,
        "--redis",
        redis_url,
        "--run",
        run,
        "--region",
        region,
        "--heartbeat-s",
        "0.2",
        "--ttl-s",
        "1.5",
        "--block-ms",
        "100",
    ]
    env = {**os.environ, "AURORA_TORCH_THREADS": "1"}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.server
@pytest.mark.slow
def test_heartbeat_deleted_on_sigterm_and_expires_after_sigkill(
    redis_server: RedisServer, redis: Any, run_name: str, tmp_path: Path
) -> None:
    origin = f"file://{tmp_path}/origin"
    describe_model(open_store(origin))  # else the Relays wait for the run to appear
    procs = {r: _relay_process(origin, f"file://{tmp_path}/mirror-{r}", redis_server.url, run_name, r) for r in ("a", "b")}
    try:
        for r, p in procs.items():
            wait_until(
                lambda r=r, p=p: redis.get(relay_key(run_name, r)) is not None or p.poll() is not None,  # type: ignore[misc]
                f"relay {r} heartbeating",
                timeout=60,
            )
            assert p.poll() is None, p.communicate()[0]
        assert redis.get(relay_key(run_name, "a")) == mirror_token(f"file://{tmp_path}/mirror-a").encode()

        procs["a"].send_signal(signal.SIGTERM)
        out = procs["a"].communicate(timeout=30)[0]
        assert procs["a"].returncode == 0, out
        assert redis.get(relay_key(run_name, "a")) is None  # deleted, not left to expire
        assert redis.get(RunKeys(run_name).relay_held("a")) is None
        assert "stopped" in out

        procs["b"].kill()
        procs["b"].wait(timeout=30)
        assert redis.pttl(relay_key(run_name, "b")) > 0  # still there: nobody deleted it
        wait_until(lambda: redis.get(relay_key(run_name, "b")) is None, "relay b's key to expire", timeout=5)
        wait_until(lambda: redis.get(RunKeys(run_name).relay_held("b")) is None, "relay b's held key to expire", timeout=5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_config_and_arguments() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        [
            "--store",
            "s3://origin/runs/r1",
            "--storage-option",
            "endpoint_url=http://127.0.0.1:9000",
            "--storage-option",
            "secret=hunter2",
            "--mirror",
            "s3://eu/runs/r1",
            "--mirror-option",
            "anon=true",
            "--redis",
            "redis://127.0.0.1:1/0",
            "--run",
            "r1",
            "--region",
            "eu",
            "--streams",
            "3",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.origin_options == {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}, "secret": "hunter2"}
    assert cfg.mirror_options == {"anon": True}
    assert (cfg.streams, cfg.heartbeat_s, cfg.ttl_s) == (3, 2.0, 6.0)
    assert "hunter2" not in repr(cfg)  # credentials never reach a log line
    base = {"origin": "file:///o", "mirror": "file:///m", "redis": "redis://h/0", "run": "r", "region": "eu"}
    for bad in (
        {"region": "e{u}"},
        {"ttl_s": 1.0, "heartbeat_s": 2.0},
        {"block_ms": 0},
        {"streams": 0},
        {"mirror": "file:///o/"},
        {"run": "a b"},
    ):
        with pytest.raises(ConfigError):
            RelayConfig(**{**base, **bad})  # type: ignore[arg-type]


def test_listing_schedule_on_a_manual_clock() -> None:
    from aurora_store.testing.clock import ManualClock
    from workers.relay.follower import ListingSchedule

    clock = ManualClock()
    s = ListingSchedule(resync_s=60.0, retry_s=5.0, clock=clock)
    assert not s.take_due()
    s.listed(ok=True)
    clock.advance(59.0)
    assert not s.take_due()
    clock.advance(1.0)
    assert s.take_due() and not s.take_due()  # taken once
    s.want_resync()
    clock.advance(4.9)
    assert not s.take_due()
    clock.advance(0.1)
    assert s.take_due()
    assert s.queue() and not s.queue()
    s.listed(ok=False)  # a failed listing: again within retry_s
    clock.advance(5.0)
    assert s.take_due()
