"""Run ``aurora bench wan`` and ``aurora bench transfer`` on two or more source trees, interleaved.

``python -m aurora_tools.bench.side_by_side --tree 1c0ffee --tree HEAD [--tree DIR] --rounds 3 [--json]``

Why: a regression hunt compares figures of different commits, and on a shared
machine wall-clock figures move with the neighbours' load by more than the
regressions being looked for. So each round runs every tree once (A B A B …),
and the table shows every run and the median per tree, with the load average
around each run. A tree is a commit (extracted with ``git archive`` into a
temporary folder, never checked out) or a folder; each run is a child process of
this interpreter with ``PYTHONPATH`` set to the tree, and the tree's own
``aurora_store`` must be the one imported (checked before the first run).

Headline figures: ``delta_vs_ideal`` of ``bench wan --quick --experiments modes
--modes ideal,delta`` (the same two runs, with the same settings, that give the
headline of the whole ``--quick`` sweep), and ``speedup_streams`` and
``pipeline_over_raw`` of ``bench transfer --no-full`` (the delta section, which
is what those two keys report). ``--wan-args`` and ``--transfer-args`` add
options (``--wan-args "--measure 6"``); ``--nice N`` runs the children at that
niceness (negative: ahead of the neighbours, as root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Tree", "BENCHES", "headline", "format_table", "main"]

BENCHES: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "wan": (["bench", "wan", "--quick", "--json", "--experiments", "modes", "--modes", "ideal,delta"], ("delta_vs_ideal",)),
    "transfer": (["bench", "transfer", "--json", "--no-full"], ("speedup_streams", "pipeline_over_raw")),
}
"""Benchmark name -> (``aurora`` arguments, headline keys of its JSON)."""


@dataclass
class Tree:
    """One source tree under test: ``label`` (what was asked for) and the folder imported from."""

    label: str
    path: str
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def headline(bench: str, result: dict[str, Any]) -> dict[str, Any]:
    """The headline keys of one run's JSON (None where absent)."""
    return {k: result.get(k) for k in BENCHES[bench][1]}


@contextlib.contextmanager
def trees(specs: Sequence[str], repo: str) -> Iterator[list[Tree]]:
    """Each spec as a :class:`Tree`: a folder as it is, a commit extracted by ``git archive`` (removed after)."""
    with tempfile.TemporaryDirectory(prefix="aurora-sbs-") as tmp:
        out = []
        for i, spec in enumerate(specs):
            if os.path.isdir(spec):
                out.append(Tree(spec, os.path.abspath(spec)))
                continue
            dest = os.path.join(tmp, f"{i}")
            os.makedirs(dest)
            archive = subprocess.run(["git", "-C", repo, "archive", spec], check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
            sha = subprocess.run(["git", "-C", repo, "rev-parse", "--short", spec], check=True, capture_output=True, text=True).stdout
            out.append(Tree(f"{spec} ({sha.strip()})" if sha.strip() != spec else spec, dest))
        yield out


def _env(tree: Tree) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=tree.path)


def check_imports(tree: Tree) -> None:
    """Refuse a tree whose children would import another ``aurora_store`` (an editable install first on the path)."""
    code = "import aurora_store, sys; sys.stdout.write(aurora_store.__file__)"
    got = subprocess.run([sys.executable, "-c", code], cwd=tree.path, env=_env(tree), capture_output=True, text=True, check=True).stdout
    if not os.path.realpath(got).startswith(os.path.realpath(tree.path) + os.sep):
        raise SystemExit(f"{tree.label}: imports aurora_store from {got}, not from {tree.path}")


def run_once(tree: Tree, bench: str, extra: Sequence[str], nice: int, timeout_s: float) -> dict[str, Any]:
    """One run of ``bench`` on ``tree``: its headline, wall time and the load average before and after."""
    argv = [sys.executable, "-m", "aurora_tools.cli", *BENCHES[bench][0], *extra]
    if nice:
        argv = ["nice", "-n", str(nice), *argv]
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    p = subprocess.run(argv, cwd=tree.path, env=_env(tree), capture_output=True, text=True, timeout=timeout_s)
    row: dict[str, Any] = {"wall_s": round(time.perf_counter() - t0, 1), "load": [round(load0, 1), round(os.getloadavg()[0], 1)]}
    try:
        row.update(headline(bench, json.loads(p.stdout.strip().splitlines()[-1])))
    except (ValueError, IndexError):
        row["error"] = (p.stderr.strip().splitlines() or [f"exit {p.returncode}, no JSON"])[-1][:200]
    return row


def _median(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    xs = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(xs) if xs else None


def format_table(result: dict[str, Any]) -> str:
    """Every run, then the median of each tree, per benchmark."""
    lines = [f"side by side: {result['rounds']} round(s), trees run in turn within each round; {result['cpus']} CPUs"]
    for bench, keys in ((b, BENCHES[b][1]) for b in result["benches"]):
        lines.append("")
        lines.append(f"  {bench}: {' '.join(BENCHES[bench][0][1:])} {' '.join(result['extra'].get(bench, []))}".rstrip())
        lines.append(f"    {'tree':<28} {'runs':<40} " + " ".join(f"{'median ' + k:>26}" for k in keys))
        for t in result["trees"]:
            rows = t["runs"].get(bench, [])
            shown = "; ".join(
                r.get("error")
                or ", ".join(f"{r[k]:.3f}" if isinstance(r.get(k), (int, float)) else "-" for k in keys) + f" @{r['load'][0]:g}"
                for r in rows
            )
            meds = " ".join(f"{'-' if (m := _median(rows, k)) is None else f'{m:.3f}':>26}" for k in keys)
            lines.append(f"    {t['label']:<28} {shown:<40} {meds}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aurora_tools.bench.side_by_side", description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="a commit (git archive of --repo) or a folder; give two or more")
    ap.add_argument("--repo", default=".", help="git repository the commits are read from (default: here)")
    ap.add_argument("--bench", action="append", choices=tuple(BENCHES), help="benchmarks to run (default: both)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; every tree runs once per round (default 2)")
    ap.add_argument("--wan-args", default="", help="extra options of bench wan (one string)")
    ap.add_argument("--transfer-args", default="", help="extra options of bench transfer (one string)")
    ap.add_argument("--nice", type=int, default=0, help="niceness of the benchmark processes (default 0)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="give up on one run after this long")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a = ap.parse_args(argv)
    if len(a.tree) < 2 or a.rounds < 1:
        ap.error("give at least two --tree and --rounds >= 1")
    benches = a.bench or list(BENCHES)
    extra = {"wan": shlex.split(a.wan_args), "transfer": shlex.split(a.transfer_args)}
    with trees(a.tree, a.repo) as ts:
        for t in ts:
            check_imports(t)
        for r in range(a.rounds):
            for bench in benches:
                for t in ts:
                    row = run_once(t, bench, extra[bench], a.nice, a.timeout_s)
                    t.runs.setdefault(bench, []).append(row)
                    print(f"round {r + 1}: {bench} {t.label}: {row}", file=sys.stderr, flush=True)
        result = {
            "rounds": a.rounds,
            "benches": benches,
            "extra": {b: extra[b] for b in benches},
            "cpus": os.cpu_count(),
            "trees": [
                {
                    "label": t.label,
                    "runs": t.runs,
                    "median": {b: {k: _median(t.runs.get(b, []), k) for k in BENCHES[b][1]} for b in benches},
                }
                for t in ts
            ],
        }
    print(json.dumps(result) if a.json else format_table(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
