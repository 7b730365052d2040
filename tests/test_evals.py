"""Held-out accuracy by version: recorded in Redis and the run root, read back as untrusted, shown by ``aurora status``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from aurora_store.coordination.evals import eval_key, read_evals, read_store_evals, record_eval
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.status import collect_status, render
from aurora_store.storage import open_store


@pytest.mark.server
def test_evals_in_redis_are_read_as_untrusted_and_shown_by_status(redis_client: Any, run_name: str) -> None:
    keys = RunKeys(run_name)
    redis_client.hset(keys.trainer, mapping={"head": 4, "status": "running"})
    for v, acc in ((0, 0.25), (2, 0.5), (4, 0.625)):
        record_eval(redis_client, keys, v, {"version": v, "accuracy": acc, "problems": 16})
    # Forged or broken entries are skipped, never shown.
    redis_client.hset(
        keys.evals,
        mapping={
            "6": "not json",
            "7": json.dumps({"accuracy": 1.5}),
            "x": json.dumps({"accuracy": 0.1}),
            "8": json.dumps({"accuracy": "nan"}),
        },
    )
    got = read_evals(redis_client, keys)
    assert {v: e["accuracy"] for v, e in got.items()} == {0: 0.25, 2: 0.5, 4: 0.625}
    st = collect_status(redis_client, run_name)
    assert st["trainer"]["eval"] == {"version": 4, "accuracy": 0.625, "problems": 16, "evaluations": 3}
    assert "eval: accuracy 0.625 on v4 (16 held-out problems; 3 evaluation(s) recorded)" in render(st)


def test_evals_in_the_run_root(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    store.put(eval_key(3), json.dumps({"version": 3, "accuracy": 0.5}).encode())
    store.put(eval_key(1), json.dumps({"version": 1, "accuracy": 0.25}).encode())
    store.put("eval/notes.txt", b"not an evaluation")
    store.put(eval_key(9), b"\xff\xfe")
    assert {v: e["accuracy"] for v, e in read_store_evals(store).items()} == {1: 0.25, 3: 0.5}
    assert eval_key(3) == "eval/v00000003.json"
