"""What the command line says on stderr: progress and results of one command, one line each."""

from __future__ import annotations

import sys

__all__ = ["say"]


def say(msg: str) -> None:
    """One line on stderr, flushed (stdout is kept for tables and JSON)."""
    print(msg, file=sys.stderr, flush=True)
