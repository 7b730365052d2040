"""Signed versions (FORMAT.md §4.1): writers sign, readers with trust keys refuse the rest.

Every refusal must come before a single segment is read, let alone decoded:
the stores here count their reads of segment objects.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from trainer_fixtures import FakeTrainer

from aurora_store.codec.extract import extract, fuse_weights, plan_of
from aurora_store.errors import ConfigError, ManifestError, SignatureError
from aurora_store.format.manifest import Manifest, manifest_key
from aurora_store.format.signing import (
    ED25519,
    HMAC_SHA256,
    PRIVATE_KEY_FILE,
    PUBLIC_KEY_FILE,
    Signer,
    TrustKeys,
    ed25519_key_id,
    generate_keypair,
    hmac_key_id,
    signing_payload,
)
from aurora_store.lineage.fetch import (
    ManifestReader,
    fetch_delta,
    fetch_snapshot,
    read_manifest,
)
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.lineage.report import read_lineage
from aurora_store.lineage.verify import verify_run
from aurora_store.options import trust_key_paths
from aurora_store.storage import LocalStore, Store
from aurora_store.testing.wait import wait_until
from aurora_tools.bench.hostile.forge import CountingStore
from aurora_tools.cli import main
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

CFG = PublishConfig(streams=2, segment_bytes=16 << 10)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("AURORA_"):
            monkeypatch.delenv(k)
    CountingStore.reset()


def _hmac_file(tmp_path: Path, name: str = "hmac.key") -> Path:
    p = tmp_path / name
    p.write_bytes(os.urandom(32))
    return p


def _chain(store: Store, signer: Signer | None, n: int = 2) -> FakeTrainer:
    """Snapshot 0 and ``n`` deltas of the tiny model, each manifest signed by ``signer`` (or not)."""
    chain = FakeTrainer(store, config=CFG, signer=signer)
    chain.steps(n)
    return chain


def _rewrite_manifest(store: Store, kind: str, v: int, edit) -> None:
    key = manifest_key(kind, v)
    d = json.loads(store.get(key))
    edit(d)
    store.put(key, json.dumps(d, indent=1).encode(), mode="overwrite")


# -- the algorithms -------------------------------------------------------------------


@pytest.mark.parametrize("alg", [ED25519, HMAC_SHA256])
def test_sign_verify_round_trip(alg: str, tmp_path: Path) -> None:
    signer = Signer.generate() if alg == ED25519 else Signer.from_file(_hmac_file(tmp_path))
    store = LocalStore(f"file://{tmp_path / 'run'}")
    chain = _chain(store, signer, n=1)
    for kind, v in (("snapshot", 0), ("delta", 1)):
        raw = json.loads(store.get(manifest_key(kind, v)))
        sig = raw["signature"]
        assert sig["alg"] == alg and sig["key_id"] == signer.key_id
        assert len(sig["value"]) == (128 if alg == ED25519 else 64)
        m = read_manifest(store, kind, v, signer.trust())
        # The signature survives a parse and a re-serialization exactly.
        assert m.extra["signature"] == sig
        assert json.loads(m.to_bytes()) == raw
        assert signer.trust().check(m, "x") == signer.key_id
    # Deterministic: a retried publish writes the very same bytes (create-only reads back equal).
    m1 = read_manifest(store, "delta", 1)
    again = publish_delta(
        store,
        "t",
        1,
        extract(chain.plan, chain.weights[0], chain.weights[1]),
        chain.states[0],
        CFG,
        attempt=m1.segments[0].key.split("/")[0],
        created_at=m1.created_at,
        signer=signer,
        weights_digest=chain.digest(1),
    )
    assert again.to_bytes() == store.get(manifest_key("delta", 1))
    tensors, state = materialize(store, 1, trust=signer.trust())
    assert state == chain.states[1]


def test_key_ids_follow_the_format(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives.serialization import (
        Encoding,
        PublicFormat,
        load_pem_public_key,
    )

    signer = generate_keypair(tmp_path / "k")
    pub = load_pem_public_key((tmp_path / "k" / PUBLIC_KEY_FILE).read_bytes())
    raw = pub.public_bytes(Encoding.Raw, PublicFormat.Raw)  # type: ignore[union-attr]
    assert signer.key_id == ed25519_key_id(raw) == __import__("hashlib").sha256(raw).hexdigest()[:16]
    secret = _hmac_file(tmp_path)
    assert Signer.from_file(secret).key_id == hmac_key_id(secret.read_bytes())
    assert Signer.from_file(secret, key_id="ops-2026").key_id == "ops-2026"
    assert TrustKeys.from_file(f"ops-2026={secret}").key_ids == ("ops-2026",)
    # The payload is the canonical JSON without the signature member.
    assert signing_payload({"b": 1, "a": "é", "signature": {}}) == '{"a":"é","b":1}'.encode()


def test_short_or_wrong_keys_are_config_errors(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"x" * 31)
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        Signer.from_file(short)
    with pytest.raises(ConfigError, match="too short"):
        TrustKeys.from_file(short)
    with pytest.raises(ConfigError, match="cannot read"):
        Signer.from_file(tmp_path / "missing")
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    ecp = tmp_path / "ec.pem"
    ecp.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
    with pytest.raises(ConfigError, match="Ed25519"):
        Signer.from_file(ecp)
    with pytest.raises(ConfigError, match="Ed25519"):
        TrustKeys.from_file(ecp)
    # Nothing secret in a repr.
    h = Signer.from_file(_hmac_file(tmp_path))
    assert "hmac-sha256" in repr(h) and repr(h.trust()).startswith("TrustKeys(")


# -- readers refuse -----------------------------------------------------------------------


def test_tampered_manifest_refused_before_any_segment_read(tmp_path: Path) -> None:
    signer = Signer.generate()
    store = CountingStore(f"file://{tmp_path / 'run'}")
    _chain(store, signer, n=2)
    trust = signer.trust()

    def bump(d: dict) -> None:
        d["producer"]["step"] = 99  # any field: every one is covered

    _rewrite_manifest(store, "delta", 2, bump)
    CountingStore.segment_reads = 0
    with pytest.raises(SignatureError) as ei:
        fetch_delta(store, 2, None, trust=trust)
    e = ei.value
    assert (e.kind, e.version, e.key_id) == ("delta", 2, signer.key_id)
    assert "does not verify" in str(e) and "delta 2" in str(e) and signer.key_id in str(e)
    assert isinstance(e, ManifestError)
    assert CountingStore.segment_reads == 0
    with pytest.raises(SignatureError):
        materialize(store, 2, trust=trust)
    # materialize refuses before any object is read (delta 2 does not count): not one object of delta 2.
    assert not [k for k in CountingStore.read if k.startswith("deltas/v0000000002/")]
    # Without a trust key the manifest is still a valid one: read as before.
    assert read_manifest(store, "delta", 2).producer["step"] == 99


def test_untrusted_and_unsigned_refused_no_trust_accepted(tmp_path: Path) -> None:
    store = CountingStore(f"file://{tmp_path / 'run'}")
    ours, theirs = Signer.generate(), Signer.generate()
    chain = _chain(store, ours, n=1)
    chain.signer = theirs  # signed, by a key nobody trusts
    chain.step()
    chain.signer = None  # unsigned
    chain.step()
    trust = ours.trust()
    CountingStore.segment_reads = 0
    with pytest.raises(SignatureError, match="not trusted") as ei:
        fetch_delta(store, 2, None, trust=trust)
    assert ei.value.key_id == theirs.key_id and ei.value.version == 2
    with pytest.raises(SignatureError, match="unsigned") as ei:
        fetch_delta(store, 3, None, trust=trust)
    assert ei.value.key_id is None and ei.value.version == 3
    # A manifest handed in (read elsewhere) is checked too.
    with pytest.raises(SignatureError):
        fetch_delta(store, 3, None, manifest=read_manifest(store, "delta", 3), trust=trust)
    assert CountingStore.segment_reads == 0
    # A planner's reader routes around what it refuses.
    reader = ManifestReader(store, trust)
    assert reader.get("delta", 1) is not None and reader.get("delta", 2) is None and reader.cost("delta", 3) is None
    # No trust key: everything is read as today.
    for v in (1, 2, 3):
        fetch_delta(store, v, None)
    _, state = materialize(store, 3)
    assert state == chain.states[3]


def test_key_rotation_trusts_two_keys(tmp_path: Path) -> None:
    store = LocalStore(f"file://{tmp_path / 'run'}")
    old, new = Signer.generate(), Signer.from_file(_hmac_file(tmp_path), key_id="new-hmac")
    chain = _chain(store, old, n=1)
    chain.signer = new  # a resumed Trainer signs with its new key
    chain.step()
    (tmp_path / "old.pub.pem").write_bytes(old.public_pem())
    both = TrustKeys.from_files([str(tmp_path / "old.pub.pem"), f"new-hmac={tmp_path / 'hmac.key'}"])
    assert set(both.key_ids) == {old.key_id, "new-hmac"}
    _, state = materialize(store, 2, trust=both)
    assert state == chain.states[2]
    with pytest.raises(SignatureError, match="not trusted"):
        materialize(store, 2, trust=old.trust())
    # The environment lists several files too.
    assert trust_key_paths(None, {"AURORA_TRUST_KEYS": "a.pem, b.key,"}) == ["a.pem", "b.key"]


def test_keys_bound_to_a_run_refuse_another_runs_signed_chain(tmp_path: Path) -> None:
    """One key signing two runs: run B's versions, copied under run A's names, are refused by
    readers that know their run (issue 24, item 10), and still read by keys bound to nothing."""
    key = Signer.generate()
    a, b = LocalStore(f"file://{tmp_path / 'a'}"), LocalStore(f"file://{tmp_path / 'b'}")
    FakeTrainer(a, run="run-a", config=CFG, signer=key).steps(1)
    FakeTrainer(b, run="run-b", config=CFG, signer=key).steps(2)
    for v in (0, 1, 2):  # run B's chain under run A's names: delta 2 lands after A's v1
        kind = "snapshot" if v == 0 else "delta"
        src = manifest_key(kind, v)
        for k in b.list(src.rsplit("/", 1)[0]):
            if not a.exists(k):
                a.put(k, b.get(k))
    bound = key.trust().for_run("run-a")
    assert read_manifest(a, "delta", 1, bound).run == "run-a"
    with pytest.raises(SignatureError, match="signed for run 'run-b'"):
        read_manifest(a, "delta", 2, bound)
    with pytest.raises(SignatureError, match="another run"):
        fetch_delta(a, 2, None, trust=bound)
    # Unbound keys accept any run the key signed (the check needs the reader's run).
    assert read_manifest(a, "delta", 2, key.trust()).run == "run-b"
    assert key.trust().for_run(None).run is None and bound.for_run("run-a") is bound
    with pytest.raises(ConfigError, match="two runs"):
        _ = bound | key.trust().for_run("run-b")


def test_untrusted_snapshot_is_planned_around(tmp_path: Path) -> None:
    """A snapshot planted at a later version (signed by nobody trusted) is never used."""
    signer = Signer.generate()
    store = CountingStore(f"file://{tmp_path / 'run'}")
    chain = _chain(store, signer, n=2)
    publish_snapshot(store, "t", 2, fuse_weights(chain.weights[2], chain.plan), chain.states[2], CFG)  # unsigned
    notes: list[str] = []
    tensors, state = materialize(store, 2, progress=notes.append, trust=signer.trust())
    assert state == chain.states[2]
    assert any("snapshot 2" in n and "unsigned" in n for n in notes), notes
    assert not [k for k in CountingStore.read if k.startswith("snapshots/v0000000002/")]


def test_lineage_and_verify_with_trust(tmp_path: Path) -> None:
    store = CountingStore(f"file://{tmp_path / 'run'}")
    signer = Signer.generate()
    chain = _chain(store, signer, n=1)
    chain.signer = None
    chain.step()
    lin = read_lineage(store)
    assert [r.key_id for r in lin.rows] == [signer.key_id, signer.key_id, None] and not lin.problems
    lin = read_lineage(store, signer.trust())
    assert len(lin.problems) == 1 and "delta 2" in lin.problems[0] and "unsigned" in lin.problems[0]
    assert verify_run(store).ok
    CountingStore.segment_reads = 0
    rep = verify_run(store, 2, 2, trust=signer.trust())
    assert not rep.ok and CountingStore.segment_reads == 0


# -- keygen and the command line ---------------------------------------------------------


def test_keygen_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )
    from cryptography.hazmat.primitives.serialization import (
        load_pem_private_key,
        load_pem_public_key,
    )

    out = tmp_path / "keys"
    assert main(["keygen", "--out", str(out)]) == 0
    key_id = capsys.readouterr().out.strip()
    priv, pub = out / PRIVATE_KEY_FILE, out / PUBLIC_KEY_FILE
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert priv.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert pub.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")  # SubjectPublicKeyInfo
    assert isinstance(load_pem_private_key(priv.read_bytes(), None), Ed25519PrivateKey)
    assert isinstance(load_pem_public_key(pub.read_bytes()), Ed25519PublicKey)
    assert Signer.from_file(priv).key_id == key_id == TrustKeys.from_file(pub).key_ids[0]
    # A second keygen into the same folder refuses to replace the key.
    assert main(["keygen", "--out", str(out)]) == 1
    assert "already exists" in capsys.readouterr().err
    openssl = shutil.which("openssl")
    if openssl:
        for args in (["pkey", "-in", str(priv), "-noout"], ["pkey", "-pubin", "-in", str(pub), "-noout"]):
            r = subprocess.run([openssl, *args], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
        # And a key openssl made is one Aurora signs with.
        made = tmp_path / "openssl.pem"
        r = subprocess.run([openssl, "genpkey", "-algorithm", "ed25519", "-out", str(made)], capture_output=True, timeout=30)
        if r.returncode == 0:
            assert Signer.from_file(made).alg == ED25519


def _weights_files(tmp_path: Path, n: int) -> list[str]:
    w = make_weights(QWEN3_TINY, seed=1)
    master = MasterWeights(w, seed=1)
    files = []
    for i, t in enumerate([w] + [master.step(lr=1e-6) for _ in range(n)]):
        p = tmp_path / f"w{i}.safetensors"
        save_file(t, str(p))
        files.append(str(p))
    plan_of(w, False, files[0])
    return files


def test_cli_signs_and_apply_refuses_forgery(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    files = _weights_files(tmp_path, 2)
    url = f"file://{tmp_path / 'run'}"
    assert main(["keygen", "--out", str(tmp_path / "k")]) == 0
    priv, pub = str(tmp_path / "k" / PRIVATE_KEY_FILE), str(tmp_path / "k" / PUBLIC_KEY_FILE)
    assert main(["snapshot", "create", files[0], "--version", "0", "--store", url, "--sign-key", priv]) == 0
    monkeypatch.setenv("AURORA_SIGN_KEY", priv)
    assert main(["delta", "create", files[0], files[1], "--version", "1", "--store", url]) == 0
    monkeypatch.delenv("AURORA_SIGN_KEY")
    # A forger with write access (but not the key) adds version 2.
    assert main(["delta", "create", files[1], files[2], "--version", "2", "--store", url]) == 0
    capsys.readouterr()
    out = str(tmp_path / "out.safetensors")
    assert main(["delta", "apply", "--version", "1", "--store", url, "--out", out, "--trust-key", pub]) == 0
    CountingStore.segment_reads = 0
    assert main(["delta", "apply", "--version", "2", "--store", url, "--out", out, "--trust-key", pub]) == 1
    err = capsys.readouterr().err
    assert "delta 2" in err and "unsigned" in err and "Traceback" not in err
    monkeypatch.setenv("AURORA_TRUST_KEYS", pub)
    assert main(["verify", url]) == 1
    assert "delta 2" in capsys.readouterr().out
    assert main(["lineage", url]) == 1
    monkeypatch.delenv("AURORA_TRUST_KEYS")
    assert main(["lineage", url]) == 0
    assert "1 version(s) unsigned" in capsys.readouterr().out
    assert main(["delta", "apply", "--version", "2", "--store", url, "--out", out]) == 0
    # A bad key file is one line, before any work.
    bad = tmp_path / "bad.pem"
    bad.write_bytes(b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n")
    capsys.readouterr()
    assert main(["delta", "create", files[1], files[2], "--version", "3", "--store", url, "--sign-key", str(bad)]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_readers_bind_the_keys_to_the_run_of_version_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``aurora delta apply --trust-key``: run B's signed v2 under run A's names is refused (the run of
    A's signed version 0 decides, or ``--run``); A's own versions apply."""
    files = _weights_files(tmp_path, 2)
    assert main(["keygen", "--out", str(tmp_path / "k")]) == 0
    priv, pub = str(tmp_path / "k" / PRIVATE_KEY_FILE), str(tmp_path / "k" / PUBLIC_KEY_FILE)
    a, b = tmp_path / "a", tmp_path / "b"
    for root, run in ((a, "run-a"), (b, "run-b")):
        url = f"file://{root}"
        assert main(["snapshot", "create", files[0], "--version", "0", "--store", url, "--sign-key", priv, "--run", run]) == 0
        assert main(["delta", "create", files[0], files[1], "--version", "1", "--store", url, "--sign-key", priv, "--run", run]) == 0
    assert (
        main(["delta", "create", files[1], files[2], "--version", "2", "--store", f"file://{b}", "--sign-key", priv, "--run", "run-b"]) == 0
    )
    shutil.copytree(b / "deltas" / "v0000000002", a / "deltas" / "v0000000002")
    capsys.readouterr()
    out = str(tmp_path / "out.safetensors")
    assert main(["delta", "apply", "--version", "1", "--store", f"file://{a}", "--out", out, "--trust-key", pub]) == 0
    assert main(["delta", "apply", "--version", "2", "--store", f"file://{a}", "--out", out, "--trust-key", pub]) == 1
    err = capsys.readouterr().err
    assert "signed for run 'run-b'" in err and "Traceback" not in err
    # --run names the run outright: bound to run-b, A's own v1 is refused, so nothing reaches v2 either.
    assert main(["delta", "apply", "--version", "2", "--store", f"file://{a}", "--out", out, "--trust-key", pub, "--run", "run-b"]) == 1


def test_counting_store_counts_segments(tmp_path: Path) -> None:
    """The counter the refusals rely on does count: a trusted fetch reads every segment."""
    signer = Signer.generate()
    store = CountingStore(f"file://{tmp_path / 'run'}")
    _chain(store, signer, n=1)
    CountingStore.segment_reads = 0
    m, _ = fetch_delta(store, 1, None, trust=signer.trust())
    assert CountingStore.segment_reads == len(m.segments) > 0
    CountingStore.segment_reads = 0
    sm, tensors = fetch_snapshot(store, 0, trust=signer.trust())
    assert CountingStore.segment_reads == len(sm.segments)
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())


# -- workers: the Actor and the Relay -----------------------------------------------------


def _resign(store: Store, kind: str, v: int, signer: Signer) -> None:
    """Sign a committed manifest in place (what a Trainer with ``signer`` would have written)."""
    key = manifest_key(kind, v)
    store.put(key, signer.sign(Manifest.from_bytes(store.get(key), key)).to_bytes(), mode="overwrite")


@pytest.mark.server
def test_actor_with_trust_key_refuses_forged_versions_before_reading_segments(tmp_path: Path, redis_server, run_name: str) -> None:
    from actor_fixtures import TinyRun

    from aurora_store.storage import open_store
    from aurora_store.testing.clock import ManualClock
    from workers.actor import Actor, ActorConfig
    from workers.common import Endpoints

    origin = open_store(f"file://{tmp_path}/origin")
    signer, forger = Signer.generate(), Signer.generate()
    trainer = TinyRun(origin, redis_server.url, run_name)
    try:
        trainer.start()
        trainer.step(1)
        for kind, v in (("snapshot", 0), ("delta", 1)):
            _resign(origin, kind, v, signer)
        clock = ManualClock()
        a = Actor.from_endpoints(
            Endpoints(origin.url, trainer.redis_url, trainer.run),
            ActorConfig(actor_id="a", trust=signer.trust()),
            clock,
            origin=CountingStore(origin.url),
        )
        a.bootstrap()
        assert a.active == 1
        # v2 unsigned, v3 signed by a key nobody trusts: written by someone with write access.
        trainer.step(2)
        _resign(origin, "delta", 3, forger)
        CountingStore.read = []
        a.stager.stage_once()
        assert a.staged_version == 1, "nothing past the trusted chain is staged"
        assert [k for k in CountingStore.read if k.startswith(("deltas/v0000000002/", "deltas/v0000000003/"))] == []
        assert 2 in a.ctx.quarantine.versions() and not a.ctx.quarantine.allowed("delta", 2)
        # The real Trainer's signature arrives (the version is repaired at origin): after its
        # back-off the Actor stages it, on its own.
        _resign(origin, "delta", 2, signer)
        _resign(origin, "delta", 3, signer)
        clock.advance(3600)
        a.stager.stage_once()
        assert a.staged_version == 3
    finally:
        trainer.close()


@pytest.mark.server
def test_relay_with_trust_key_mirrors_only_signed_versions(
    tmp_path: Path, redis_server, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from relay_helpers import describe_model, make_relay, mirrored, running
    from trainer_fixtures import FakeTrainer

    from aurora_store.coordination.bus import Bus
    from aurora_store.coordination.redisconn import connect
    from aurora_store.storage import open_store

    caplog.set_level(logging.INFO, logger="aurora.relay")
    origin = open_store(f"file://{tmp_path}/origin")
    mirror = open_store(f"file://{tmp_path}/mirror")
    describe_model(origin)
    signer = Signer.generate()
    (tmp_path / "pub.pem").write_bytes(signer.public_pem())
    relay = make_relay(origin, mirror, redis_server.url, run_name, trust=TrustKeys.from_file(tmp_path / "pub.pem"))
    redis = connect(redis_server.url)
    try:
        with running(relay):
            wait_until(relay.caught_up.is_set, "the first listing")
            trainer = FakeTrainer(origin, run_name, Bus(redis, run_name))  # v0, unsigned
            wait_until(
                lambda: any("snapshot 0 not mirrored" in r.getMessage() and "unsigned" in r.getMessage() for r in caplog.records),
                "v0 refused",
            )
            assert not mirror.exists(manifest_key("snapshot", 0))
            _resign(origin, "snapshot", 0, signer)
            wait_until(mirrored(relay, ("snapshot", 0)), "v0 once signed")
            trainer.step()  # delta 1, unsigned
            wait_until(lambda: any("delta 1 not mirrored" in r.getMessage() for r in caplog.records), "delta 1 refused")
            assert not mirror.exists(manifest_key("delta", 1))
    finally:
        redis.close()
    assert read_manifest(mirror, "snapshot", 0, signer.trust()).extra["signature"]["key_id"] == signer.key_id


@pytest.mark.server
def test_status_says_whether_the_run_is_signed(redis_server, run_name: str) -> None:
    from aurora_store.coordination.keys import RunKeys
    from aurora_store.coordination.redisconn import connect
    from aurora_store.coordination.status import collect_status, render

    r = connect(redis_server.url)
    try:
        key = RunKeys(run_name).trainer
        r.hset(key, mapping={"head": 3, "status": "running", "signed": 0, "key_id": ""})
        st = collect_status(r, run_name)
        assert st["trainer"]["signed"] is False and ", unsigned" in render(st)
        r.hset(key, mapping={"signed": 1, "key_id": "0123456789abcdef"})
        st = collect_status(r, run_name)
        assert st["trainer"]["key_id"] == "0123456789abcdef" and "signed by key 0123456789abcdef" in render(st)
    finally:
        r.close()


@pytest.mark.slow
@pytest.mark.server
def test_signed_run_end_to_end_trainer_and_actor_processes(tmp_path: Path, redis_server, run_name: str) -> None:
    """``aurora trainer --sign-key`` signs every manifest; ``aurora actor --trust-key`` follows it."""
    import sys

    from aurora_store.coordination.keys import RunKeys
    from aurora_store.coordination.redisconn import connect
    from aurora_store.lineage.plan import scan_versions
    from aurora_store.storage import open_store

    signer = generate_keypair(tmp_path / "keys")
    priv, pub = tmp_path / "keys" / PRIVATE_KEY_FILE, tmp_path / "keys" / PUBLIC_KEY_FILE
    url = f"file://{tmp_path}/run"
    # Two warm-start steps: signatures are the point, not what the model learns.
    env = {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1", "AURORA_TRAINER_WARM_START_STEPS": "2"}
    base = [sys.executable, "-m", "aurora_tools.cli"]
    common = ["--store", url, "--redis", redis_server.url, "--run", run_name]
    tlog, alog = open(tmp_path / "trainer.log", "wb"), open(tmp_path / "actor.log", "wb")  # noqa: SIM115
    trainer = subprocess.Popen(
        [*base, "trainer", *common, "--steps", "3", "--batch", "4", "--group", "2", "--snapshot-every", "2", "--checkpoint-every", "0"],
        env={**env, "AURORA_SIGN_KEY": str(priv)},
        stdout=tlog,
        stderr=subprocess.STDOUT,
    )
    actor = subprocess.Popen(
        [*base, "actor", *common, "--id", "a0", "--trust-key", str(pub)], env=env, stdout=alog, stderr=subprocess.STDOUT
    )
    try:
        wait_until(
            lambda: trainer.poll() is not None,
            "the Trainer to finish",
            timeout=600,
            interval=0.2,
            processes={"the Actor": actor},
            logs=[tmp_path / "trainer.log", tmp_path / "actor.log"],
        )
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text(errors="replace")[-3000:]
    finally:
        for p in (trainer, actor):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=60)
        tlog.close()
        alog.close()
    store = open_store(url)
    index = scan_versions(store)
    assert index.deltas == {1, 2, 3} and {0, 2} <= index.snapshots
    trust = TrustKeys.from_file(pub)
    for kind, vs in (("delta", index.deltas), ("snapshot", index.snapshots)):
        for v in vs:
            assert trust.check(read_manifest(store, kind, v, trust), "x") == signer.key_id
    r = connect(redis_server.url)
    try:
        th = r.hgetall(RunKeys(run_name).trainer)
        assert th[b"signed"] == b"1" and th[b"key_id"] == signer.key_id.encode()
    finally:
        r.close()
    assert "Traceback" not in (tmp_path / "actor.log").read_text(errors="replace")
