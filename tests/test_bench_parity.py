"""``aurora bench e2e --parity``: accuracy by version of an asynchronous and a synchronous run, side by side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A benchmark's smoke run (two whole systems, 37 s): `make test-all`; the system path is test_e2e's.
pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.long]


def test_parity_compares_async_and_sync_accuracy_by_version() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aurora_tools.cli",
            "bench",
            "e2e",
            "--parity",
            "--steps",
            "4",
            "--batch",
            "8",
            "--group",
            "4",
            "--eval-every",
            "2",
            "--eval-size",
            "16",
            "--tiny-size",
            "64",
            "192",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "AURORA_TORCH_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    j = json.loads(out.stdout.strip().splitlines()[-1])
    assert j["parity_versions"] == [0, 2, 4]
    for mode in ("async", "sync"):
        acc = j[f"parity_accuracy_{mode}"]
        assert len(acc) == 3 and all(0.0 <= a <= 1.0 for a in acc)
        assert j[f"bit_identical_{mode}"] is True
    # Same model, seed and held-out set: version 0 is the same weights in both runs.
    assert j["parity_accuracy_async"][0] == j["parity_accuracy_sync"][0]
    # K=1: batch b on version b-1 (b >= 1); K=0: batch b on version b.
    assert j["gen_version_async"] == [0, 0, 1, 2]
    assert j["gen_version_sync"] == [0, 1, 2, 3]
