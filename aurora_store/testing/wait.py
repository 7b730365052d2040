"""Waiting on a condition in a test, never on a fixed sleep.

:func:`wait_until` polls a predicate on real time and fails the test with an
``AssertionError`` that names what it waited for. Child processes a test
depends on can be watched at each poll, so a crashed worker fails the test at
once (with its log's tail) instead of at the timeout.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

__all__ = ["wait_until", "tail"]


def tail(path: Path, chars: int = 3000) -> str:
    """The last ``chars`` characters of a log file (a note if it does not exist)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return f"(no {path})"


def _logs_said(logs: Sequence[Path]) -> str:
    return "".join(f"\n--- {log.name}:\n{tail(log)}" for log in logs)


def wait_until(
    predicate: Callable[[], object],
    what: str = "condition",
    *,
    timeout: float = 30.0,
    interval: float = 0.02,
    processes: Mapping[str, subprocess.Popen[bytes] | subprocess.Popen[str]] | None = None,
    logs: Sequence[Path] = (),
    ignoring: tuple[type[BaseException], ...] = (),
) -> None:
    """Poll ``predicate()`` every ``interval`` seconds until it is truthy.

    ``wait_until(relay.caught_up.is_set, "the first listing")``. Raises ``AssertionError`` naming ``what`` after ``timeout`` seconds, or as
    soon as one of ``processes`` (name to child) has exited; the message ends
    with the tails of ``logs``. Exceptions of the types in ``ignoring`` raised
    by the predicate count as "not yet" (an endpoint not listening yet).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except ignoring:
            pass
        for name, proc in (processes or {}).items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited ({proc.returncode}) while waiting for {what}{_logs_said(logs)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{_logs_said(logs)}")
        time.sleep(interval)
