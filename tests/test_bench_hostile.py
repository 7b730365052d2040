"""``aurora bench hostile --quick``: the JSON contract and its invariants on a few cases of each kind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aurora_tools.bench.hostile import all_cases
from aurora_tools.bench.hostile.forge import SEGMENT_MUTATIONS, hostile_segment

KEYS = {
    "cases",
    "refused",
    "applied",
    "tracebacks",
    "valid_accepted",
    "valid_cases",
    "names",
    "segment_reads_before_refusal",
    "results",
    "peak_rss_mb",
}


def test_the_registry_has_every_kind_of_case() -> None:
    cases = all_cases()
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    attacks = [c for c in cases if c.expected == "refuse"]
    assert len(attacks) >= 45
    for group in ("segment", "limits", "signature", "snapshot", "actor", "planted", "oversized", "mirror", "trainer", "ledger"):
        assert any(c.group == group for c in attacks), group
    assert any(c.expected == "accept" for c in cases)
    for name in SEGMENT_MUTATIONS:
        assert hostile_segment(name)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.server
def test_quick_run_refuses_every_attack_and_accepts_the_controls() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "aurora_tools.cli", "bench", "hostile", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert "Traceback" not in p.stdout + p.stderr, p.stderr[-2000:]
    s = json.loads(p.stdout)
    assert set(s) >= KEYS
    assert p.returncode == 0, s["failed"]
    assert s["cases"] == s["refused"] > 0
    assert s["applied"] == 0 and s["tracebacks"] == 0
    assert s["valid_accepted"] == s["valid_cases"] > 0
    assert s["names"] == [r["name"] for r in s["results"]]
    sig = [r for r in s["results"] if "segment_reads" in r]
    assert sig and all(r["segment_reads"] == 0 for r in sig) and s["segment_reads_before_refusal"] == 0
    assert any(n.startswith("actor:") for n in s["names"]) and any(n.startswith("segment:") for n in s["names"])
    # Issue 24: a planted object of hundreds of MB costs no reader its size in memory.
    assert any(n.startswith("oversized:") for n in s["names"]) and any(n.startswith("ledger:") for n in s["names"])
    assert 0 < s["peak_rss_mb"] < 2048
