"""``aurora lineage``, ``aurora verify``, ``aurora gc``: a run's stored versions, read without torch or the workers."""

from __future__ import annotations

import argparse
import json

from aurora_store.options import storage_options
from aurora_tools.cli.console import say

__all__ = ["cmd_lineage", "cmd_verify", "cmd_gc"]


def cmd_lineage(args: argparse.Namespace) -> int:
    from aurora_store.lineage.report import read_lineage
    from aurora_store.storage import open_store

    lin = read_lineage(open_store(args.url, storage_options(args.storage_option)))
    if args.json:
        print(json.dumps(lin.to_json(), indent=1))
        return 0
    print(f"{lin.url}: {len(lin.rows)} version(s)")
    print(f"{'version':>8} {'kind':<8} {'base':>6} {'state':<20} {'bytes':>12} {'changed':>11} {'density':>8} {'segs':>5}  created")
    for r in lin.rows:
        dens = f"{100 * r.density:.3f}%" if r.density is not None else "-"
        base = "-" if r.base is None else str(r.base)
        print(f"{r.version:>8} {r.kind:<8} {base:>6} {r.state[7:23]:<20} {r.bytes:>12} {r.changed:>11} {dens:>8} {r.segments:>5}  {r.created_at}")
    if lin.gaps:
        print(f"GAPS: version(s) {lin.gaps[:20]} have neither a delta nor a snapshot")
    if lin.orphans:
        print(f"ORPHANS: {len(lin.orphans)} object(s) of uncommitted publish attempts (aurora gc removes them)")
    for p in lin.problems:
        print(f"PROBLEM: {p}")
    return 1 if lin.problems else 0


def cmd_verify(args: argparse.Namespace) -> int:
    from aurora_store.lineage.verify import verify_run
    from aurora_store.storage import open_store

    store = open_store(args.url, storage_options(args.storage_option))
    rep = verify_run(store, args.from_version, args.to_version, deep=args.deep, progress=say if args.verbose else None)
    for w in rep.warnings:
        say(f"warning: {w}")
    for p in rep.problems:
        print(f"PROBLEM: {p}")
    print(
        f"{'OK' if rep.ok else 'FAILED'}: {rep.checked_versions} version(s), {rep.checked_objects} object(s), "
        f"{rep.checked_bytes} bytes re-hashed; {len(rep.problems)} problem(s)"
    )
    return 0 if rep.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    from aurora_store.lineage.gc import run_gc
    from aurora_store.storage import open_store

    store = open_store(args.url, storage_options(args.storage_option))
    run_gc(store, args.keep_snapshots, apply=args.apply, min_orphan_age_s=args.min_orphan_age)
    return 0
