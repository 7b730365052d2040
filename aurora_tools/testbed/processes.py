"""Processes of the testbed: alive or not, ours or a recycled pid, stopped politely then not; servers that answer."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from aurora_store.errors import TestbedError

__all__ = [
    "process_alive",
    "cmdline",
    "ours",
    "wait_gone",
    "terminate",
    "http_answers",
    "redis_answers",
    "wait_for",
]


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


def cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def ours(pid: int, marker: str) -> bool:
    """``pid`` runs and (where /proc tells) its command line contains ``marker``:
    a recycled pid of some unrelated process is never signalled."""
    if not process_alive(pid):
        return False
    cmd = cmdline(pid)
    return cmd is None or marker in cmd


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def terminate(pid: int, timeout_s: float) -> str:
    """SIGTERM, then SIGKILL after ``timeout_s``. Returns how it ended."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if wait_gone(pid, timeout_s):
        return "terminated"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    wait_gone(pid, 5.0)
    return "killed"


def http_answers(url: str, timeout_s: float = 1.0) -> bool:
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


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def wait_for(pred: Callable[[], bool], timeout_s: float, what: str, alive: Callable[[], bool] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if alive is not None and not alive():
            raise TestbedError(f"{what} exited before it answered")
        if time.monotonic() > deadline:
            raise TestbedError(f"{what} did not answer within {timeout_s:.0f}s")
        time.sleep(0.05)
