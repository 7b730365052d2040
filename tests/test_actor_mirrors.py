"""Mirrors are configured, not announced; what an engine that reads the store itself holds is what was checked.

A real Redis and ``file://`` (and one S3) stores; the stager is driven
directly (``Stager.stage_once``) on a :class:`ManualClock`, as in
``test_actor_staging``. The engine that reads the store itself is
:class:`StoreStagingEngine` (from the hostile-input bench), a real class standing in for
vLLM's workers: it fetches from the store on its own, and ``reread=True``
makes it read the manifest again as vLLM's workers used to (the Actor must
then catch the difference).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import time
from pathlib import Path
from typing import Any, cast

import pytest

from aurora_store.codec.extract import extract
from aurora_store.coordination.keys import mirror_token
from aurora_store.errors import ConfigError
from aurora_store.format.manifest import manifest_key
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.publish import PublishConfig, publish_delta
from aurora_store.storage import Store, open_store
from aurora_store.testing.clock import ManualClock
from aurora_store.testing.servers import S3Server
from aurora_tools.bench.hostile.forge import TwoFacedStore
from aurora_tools.bench.hostile.workers import (
    VERSIONS,
    SourceRecorder,
    StoreStagingEngine,
    mirror_actor,
    publish_mirror_run,
)
from aurora_tools.synthetic.workload import base_weights, sparse_update
from workers.actor import Actor, ActorConfig, add_arguments, config_from_args
from workers.actor.holding import Staged
from workers.common import Endpoints
from workers.engine import RemoteStaged, StoreStaging
from workers.model import fusion_plan_for

pytestmark = pytest.mark.server


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_client: Any, redis_server: Any) -> dict[str, Any]:
    """Deltas 1..VERSIONS at origin, a true copy in ``mirror``, an ``evil`` copy, and a forged v1 (same base_state)."""
    monkeypatch.setenv("AURORA_SYNTHETIC_CACHE", str(tmp_path / "cache"))
    res = publish_mirror_run(tmp_path)
    fm = res["forged"]
    assert fm.base_state == res["spec"].base_state and fm.state != res["states"][1]
    res.update(redis=redis_server.url, client=redis_client)
    return res


def _actor(run: dict[str, Any], relay_url: str | None, **cfg: Any) -> tuple[Actor, SourceRecorder]:
    """A fresh Actor at v0, the Trainer's head at VERSIONS (no expected states recorded)."""
    return mirror_actor(run, relay_url, record_states=False, **cfg)


# -- mirrors are configured -----------------------------------------------------------


def test_a_mirror_url_planted_in_redis_is_ignored_and_logged_once(run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    tmp = run["tmp"]
    a, rec = _actor(run, f"file://{tmp}/evil", mirror=f"file://{tmp}/mirror")
    with caplog.at_level(logging.WARNING, logger="aurora.actor"):
        a.stager.stage_once()
        a.stager.stage_once()
        assert a.sources.source(mirror_token(f"file://{tmp}/evil"))[0] is a.origin
    assert rec.sources == [(v, False) for v in range(1, VERSIONS + 1)]  # origin, not the planted store
    assert not a.sources.mirror_opened  # the configured mirror is never opened while the key names another
    said = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    # The key holds a token (a digest of the mirror's URL), never a URL: the line names the token.
    assert len(said) == 1 and mirror_token(f"file://{tmp}/evil")[-32:] in said[0] and "not this Actor's --mirror" in said[0]


def test_an_actor_without_a_mirror_reads_origin_whatever_redis_says(run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    tmp = run["tmp"]
    a, rec = _actor(run, f"file://user:hunter2@{tmp}/mirror")
    with caplog.at_level(logging.WARNING, logger="aurora.actor"):
        a.stager.stage_once()
    assert rec.sources == [(v, False) for v in range(1, VERSIONS + 1)]
    said = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(said) == 1 and "has no --mirror" in said[0] and "hunter2" not in said[0]  # a URL from Redis may carry secrets


def test_the_configured_mirror_is_read_while_its_relay_heartbeats_with_it(run: dict[str, Any]) -> None:
    tmp = run["tmp"]
    shutil.rmtree(tmp / "mirror")
    shutil.copytree(tmp / "origin", tmp / "mirror")  # a plain true copy
    a, rec = _actor(run, f"file://{tmp}/mirror/", mirror=f"file://{tmp}/mirror")  # a trailing / is the same root
    a.stager.stage_once()
    assert rec.sources == [(v, True) for v in range(1, VERSIONS + 1)]
    assert a.staged_state == run["states"][VERSIONS]


def test_a_configured_mirror_uses_its_own_storage_options(run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An S3 mirror reachable only through its options (its endpoint and keys: another account)."""
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    with S3Server() as s3:
        url, opts = f"s3://{s3.new_bucket('mirror')}/r", s3.storage_options()
        mirror = open_store(url, opts)
        origin = run["tmp"] / "origin"
        for p in sorted(origin.rglob("*")):
            if p.is_file():
                mirror.put(str(p.relative_to(origin)), p.read_bytes(), mode="overwrite")
        a, rec = _actor(run, url, engine=lambda e: StoreStagingEngine(e, reread=False), mirror=url, mirror_options=opts)
        a.stager.stage_once()
        assert rec.sources == [(v, True) for v in range(1, VERSIONS + 1)]
        assert a.engine.options == [opts] * VERSIONS  # what its workers are given too
        assert "secret" not in repr(a.cfg) and opts["secret"] not in repr(a.cfg)


def test_mirror_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--store", "file:///o", "--redis", "redis://h/0", "--run", "r"]
    assert config_from_args(p.parse_args(base)).mirror is None
    cfg = config_from_args(
        p.parse_args([*base, "--mirror", "s3://b/m", "--mirror-option", "endpoint_url=http://h:9", "--mirror-option", "anon=true"])
    )
    assert cfg.mirror == "s3://b/m" and cfg.mirror_options == {"client_kwargs": {"endpoint_url": "http://h:9"}, "anon": True}
    monkeypatch.setenv("AURORA_ACTOR_MIRROR", "file:///m")
    monkeypatch.setenv("AURORA_ACTOR_MIRROR_OPTIONS", '{"key": "k", "secret": "s3cr3t"}')
    cfg = config_from_args(p.parse_args(base))
    assert cfg.mirror == "file:///m" and cfg.mirror_options == {"key": "k", "secret": "s3cr3t"} and "s3cr3t" not in repr(cfg)
    monkeypatch.setenv("AURORA_ACTOR_MIRROR_OPTIONS", "[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        config_from_args(p.parse_args(base))
    with pytest.raises(ConfigError, match="URL"):
        ActorConfig(mirror="just-a-name")
    with pytest.raises(ConfigError, match="without a mirror"):
        ActorConfig(mirror_options={"anon": True})


# -- what the engine holds is what was checked ------------------------------------------


def _two_faced_mirror(run: dict[str, Any]) -> TwoFacedStore:
    url = f"file://{run['tmp']}/mirror"
    return TwoFacedStore(open_store(url), manifest_key("delta", 1), run["forged_manifest"])


def test_a_mirror_that_changes_its_manifest_between_two_reads_is_refused(run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Workers that read the manifest again get the forged one: the Actor sees another state and reads origin."""
    mirror = _two_faced_mirror(run)
    url = f"file://{run['tmp']}/mirror"
    a, rec = _actor(run, url, engine=lambda e: StoreStagingEngine(e, reread=True), mirror_store=mirror, mirror=url)
    eng = a.engine
    assert isinstance(eng, StoreStagingEngine) and isinstance(eng, StoreStaging)
    with caplog.at_level(logging.WARNING, logger="aurora.actor"):
        a.stager.stage_once()
    assert mirror.reads == 2  # the Actor's read (true), then the workers' (forged)
    assert rec.sources[0] == (1, False)  # v1 refused from the mirror, read from origin
    assert any("from mirror failed" in r.getMessage() and "refused" in r.getMessage() for r in caplog.records)
    assert [e.state for e in a.staged] == [run["states"][v] for v in range(1, VERSIONS + 1)]
    assert run["forged_state"] not in {s for s, _ in eng.held.values()}


def test_workers_handed_the_checked_manifest_never_read_it_again(run: dict[str, Any]) -> None:
    mirror = _two_faced_mirror(run)
    url = f"file://{run['tmp']}/mirror"
    a, rec = _actor(run, url, engine=lambda e: StoreStagingEngine(e, reread=False), mirror_store=mirror, mirror=url)
    a.stager.stage_once()
    assert mirror.reads == 1 and rec.sources == [(v, True) for v in range(1, VERSIONS + 1)]
    assert a.staged_state == run["states"][VERSIONS]
    assert read_manifest(cast(Store, mirror), "delta", 1).state == run["forged_state"]  # what a second read would get


def test_an_engine_that_refuses_activation_leaves_the_version_quarantined(run: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """Staged under one state, asked to activate another: nothing written, the version quarantined, staging starts over."""
    a, _ = _actor(run, None, engine=lambda e: StoreStagingEngine(e, reread=False))
    eng = a.engine
    a.stager.stage_once()
    digest = eng.digest()
    first = a.staged[0].item
    assert isinstance(first, RemoteStaged)
    # What was staged, swapped for v1 under another state (the engine's workers hold v1's true one).
    a.holding.start_at(0, run["spec"].base_state)
    a.holding.stage(Staged(RemoteStaged(first.version, 0, run["forged_state"], first.nnz), run["forged_state"], 0.0))
    a.holding.commit_seen = 1
    with caplog.at_level(logging.ERROR, logger="aurora.actor"):
        a.safepoint.activate()
    assert a.active == 0 and a.active_state == run["spec"].base_state and eng.digest() == digest
    assert not a.ctx.quarantine.allowed("delta", 1)
    assert not a.staged and (a.staged_version, a.staged_state) == (0, run["spec"].base_state)
    assert any("refused to activate v1" in r.getMessage() for r in caplog.records)


class _Reacher:
    """A StoreStaging engine whose "workers" report reaching the end of the chain they are handed; ``lies`` times another state."""

    def __init__(self, lies: int) -> None:
        self.lies = lies
        self.handed: list[list[tuple[str, int]]] = []

    def bootstrap_from_store(
        self, store: Store, options: Any, version: int | None, streams: int = 2, manifests: Any = None
    ) -> tuple[int, str]:
        assert manifests is not None  # the Actor always hands over the chain it checked
        self.handed.append([(m.kind, m.version) for m in manifests])
        if self.lies:
            self.lies -= 1
            return manifests[-1].version, "sha256:" + "0" * 64
        return manifests[-1].version, manifests[-1].state

    def stage_from_store(self, *a: Any, **kw: Any) -> Any:
        raise AssertionError("not used here")

    def close(self) -> None:
        pass


def test_a_bootstrap_that_reaches_another_state_is_quarantined_and_planned_again(run: dict[str, Any]) -> None:
    from aurora_store.lineage.publish import publish_snapshot
    from workers.model import fused_weights

    spec = run["spec"]
    origin = open_store(f"file://{run['tmp']}/boot")
    w = base_weights(spec.shape, spec.seed)
    plan = fusion_plan_for(w, tied=True)
    cfg = PublishConfig(streams=2, segment_bytes=4096)
    state = publish_snapshot(origin, "r", 0, fused_weights(w, plan), None, cfg).state
    states = {0: state}
    for v in range(1, VERSIONS + 1):
        new = {n: t.clone() for n, t in w.items()}
        sparse_update(new, spec.density, spec.seed, v)
        state = states[v] = publish_delta(origin, "r", v, extract(plan, w, new), state, cfg).state
        w = new
    eng = _Reacher(lies=1)
    a = Actor.from_endpoints(
        Endpoints(origin.url, run["redis"], f"t{time.monotonic_ns()}"), ActorConfig(actor_id="a"), ManualClock(), engine=cast(Any, eng)
    )
    assert a.boot.reach() == (VERSIONS - 1, states[VERSIONS - 1])
    assert eng.handed == [
        [("snapshot", 0)] + [("delta", v) for v in range(1, VERSIONS + 1)],
        [("snapshot", 0)] + [("delta", v) for v in range(1, VERSIONS)],
    ]
    assert not a.ctx.quarantine.allowed("delta", VERSIONS)  # refused, tried again after its back-off
