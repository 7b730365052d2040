"""Crash points: kill the Trainer at an exact place, to prove a resume from there.

``AURORA_CRASH_AT=point@version[,point@version…]`` makes the Trainer SIGKILL
itself when it reaches ``point`` for ``version`` (``point@version+``: for the
first version at or after it that reaches the point; a step that changed no
weight publishes no segment) (tests and ``aurora bench
chaos``; nothing sets it in a real run). The points are the places where a
crash leaves the most half-done state behind:

- ``segment``: a segment of the version is durable, its manifest is not
  written (a publish cut short: orphans, no version);
- ``manifest``: the manifest is written, the version is neither recorded in
  Redis nor announced (committed in the store, unknown to the run);
- ``closed``: the batch that makes the version is collected and closed in the
  ledger, the update is not taken yet (its results exist only in memory).
"""

from __future__ import annotations

import logging
import os
import signal

from aurora_store.config import Switch

__all__ = ["CRASH_AT", "CRASH_ENV", "POINTS", "crash_point"]

CRASH_ENV = "AURORA_CRASH_AT"
CRASH_AT = Switch(
    CRASH_ENV, str | None, None, "point@version[,…]: the Trainer SIGKILLs itself there (crash tests; points: segment, manifest, closed)"
)
POINTS = ("segment", "manifest", "closed")

log = logging.getLogger("aurora.trainer")


def crash_point(point: str, version: int) -> None:
    """SIGKILL this process if :data:`CRASH_ENV` names ``point@version``."""
    spec = CRASH_AT.get()
    if not spec:
        return
    for item in spec.split(","):
        name, _, v = item.strip().partition("@")
        v = v.strip()
        at_or_after = v.endswith("+")
        try:
            want = int(v.rstrip("+"))
        except ValueError:
            continue
        if name == point and (version >= want if at_or_after else version == want):
            log.warning("crash point %s@%d reached: SIGKILL (%s)", point, version, CRASH_ENV)
            for h in logging.getLogger().handlers:
                h.flush()
            os.kill(os.getpid(), signal.SIGKILL)
