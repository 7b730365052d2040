"""The run's records in Redis (``aurora_store.coordination.records``): one owner, fenced writes, untrusted reads.

Against a real redis-server: the Trainer's hash is written only under the
writer's epoch, every value read back is parsed defensively, the Publisher
records each version (the digest log included) like the Trainer does, and
the Actor's one-field report never creates a record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from aurora_store import Publisher
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.records import DIGEST_LOG_ENV, RunRecords, TrainerRecord
from aurora_store.errors import CoordinationError, FencedOut

pytestmark = pytest.mark.server

S = "sha256:" + "5" * 64


def test_a_version_is_recorded_state_first_and_read_back(redis_client: Any, run_name: str) -> None:
    rec = RunRecords(redis_client, run_name)
    rec.enter_epoch(1)
    rec.record_identity(True, "key-1")
    rec.record_version(3, S, "sha256:" + "d" * 64)
    assert rec.head_and_commit() == (3, None)
    rec.record_commit(3)
    rec.record_step(5)
    t = rec.trainer()
    assert (t.head, t.head_state, t.commit, t.step, t.status, t.epoch, t.signed, t.key_id) == (3, S, 3, 5, "running", 1, True, "key-1")
    assert rec.head() == 3 and rec.expected_state(3) == S and rec.expected_state(4) is None
    assert rec.digests() == ({3: "sha256:" + "d" * 64}, {})


def test_a_writer_of_an_older_epoch_changes_nothing(redis_client: Any, run_name: str) -> None:
    old, new = RunRecords(redis_client, run_name), RunRecords(redis_client, run_name)
    old.enter_epoch(1)
    old.record_version(1, S, None)
    new.enter_epoch(2)
    with pytest.raises(FencedOut):
        old.record_commit(1)
    with pytest.raises(FencedOut):
        old.record_version(2, S, None)
    with pytest.raises(FencedOut):
        old.check_epoch()
    assert RunRecords(redis_client, run_name).head_and_commit() == (1, None)


def test_garbage_in_the_records_reads_as_missing_never_as_a_crash(redis_client: Any, run_name: str) -> None:
    keys = RunKeys(run_name)
    redis_client.hset(keys.trainer, mapping={"head": "v7", "commit": b"\xff", "head_state": b"\xfe\x00", "signed": "yes", "step": "3"})
    redis_client.hset(keys.trainer_states, mapping={"4": b"\xff\xfe"})
    redis_client.hset(keys.trainer_digests, mapping={"x": "d", "2": "sha256:ok"})
    redis_client.hset(keys.actor_digests, mapping={"noversion": "d", "a|z": "d", "a|2": "sha256:ok"})
    redis_client.hset(keys.activations, mapping={"a|1": "{not json", "a|2": json.dumps({"stage_s": 1.0}), "a|3": "[1]"})
    redis_client.set(keys.epoch, "lots")
    rec = RunRecords(redis_client, run_name)
    assert rec.trainer() == TrainerRecord(step=3)
    assert rec.head_and_commit() == (None, None)
    assert rec.expected_state(4) == ""  # not a state: matches no manifest, so the version is refused
    assert rec.digests() == ({2: "sha256:ok"}, {("a", 2): "sha256:ok"})
    assert rec.activations() == {("a", 2): {"stage_s": 1.0}}
    # The fence is not garbage-tolerant: an epoch that is no integer below 2^53 is refused, naming the key.
    with pytest.raises(CoordinationError, match="stored epoch 'lots'"):
        rec.stored_epoch()


def test_the_mirror_head_and_commit_come_in_one_read(redis_client: Any, run_name: str) -> None:
    keys = RunKeys(run_name)
    rec = RunRecords(redis_client, run_name)
    assert rec.mirror_head_commit("eu") == (None, None, None)
    redis_client.set(keys.relay("eu"), "s3://mirror/run")
    redis_client.hset(keys.trainer, mapping={"head": 4, "commit": 3})
    assert rec.mirror_head_commit("eu") == ("s3://mirror/run", 4, 3)


def test_an_actor_report_writes_its_record_and_never_creates_one(redis_client: Any, run_name: str) -> None:
    led = Ledger(redis_client, run_name)
    assert led.report("a", "quarantined", "3") is False
    assert not redis_client.exists(led.keys.actor("a"))
    led.register("a")
    assert led.report("a", "quarantined", "3") is True
    assert led.actor("a") is not None and redis_client.hget(led.keys.actor("a"), "quarantined") == b"3"
    assert redis_client.pttl(led.keys.actor("a")) > 0  # the record keeps its TTL


def test_the_publisher_records_every_version_in_redis_and_the_digest_log(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    log_file = tmp_path / "digests.jsonl"
    monkeypatch.setenv(DIGEST_LOG_ENV, str(log_file))
    w = {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}
    published = []
    with Publisher(f"file://{tmp_path}/run", redis=redis_server.url, run=run_name, digest_every=2) as pub:
        for v in range(4):
            w["w"][v, v] += 1.0
            p = pub.publish(w)
            assert p is not None
            published.append(p)
    # Hashed where asked (version 0, every 2nd); every version's state and the head are recorded all the same.
    assert [p.weights_digest is not None for p in published] == [True, False, True, False]
    hashed = [p for p in published if p.weights_digest is not None]
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert lines == [{"who": "trainer", "version": p.version, "digest": p.weights_digest} for p in hashed]
    rec = RunRecords(redis_client, run_name)
    assert rec.digests()[0] == {p.version: p.weights_digest for p in hashed}
    assert [rec.expected_state(p.version) for p in published] == [p.state for p in published]
    assert rec.head_and_commit() == (3, 3)
    assert rec.trainer().epoch is None and rec.stored_epoch() == 1  # the fence it took


def test_a_publisher_is_fenced_out_by_a_newer_writer(tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str) -> None:
    w = {"w": torch.zeros(4, 4)}
    with Publisher(f"file://{tmp_path}/run", redis=redis_server.url, run=run_name, outage_budget=0.5) as pub:
        pub.publish(w)
        RunRecords(redis_client, run_name).enter_epoch(5)  # a Trainer resumed the run
        w["w"][0, 0] = 1.0
        with pytest.raises(FencedOut):
            pub.publish(w)
    assert RunRecords(redis_client, run_name).head() == 0
