"""Attacks on an Actor's mirror path, against the real :class:`workers.actor.Actor` in-process.

A real redis-server (``aurora_store.testing.servers.RedisServer``) carries the
run's keys; origin, a true mirror, an "evil" copy and a forged version live in
local stores. Each case builds a fresh Actor on the synthetic engine and runs
its staging step; "applied" means a forged state was staged or activated.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aurora_store.coordination.keys import mirror_token
from aurora_store.errors import IntegrityError
from aurora_store.format.manifest import manifest_key, version_dir
from aurora_store.lineage.fetch import fetch_delta
from aurora_tools.bench.hostile.cases import Case, Context, Result
from aurora_tools.bench.hostile.forge import TwoFacedStore
from workers.actor import Actor
from workers.engine import RemoteStaged

__all__ = ["WORKER_CASES", "SourceRecorder", "StoreStagingEngine", "publish_mirror_run", "mirror_actor", "VERSIONS", "REGION"]

VERSIONS = 3
REGION = "r1"


class SourceRecorder:
    """Records, for each version an Actor stages, whether it came from its mirror (a ``StagedObserver``)."""

    def __init__(self) -> None:
        self.sources: list[tuple[int, bool]] = []

    def staged(self, version: int, nbytes: int, seconds: float, from_mirror: bool) -> None:
        self.sources.append((version, from_mirror))


class StoreStagingEngine:
    """An engine whose "workers" fetch deltas from the store themselves (as vLLM's do), in this process.

    ``reread``: ignore the manifest the Actor hands over and read it again
    (what vLLM's workers did before the manifest was handed to them); the
    Actor must then catch the difference. ``options`` records the storage
    options each fetch was given.
    """

    def __init__(self, inner: Any, reread: bool = True) -> None:
        self.inner, self.reread = inner, reread
        self.held: dict[int, tuple[str, Any]] = {}
        self.options: list[dict[str, Any]] = []

    def stage_from_store(
        self, store: Any, storage_options: Any, version: int, expect_base_state: str | None, streams: int = 2, manifest: Any = None
    ) -> tuple[Any, RemoteStaged]:
        self.options.append(dict(storage_options or {}))
        m, staged = fetch_delta(
            store, version, self.inner.param_specs(), streams, expect_base_state, manifest=None if self.reread else manifest
        )
        self.held[version] = (m.state, staged)
        return m, RemoteStaged(version, version - 1, m.state, staged.nnz)

    def bootstrap_from_store(self, *a: Any, **kw: Any) -> tuple[int, str]:
        raise RuntimeError("not used here")

    def apply(self, staged: Any) -> None:
        state, delta = self.held.pop(staged.version)
        if state != staged.state:  # as vLLM's ranks do: refused before any write
            raise IntegrityError(f"delta {staged.version}: staged {state}, asked for {staged.state}")
        self.inner.apply(delta)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def publish_mirror_run(tmp: Path) -> dict[str, Any]:
    """Deltas 1..VERSIONS at ``tmp/origin``, true copies in ``mirror`` and ``evil``, a forged v1
    (same base state) in ``forge`` whose segments also sit in ``mirror`` beside the true ones.

    Returns ``spec``, ``tmp``, ``states`` (version -> true state), ``forged``
    (the forged manifest), ``forged_manifest`` (its bytes) and ``forged_state``.
    The caller points ``AURORA_SYNTHETIC_CACHE`` somewhere first.
    """
    from aurora_store.codec.extract import extract
    from aurora_store.lineage.publish import PublishConfig, publish_delta
    from aurora_store.storage import open_store
    from aurora_tools.synthetic.shapes import QWEN3_TINY
    from aurora_tools.synthetic.workload import SyntheticSpec, base_weights, sparse_update
    from workers.model import fusion_plan_for

    spec = SyntheticSpec(QWEN3_TINY, seed=7)
    origin = open_store(f"file://{tmp}/origin")
    base = w = base_weights(spec.shape, spec.seed)
    plan = fusion_plan_for(w, tied=True)
    cfg = PublishConfig(streams=2, segment_bytes=4096)
    state, states = spec.base_state, {0: spec.base_state}
    for v in range(1, VERSIONS + 1):
        new = {n: t.clone() for n, t in w.items()}
        sparse_update(new, spec.density, spec.seed, v)
        state = states[v] = publish_delta(origin, "r", v, extract(plan, w, new), state, cfg).state
        w = new
    for d in ("mirror", "evil"):
        shutil.copytree(tmp / "origin", tmp / d)
    forged = {n: t.clone() for n, t in base.items()}
    sparse_update(forged, spec.density, spec.seed + 99, 1)
    fm = publish_delta(open_store(f"file://{tmp}/forge"), "r", 1, extract(plan, base, forged), spec.base_state, cfg)
    vdir = version_dir("delta", 1)
    # The mirror two-faced case: forged segments beside the true ones, the forged manifest its second answer.
    shutil.copytree(tmp / "forge" / vdir, tmp / "mirror" / vdir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("manifest.json"))
    return {
        "spec": spec,
        "tmp": tmp,
        "states": states,
        "forged": fm,
        "forged_manifest": (tmp / "forge" / manifest_key("delta", 1)).read_bytes(),
        "forged_state": fm.state,
    }


def _mirror_run(ctx: Context) -> dict[str, Any]:
    """Deltas 1..3 at origin, true copies ``mirror`` and ``evil``, a forged v1 (same base state) in ``forge``."""
    if "mirrors" in ctx.resources:
        return ctx.resources["mirrors"]
    import os

    import redis

    from aurora_store.testing.servers import RedisServer

    tmp = ctx.dir("mirrors")
    os.environ["AURORA_SYNTHETIC_CACHE"] = str(tmp / "cache")
    server = RedisServer().start()
    ctx.closers.append(server.stop)
    res = publish_mirror_run(tmp)
    # The forged chain: a mirror whose v1 is the forged version, manifest and segments.
    vdir = version_dir("delta", 1)
    shutil.copytree(tmp / "origin", tmp / "forged-mirror")
    shutil.rmtree(tmp / "forged-mirror" / vdir)
    shutil.copytree(tmp / "forge" / vdir, tmp / "forged-mirror" / vdir)
    res.update(redis=server.url, client=redis.Redis.from_url(server.url))
    ctx.resources["mirrors"] = res
    return res


def mirror_actor(
    run: dict[str, Any],
    relay_url: str | None,
    record_states: bool = True,
    engine: Callable[[Any], Any] | None = None,
    mirror_store: Any = None,
    **cfg: Any,
) -> tuple[Actor, SourceRecorder]:
    """A fresh Actor (on the synthetic engine, at v0) of a fresh run name over ``run``
    (:func:`publish_mirror_run` plus ``redis`` and ``client``): the Trainer's head at
    VERSIONS, its expected states recorded unless told not to, the region's Relay key
    naming ``relay_url``; ``cfg`` goes to :class:`ActorConfig`. ``engine`` wraps the synthetic
    engine; ``mirror_store`` is the store the Actor opens as its mirror. Returns the Actor and what
    records where each version came from."""
    from aurora_store.coordination.keys import RunKeys
    from aurora_store.coordination.records import RunRecords
    from aurora_store.testing.clock import ManualClock
    from aurora_tools.synthetic.engine import SyntheticEngine
    from workers.actor import ActorConfig
    from workers.common import Endpoints

    name = f"hostile{time.monotonic_ns()}"
    eng: Any = SyntheticEngine(run["spec"], hold=True, digests=True)
    eng.load_base()
    rec = SourceRecorder()
    a = Actor.from_endpoints(
        Endpoints(f"file://{run['tmp']}/origin", run["redis"], name),
        ActorConfig(actor_id="a", region=REGION, **cfg),
        ManualClock(),
        engine=engine(eng) if engine is not None else eng,
        open_mirror=(lambda: mirror_store) if mirror_store is not None else None,
        observers=[rec],
    )
    a.holding.start_at(0, run["spec"].base_state)
    keys = RunKeys(name)
    records = RunRecords(run["client"], name)
    if record_states:
        for v, st in run["states"].items():  # what the Trainer records as it commits each version
            records.record_expected_state(v, st)
    records.record_head(VERSIONS)
    if relay_url is not None:
        run["client"].set(keys.relay(REGION), mirror_token(relay_url))  # what a Relay writes for that mirror
    return a, rec


def _judge(res: Result, run: dict[str, Any], a: Actor, rec: SourceRecorder, want_sources: list[tuple[int, bool]] | None, how: str) -> None:
    """Refused (or, for a control, accepted) when the Actor staged exactly the true chain."""
    staged_states = [e.state for e in a.staged]
    true_chain = staged_states == [run["states"][v] for v in range(1, VERSIONS + 1)]
    res.applied = run["forged_state"] in staged_states or a.active_state == run["forged_state"]
    ok_sources = want_sources is None or rec.sources == want_sources
    if res.applied:
        res.outcome, res.how = "applied", "the forged state was staged"
    elif true_chain and ok_sources:
        res.outcome = "accepted" if res.expected == "accept" else "refused"
        res.how = how
    else:
        res.outcome, res.how = "failed", f"staged {len(staged_states)} versions, sources {rec.sources}"


def _planted_url(ctx: Context, res: Result) -> None:
    run = _mirror_run(ctx)
    tmp = run["tmp"]
    a, rec = mirror_actor(run, f"file://{tmp}/evil", mirror=f"file://{tmp}/mirror")
    a.stager.stage_once()
    _judge(res, run, a, rec, [(v, False) for v in range(1, VERSIONS + 1)], "planted URL ignored; read origin")


def _two_faced(ctx: Context, res: Result) -> None:
    from aurora_store.format.manifest import manifest_key
    from aurora_store.storage import open_store

    run = _mirror_run(ctx)
    url = f"file://{run['tmp']}/mirror"
    store = TwoFacedStore(open_store(url), manifest_key("delta", 1), run["forged_manifest"])
    a, rec = mirror_actor(run, url, engine=lambda e: StoreStagingEngine(e, reread=True), mirror_store=store, mirror=url)
    eng = a.engine
    assert isinstance(eng, StoreStagingEngine)
    a.stager.stage_once()
    _judge(res, run, a, rec, None, "second answer refused; v1 read from origin")
    if res.outcome == "refused" and (store.reads < 2 or rec.sources[0] != (1, False)):
        res.outcome, res.how = "failed", f"mirror read {store.reads} times, sources {rec.sources}"
    if run["forged_state"] in {s for s, _ in eng.held.values()}:
        res.applied, res.outcome = True, "applied"


def true_mirror_url(run: dict[str, Any]) -> str:
    """URL of a plain, true copy of the run's origin (made at its first use): the honest mirror."""
    tmp: Path = run["tmp"]
    if not (tmp / "true-mirror").exists():
        shutil.copytree(tmp / "origin", tmp / "true-mirror")
    return f"file://{tmp}/true-mirror"


def _forged_chain(ctx: Context, res: Result) -> None:
    run = _mirror_run(ctx)
    url = f"file://{run['tmp']}/forged-mirror"
    a, rec = mirror_actor(run, url, mirror=url)
    a.stager.stage_once()
    _judge(res, run, a, rec, None, "forged v1 refused; read from origin")
    if res.outcome == "refused" and rec.sources[0] != (1, False):
        res.outcome, res.how = "failed", f"sources {rec.sources}"


def _valid_mirror(ctx: Context, res: Result) -> None:
    run = _mirror_run(ctx)
    url = true_mirror_url(run)
    a, rec = mirror_actor(run, url, mirror=url)
    a.stager.stage_once()
    _judge(res, run, a, rec, [(v, True) for v in range(1, VERSIONS + 1)], "every version read from the mirror")


def _case(name: str, expected: str, fn: Callable[[Context, Result], None], quick: bool = False) -> Case:
    return Case(name, "actor", expected, fn, quick=quick)


WORKER_CASES = [
    _case("actor:mirror-url-planted-in-redis", "refuse", _planted_url, quick=True),
    _case("actor:mirror-changes-its-answer", "refuse", _two_faced),
    _case("actor:forged-mirror-chain", "refuse", _forged_chain),
    _case("valid:actor-uses-its-mirror", "accept", _valid_mirror),
]
