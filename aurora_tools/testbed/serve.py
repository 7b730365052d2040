"""A testbed in the foreground: ``aurora testbed up`` (and the detached process of ``--background``)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

from aurora_tools.testbed.state import check_free, remove_state_if_ours, write_state
from aurora_tools.testbed.testbed import DEFAULT_BUCKET, DEFAULT_DIR, Testbed

__all__ = ["banner", "serve"]


def banner(state: dict[str, Any], background: bool = False) -> str:
    """What to paste into other terminals."""
    u, env, d = state["urls"], state["env"], state["dir"]
    run = state.get("run", "r1")
    s3 = state["s3"]
    where = "in-process" if s3["kind"] == "moto" else f"pid {s3['pid']}"
    common = f"--store {u['store']} --redis {u['redis']} --run {run}"
    via = " --commit-via redis" if s3.get("commit_via") == "redis" else ""
    lines = [
        f"Aurora testbed is up (dir {d}, pid {state['pid']})",
        f"  Redis  {u['redis']}   (redis-server pid {state['redis']['pid']})",
        f"  S3     {u['s3']}   ({s3['kind']}, {where}), bucket {state['bucket']}"
        + ("  [moto keeps objects in memory only]" if s3["kind"] == "moto" else "")
        + ("  [files on disk; no conditional writes: the Trainer commits through Redis]" if via else ""),
        "",
        "Paste into each other terminal:",
        *[f"  export {k}={v}" for k, v in env.items()],
        "",
        f"  --store {u['store']}",
        f"  --redis {u['redis']}",
        "",
        "Then, one per terminal:",
        f"  aurora trainer {common} --steps 20{via}",
        f"  aurora relay   {common} --region eu --mirror {u['mirror']}",
        f"  aurora actor   {common} --region eu --mirror {u['mirror']}",
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
    s3: str = "auto",
) -> int:
    """Run a testbed until SIGINT/SIGTERM/SIGHUP, with ``DIR/testbed.json`` while it is up."""
    out = out or sys.stdout
    d = Path(dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    check_free(d, lambda m: print(f"aurora testbed: {m}", file=sys.stderr, flush=True))
    stop = threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    # moto's server logs every request: too loud for a terminal (or a log) during a run.
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    tb = Testbed(d, s3_port=s3_port, redis_port=redis_port, bucket=bucket, s3=s3)
    try:
        tb.start()
        state = tb.state()
        write_state(d, state)
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
        remove_state_if_ours(d, os.getpid())
        for sig, handler in previous.items():
            signal.signal(sig, handler)
