"""The S3-protocol server a run talks to: moto in a child process or a thread, optionally behind the WAN proxy."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from aurora_store.testing.servers import S3Server
from aurora_tools.bench.transfer.timing import TimedStore

__all__ = ["proxied", "s3_server", "open_timed", "drop"]


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
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@contextmanager
def s3_server(mode: str, rtt_ms: float = 0.0, rate_mbit: float = 0.0) -> Iterator[tuple[S3Server, int | None]]:
    """(S3Server, server pid or None) on 127.0.0.1, in a child process or a thread.

    With ``rtt_ms`` or ``rate_mbit``, the endpoint handed out is that of a
    WAN proxy (``aurora_tools.wan.proxy``, a child process of its own, so
    its work does not share the client's interpreter lock) in front of it.
    """
    if rtt_ms > 0 or rate_mbit > 0:
        with s3_server(mode) as (srv, pid), proxied(srv.endpoint, rtt_ms, rate_mbit) as endpoint:
            yield S3Server(endpoint=endpoint), pid
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
    """Delete everything under the store's root (moto keeps objects in memory and /tmp)."""
    with suppress(FileNotFoundError):
        store.fs.rm(store.root, recursive=True)
