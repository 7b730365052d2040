"""A detached testbed: ``aurora testbed up --background`` starts one, ``aurora testbed down`` stops it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aurora_store.errors import TestbedError, TestbedStale
from aurora_tools.testbed.processes import http_answers, ours, redis_answers, terminate, wait_for
from aurora_tools.testbed.state import (
    LOG_FILE,
    STATE_FILE,
    check_free,
    children,
    clear_stale,
    read_state,
)
from aurora_tools.testbed.testbed import DEFAULT_BUCKET, DEFAULT_DIR

__all__ = ["start_background", "stop_background"]


def start_background(
    dir: str | os.PathLike[str] = DEFAULT_DIR,
    s3_port: int = 0,
    redis_port: int = 0,
    bucket: str = DEFAULT_BUCKET,
    timeout_s: float = 60.0,
    s3: str = "auto",
) -> dict[str, Any]:
    """Start a detached testbed process; return its state once both servers answer."""
    d = Path(dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    check_free(d, lambda m: print(f"aurora testbed: {m}", file=sys.stderr, flush=True))
    log_path = d / LOG_FILE
    cmd = [
        sys.executable,
        "-m",
        "aurora_tools.testbed",
        "serve",
        "--dir",
        str(d),
        "--s3-port",
        str(s3_port),
        "--redis-port",
        str(redis_port),
        "--bucket",
        bucket,
        "--s3",
        s3,
    ]
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            env=env,
            cwd=str(d),
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
        wait_for(lambda: redis_answers(state["urls"]["redis"]), 10.0, f"redis on {state['urls']['redis']}")
        wait_for(lambda: http_answers(state["urls"]["s3"] + "/"), 10.0, f"S3 server on {state['urls']['s3']}")
    except BaseException:
        if proc.poll() is None:
            terminate(proc.pid, 10.0)
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
    if not ours(pid, "testbed"):
        stopped = clear_stale(d, state)
        raise TestbedStale(
            f"{d / STATE_FILE} was stale: testbed process {pid} is not running; removed it"
            + (f" and stopped leftover {', '.join(stopped)}" if stopped else "")
        )
    how = terminate(pid, timeout_s)
    stopped = [f"testbed (pid {pid}) {how}"]
    for name, cpid, marker in children(state):
        if ours(cpid, marker):
            stopped.append(f"{name} (pid {cpid}) {terminate(cpid, 5.0)}")
    with contextlib.suppress(FileNotFoundError):
        (d / STATE_FILE).unlink()
    return {"pid": pid, "how": how, "stopped": stopped}
