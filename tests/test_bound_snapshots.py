"""Bound snapshots, model files and states (FORMAT.md §1 and §4.1; issue 13 point 2).

Someone who can write to the store but cannot rewrite committed deltas
plants ``snapshots/v{N}`` for a version the Trainer never snapshotted: any
weights, the true ``state`` copied. It is never used. A model description
changed after version 0 is refused. A self-consistent chain that is not the
Trainer's (a mirror's forgery) is refused against the state the Trainer
recorded in Redis, and origin read instead; a lease is never claimed for a
state the Actor does not hold.

Real stores (memory, ``file://``) and a real Redis; the Actors are the real
class, their stagers driven directly on a :class:`ManualClock`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from actor_fixtures import TinyRun
from trainer_fixtures import FakeTrainer

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import extract, fuse_weights, plan_of
from aurora_store.coordination.keys import RunKeys, mirror_token
from aurora_store.coordination.records import record_expected_state
from aurora_store.errors import IntegrityError
from aurora_store.format.manifest import manifest_key
from aurora_store.lineage.fetch import ManifestReader, bound_index, read_manifest
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import plan_chain, scan_versions
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.storage import Store, open_store
from aurora_store.testing.clock import ManualClock
from aurora_tools.bench.hostile.workers import SourceRecorder
from aurora_tools.synthetic.engine import SyntheticEngine
from aurora_tools.synthetic.shapes import QWEN3_TINY, make_weights
from aurora_tools.synthetic.workload import SyntheticSpec, base_weights, sparse_update
from workers.actor import Actor, ActorConfig
from workers.common import MODEL_CONFIG_KEY, Endpoints, read_model_description
from workers.model import fusion_plan_for

CFG = PublishConfig(streams=2, segment_bytes=4096)


# -- the digest is the one FORMAT.md §4.1 specifies ------------------------------------


def _spec_digest(fused: dict[str, torch.Tensor]) -> str:
    """FORMAT.md §4.1 written out from the page alone (numpy, no Aurora code)."""
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    h = hashlib.sha256()
    for name in sorted(fused):
        t = fused[name].contiguous()
        shape = "[" + ", ".join(str(d) for d in t.shape) + "]"
        h.update(f"{name}|{shape}|{names[t.dtype]}\n".encode())
        raw = t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()
        h.update(raw.astype(raw.dtype.newbyteorder("<")).tobytes(order="C"))
    return "sha256:" + h.hexdigest()


def test_weights_digest_is_the_one_the_format_specifies() -> None:
    w = make_weights(QWEN3_TINY, seed=3)
    plan = plan_of(w, tied=False)
    fused = fuse_weights(w, plan)
    fused["scalar.gain"] = torch.tensor(1.5, dtype=torch.float32)  # "[]" for a scalar
    fused["half.bias"] = torch.randn(7, dtype=torch.float16)
    want = _spec_digest(fused)
    assert weights_digest(fused) == want
    split = {**w, "scalar.gain": fused["scalar.gain"], "half.bias": fused["half.bias"]}
    assert weights_digest(split) == want  # split holders (q/k/v apart) hash as the fused view


# -- a chain with snapshots, and planted ones -----------------------------------------------


def _forged(run: FakeTrainer, v: int) -> dict[str, torch.Tensor]:
    """Version ``v``'s fused weights, each element moved: what a forger writes under the true state."""
    return {n: t + 0.25 for n, t in fuse_weights(run.weights[v], run.plan).items()}


def _plant(store: Store, v: int, fused: dict[str, torch.Tensor], state: str, digest: str | None | bool = True) -> None:
    """A snapshot at ``v`` written by someone who can only write the store: the true state copied.

    ``digest``: True keeps the digest of its own (forged) weights, a string
    claims that one, None leaves the field out.
    """
    m = publish_snapshot(store, "t", v, fused, state, CFG)
    if digest is True:
        return
    d = m.to_json()
    if digest is None:
        del d["weights_digest"]
    else:
        d["weights_digest"] = digest
    store.delete(manifest_key("snapshot", v))
    store.put(manifest_key("snapshot", v), json.dumps(d).encode(), mode="create")


@pytest.fixture
def mem() -> Store:
    return open_store(f"memory://bound-{uuid.uuid4().hex}/run")


@pytest.mark.parametrize("variant", ["own digest", "claims the delta's digest", "no digest"])
def test_a_planted_snapshot_is_ignored_by_plan_and_materialize(mem: Store, variant: str) -> None:
    run = FakeTrainer(mem, config=CFG)
    run.steps(4)
    claim = {"own digest": True, "claims the delta's digest": run.digest(3), "no digest": None}[variant]
    _plant(mem, 3, _forged(run, 3), run.states[3], claim)
    reader = ManifestReader(mem)
    index = scan_versions(mem)
    if variant != "claims the delta's digest":
        assert reader.unbound(3) is not None and reader.cost("snapshot", 3) is None
        assert bound_index(index, reader).snapshots == {0}
        assert plan_chain(index, 4, cost=reader.cost).snapshot == 0  # the planner never picks it
    notes: list[str] = []
    tensors, state = materialize(mem, 4, progress=notes.append)
    assert state == run.states[4] and weights_digest(tensors) == run.digest(4)
    assert any("snapshot 3" in n and ("not used" in n or "unusable" in n) for n in notes), notes


def test_a_claimed_digest_that_the_shards_do_not_hold_is_refused(mem: Store) -> None:
    run = FakeTrainer(mem, config=CFG)
    run.steps(3)
    _plant(mem, 3, _forged(run, 3), run.states[3], run.digest(3))
    from aurora_store.lineage.fetch import fetch_snapshot

    with pytest.raises(IntegrityError, match="digest"):
        fetch_snapshot(mem, 3)


def test_a_snapshot_at_a_version_whose_delta_carries_no_digest_is_ignored(mem: Store) -> None:
    """A writer that puts digests only where it snapshots (FORMAT.md allows it): the other names are free."""
    run = FakeTrainer(mem, config=CFG, weights_digests=False)
    run.steps(3)
    publish_snapshot(mem, "t", 3, fuse_weights(run.weights[3], run.plan), run.states[3], CFG)  # even true weights
    assert "carries no weights_digest" in (ManifestReader(mem).unbound(3) or "")
    _, state = materialize(mem, 3)
    assert state == run.states[3]


def test_a_true_snapshot_is_bound_and_used(mem: Store) -> None:
    run = FakeTrainer(mem, config=CFG)
    run.steps(4)
    m = publish_snapshot(mem, "t", 2, fuse_weights(run.weights[2], run.plan), run.states[2], CFG)
    assert m.extra["weights_digest"] == run.digest(2) == read_manifest(mem, "delta", 2).extra["weights_digest"]
    assert ManifestReader(mem).unbound(2) is None
    notes: list[str] = []
    tensors, state = materialize(mem, 4, progress=notes.append)
    assert notes[0].startswith("snapshot 2:") and state == run.states[4] and weights_digest(tensors) == run.digest(4)


def test_a_snapshot_only_run_still_reads(mem: Store) -> None:
    """``transfer="full"``: every version a self-rooted snapshot, no delta to bind to."""
    w = make_weights(QWEN3_TINY, seed=1)
    plan = plan_of(w, tied=False)
    for v in range(3):
        publish_snapshot(mem, "t", v, fuse_weights(w, plan), None, CFG)
    tensors, _ = materialize(mem, 2)
    assert weights_digest(tensors) == weights_digest(w, plan)


# -- a bootstrapping Actor -----------------------------------------------------------------


@pytest.fixture
def origin(tmp_path: Path) -> Store:
    return open_store(f"file://{tmp_path}/origin")


@pytest.fixture
def trainer(origin: Store, redis_server: Any, redis_client: Any, run_name: str) -> Any:
    run = TinyRun(origin, redis_server.url, run_name)
    run.record_states = True
    run.start()
    yield run
    run.close()


@pytest.mark.server
def test_a_bootstrapping_actor_ignores_a_planted_snapshot(trainer: TinyRun, origin: Store, caplog: pytest.LogCaptureFixture) -> None:
    trainer.step(3)
    forged = {n: t + 0.5 for n, t in fuse_weights(trainer.weights[3], trainer.plan).items()}
    publish_snapshot(origin, trainer.run, 3, forged, trainer.states[3], CFG)  # newest, true state, any weights
    a = Actor.from_endpoints(Endpoints(origin.url, trainer.redis_url, trainer.run), ActorConfig(actor_id="a"), clock=ManualClock())
    with caplog.at_level(logging.WARNING, logger="aurora.lineage"):
        a.bootstrap()
    assert (a.active, a.active_state) == (3, trainer.states[3])
    assert a.engine.digest() == trainer.digest(3)  # the true chain, not the planted weights
    assert any("snapshot 3 is not used" in r.getMessage() for r in caplog.records)


# -- model files ------------------------------------------------------------------------


@pytest.mark.server
def test_v0_lists_the_model_files_and_a_config_changed_after_it_is_refused(trainer: TinyRun, origin: Store) -> None:
    listed = read_manifest(origin, "snapshot", 0).extra["model"]
    assert sorted(f["key"] for f in listed) == ["model/config.json", "model/tokenizer.json"]
    read_model_description(origin)  # as written: accepted
    cfg = json.loads(origin.get(MODEL_CONFIG_KEY))
    cfg["num_hidden_layers"] = cfg.get("num_hidden_layers", 2) + 1
    origin.put(MODEL_CONFIG_KEY, json.dumps(cfg).encode(), mode="overwrite")
    with pytest.raises(IntegrityError, match="changed after version 0"):
        read_model_description(origin)
    a = Actor.from_endpoints(Endpoints(origin.url, trainer.redis_url, trainer.run), ActorConfig(actor_id="a"), clock=ManualClock())
    with pytest.raises(IntegrityError):
        a.prepare()


@pytest.mark.server
def test_model_files_read_before_v0_are_checked_at_bootstrap(origin: Store, redis_server: Any, run_name: str) -> None:
    run = TinyRun(origin, redis_server.url, run_name)
    run.describe()
    cfg = json.loads(origin.get(MODEL_CONFIG_KEY))
    cfg["rms_norm_eps"] = 0.5  # changed before any Actor read it, after the Trainer hashed it
    origin.put(MODEL_CONFIG_KEY, json.dumps(cfg).encode(), mode="overwrite")
    a = Actor.from_endpoints(Endpoints(origin.url, redis_server.url, run_name), ActorConfig(actor_id="a"), clock=ManualClock())
    a.prepare()  # no version 0 yet: nothing lists the files, the engine is built
    run.publish_v0()
    with pytest.raises(IntegrityError, match="changed after version 0"):
        a.bootstrap()
    assert a.ctx.ledger.actor("a") is None  # never registered
    run.close()


def test_a_run_whose_v0_lists_no_model_files_is_read_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from workers.common import write_model_description
    from workers.model import tiny_qwen3
    from workers.tokenizer import CharTokenizer

    store = open_store(f"file://{tmp_path}/old")
    tok = CharTokenizer()
    model = tiny_qwen3(tok.vocab_size, seed=0)
    write_model_description(store, model.config.to_json_string(), tok.to_json())
    w = make_weights(QWEN3_TINY, seed=0)
    publish_snapshot(store, "t", 0, fuse_weights(w, plan_of(w, tied=False)), None, CFG)  # no model list: an older writer
    with caplog.at_level(logging.WARNING, logger="aurora.workers"):
        read_model_description(store)
    assert any("not checked" in r.getMessage() for r in caplog.records)


# -- the state the Trainer recorded --------------------------------------------------------

VERSIONS = 3


@pytest.fixture
def forged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_client: Any, redis_server: Any) -> dict[str, Any]:
    """True deltas 1..VERSIONS at origin; in ``mirror`` a self-consistent forged chain on the true base."""
    monkeypatch.setenv("AURORA_SYNTHETIC_CACHE", str(tmp_path / "cache"))
    spec = SyntheticSpec(QWEN3_TINY, seed=7)
    origin, mirror = open_store(f"file://{tmp_path}/origin"), open_store(f"file://{tmp_path}/mirror")
    base = base_weights(spec.shape, spec.seed)
    plan = fusion_plan_for(base, tied=True)
    states, fstates = {0: spec.base_state}, {0: spec.base_state}
    w = f = base
    for v in range(1, VERSIONS + 1):
        new = {n: t.clone() for n, t in w.items()}
        sparse_update(new, spec.density, spec.seed, v)
        states[v] = publish_delta(origin, "r", v, extract(plan, w, new), states[v - 1], CFG).state
        fnew = {n: t.clone() for n, t in f.items()}
        sparse_update(fnew, spec.density, spec.seed + 99, v)
        fstates[v] = publish_delta(mirror, "r", v, extract(plan, f, fnew), fstates[v - 1], CFG).state
        w, f = new, fnew
    assert all(fstates[v] != states[v] for v in range(1, VERSIONS + 1))
    return {"spec": spec, "tmp": tmp_path, "redis": redis_server.url, "client": redis_client, "states": states, "fstates": fstates}


def _mirror_actor(run: dict[str, Any], record: bool) -> tuple[Actor, SourceRecorder]:
    name = f"t{time.monotonic_ns()}"
    tmp = run["tmp"]
    eng = SyntheticEngine(run["spec"], hold=True, digests=True)
    eng.load_base()
    rec = SourceRecorder()
    a = Actor.from_endpoints(
        Endpoints(f"file://{tmp}/origin", run["redis"], name),
        ActorConfig(actor_id="a", region="r1", mirror=f"file://{tmp}/mirror"),
        ManualClock(),
        engine=eng,
        observers=[rec],
    )
    a.holding.start_at(0, run["spec"].base_state)
    keys = RunKeys(name)
    if record:
        for v, st in run["states"].items():
            record_expected_state(run["client"], keys, v, st)
    run["client"].hset(keys.trainer, mapping={"head": VERSIONS})
    run["client"].set(keys.relay("r1"), mirror_token(f"file://{tmp}/mirror"))
    return a, rec


@pytest.mark.server
def test_a_forged_chain_from_a_mirror_is_refused_and_origin_read(forged: dict[str, Any]) -> None:
    control, _ = _mirror_actor(forged, record=False)
    control.stager.stage_once()
    assert control.staged_state == forged["fstates"][VERSIONS]  # without the record, the forgery passes every chain check
    a, rec = _mirror_actor(forged, record=True)
    a.stager.stage_once()
    assert rec.sources == [(v, False) for v in range(1, VERSIONS + 1)]  # every version from origin
    assert [e.state for e in a.staged] == [forged["states"][v] for v in range(1, VERSIONS + 1)]
    assert a.ctx.quarantine.versions() == []  # origin's versions are fine: nothing held against them


@pytest.mark.server
def test_a_version_staged_before_its_record_is_not_activated(forged: dict[str, Any]) -> None:
    a, _ = _mirror_actor(forged, record=False)
    a.stager.stage_once()  # the forged chain, staged while Redis had no record
    keys = a.ctx.keys
    for v, st in forged["states"].items():
        record_expected_state(forged["client"], keys, v, st)
    a.holding.commit_seen = VERSIONS
    a.safepoint.activate()
    assert (a.active, a.active_state) == (0, forged["spec"].base_state)  # refused: nothing applied
    assert not a.staged and a.staged_version == 0
    a.stager.stage_once()  # again: now checked against the record, read from origin
    a.safepoint.activate()
    assert (a.active, a.active_state) == (VERSIONS, forged["states"][VERSIONS])


# -- leases only for the state held ----------------------------------------------------------


@pytest.mark.server
def test_an_actor_never_claims_a_lease_for_a_state_it_does_not_hold(trainer: TinyRun, origin: Store) -> None:
    a = Actor.from_endpoints(Endpoints(origin.url, trainer.redis_url, trainer.run), ActorConfig(actor_id="a"), clock=ManualClock())
    a.bootstrap()
    items = [(f"x{i}", json.dumps({"id": f"x{i}", "ids": trainer.tokenizer.encode("1+1=", bos=True)}).encode()) for i in range(2)]
    other = "sha256:" + "ab" * 32
    trainer.ledger.create_step(7, other, items, {}, 1, 120_000, version=0)
    assert a.work.work_once() is False
    assert trainer.redis.hlen(trainer.keys.step(7, "lease")) == 0  # not one lease taken
    trainer.ledger.close_step(7)
    trainer.open_step(8, 0, prompts=2, group=1)  # the state it holds: claimed and settled
    assert a.work.work_once() is True
    assert trainer.settled(8) == 2
