"""Keep a benchmark's standard output for its one JSON object.

``--json`` promises one JSON object on standard output. A benchmark that
starts vLLM cannot keep that promise by printing carefully: vLLM's logger
writes to the standard output it found at import, and its worker
processes inherit file descriptor 1. While :func:`json_only` is active,
descriptor 1 and ``sys.stdout`` both point at standard error, so whatever
the run prints (this process, its libraries, its children) lands there; the
caller prints the JSON after the block, once the real stdout is back.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

__all__ = ["json_only"]


@contextlib.contextmanager
def json_only(enabled: bool) -> Iterator[None]:
    """Send everything written to standard output to standard error for the block (when ``enabled``)."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved_fd = os.dup(1)
    saved = sys.stdout
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = saved
