"""Readers of a run that commits through Redis (FORMAT.md §1, Redis-commit mode).

In such a run a manifest in the store is a version only if its bytes match
the run's Redis record. The run here is put in that mode by
:meth:`RedisCommitLog.enable` (as the Trainer's ``--commit-via redis``
does) on a ``file://`` store and a real ``redis-server --appendonly yes``;
then a manifest is written *without* a record (a stray publisher, or one
that lost the commit). The Actor stages the committed versions and never
that one, the Relay does not mirror it, ``aurora verify`` refuses to check
the run without ``--redis --run`` and reports the stray manifest with them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from actor_fixtures import TinyRun

from aurora_store.coordination.commit import RedisCommitLog
from aurora_store.coordination.redisconn import connect
from aurora_store.format.manifest import manifest_key
from aurora_store.storage import Store, open_store
from aurora_store.testing.clock import ManualClock
from aurora_store.testing.servers import RedisServer
from aurora_tools.cli.main import main
from workers.actor import Actor, ActorConfig
from workers.common import Endpoints

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def persistent_redis() -> Iterator[str]:
    """A redis-server started with ``--appendonly yes`` (what Redis-commit mode requires)."""
    with RedisServer(appendonly=True) as server:
        yield server.url


@pytest.fixture
def run(tmp_path: Path, persistent_redis: str, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """v0 and delta 1 committed through Redis; delta 2's manifest written without a record, the head at 2."""
    origin = open_store(f"file://{tmp_path}/origin")
    name = f"commit-{request.node.name[-24:]}-{time.monotonic_ns() % 10**6}"
    trainer = TinyRun(origin, persistent_redis, name)
    trainer.start()
    commits = RedisCommitLog(connect(persistent_redis), name)
    commits.enable(origin)  # records v0, writes the store marker
    trainer.step(1)
    commits.commit("delta", 1, origin.get(manifest_key("delta", 1)))
    trainer.step(1)  # delta 2: in the store, never recorded
    assert commits.record("delta", 2) is None
    yield {"origin": origin, "trainer": trainer, "commits": commits, "tmp": tmp_path, "redis": persistent_redis}
    trainer.close()
    commits.client.close()


def _actor(r: dict[str, Any], clock: ManualClock) -> Actor:
    t: TinyRun = r["trainer"]
    return Actor.from_endpoints(Endpoints(r["origin"].url, t.redis_url, t.run), ActorConfig(actor_id="a"), clock=clock)


def test_the_actor_stages_committed_versions_and_never_an_unrecorded_manifest(run: dict[str, Any]) -> None:
    t: TinyRun = run["trainer"]
    clock = ManualClock()
    a = _actor(run, clock)
    a.bootstrap()
    assert a.fetcher.commits is not None, "the Actor did not find the run in Redis-commit mode"
    assert a.active == 1, "bootstrap used delta 2, whose manifest has no commit record"
    assert a.engine.digest() == t.digest(1)
    for _ in range(3):
        a.stager.stage_once()
        clock.advance(3600)
    assert a.staged_version == 1 and not a.staged, "the Actor staged a version with no commit record"
    # The Trainer commits delta 2 (here: the record of the very bytes in the store): staged now.
    run["commits"].commit("delta", 2, run["origin"].get(manifest_key("delta", 2)))
    clock.advance(3600)
    a.stager.stage_once()
    assert a.staged_version == 2
    t.open_step(102, 2, prompts=2)
    a.safepoint.activate()
    assert a.active == 2 and a.engine.digest() == t.digest(2)


def test_a_manifest_that_differs_from_its_record_is_quarantined(run: dict[str, Any]) -> None:
    origin: Store = run["origin"]
    commits: RedisCommitLog = run["commits"]
    # The record names other bytes than the manifest in the store (a replaced manifest).
    good = origin.get(manifest_key("delta", 2))
    commits.commit("delta", 2, good + b" ")
    a = _actor(run, ManualClock())
    a.bootstrap()
    assert a.active == 1
    a.stager.stage_once()
    assert a.staged_version == 1
    assert 2 in a.ctx.quarantine.versions()
    assert not a.ctx.quarantine.allowed("delta", 2)


def test_the_relay_does_not_mirror_an_unrecorded_manifest(run: dict[str, Any], tmp_path: Path) -> None:
    from relay_helpers import make_relay

    origin: Store = run["origin"]
    mirror = open_store(f"file://{tmp_path}/mirror")
    relay = make_relay(origin, mirror, run["redis"], run["trainer"].run)
    try:
        assert relay.sync() is True  # delta 2 is no version: it does not hold the mirror back
        assert mirror.exists(manifest_key("snapshot", 0)) and mirror.exists(manifest_key("delta", 1))
        assert not mirror.exists(manifest_key("delta", 2))
        run["commits"].commit("delta", 2, origin.get(manifest_key("delta", 2)))
        assert relay.sync() is True
        assert mirror.exists(manifest_key("delta", 2))
    finally:
        relay.close()


def test_verify_needs_redis_for_a_redis_commit_run_and_checks_records_with_it(
    run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    url = run["origin"].url
    assert main(["verify", url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "commits through Redis" in err[0] and "--redis URL --run NAME" in err[0], err
    assert main(["lineage", url]) == 1
    assert "commits through Redis" in capsys.readouterr().err
    # With the records: delta 2 has none, a problem; the committed versions check out.
    assert main(["verify", url, "--redis", run["redis"], "--run", run["trainer"].run]) == 1
    out = capsys.readouterr().out
    assert "delta 2 has no Redis commit record" in out and "FAILED: 2 version(s)" in out, out
    run["commits"].commit("delta", 2, run["origin"].get(manifest_key("delta", 2)))
    assert main(["verify", url, "--redis", run["redis"], "--run", run["trainer"].run]) == 0
    assert "OK: 3 version(s)" in capsys.readouterr().out


def test_delta_apply_refuses_without_redis_and_materializes_with_it(run: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    url = run["origin"].url
    out = str(run["tmp"] / "v1.safetensors")
    assert main(["delta", "apply", "--store", url, "--version", "1", "--out", out]) == 1
    assert "--redis URL --run NAME" in capsys.readouterr().err
    assert not Path(out).exists()
    assert (
        main(["delta", "apply", "--store", url, "--version", "1", "--out", out, "--redis", run["redis"], "--run", run["trainer"].run]) == 0
    )
    assert Path(out).exists()
    # Version 2 is not committed (no record): unreachable, nothing written.
    out2 = str(run["tmp"] / "v2.safetensors")
    assert (
        main(["delta", "apply", "--store", url, "--version", "2", "--out", out2, "--redis", run["redis"], "--run", run["trainer"].run]) == 1
    )
    assert not Path(out2).exists()


def test_only_the_trainer_may_write_the_commit_keys() -> None:
    """infra/redis/aurora.acl: the Trainer writes the records and the mode; Actors, Relays and the
    read-only user read them (Redis >= 7) and cannot write them."""
    import redis.exceptions as rx
    from test_redis_acl import PASSWORDS, _binary, load_acl

    from aurora_store.coordination.keys import RunKeys
    from aurora_store.testing.servers import RedisServer

    run_ = "acl-commit"
    binary, version = _binary()
    keys = RunKeys(run_)
    with RedisServer(binary) as server:
        load_acl(server, run_, version).close()

        def client(role: str) -> Any:
            return connect(f"redis://aurora-{role}:{PASSWORDS[role]}@127.0.0.1:{server.port}/0")

        tr = client("trainer")
        log_ = RedisCommitLog(tr, run_)
        assert log_.commit("delta", 1, b'{"kind": "delta"}')
        tr.set(log_.mode_key, b'{"via": "redis", "since_ms": 1}', nx=True)
        tr.hset(keys.prefix + "state:trainer", "1", "sha256:" + "a" * 64)
        tr.zadd(keys.prefix + "state:trainer:index", {"1": 1})
        tr.close()
        for role in ("actor", "relay", "readonly"):
            c = client(role)
            if version >= (7, 0):
                assert RedisCommitLog(c, run_).commit_record("delta", 1) is not None
                assert RedisCommitLog(c, run_).enabled()
                assert c.hget(keys.prefix + "state:trainer", "1") is not None
            for write in (
                lambda c=c: c.set(log_.key("delta", 2), b"sha256:" + b"0" * 64 + b"\n"),
                lambda c=c: c.set(log_.key("delta", 1), b"x"),
                lambda c=c: c.delete(log_.key("delta", 1)),
                lambda c=c: c.set(log_.mode_key, b"{}"),
                lambda c=c: c.hset(keys.prefix + "state:trainer", "2", "sha256:" + "f" * 64),
            ):
                with pytest.raises(rx.NoPermissionError):
                    write()
            c.close()


def test_the_relay_quarantines_a_manifest_that_differs_from_its_record(run: dict[str, Any], tmp_path: Path) -> None:
    from relay_helpers import make_relay

    origin: Store = run["origin"]
    run["commits"].commit("delta", 2, origin.get(manifest_key("delta", 2)) + b" ")  # the record names other bytes
    mirror = open_store(f"file://{tmp_path}/mirror")
    relay = make_relay(origin, mirror, run["redis"], run["trainer"].run)
    try:
        relay.sync()
        assert not mirror.exists(manifest_key("delta", 2))
        assert ("delta", 2) in relay.stats().quarantined
        assert mirror.exists(manifest_key("delta", 1))
    finally:
        relay.close()


class _RecordsAfter:
    """Commit records (the CommitRecords protocol) of a writer that records ``version`` only when the
    store's manifest appears: a record read made beside the manifest's read can run ahead of it."""

    def __init__(self, store: Store, digest: str) -> None:
        self.store, self.digest, self.calls = store, digest, 0
        self.threads: set[str] = set()

    def commit_record(self, kind: str, version: int) -> str | None:
        import threading

        self.calls += 1
        self.threads.add(threading.current_thread().name)
        return self.digest if self.calls > 1 else None  # the first read raced ahead of the record


def test_a_record_read_beside_its_manifest_that_ran_ahead_is_read_again(tmp_path: Path) -> None:
    """``read_manifest`` reads the commit record beside the manifest (one round trip on a far link),
    and a record found missing there is read once more after the manifest (records precede manifests);
    a record still missing then means: not committed."""
    import hashlib

    import torch

    from aurora_store.codec.extract import extract
    from aurora_store.errors import VersionNotFound
    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.lineage.publish import PublishConfig, publish_delta
    from workers.model import fusion_plan_for, hf_weights, tiny_qwen3

    model = tiny_qwen3(64, seed=0)
    plan = fusion_plan_for(model)
    old = {n: t.detach().clone() for n, t in hf_weights(model).items() if n in {b.source for p in plan for b in p.blocks}}
    new = {n: (t.view(torch.int16) ^ 1).view(torch.bfloat16) for n, t in old.items()}
    store = open_store(f"file://{tmp_path}")
    publish_delta(store, "r", 1, extract(plan, old, new), "sha256:" + "0" * 64, PublishConfig())
    data = store.get(manifest_key("delta", 1))
    recs = _RecordsAfter(store, "sha256:" + hashlib.sha256(data).hexdigest())
    m = read_manifest(store, "delta", 1, None, recs)
    assert m.version == 1 and recs.calls == 2
    assert any(name.startswith("aurora-side-read") for name in recs.threads)

    class Never(_RecordsAfter):
        def commit_record(self, kind: str, version: int) -> str | None:
            self.calls += 1
            return None

    never = Never(store, "")
    with pytest.raises(VersionNotFound, match="no Redis commit record"):
        read_manifest(store, "delta", 1, None, never)
    assert never.calls == 2
