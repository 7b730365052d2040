"""``aurora bench hostile``: every attack of issues 13 and 24 against the real code, plus valid controls.

Each case forges what someone with write access to the store (but no signing
key), a hostile or failing mirror, or a role's Redis credential could do, then
runs the real reader, worker or Trainer on it and checks the refusal: for the
command line, exit status != 0, one error line, no traceback, no output file;
for a worker, that it survives and applies nothing forged. Signature cases
also count, through a store that counts its reads, how many segments of the
refused version were read (0). Valid controls must be accepted, bit-exact.
``peak_rss_mb`` is the largest resident size of any process of the bench
(:mod:`aurora_tools.bench.hostile.rss`). The builders live in
:mod:`aurora_tools.bench.hostile.forge`, the shared runs in
:mod:`aurora_tools.bench.hostile.runs`, so that tests can share them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main", "run", "all_cases"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--quick", action="store_true", help="a few cases of each kind (for tests)")
    p.add_argument(
        "--case", action="append", default=None, metavar="SUBSTRING", help="run only cases whose name contains SUBSTRING (repeatable)"
    )
    p.add_argument("--list", action="store_true", help="list the case names and exit")


def all_cases() -> list[Any]:
    """Every case, in the order they run: store and CLI attacks, Actor attacks, then the controls."""
    from aurora_tools.bench.hostile.cases import CASES
    from aurora_tools.bench.hostile.ledger import LEDGER_CASES
    from aurora_tools.bench.hostile.mirrors import MIRROR_CASES
    from aurora_tools.bench.hostile.planted import PLANTED_CASES
    from aurora_tools.bench.hostile.race import RACE_CASES
    from aurora_tools.bench.hostile.results import RESULTS_CASES
    from aurora_tools.bench.hostile.trainer import TRAINER_CASES
    from aurora_tools.bench.hostile.workers import WORKER_CASES

    every = [*CASES, *PLANTED_CASES, *WORKER_CASES, *MIRROR_CASES, *TRAINER_CASES, *LEDGER_CASES, *RESULTS_CASES, *RACE_CASES]
    attacks = [c for c in every if c.expected == "refuse"]
    return attacks + [c for c in every if c.expected == "accept"]


def run(quick: bool = False, only: list[str] | None = None, root: Path | None = None) -> dict[str, Any]:
    """Run the selected cases; the summary object ``--json`` prints."""
    from aurora_tools.bench.hostile.cases import Context, run_case
    from aurora_tools.bench.hostile.rss import peak_rss_mb

    chosen = [c for c in all_cases() if (not quick or c.quick) and (not only or any(s in c.name for s in only))]
    with tempfile.TemporaryDirectory(prefix="aurora-hostile-", dir=root) as tmp:
        ctx = Context(Path(tmp))
        try:
            results = [run_case(c, ctx) for c in chosen]
        finally:
            ctx.close()
    attacks = [r for r in results if r.expected == "refuse"]
    valid = [r for r in results if r.expected == "accept"]
    sig = [r for r in results if r.segment_reads is not None]
    return {
        "cases": len(attacks),
        "refused": sum(r.outcome == "refused" for r in attacks),
        "applied": sum(r.applied for r in results),
        "tracebacks": sum(r.traceback for r in results),
        "valid_accepted": sum(r.outcome == "accepted" and not r.traceback for r in valid),
        "valid_cases": len(valid),
        "signature_cases": len(sig),
        "segment_reads_before_refusal": sum(r.segment_reads or 0 for r in sig),
        "peak_rss_mb": peak_rss_mb(),
        "failed": [r.name for r in results if not r.ok],
        "names": [r.name for r in results],
        "results": [r.to_json() for r in results],
    }


def _table(summary: dict[str, Any]) -> str:
    rows = [("case", "expected", "outcome", "reads", "how refused / accepted")]
    for r in summary["results"]:
        reads = str(r["segment_reads"]) if "segment_reads" in r else ""
        rows.append((r["name"], r["expected"], r["outcome"] + ("" if r["ok"] else " !"), reads, r["how"][:110]))
    w = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w[i]) if i < 4 else c for i, c in enumerate(row)) for row in rows]
    lines.insert(1, "  ".join("-" * n for n in w) + "  " + "-" * 22)
    s = summary
    lines.append("")
    lines.append(
        f"{s['refused']}/{s['cases']} attacks refused, {s['applied']} applied, {s['tracebacks']} tracebacks; "
        f"{s['valid_accepted']}/{s['valid_cases']} valid controls accepted; "
        f"{s['segment_reads_before_refusal']} segment reads before {s['signature_cases']} signature refusals; "
        f"peak RSS {s['peak_rss_mb']:.0f} MB"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "list", False):
        print("\n".join(c.name + ("  (quick)" if c.quick else "") for c in all_cases()))
        return 0
    summary = run(quick=args.quick, only=args.case)
    if args.json:
        json.dump(summary, sys.stdout)
        print()
    else:
        print(_table(summary))
    return 0 if not summary["failed"] else 1
