"""``DIR/testbed.json``: the state file a running testbed writes (pids, ports, URLs) and ``down`` reads."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aurora_store.errors import TestbedError, TestbedNotRunning, TestbedStale
from aurora_tools.testbed.processes import ours, terminate

__all__ = [
    "STATE_FILE",
    "LOG_FILE",
    "state_path",
    "read_state",
    "write_state",
    "remove_state_if_ours",
    "children",
    "clear_stale",
    "check_free",
]

STATE_FILE = "testbed.json"
LOG_FILE = "testbed.log"


def state_path(dir: str | os.PathLike[str]) -> Path:
    return Path(dir).resolve() / STATE_FILE


def read_state(dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The state file of the testbed in ``dir``; :class:`TestbedNotRunning` without one."""
    path = state_path(dir)
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


def write_state(dir: Path, state: dict[str, Any]) -> None:
    path = dir / STATE_FILE
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, path)


def remove_state_if_ours(dir: Path, pid: int) -> None:
    with contextlib.suppress(FileNotFoundError, TestbedError):
        if int(read_state(dir).get("pid", -1)) == pid:
            (dir / STATE_FILE).unlink()


def children(state: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(name, pid, command-line marker) of the server processes of a state, other than the testbed's own."""
    out = []
    r = state.get("redis") or {}
    if r.get("pid"):
        out.append(("redis-server", int(r["pid"]), "redis-server"))
    s = state.get("s3") or {}
    if s.get("pid") and int(s["pid"]) != int(state["pid"]):
        out.append((str(s.get("kind", "s3")), int(s["pid"]), str(s.get("kind", ""))))
    return out


def clear_stale(dir: Path, state: dict[str, Any]) -> list[str]:
    """Stop leftover servers of a dead testbed and remove its state file; returns what was stopped."""
    stopped = []
    for name, pid, marker in children(state):
        if ours(pid, marker):
            stopped.append(f"{name} (pid {pid}) {terminate(pid, 5.0)}")
    with contextlib.suppress(FileNotFoundError):
        (dir / STATE_FILE).unlink()
    return stopped


def check_free(dir: Path, say: Callable[[str], None]) -> None:
    """Refuse to start over a live testbed; clear a stale state file."""
    try:
        state = read_state(dir)
    except TestbedNotRunning:
        return
    except TestbedStale as e:
        raise TestbedError(f"{e}") from None
    pid = int(state["pid"])
    if ours(pid, "testbed"):
        raise TestbedError(
            f"a testbed is already running in {dir} (pid {pid}, redis {state.get('urls', {}).get('redis')}, "
            f"s3 {state.get('urls', {}).get('s3')}); stop it first: aurora testbed down --dir {dir}"
        )
    stopped = clear_stale(dir, state)
    say(f"removed the stale state file of testbed pid {pid} (not running)" + (f"; stopped {', '.join(stopped)}" if stopped else ""))
