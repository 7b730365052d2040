"""The vLLM worker's own bootstrap (no manifests handed by an Actor) never starts from a planted snapshot.

A snapshot at V > 0 is used only when it is bound to the chain (FORMAT.md
§4.1: delta V's ``weights_digest`` names its weights). One written by
someone who can only write the store, carrying the true state of V but
other weights, must be planned around: the worker reaches V from v0 and
the deltas, with the Trainer's weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from vllm_fixtures import CFG, VERSIONS, Run, needs_vllm

from aurora_store.lineage.fetch import fetch_snapshot
from aurora_store.lineage.publish import publish_snapshot
from aurora_store.storage import open_store

pytestmark = pytest.mark.slow


@needs_vllm
def test_the_workers_fallback_bootstrap_skips_a_planted_snapshot(vllm_engine: Any, vllm_run: Run, tmp_path: Path) -> None:
    root = tmp_path / "planted"
    shutil.copytree(vllm_run.root, root)
    store = open_store(f"file://{root}")
    _, v0 = fetch_snapshot(store, 0)
    forged = {n: t + 0.25 for n, t in v0.items()}
    publish_snapshot(store, "t", VERSIONS, forged, vllm_run.states[VERSIONS], CFG)  # the true state, other weights
    assert vllm_engine.bootstrap_from_store(store, {}, None, 2) == (VERSIONS, vllm_run.states[VERSIONS])
    assert vllm_engine.digest() == vllm_run.digests[VERSIONS], "the worker started from the planted snapshot"
