"""vLLM Actors in the whole system, and a tensor-parallel vLLM engine, on this machine's CPU.

``aurora demo --engine vllm`` in small: a Trainer, real Redis and S3
servers, and an Actor process generating with vLLM, whose digests (computed
inside vLLM's worker) must equal the Trainer's at every version it
activates. Then vLLM with two tensor-parallel ranks: each rank patches its
own shard of every fused parameter (aurora_store.apply.tp), and the digest of the
gathered shards equals the Trainer's at every version.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from aurora_store.lineage.fetch import fetch_delta
from aurora_store.testing.servers import RedisServer
from aurora_tools.cli import build_parser
from aurora_tools.demo.system import DemoConfig, run_system_demo

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed: pip install 'aurora-store[vllm]' (make venv installs it)",
    ),
]


def test_cli_takes_engine_vllm() -> None:
    p = build_parser()
    a = p.parse_args(["actor", "--store", "file:///x", "--redis", "redis://h", "--run", "r", "--engine", "vllm"])
    assert a.engine == "vllm"
    d = p.parse_args(["demo", "--engine", "vllm", "--steps", "3", "--json"])
    assert d.engine == "vllm" and d.steps == 3 and d.json
    b = p.parse_args(["bench", "e2e", "--engine", "vllm", "--json"])
    assert b.engine == "vllm"


@pytest.mark.server
@pytest.mark.long  # a vLLM Actor through the whole system stays in CI: tests/test_hf_system_qwen3.py
def test_demo_with_a_vllm_actor_is_bit_identical(tmp_path: Path) -> None:
    with RedisServer() as rs:
        cfg = DemoConfig(
            steps=3,
            batch=8,
            group=4,
            actors_relay=0,
            actors_origin=1,
            relay=False,
            kill_at=-1,
            join_at=-1,
            redis=rs.url,
            run="vllm-e2e",
            workdir=str(tmp_path),
            display=False,
            engine="vllm",
            tiny_hidden=64,
            tiny_intermediate=192,
        )
        res = run_system_demo(cfg, say=lambda *a, **k: None)
    logs = (tmp_path / "logs" / "us-0.log").read_text(errors="replace")
    assert len(res.logs) == 3, logs[-3000:]
    assert res.bit_identical, (res.mismatches, logs[-3000:])
    # Bootstrap at v0 and every version after it, digested inside vLLM's worker.
    versions = sorted(v for a, v in res.activations)
    assert versions[:1] == [1] and res.activations_compared == 1 + len(versions)
    assert res.prompts_lost == 0 and res.accepted_twice == 0 and res.accepted_wrong_version == 0
    assert all(lg.by_actor == {"us-0": cfg.batch} for lg in res.logs)
    assert "VLLM::Worker" in logs or "vllm" in logs.lower()
    assert "activated v1" in logs
    # --fetch announced (the default): vLLM's workers staged from the segments held from their
    # announcements (checked against the manifest, in a private local folder), not from the store.
    assert "delta(s) staged from held segments" in logs, logs[-3000:]
    # The JSON object of `aurora demo --json`, as the torch demo prints it.
    j = json.loads(json.dumps(res.to_json()))
    assert j["bit_identical"] is True and j["steps"] == 3


@pytest.mark.long
def test_tensor_parallel_vllm_patches_each_shard(tmp_path: Path) -> None:
    """TP=2 on the CPU: the shards, patched rank by rank, digest like the Trainer's whole weights."""
    import test_vllm_engine as t
    from vllm_fixtures import make_run

    from workers.engine.vllm_engine import VLLMConfig, VLLMEngine

    run = make_run(tmp_path / "run")  # the same Trainer run as test_vllm_engine's
    e = VLLMEngine(t.TOK, VLLMConfig(kv_cache_mib=64, tensor_parallel_size=2))
    try:
        e.load(run.skeleton)
        assert e.param_specs() == run.plan.specs()
        probes = e.probe()
        assert len(probes) == 2 and probes[0]["pid"] != probes[1]["pid"]
        assert e.bootstrap_from_store(run.store, {}, 0, 2) == (0, run.states[0])
        assert e.digest() == run.digests[0]
        for v in range(1, t.VERSIONS):
            e.apply(t._stage(e, run, v))
            assert e.digest() == run.digests[v], f"v{v}"
        _, staged = fetch_delta(run.store, t.VERSIONS, e.param_specs(), expect_base_state=run.states[t.VERSIONS - 1])
        e.apply(staged)  # decoded here, shipped, cut per rank
        assert e.digest() == run.digests[t.VERSIONS]
        assert [p["ptrs"] for p in e.probe()] == [p["ptrs"] for p in probes]
        g = e.generate([[1, 5, 6]], group=2, max_new_tokens=6, seed=1)
        assert g.new_tokens > 0
    finally:
        e.close()
    shutil.rmtree(tmp_path, ignore_errors=True)
