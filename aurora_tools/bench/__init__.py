"""Benchmark programs: each prints a table (or one JSON object with --json)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["run_and_report"]


def run_and_report(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace, Callable[[str], None]], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    ok: Callable[[dict[str, Any]], bool],
) -> int:
    """Run a benchmark; progress to stderr unless ``--json``; one JSON object or the table to stdout."""
    as_json = bool(getattr(args, "json", False))

    def log(msg: str) -> None:
        if not as_json:
            print(msg, file=sys.stderr, flush=True)

    result = run(args, log)
    print(json.dumps(result) if as_json else table(result))
    return 0 if ok(result) else 1
