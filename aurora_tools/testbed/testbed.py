"""The :class:`Testbed`: Redis and an S3-protocol server on loopback, with one bucket."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from aurora_store.errors import TestbedError
from aurora_store.testing.servers import RcloneS3Server, S3Server, free_port, port_is_free
from aurora_tools.testbed.processes import http_answers, wait_for

__all__ = ["DEFAULT_DIR", "DEFAULT_BUCKET", "ACCESS_KEY", "SECRET_KEY", "REGION", "S3_KINDS", "Testbed"]

DEFAULT_DIR = ".aurora-testbed"
DEFAULT_BUCKET = "aurora"

#: Credentials of the testbed's S3 server (minio wants a secret of >= 8 characters; moto takes any).
ACCESS_KEY = "aurora"
SECRET_KEY = "aurora-testbed"
REGION = "us-east-1"

_HOST = "127.0.0.1"

#: The S3 servers a testbed can run (``auto``: minio if on PATH, else moto).
S3_KINDS = ("auto", "minio", "moto", "rclone")


class Testbed:
    """Redis and an S3-protocol server on loopback, with one bucket.

    ``s3``: ``"auto"`` (minio if on PATH, else moto), ``"minio"``, ``"moto"`` or
    ``"rclone"`` (``rclone serve s3`` over ``DIR/rclone``: objects on disk, no
    conditional writes, so its Redis persists (``appendonly yes``) and a run
    commits through it: ``--commit-via redis``).
    Ports 0 mean "a free one". ``run`` only names the run in :attr:`urls`.
    """

    __test__ = False  # not a pytest test class despite its name

    def __init__(
        self,
        dir: str | os.PathLike[str] = DEFAULT_DIR,
        s3_port: int = 0,
        redis_port: int = 0,
        bucket: str = DEFAULT_BUCKET,
        s3: str = "auto",
        run: str = "r1",
    ) -> None:
        if s3 not in S3_KINDS:
            raise TestbedError(f"s3 server {s3!r}: expected {', '.join(S3_KINDS)}")
        for name, port in (("--s3-port", s3_port), ("--redis-port", redis_port)):
            if not 0 <= port <= 65535:
                raise TestbedError(f"{name} {port}: not a TCP port")
        self.dir = Path(dir).resolve()
        self.s3_port = s3_port
        self.redis_port = redis_port
        self.bucket = bucket
        self.run = run
        self.s3_kind = s3 if s3 != "auto" else ("minio" if shutil.which("minio") else "moto")
        self.s3_endpoint = ""
        self._redis: Any = None
        self._moto: S3Server | None = None
        self._minio: subprocess.Popen[bytes] | None = None
        self._minio_log: Any = None
        self._rclone: RcloneS3Server | None = None

    # -- life cycle ---------------------------------------------------------
    def start(self) -> Testbed:
        """Start both servers and create the bucket; on any failure nothing is left running."""
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_redis()
            self._start_s3()
            self._create_bucket()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop both servers (idempotent)."""
        if self._moto is not None:
            with contextlib.suppress(Exception):
                self._moto.stop()
            self._moto = None
        if self._rclone is not None:
            with contextlib.suppress(Exception):
                self._rclone.stop()
            self._rclone = None
        if self._minio is not None:
            if self._minio.poll() is None:
                self._minio.terminate()
                try:
                    self._minio.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._minio.kill()
                    self._minio.wait()
            self._minio = None
        if self._minio_log is not None:
            self._minio_log.close()
            self._minio_log = None
        if self._redis is not None:
            self._redis.stop()
            self._redis = None

    def __enter__(self) -> Testbed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._redis is not None and bool(self.s3_endpoint)

    def problem(self) -> str | None:
        """Why the testbed is no longer whole (a server exited), or None."""
        if self._redis is not None and self._redis.proc is not None and self._redis.proc.poll() is not None:
            return f"redis-server (pid {self._redis.proc.pid}) exited with status {self._redis.proc.returncode}"
        if self._minio is not None and self._minio.poll() is not None:
            return f"minio (pid {self._minio.pid}) exited with status {self._minio.returncode}; see {self.dir / 'minio.log'}"
        if self._rclone is not None:
            return self._rclone.problem()
        return self._moto.problem() if self._moto is not None else None

    def _start_redis(self) -> None:
        from aurora_store.testing.servers import RedisServer, redis_server_binary

        try:
            binary = redis_server_binary()
        except RuntimeError as e:
            raise TestbedError(str(e)) from None
        if self.redis_port and not port_is_free(self.redis_port):
            raise TestbedError(f"--redis-port {self.redis_port}: something already listens on {_HOST}:{self.redis_port}")
        # Redis-commit mode (what a store without conditional writes needs) wants a Redis that persists.
        server = RedisServer(binary, appendonly=self.commit_via == "redis")
        server.port = self.redis_port
        server.dir = str(self.dir / "redis")
        os.makedirs(server.dir, exist_ok=True)
        try:
            server.start()
        except RuntimeError as e:
            server.stop()
            raise TestbedError(f"redis-server ({binary}): {e}") from None
        self._redis = server

    def _start_s3(self) -> None:
        if self.s3_port and not port_is_free(self.s3_port):
            raise TestbedError(f"--s3-port {self.s3_port}: something already listens on {_HOST}:{self.s3_port}")
        if self.s3_kind == "minio":
            self._start_minio()
        elif self.s3_kind == "rclone":
            self._start_rclone()
        else:
            self._start_moto()

    def _start_moto(self) -> None:
        self._moto = S3Server(port=self.s3_port).start()
        self.s3_endpoint = self._moto.endpoint
        wait_for(lambda: http_answers(self.s3_endpoint + "/"), 15.0, f"moto's server on {self.s3_endpoint}")

    def _start_rclone(self) -> None:
        data = self.dir / "rclone"
        data.mkdir(parents=True, exist_ok=True)
        server = RcloneS3Server(root=data, port=self.s3_port, access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION)
        try:
            server.start()
        except RuntimeError as e:
            raise TestbedError(f"rclone serve s3: {e}") from None
        self._rclone = server
        self.s3_endpoint = server.endpoint

    @property
    def commit_via(self) -> str:
        """How a run on this testbed commits: ``"redis"`` on a server that ignores conditional writes."""
        return "redis" if self.s3_kind == "rclone" else "store"

    def _start_minio(self) -> None:
        binary = shutil.which("minio")
        if not binary:
            raise TestbedError("no minio binary on PATH (use s3='moto')")
        port = self.s3_port or free_port()
        data = self.dir / "minio"
        data.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, MINIO_ROOT_USER=ACCESS_KEY, MINIO_ROOT_PASSWORD=SECRET_KEY, MINIO_BROWSER="off")
        self._minio_log = open(self.dir / "minio.log", "ab")  # noqa: SIM115 - closed in stop()
        self._minio = subprocess.Popen(
            [binary, "server", str(data), "--address", f"{_HOST}:{port}", "--console-address", f"{_HOST}:{free_port()}"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._minio_log,
            stderr=subprocess.STDOUT,
        )
        self.s3_endpoint = f"http://{_HOST}:{port}"
        proc = self._minio
        wait_for(
            lambda: http_answers(self.s3_endpoint + "/minio/health/live"),
            30.0,
            f"minio on {self.s3_endpoint} (log: {self.dir / 'minio.log'})",
            alive=lambda: proc.poll() is None,
        )

    def client(self) -> Any:
        """A boto3 S3 client of this testbed's server."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.s3_endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def _create_bucket(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client().create_bucket(Bucket=self.bucket)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise TestbedError(f"bucket {self.bucket!r} on {self.s3_endpoint}: {e}") from None
        except (BotoCoreError, ValueError) as e:
            raise TestbedError(f"bucket {self.bucket!r} on {self.s3_endpoint}: {e}") from None

    # -- what clients need ----------------------------------------------------
    @property
    def redis_url(self) -> str:
        return self._redis.url if self._redis is not None else ""

    @property
    def urls(self) -> dict[str, str]:
        """``redis``, ``s3`` (endpoint), ``store`` (a run root in the bucket) and a region's ``mirror``."""
        return {
            "redis": self.redis_url,
            "s3": self.s3_endpoint,
            "store": f"s3://{self.bucket}/runs/{self.run}",
            "mirror": f"s3://{self.bucket}/mirrors/eu/{self.run}",
        }

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point S3 clients (s3fs, boto3, the workers) here."""
        if self._rclone is not None:
            return self._rclone.env_vars  # with botocore's checksums as rclone needs them
        return {
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server (for ``open_store``)."""
        if self._rclone is not None:
            return self._rclone.storage_options()
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": {"endpoint_url": self.s3_endpoint, "region_name": REGION}}

    def state(self) -> dict[str, Any]:
        """What ``DIR/testbed.json`` holds (the caller's pid is the testbed's)."""
        redis_pid = self._redis.proc.pid if self._redis is not None and self._redis.proc is not None else None
        s3_pid = self._minio.pid if self._minio is not None else os.getpid()
        if self._rclone is not None and self._rclone.pid is not None:
            s3_pid = self._rclone.pid
        return {
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "dir": str(self.dir),
            "bucket": self.bucket,
            "run": self.run,
            "redis": {
                "pid": redis_pid,
                "port": self._redis.port if self._redis else None,
                "url": self.redis_url,
                "binary": self._redis.binary if self._redis else None,
            },
            "s3": {
                "kind": self.s3_kind,
                "pid": s3_pid,
                "port": int(self.s3_endpoint.rsplit(":", 1)[1]) if self.s3_endpoint else None,
                "endpoint": self.s3_endpoint,
                "commit_via": self.commit_via,
            },
            "urls": self.urls,
            "env": self.env,
        }
