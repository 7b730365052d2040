"""The Actor's stager: which store each version comes from, and when.

A real Redis and two ``file://`` stores (origin, and a region's mirror that
the test fills by hand, as a Relay would: segments first, manifest last).
The stager is driven directly (``Stager.stage_once``), without its thread,
on a :class:`ManualClock`: the mirror's grace passes when the test says so.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from actor_fixtures import Counting

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.codec.extract import extract
from aurora_store.coordination.keys import RunKeys, mirror_token
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.lineage.publish import PublishConfig, publish_delta
from aurora_store.storage import open_store
from aurora_store.testing.clock import ManualClock
from aurora_tools.bench.hostile.workers import SourceRecorder
from aurora_tools.synthetic.engine import SyntheticEngine
from aurora_tools.synthetic.shapes import QWEN3_TINY
from aurora_tools.synthetic.workload import SyntheticSpec, base_weights, sparse_update
from workers.actor import Actor, ActorConfig
from workers.common import Endpoints
from workers.model import fusion_plan_for

pytestmark = pytest.mark.server

VERSIONS = 4


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_client: Any, redis_server: Any) -> dict[str, Any]:
    monkeypatch.setenv("AURORA_SYNTHETIC_CACHE", str(tmp_path / "cache"))
    spec = SyntheticSpec(QWEN3_TINY, seed=7)
    origin = open_store(f"file://{tmp_path}/origin")
    w = base_weights(spec.shape, spec.seed)
    plan = fusion_plan_for(w, tied=True)
    state = spec.base_state
    for v in range(1, VERSIONS + 1):
        new = {n: t.clone() for n, t in w.items()}
        sparse_update(new, spec.density, spec.seed, v)
        state = publish_delta(origin, "r", v, extract(plan, w, new), state, PublishConfig(streams=2, segment_bytes=4096)).state
        w = new
    return {"spec": spec, "tmp": tmp_path, "redis": redis_server.url, "client": redis_client}


def _actor(
    run: dict[str, Any], grace: float = 60.0, head: int | None = VERSIONS, relay: bool = True, clock: Clock | None = None, **cfg: Any
) -> tuple[Actor, SourceRecorder]:
    """An Actor at v0 on the synthetic engine, its origin counted, and what records where each version came from."""
    tmp: Path = run["tmp"]
    name = f"t{time.monotonic_ns()}"
    eng = SyntheticEngine(run["spec"], hold=True, digests=True)
    eng.load_base()
    rec = SourceRecorder()
    opts: dict[str, Any] = {"actor_id": "a", "region": "r1", "mirror_grace_s": grace, "mirror": f"file://{tmp}/mirror", **cfg}
    a = Actor.from_endpoints(
        Endpoints(f"file://{tmp}/origin", run["redis"], name),
        ActorConfig(**opts),
        clock or ManualClock(),
        origin=Counting(open_store(f"file://{tmp}/origin")),
        engine=eng,
        observers=[rec],
    )
    a.holding.start_at(0, run["spec"].base_state)
    keys = RunKeys(name)
    if head is not None:
        run["client"].hset(keys.trainer, mapping={"head": head})
    if relay:
        (tmp / "mirror").mkdir(exist_ok=True)
        run["client"].set(keys.relay("r1"), mirror_token(f"file://{tmp}/mirror"))
    return a, rec


def _mirror(run: dict[str, Any], *versions: int) -> None:
    """Copy versions into the mirror the way a Relay does (segments, then the manifest)."""
    tmp: Path = run["tmp"]
    for v in versions:
        d = version_dir("delta", v)
        shutil.copytree(tmp / "origin" / d, tmp / "mirror" / d, ignore=shutil.ignore_patterns("manifest.json"))
        shutil.copy(tmp / "origin" / manifest_key("delta", v), tmp / "mirror" / manifest_key("delta", v))


def test_without_a_relay_every_version_comes_from_origin_by_its_manifest_key(run: dict[str, Any]) -> None:
    a, rec = _actor(run, relay=False)
    a.stager.stage_once()
    assert rec.sources == [(v, False) for v in range(1, VERSIONS + 1)]
    assert a.staged_version == VERSIONS
    # No listing, one manifest read per version, and nothing probed past the head.
    assert a.origin.lists == 0
    assert [k for k in a.origin.gets if k.endswith("manifest.json")] == [manifest_key("delta", v) for v in range(1, VERSIONS + 1)]
    # The staged chain applies onto the base and reproduces what was published.
    for e in a.staged:
        a.engine.apply(e.item)
    assert a.engine.version == VERSIONS


def test_the_head_bounds_what_is_staged(run: dict[str, Any]) -> None:
    a, rec = _actor(run, relay=False, head=2)
    a.stager.stage_once()
    assert a.staged_version == 2
    assert not any(manifest_key("delta", 3) == k for k in a.origin.gets)


def test_without_a_head_the_stager_probes_until_a_version_is_missing(run: dict[str, Any]) -> None:
    a, rec = _actor(run, relay=False, head=None)
    a.stager.stage_once()
    assert a.staged_version == VERSIONS


def test_a_mirror_missing_a_version_is_waited_for_within_the_grace(run: dict[str, Any]) -> None:
    _mirror(run, 1, 2)
    a, rec = _actor(run, grace=60.0)
    a.stager.stage_once()
    assert rec.sources == [(1, True), (2, True)]
    assert a.origin.gets == []  # nothing crossed the region boundary
    _mirror(run, 3, 4)
    a.stager.stage_once()
    assert rec.sources[2:] == [(3, True), (4, True)]
    assert a.origin.gets == []


def test_after_the_grace_origin_serves_and_the_mirror_is_used_again_once_it_has_the_next_version(run: dict[str, Any]) -> None:
    _mirror(run, 1)
    clock = ManualClock()
    a, rec = _actor(run, grace=0.2, clock=clock)
    a.stager.stage_once()
    assert a.staged_version == 1  # v2 missing from the mirror: wait
    clock.advance(0.1)
    a.stager.stage_once()
    assert a.staged_version == 1  # still within the grace
    clock.advance(0.15)
    a.stager.stage_once()
    # v2 from origin; the mirror is behind, so v3 and v4 go to origin at once too.
    assert rec.sources == [(1, True), (2, False), (3, False), (4, False)]
    assert a.sources.mirror_behind


def test_a_mirror_that_catches_up_serves_the_next_version(run: dict[str, Any]) -> None:
    _mirror(run, 1)
    clock = ManualClock()
    a, rec = _actor(run, grace=0.2, head=2, clock=clock)
    a.stager.stage_once()
    clock.advance(0.25)
    a.stager.stage_once()
    assert rec.sources == [(1, True), (2, False)] and a.sources.mirror_behind
    _mirror(run, 2, 3)
    run["client"].hset(RunKeys(a.ctx.ep.run).trainer, "head", 3)
    a.stager.stage_once()
    assert rec.sources[-1] == (3, True)
    assert not a.sources.mirror_behind


def test_relay_progress_on_the_missing_version_extends_the_wait(run: dict[str, Any]) -> None:
    _mirror(run, 1)
    clock = ManualClock()
    a, rec = _actor(run, grace=0.3, clock=clock)
    a.stager.stage_once()
    clock.advance(10)  # missing for long...
    a.sources.relay_progress(2, clock.monotonic())  # ...but the Relay just announced a segment of it
    a.stager.stage_once()
    assert a.staged_version == 1 and a.origin.gets == []
    clock.advance(10)  # and then went quiet
    a.stager.stage_once()
    assert a.staged_version == VERSIONS
    assert (2, False) in rec.sources


def test_a_corrupt_mirror_object_falls_back_to_origin(run: dict[str, Any]) -> None:
    _mirror(run, 1)
    tmp: Path = run["tmp"]
    seg = next(p for p in (tmp / "mirror" / version_dir("delta", 1)).rglob("*.safetensors"))
    data = bytearray(seg.read_bytes())
    data[-1] ^= 0xFF
    seg.write_bytes(bytes(data))
    a, rec = _actor(run, head=1)
    a.stager.stage_once()
    assert rec.sources == [(1, False)]


def test_relay_wait_returns_when_the_relay_appears(run: dict[str, Any]) -> None:
    # The Relay appears on wall time here.
    a, _ = _actor(run, relay=False, clock=SYSTEM_CLOCK, relay_wait_s=30.0, mirror="file:///nowhere")
    key = RunKeys(a.ctx.ep.run).relay("r1")
    import threading

    threading.Timer(0.3, lambda: run["client"].set(key, "file:///nowhere")).start()
    t0 = time.monotonic()
    a.sources.wait_for_relay()
    assert 0.2 < time.monotonic() - t0 < 10
