"""Attacks through an Actor's mirror, and a fresh Actor against planted far-future versions (issue 24).

The mirror cases run the real :class:`workers.actor.Actor` over the run of
:mod:`aurora_tools.bench.hostile.workers` (deltas 1..3 at origin) with a
mirror that is hostile or failing: one serving only a forged, self-consistent
snapshot; one whose server is away (every request refused); one that answers
slowly. Oversized objects from a mirror are read by an Actor in a child
process (:mod:`aurora_tools.bench.hostile.mirror_child`) under the 8 GiB
address-space limit, its peak resident size compared with the same Actor
reading a true mirror. The far-future case starts a fresh Actor (its real
boot, the real torch engine) on a clone of the bench's Trainer run.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from aurora_tools.bench.hostile.cases import Case, Context, Result
from aurora_tools.bench.hostile.planted import RSS_SLACK_MB, sparse
from aurora_tools.bench.hostile.rss import run_measured
from aurora_tools.bench.hostile.workers import VERSIONS, _mirror_run, mirror_actor, true_mirror_url

__all__ = ["MIRROR_CASES", "bound_mirror_run"]

SLOW_S = 3.0
"""What each request to the slow mirror costs."""

MIRROR_TIMEOUT_S = 2.0
"""The Actors' ``mirror_timeout_s`` in these cases."""

FAR_PLANTS = 20
"""Far-future delta manifests planted for the fresh Actor (it used to try only the 16 newest)."""


def _staged(a: Any) -> list[tuple[int, str, bool]]:
    return [(e.version, e.state, e.whole) for e in a.staged]


def _true_chain(run: dict[str, Any], a: Any) -> bool:
    return [s for _, s, _ in _staged(a)] == [run["states"][v] for v in range(1, VERSIONS + 1)]


def _with_timeout(cfg: dict[str, Any]) -> dict[str, Any]:
    """``mirror_timeout_s`` for the Actor, where its configuration knows the option."""
    import dataclasses

    from workers.actor import ActorConfig

    if "mirror_timeout_s" in {f.name for f in dataclasses.fields(ActorConfig)}:
        cfg["mirror_timeout_s"] = MIRROR_TIMEOUT_S
    return cfg


def _mirror_store(url: str, call: Any) -> Any:
    """The store at ``url`` whose every request goes through ``call(what, fn)`` (a failing or slow server)."""
    from aurora_store.storage import open_store

    store = open_store(url)
    try:
        from workers.actor.breaker import mirror_store_config

        store.config = mirror_store_config(MIRROR_TIMEOUT_S, store.config)  # what the Actor opens a mirror with
    except ImportError:
        pass
    store._call = call  # type: ignore[method-assign]  # noqa: SLF001 - the one hook every request of a store goes through
    return store


# --- a forged snapshot, alone in the mirror -----------------------------------------------


def _mirror_only_snapshot(ctx: Context, res: Result) -> None:
    from aurora_store.codec.extract import fuse_weights
    from aurora_store.lineage.publish import PublishConfig, publish_snapshot
    from aurora_store.storage import open_store
    from aurora_tools.synthetic.workload import base_weights
    from workers.model import fusion_plan_for

    run = _mirror_run(ctx)
    tmp: Path = run["tmp"]
    url = f"file://{tmp}/snapshot-only-mirror"
    if not (tmp / "snapshot-only-mirror").exists():
        spec = run["spec"]
        w = base_weights(spec.shape, spec.seed)
        forged = {n: t + 0.25 for n, t in fuse_weights(w, fusion_plan_for(w, tied=True)).items()}
        # Self-consistent (its own weights digest), the true state of v3 copied in, no deltas beside it.
        publish_snapshot(open_store(url), "r", VERSIONS, forged, run["states"][VERSIONS], PublishConfig(streams=2))
    a, rec = mirror_actor(run, url, mirror=url)
    a.fetcher.full_bytes = 1  # as after a bootstrap from a snapshot: far behind, a whole version is the cheaper way
    a.stager.stage_once()
    from_mirror = [v for v, m in rec.sources if m]
    if from_mirror or any(whole for _, _, whole in _staged(a)):
        res.outcome, res.applied = "applied", True
        res.how = f"staged from the mirror: {from_mirror or 'a whole version'}"
    elif _true_chain(run, a) or not a.staged:
        res.outcome = "refused"
        res.how = f"the mirror's snapshot not used; {len(a.staged)} true deltas staged from origin"
    else:
        res.outcome, res.how = "failed", f"staged {_staged(a)}"


# --- a mirror away, a slow mirror ----------------------------------------------------------


def _mirror_outage(ctx: Context, res: Result) -> None:
    run = _mirror_run(ctx)
    url = true_mirror_url(run)

    def refused(what: str, fn: Any) -> Any:
        raise ConnectionRefusedError(111, "Connection refused (the mirror's server is stopped)")

    store = _mirror_store(url, refused)
    a, rec = mirror_actor(run, url, mirror_store=store, **_with_timeout({"mirror": url}))
    a.fetcher.full_bytes = 1  # far behind after a snapshot bootstrap: the catch-up lists the mirror first
    try:
        for _ in range(3):  # the stager's loop, a few rounds
            a.stager.stage_once()
            if len(a.staged) >= VERSIONS:
                break
    except Exception as e:  # noqa: BLE001 - an Actor that dies of its mirror is the finding
        res.outcome, res.how = "failed", f"the Actor died of its mirror: {type(e).__name__}: {str(e)[:120]}"
        return
    if _true_chain(run, a) and not any(m for _, m in rec.sources):
        res.outcome, res.how = "refused", "survived the mirror's outage; v1..v3 staged from origin"
    else:
        res.outcome, res.how = "failed", f"staged {len(a.staged)} version(s), sources {rec.sources}"


def _slow_mirror(ctx: Context, res: Result) -> None:
    run = _mirror_run(ctx)
    url = true_mirror_url(run)

    def slow(what: str, fn: Any) -> Any:
        time.sleep(SLOW_S)
        return fn()

    store = _mirror_store(url, slow)
    a, rec = mirror_actor(run, url, mirror_store=store, **_with_timeout({"mirror": url}))
    t0 = time.monotonic()
    try:
        a.stager.stage_once()
    except Exception as e:  # noqa: BLE001 - judged below
        res.outcome, res.how = "failed", f"the Actor died of its slow mirror: {type(e).__name__}: {str(e)[:120]}"
        return
    took = time.monotonic() - t0
    bound = VERSIONS * SLOW_S + 2.0  # a mirror read in full would cost at least two requests a version
    if not _true_chain(run, a):
        res.outcome, res.how = "failed", f"staged {len(a.staged)} version(s), sources {rec.sources}"
    elif took > bound:
        res.outcome, res.how = (
            "failed",
            f"{VERSIONS} versions took {took:.1f}s through a mirror answering in {SLOW_S}s (bound {bound:.0f}s)",
        )
    else:
        res.outcome = "refused"
        res.how = f"{VERSIONS} true versions in {took:.1f}s (mirror {SLOW_S}s a request; sources {rec.sources})"


# --- oversized objects from a mirror, read in a child process ---------------------------------


def bound_mirror_run(ctx: Context) -> dict[str, Any]:
    """Like the Actor cases' run, but every delta carries its weights digest, and the mirror holds a true
    snapshot of the head (bound to the chain by the head's delta) and no earlier delta: a catch-up from
    the mirror has to read the snapshot's shards."""
    if "bound-mirror" in ctx.resources:
        return ctx.resources["bound-mirror"]

    from aurora_store.apply.sink import weights_digest
    from aurora_store.codec.extract import extract, fuse_weights
    from aurora_store.format.manifest import version_dir
    from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
    from aurora_store.storage import open_store
    from aurora_tools.synthetic.shapes import QWEN3_TINY
    from aurora_tools.synthetic.workload import SyntheticSpec, base_weights, sparse_update
    from workers.model import fusion_plan_for

    base = _mirror_run(ctx)  # its Redis server and synthetic cache
    tmp = ctx.dir("bound-mirror")
    os.environ["AURORA_SYNTHETIC_CACHE"] = str(base["tmp"] / "cache")
    spec = SyntheticSpec(QWEN3_TINY, seed=7)
    origin = open_store(f"file://{tmp}/origin")
    w = base_weights(spec.shape, spec.seed)
    plan = fusion_plan_for(w, tied=True)
    cfg = PublishConfig(streams=2, segment_bytes=4096)
    state, states = spec.base_state, {0: spec.base_state}
    for v in range(1, VERSIONS + 1):
        new = {n: t.clone() for n, t in w.items()}
        sparse_update(new, spec.density, spec.seed, v)
        m = publish_delta(origin, "r", v, extract(plan, w, new), state, cfg, weights_digest=weights_digest(new, plan))
        state = states[v] = m.state
        w = new
    shutil.copytree(tmp / "origin", tmp / "mirror")
    for v in range(1, VERSIONS):  # only the head's delta (which binds the snapshot): the catch-up must read the snapshot
        shutil.rmtree(tmp / "mirror" / version_dir("delta", v))
    publish_snapshot(open_store(f"file://{tmp}/mirror"), "r", VERSIONS, fuse_weights(w, plan), state, cfg)
    res = {"spec": spec, "tmp": tmp, "states": states, "forged_state": "none", "redis": base["redis"]}
    ctx.resources["bound-mirror"] = res
    return res


def _child(ctx: Context, run: dict[str, Any], mirror: Path, name: str, full_bytes: int | None) -> tuple[dict[str, Any], Any]:
    """An Actor at v0 staging once from ``mirror``, in a child process: (its report, its measurement)."""
    d = ctx.dir(f"child-{name}")
    spec_file = d / "run.pickle"
    keep = {k: run[k] for k in ("spec", "tmp", "states", "forged_state", "redis")}
    spec_file.write_bytes(pickle.dumps({"run": keep, "mirror": f"file://{mirror}", "full_bytes": full_bytes}))

    env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    env["AURORA_SYNTHETIC_CACHE"] = str(_mirror_run(ctx)["tmp"] / "cache")
    env["AURORA_TORCH_THREADS"] = "1"
    m = run_measured([sys.executable, "-m", "aurora_tools.bench.hostile.mirror_child", str(spec_file)], env=env, timeout=240)
    lines = [ln for ln in m.out.splitlines() if ln.startswith("{")]
    report = json.loads(lines[-1]) if lines else {"error": (m.err.strip().splitlines() or [f"exit {m.rc}"])[-1][:200]}
    return report, m


def _baseline(ctx: Context, run: dict[str, Any], key: str, mirror: Path, full_bytes: int | None) -> float:
    """The peak RSS of the same Actor reading a true mirror (once per run)."""
    cache = ctx.resources.setdefault("mirror-baselines", {})
    if key not in cache:
        report, m = _child(ctx, run, mirror, f"baseline-{key}", full_bytes)
        if report.get("error") or m.rc != 0:
            raise RuntimeError(f"the baseline Actor failed: {report.get('error') or m.err[-200:]}")
        cache[key] = m.peak_mb
    return cache[key]


def _oversized_from_mirror(target: str) -> Any:
    def run_case(ctx: Context, res: Result) -> None:
        from aurora_store.format.manifest import manifest_key, version_dir

        if target == "shard":
            run = bound_mirror_run(ctx)
            full_bytes: int | None = 1
            true_mirror = run["tmp"] / "mirror"
        else:
            run = _mirror_run(ctx)
            full_bytes = None
            true_mirror = run["tmp"] / "true-mirror"
            if not true_mirror.exists():
                shutil.copytree(run["tmp"] / "origin", true_mirror)
        baseline = _baseline(ctx, run, "bound" if target == "shard" else "plain", true_mirror, full_bytes)
        mirror = ctx.dir(f"oversized-{target}-mirror") / "mirror"
        if mirror.exists():
            shutil.rmtree(mirror)
        shutil.copytree(true_mirror, mirror)
        for p in mirror.rglob("*"):
            if p.is_file():
                p.chmod(0o644)
        kind, version = ("snapshot", VERSIONS) if target == "shard" else ("delta", 1)
        if target == "manifest":
            sparse(mirror / manifest_key(kind, version))
        else:
            m = json.loads((mirror / manifest_key(kind, version)).read_bytes())
            sparse(mirror / version_dir(kind, version) / m["segments"][0]["key"])
        report, meas = _child(ctx, run, mirror, f"oversized-{target}", full_bytes)
        res.traceback = meas.traceback
        true = [run["states"][v] for v in range(1, VERSIONS + 1)]
        staged = report.get("staged_states")
        if meas.traceback:
            res.outcome, res.how = "traceback", "the Actor wrote a traceback"
        elif meas.rc != 0 or report.get("error"):
            res.outcome, res.how = "failed", f"the Actor died (exit {meas.rc}, peak {meas.peak_mb:.0f} MB): {report.get('error', '')[:100]}"
        elif meas.peak_mb > baseline + RSS_SLACK_MB:
            res.outcome, res.how = "failed", f"peak RSS {meas.peak_mb:.0f} MB, {baseline:.0f} MB reading a true mirror"
        elif staged not in (true, [true[-1]]):
            res.outcome, res.how = "failed", f"staged {len(staged or [])} versions, not the true chain"
        else:
            res.outcome = "refused"
            res.how = f"refused, the true chain staged; peak {meas.peak_mb:.0f} MB ({baseline:.0f} reading a true mirror)"

    return run_case


# --- a fresh Actor and planted far-future versions -------------------------------------------


def _far_future_versions(ctx: Context, res: Result) -> None:
    from aurora_store.format.manifest import Manifest, content_digest, manifest_key
    from aurora_tools.bench.hostile.runs import STEPS, clone_run

    run = clone_run(ctx, "far-future-versions")
    first = 9_999_999_999 - FAR_PLANTS + 1
    for v in range(first, first + FAR_PLANTS):
        m = Manifest(
            kind="delta",
            run=run["run"],
            version=v,
            segments=(),
            params={},
            state=content_digest(()),
            base_version=v - 1,
            base_state=content_digest(()),
        )
        p = run["dir"] / manifest_key("delta", v)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(m.to_bytes())
    d = ctx.dir("far-future-versions")
    spec_file = d / "fresh.pickle"
    spec_file.write_bytes(pickle.dumps({"mode": "fresh", "url": run["url"], "redis": run["redis"], "run": run["run"], "timeout_s": 120}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    env["AURORA_TORCH_THREADS"] = "1"
    # A child under the address-space limit: a reader whose memory grows with version numbers fails here, not the machine.
    meas = run_measured([sys.executable, "-m", "aurora_tools.bench.hostile.mirror_child", str(spec_file)], env=env, timeout=200)
    lines = [ln for ln in meas.out.splitlines() if ln.startswith("{")]
    last = (meas.err.strip().splitlines() or [""])[-1][:150]
    report: dict[str, Any] = json.loads(lines[-1]) if lines else {"error": f"exit {meas.rc}, peak {meas.peak_mb:.0f} MB: {last}"}
    res.traceback = meas.traceback
    reached = report.get("reached")
    if meas.traceback:
        res.outcome, res.how = "traceback", "the Actor wrote a traceback"
    elif "error" in report:
        res.outcome, res.how = "failed", f"the boot failed: {report['error'][:140]}"
    elif reached is None:
        res.outcome, res.how = "failed", f"no bootstrap in 120 s past {FAR_PLANTS} planted far-future versions"
    elif reached[0] != STEPS:
        res.outcome, res.applied = "applied", reached[0] > STEPS
        res.how = f"bootstrapped onto v{reached[0]}, the real head is v{STEPS}"
    else:
        res.outcome = "refused"
        res.how = f"bootstrapped onto the real head v{STEPS} past {FAR_PLANTS} planted versions (peak {meas.peak_mb:.0f} MB)"


def _case(name: str, fn: Any, quick: bool = False, group: str = "mirror") -> Case:
    return Case(name, group, "refuse", fn, quick=quick)


MIRROR_CASES = [
    _case("mirror:only-a-forged-snapshot", _mirror_only_snapshot),
    _case("mirror:outage", _mirror_outage, quick=True),
    _case("mirror:slow", _slow_mirror),
    _case("oversized:manifest-from-mirror", _oversized_from_mirror("manifest"), group="oversized"),
    _case("oversized:segment-from-mirror", _oversized_from_mirror("segment"), group="oversized"),
    _case("oversized:shard-from-mirror", _oversized_from_mirror("shard"), group="oversized"),
    _case("planted:far-future-versions:fresh-actor", _far_future_versions),
]
