"""The S3-protocol server a run talks to: moto (a child process or a thread) or ``rclone serve s3`` (files on
disk; its runs commit through Redis), optionally behind the WAN proxy."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from aurora_store.testing.servers import RcloneS3Server, RedisServer, S3Server, stop_process
from aurora_tools.bench.transfer.timing import TimedStore

__all__ = ["S3_KINDS", "proxied", "s3_server", "open_timed", "drop", "rss_peak_mb", "RedisCommits"]

S3_KINDS = ("moto", "rclone")
"""``--s3``: moto (objects in memory) or rclone serve s3 (objects in files; no conditional writes)."""


@contextmanager
def proxied(endpoint: str, rtt_ms: float, rate_mbit: float) -> Iterator[str]:
    """The endpoint of a WAN proxy (``python -m aurora_tools.wan.proxy``, a child process) in front of ``endpoint``."""
    host, _, port = endpoint.removeprefix("http://").rpartition(":")
    argv = [sys.executable, "-m", "aurora_tools.wan.proxy", "--upstream", f"{host}:{port}", "--delay-ms", f"{rtt_ms / 2:g}"]
    if rate_mbit > 0:
        argv += ["--rate-mbit", f"{rate_mbit:g}"]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout is not None
        addr = child.stdout.readline().strip()
        if ":" not in addr:
            raise RuntimeError(f"the WAN proxy did not start (said {addr!r})")
        yield f"http://{addr}"
    finally:
        stop_process(child)


@contextmanager
def s3_server(
    mode: str, rtt_ms: float = 0.0, rate_mbit: float = 0.0, kind: str = "moto", root: str | None = None
) -> Iterator[tuple[Any, int | None]]:
    """(server, server pid or None) on 127.0.0.1: moto in a child process or a thread, or rclone.

    ``kind="rclone"``: ``rclone serve s3`` over ``root`` (None: a temporary folder), always a
    child process (``mode`` does not apply). With ``rtt_ms`` or ``rate_mbit``, the endpoint
    handed out is that of a WAN proxy (``aurora_tools.wan.proxy``, a child process of its
    own, so its work does not share the client's interpreter lock) in front of it.
    """
    if kind not in S3_KINDS:
        raise ValueError(f"--s3 {kind!r}: expected one of {', '.join(S3_KINDS)}")
    if rtt_ms > 0 or rate_mbit > 0:
        with s3_server(mode, kind=kind, root=root) as (srv, pid), proxied(srv.endpoint, rtt_ms, rate_mbit) as endpoint:
            if kind == "rclone":
                yield _Behind(srv, endpoint), pid
            else:
                yield S3Server(endpoint=endpoint), pid
        return
    if kind == "rclone":
        with RcloneS3Server(root=root) as rc:
            yield rc, rc.pid
        return
    if mode == "thread":
        wz = logging.getLogger("werkzeug")
        level = wz.level
        wz.setLevel(logging.ERROR)  # one access-log line per request otherwise
        try:
            with S3Server() as srv:
                yield srv, None
        finally:
            wz.setLevel(level)
        return
    with S3Server(process=True) as srv:
        yield srv, srv.pid


class _Behind:
    """A started server seen through another endpoint (a proxy in front of it): same credentials."""

    def __init__(self, srv: Any, endpoint: str) -> None:
        self._srv, self.endpoint = srv, endpoint
        self.honours_create_only = getattr(srv, "honours_create_only", True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._srv, name)

    def client(self) -> Any:
        import boto3

        o = self._srv.storage_options()
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=o["key"],
            aws_secret_access_key=o["secret"],
            region_name=o["client_kwargs"]["region_name"],
        )

    def new_bucket(self, prefix: str = "aurora") -> str:
        return str(self._srv.new_bucket(prefix))

    def storage_options(self) -> dict[str, Any]:
        o = self._srv.storage_options()
        return {**o, "client_kwargs": {**o["client_kwargs"], "endpoint_url": self.endpoint}}


class RedisCommits:
    """Redis-commit mode for a server without conditional writes: a persistent ``redis-server`` (AOF)
    and, per published version, a run of its own whose record is the commit point."""

    def __init__(self) -> None:
        self.server = RedisServer(appendonly=True)
        self.client: Any = None

    def __enter__(self) -> RedisCommits:
        from aurora_store.coordination.redisconn import connect

        self.server.start()
        self.client = connect(self.server.url)
        return self

    def __exit__(self, *exc: object) -> None:
        with suppress(Exception):
            self.client.close()
        self.server.close()

    def prepare(self, store: Any) -> tuple[Any, Any]:
        """(commit callback for ``publish_*``, records for ``read_manifest``) of a fresh run on ``store``."""
        import uuid

        from aurora_store.coordination.commit import commit_records_for, prepare_commit

        run = f"bench-{uuid.uuid4().hex[:10]}"
        commit = prepare_commit(store, self.client, run, "redis")
        return commit, commit_records_for(self.client, run)


def rss_peak_mb(pid: int | None) -> float | None:
    """Peak resident memory of process ``pid`` (VmHWM), in MB; None without one or where /proc lacks it."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) * 1024 / 1e6, 1)
    except OSError:
        return None
    return None


def open_timed(srv: Any, bucket: str, prefix: str, max_concurrency: int = 0) -> TimedStore:
    """A warmed store: the s3fs client exists and one request went through."""
    from aurora_store.storage import open_store

    opts = srv.storage_options()
    if max_concurrency:
        opts["max_concurrency"] = max_concurrency
    store = open_store(f"s3://{bucket}/{prefix}", opts)
    store.exists("warm-up")
    return TimedStore(store)


def drop(store: TimedStore) -> None:
    """Delete everything under the store's root (moto keeps objects in memory and /tmp; rclone in files)."""
    with suppress(FileNotFoundError):
        store.fs.rm(store.root, recursive=True)
