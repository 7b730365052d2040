"""Trainer checkpoints bound like snapshots, and resume from trusted facts only (issue 24, holes 1 and 5).

A checkpoint names the version and state it trained from and the weights
digest of what it would publish; resume takes only one whose version is
committed (the Trainer's record in Redis, a trusted signature, a Redis
commit record) with that version's committed digest, and pruning orders by
that binding. The head comes from the Trainer's fenced record and the chain
after it, never from the highest name listed; epochs are integers below 2^53.

The attacks are the issue's own: a real checkpoint copied with its tensors
changed and its hashes recomputed as ``checkpoints/step-99999999/``; a
far-future delta manifest; a well-formed unsigned delta on the head of a
signed run; epochs at or past 2^53 in Redis, manifests and checkpoint records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_fixtures import settling_actor

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.records import RunRecords
from aurora_store.errors import AuroraError, ConfigError, CoordinationError, ManifestError
from aurora_store.format.manifest import Manifest, canonical_json, chain_state, manifest_key
from aurora_store.format.signing import Signer
from aurora_store.storage import open_store
from workers.common import Endpoints
from workers.trainer import TrainerConfig
from workers.trainer.checkpoint import Checkpoint, checkpoint_key, list_checkpoints, load_checkpoint, save_checkpoint
from workers.trainer.trainer import Trainer


def _mark_run(f: Any) -> Any:
    """The tests that run a Trainer: a real Redis, a few seconds each."""
    return pytest.mark.slow(pytest.mark.server(f))


PLANTED = 99999999


def _cfg(steps: int, **kw: Any) -> TrainerConfig:
    return TrainerConfig(
        **{
            "steps": steps,
            "batch": 2,
            "group": 2,
            "checkpoint_every": 2,
            "keep_checkpoints": 2,
            "eval_every": 0,
            "snapshot_every": 0,
            "poll_s": 0.01,
            "warm_start_steps": 0,
            "device": "cpu",
            **kw,
        }
    )


def _fresh_run(root: Path, redis_url: str, redis_client: Any, run: str, **kw: Any) -> Trainer:
    """A fresh run of 4 steps: versions 0..4, checkpoints before steps 2 and 4 kept (0 pruned)."""
    tr = Trainer(Endpoints(f"file://{root}", redis_url, run), _cfg(4, **kw))
    with settling_actor(redis_client, run):
        tr.run()
    assert list_checkpoints(open_store(str(root))) == [2, 4]
    return tr


def _resumer(root: Path, redis_url: str, run: str, steps: int = 6, **kw: Any) -> Trainer:
    return Trainer(Endpoints(f"file://{root}", redis_url, run), _cfg(steps, resume=True, **kw))


def _plant_checkpoint(root: Path, src: int, dst: int, *, keep_signature: bool = False) -> None:
    """The issue's attack: copy checkpoint ``src``, change its model tensors, recompute every hash,
    write it as ``checkpoints/step-{dst}``."""
    store = open_store(str(root))
    ck = load_checkpoint(store, src)
    tensors = {
        # far beyond a bf16 rounding: the published weights would differ
        n: (t + 0.25 if n.startswith("model.") and t.is_floating_point() else t)
        for n, t in ck.tensors.items()
    }
    save_checkpoint(store, dataclasses.replace(ck, step=dst, tensors=tensors))  # every hash recomputed, unsigned
    if keep_signature:
        signature = json.loads((root / checkpoint_key(src)).read_bytes()).get("signature")
        rec = json.loads((root / checkpoint_key(dst)).read_bytes())
        rec["signature"] = signature
        (root / checkpoint_key(dst)).write_bytes(canonical_json(rec))


def _model_tensors(root: Path, step: int) -> dict[str, torch.Tensor]:
    ck = load_checkpoint(open_store(str(root)), step)
    return {n: t for n, t in ck.tensors.items() if n.startswith("model.")}


def _master_is(tr: Trainer, want: dict[str, torch.Tensor]) -> bool:
    assert tr.grpo is not None
    have = {f"model.{n}": p.detach() for n, p in tr.grpo.model.state_dict().items()}
    return set(have) == set(want) and all(torch.equal(have[n].cpu(), want[n]) for n in want)


def _write_manifest(root: Path, kind: str, version: int, m: Manifest) -> None:
    path = root / manifest_key(kind, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(m.to_bytes())


def _read(root: Path, kind: str, version: int) -> Manifest:
    return Manifest.from_bytes((root / manifest_key(kind, version)).read_bytes(), "test")


def _delta_on(root: Path, head: int, *, epoch: int | None = None) -> Manifest:
    """A well-formed, unsigned delta ``head + 1`` on the head: no segments, the right base state."""
    h = _read(root, "delta", head)
    extra = {k: v for k, v in h.extra.items() if k != "signature"}
    producer = dict(h.producer)
    if epoch is not None:
        producer["epoch"] = epoch
    m = dataclasses.replace(h, version=head + 1, base_version=head, base_state=h.state, segments=(), extra=extra, producer=producer)
    return dataclasses.replace(m, state=chain_state(h.state, m.content))


# -- (a) the planted checkpoint, unsigned run -------------------------------------------------------
@_mark_run
def test_a_planted_checkpoint_neither_wins_resume_nor_makes_pruning_delete_the_real_ones(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "run"
    _fresh_run(root, redis_server.url, redis_client, run_name)
    real = _model_tensors(root, 4)
    _plant_checkpoint(root, 4, PLANTED)
    tr = _resumer(root, redis_server.url, run_name)
    caplog.set_level(logging.WARNING, "aurora.trainer")
    try:
        assert tr.resume() == 4
        assert tr.resumed_from == 4, f"resumed from the planted checkpoint {tr.resumed_from}"
        assert _master_is(tr, real)  # trains from the real checkpoint's master weights
        assert sum(f"step-{PLANTED:08d}" in r.getMessage() for r in caplog.records) >= 1
    finally:
        tr.stop.set()
        assert tr.grpo is not None
        tr.grpo.close()
    # Run on: the checkpoint before step 6 is pruned against the others by their binding, not their names.
    tr = _resumer(root, redis_server.url, run_name)
    with settling_actor(redis_client, run_name):
        tr.run()
    assert tr.resumed_from == 4
    store = open_store(str(root))
    assert set(list_checkpoints(store)) == {4, 6, PLANTED}, list_checkpoints(store)  # 2 pruned; 4 and 6 kept; the plant ignored
    named = [r.getMessage() for r in caplog.records if f"step-{PLANTED:08d}" in r.getMessage()]
    assert len(named) >= 1


@_mark_run
def test_a_checkpoint_whose_record_claims_a_committed_version_is_refused_by_its_tensors(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str
) -> None:
    """The plant names version 3 with its true state and digest (from Redis): only its tensors betray it.

    Version 3 is hashed (a snapshot's version), so a digest of it is committed to copy."""
    root = tmp_path / "run"
    _fresh_run(root, redis_server.url, redis_client, run_name, snapshot_every=3)
    records = RunRecords(redis_client, run_name)
    digests, _ = records.digests()
    _plant_checkpoint(root, 4, 3)
    path = root / checkpoint_key(3)
    rec = json.loads(path.read_bytes())
    rec.update(version=3, state=records.expected_state(3), weights_digest=digests[3])
    path.write_bytes(canonical_json(rec))
    real = _model_tensors(root, 2)
    for p in sorted((root / "checkpoints" / "step-00000004").rglob("*"), reverse=True):  # the real newest is gone
        p.chmod(0o755) if p.is_dir() else p.unlink()
    tr = _resumer(root, redis_server.url, run_name, snapshot_every=3)
    try:
        assert tr.resume() == 4
        assert tr.resumed_from == 2 and _master_is(tr, real)
    finally:
        tr.stop.set()
        assert tr.grpo is not None
        tr.grpo.close()


@_mark_run
def test_redis_commit_mode_adopts_no_delta_without_a_record(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unsigned run that commits through Redis: a well-formed delta on the head without a commit record is not the head."""
    monkeypatch.setenv("AURORA_REDIS_PERSISTENT", "1")  # the test server persists nothing; the mode would refuse it
    root = tmp_path / "run"
    _fresh_run(root, redis_server.url, redis_client, run_name, commit_via="redis")
    _write_manifest(root, "delta", 5, _delta_on(root, 4))
    tr = _resumer(root, redis_server.url, run_name, commit_via="redis")
    try:
        assert tr.resume() == 4
    finally:
        tr.stop.set()
        assert tr.grpo is not None
        tr.grpo.close()


# -- (b) a signed run: unsigned and badly signed plants ---------------------------------------------
@_mark_run
def test_a_signed_run_ignores_unsigned_and_badly_signed_checkpoints(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str
) -> None:
    key = tmp_path / "sign.pem"
    key.write_bytes(Signer.generate().private_pem())
    root = tmp_path / "run"
    _fresh_run(root, redis_server.url, redis_client, run_name, sign_key=str(key))
    real = _model_tensors(root, 4)
    _plant_checkpoint(root, 4, PLANTED)  # unsigned
    _plant_checkpoint(root, 4, PLANTED - 1, keep_signature=True)  # the real signature, over other bytes
    tr = _resumer(root, redis_server.url, run_name, sign_key=str(key))
    try:
        assert tr.resume() == 4
        assert tr.resumed_from == 4 and _master_is(tr, real)
    finally:
        tr.stop.set()
        assert tr.grpo is not None
        tr.grpo.close()


@_mark_run
def test_a_resumed_trainer_with_a_new_key_reads_the_old_one_only_when_trusted(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = Signer.generate(), Signer.generate()
    for name, signer in (("old", old), ("new", new)):
        (tmp_path / f"{name}.pem").write_bytes(signer.private_pem())
    (tmp_path / "old.pub.pem").write_bytes(old.public_pem())
    root = tmp_path / "run"
    _fresh_run(root, redis_server.url, redis_client, run_name, sign_key=str(tmp_path / "old.pem"))
    tr = _resumer(root, redis_server.url, run_name, sign_key=str(tmp_path / "new.pem"))
    try:
        with pytest.raises(ConfigError, match="signed by the run key"):
            tr.resume()  # nothing the old key signed counts for a Trainer that trusts only the new one
    finally:
        tr.stop.set()
        assert tr.grpo is not None
        tr.grpo.close()
    monkeypatch.setenv("AURORA_TRUST_KEYS", str(tmp_path / "old.pub.pem"))
    tr = _resumer(root, redis_server.url, run_name, sign_key=str(tmp_path / "new.pem"))
    try:
        assert tr.resume() == 4 and tr.resumed_from == 4
    finally:
        tr.stop.set()
        assert tr.grpo is not None
        tr.grpo.close()


# -- (c) planted versions: far-future, and an unsigned delta on the head of a signed run ------------
@_mark_run
def test_a_far_future_delta_does_not_stop_resume_and_is_not_the_head(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str
) -> None:
    root = tmp_path / "run"
    _fresh_run(root, redis_server.url, redis_client, run_name)
    m = _read(root, "delta", 4)
    _write_manifest(root, "delta", PLANTED, dataclasses.replace(m, version=PLANTED, base_version=PLANTED - 1))
    tr = _resumer(root, redis_server.url, run_name)
    try:
        assert tr.resume() == 4
        assert tr.versions.newest == 4
    finally:
        tr.stop.set()
        assert tr.grpo is not None
        tr.grpo.close()


@_mark_run
def test_an_unsigned_delta_on_the_head_of_a_signed_run_is_not_adopted(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Not the head; and since the next publish would land on it, the resume stops with one line naming it."""
    key = tmp_path / "sign.pem"
    key.write_bytes(Signer.generate().private_pem())
    root = tmp_path / "run"
    _fresh_run(root, redis_server.url, redis_client, run_name, sign_key=str(key))
    _write_manifest(root, "delta", 5, _delta_on(root, 4))
    tr = _resumer(root, redis_server.url, run_name, sign_key=str(key))
    caplog.set_level(logging.WARNING, "aurora.trainer")
    try:
        with pytest.raises(ConfigError, match=r"deltas/v0000000005/manifest.json: .*committed head is v4.*remove it"):
            tr.resume()
        assert RunRecords(redis_client, run_name).head() == 4
        assert any("delta 5" in r.getMessage() and "unsigned" in r.getMessage() for r in caplog.records)
    finally:
        tr.stop.set()
        assert tr.grpo is not None
        tr.grpo.close()


# -- (d) epochs: integers 0 <= e < 2^53 wherever they are read -----------------------------------------
@pytest.mark.server
@pytest.mark.parametrize("raw", [str(2**53), str(2**60), "1.5", "abc", "-1"])
def test_a_stored_epoch_that_is_not_an_integer_below_2_53_is_refused(redis_client: Any, run_name: str, raw: str) -> None:
    redis_client.set(RunKeys(run_name).epoch, raw)
    with pytest.raises(CoordinationError, match="epoch"):
        RunRecords(redis_client, run_name).stored_epoch()


@pytest.mark.server
@pytest.mark.parametrize("epoch", [2**53, 2**53 + 1, -1])
def test_entering_an_epoch_outside_0_to_2_53_is_refused(redis_client: Any, run_name: str, epoch: int) -> None:
    with pytest.raises(ConfigError, match="2\\^53"):
        RunRecords(redis_client, run_name).enter_epoch(epoch)


@pytest.mark.parametrize("epoch", [2**53, 1.5, "3", True])
def test_a_checkpoint_record_with_a_bad_epoch_is_refused(tmp_path: Path, epoch: Any) -> None:
    store = open_store(str(tmp_path))
    save_checkpoint(store, Checkpoint(step=2, epoch=1, tensors={"x": torch.zeros(2)}, meta={}))
    path = tmp_path / checkpoint_key(2)
    rec = json.loads(path.read_bytes())
    rec["epoch"] = epoch
    path.chmod(0o644)
    path.write_bytes(canonical_json(rec))
    with pytest.raises(ManifestError, match="epoch"):
        load_checkpoint(store, 2)


@_mark_run
def test_a_head_manifest_with_an_epoch_past_2_53_is_not_taken(
    tmp_path: Path, redis_server: Any, redis_client: Any, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An unsigned run whose head manifest (overwritten in place: the state does not cover ``producer``)
    says epoch 2^53: that manifest does not count, is named, and no epoch from it is ever entered."""
    root = tmp_path / "run"
    _fresh_run(root, redis_server.url, redis_client, run_name)
    m = _read(root, "delta", 4)
    path = root / manifest_key("delta", 4)
    path.chmod(0o644)
    path.write_bytes(dataclasses.replace(m, producer={**m.producer, "epoch": 2**53}).to_bytes())
    redis_client.delete(RunKeys(run_name).epoch)  # Redis lost its epoch: the manifest's would be the one taken
    tr = _resumer(root, redis_server.url, run_name)
    caplog.set_level(logging.WARNING, "aurora.trainer")
    try:
        with pytest.raises(AuroraError, match="v0000000004"):
            tr.resume()
        assert any("producer epoch 9007199254740992 is outside 0 .. 2^53 - 1" in r.getMessage() for r in caplog.records)
        assert RunRecords(redis_client, run_name).stored_epoch() is None
    finally:
        tr.stop.set()
        assert tr.grpo is not None
        tr.grpo.close()


# -- the binding itself (records, signatures, pruning order), over a file store -------------------------
def _h(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _committed(head: int) -> Any:
    return lambda v: (_h(f"state {v}"), _h(f"weights {v}")) if v <= head else None


def _save(store: Any, step: int, signer: Signer | None = None, *, digest: str | None = None, run: str = "r") -> None:
    ck = Checkpoint(
        step=step,
        epoch=1,
        tensors={"model.w": torch.full((4,), float(step))},
        meta={},
        state=_h(f"state {step}"),
        weights_digest=digest or _h(f"weights {step}"),
        run=run,
    )
    save_checkpoint(store, ck, signer=signer)


def test_pruning_orders_by_binding_and_ignores_what_is_not_bound(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from workers.trainer.checkpoint import bound_checkpoints, prune_checkpoints

    store = open_store(str(tmp_path))
    for s in (2, 4, 6):
        _save(store, s)
    _save(store, PLANTED)  # well-formed, but its version is not committed
    _save(store, 8, digest=_h("other weights"))  # committed version, other weights
    _save(store, 10, run="another-run")
    save_checkpoint(store, Checkpoint(step=12, epoch=1, tensors={"x": torch.zeros(1)}, meta={}))  # no binding at all
    binding = _committed(20)
    caplog.set_level(logging.WARNING, "aurora.trainer")
    assert [r.step for r in bound_checkpoints(store, binding, run="r")] == [6, 4, 2]
    assert prune_checkpoints(store, 2, binding, run="r") == [2]
    assert prune_checkpoints(store, 2, binding, run="r") == []
    assert list_checkpoints(store) == [4, 6, 8, 10, 12, PLANTED]  # the unbound are neither kept as newest nor deleted
    for step in (8, 10, 12, PLANTED):  # each named once over both rounds
        assert sum(f"step-{step:08d}" in r.getMessage() for r in caplog.records) == 1, step


def test_a_signed_runs_checkpoints_count_only_when_signed_by_its_key(tmp_path: Path) -> None:
    from aurora_store.errors import SignatureError
    from workers.trainer.checkpoint import bound_checkpoints, read_checkpoint_record

    key, other = Signer.generate(), Signer.generate()
    store = open_store(str(tmp_path))
    _save(store, 2, key)
    _save(store, 4, None)  # unsigned
    _save(store, 6, other)  # another key
    _save(store, 8, key)
    rec = json.loads((tmp_path / checkpoint_key(8)).read_bytes())
    rec["epoch"] = 7  # altered after signing
    (tmp_path / checkpoint_key(8)).chmod(0o644)
    (tmp_path / checkpoint_key(8)).write_bytes(canonical_json(rec))
    trust = key.trust()
    assert read_checkpoint_record(store, 2, trust).key_id == key.key_id
    for step in (4, 6, 8):
        with pytest.raises(SignatureError):
            read_checkpoint_record(store, step, trust)
    assert [r.step for r in bound_checkpoints(store, _committed(20), trust)] == [2]
    with pytest.raises(SignatureError):
        load_checkpoint(store, 8, trust)
