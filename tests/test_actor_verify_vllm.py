"""``VLLMEngine.verify_digest``: the Actor's verification hashed inside vLLM's workers (either form of FORMAT.md §4.1).

At tp=1 the worker hashes in a background thread (generation goes on); under
tensor parallelism each whole tensor is gathered to rank 0 only and hashed
there. Both must equal the Trainer's digests of the same weights. Slow (vLLM
starts in 20-40 s); the tp=2 test is ``long``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from vllm_fixtures import VERSIONS, Run, needs_vllm

from aurora_store.apply.sink import tree_weights_digest
from workers.engine import VerifyingEngine

pytestmark = [pytest.mark.slow]


@needs_vllm
def test_vllm_verifies_in_either_form_while_it_can_still_generate(vllm_engine, vllm_run: Run) -> None:  # type: ignore[no-untyped-def]
    import test_vllm_engine as t

    assert isinstance(vllm_engine, VerifyingEngine)
    assert vllm_engine.bootstrap_from_store(vllm_run.store, {}, 0, 2) == (0, vllm_run.states[0])
    tree0 = tree_weights_digest(vllm_run.weights[0], vllm_run.plan)
    assert vllm_engine.verify_digest(tree0) == tree0
    assert vllm_engine.verify_digest(vllm_run.digests[0]) == vllm_run.digests[0]
    for v in range(1, VERSIONS + 1):
        vllm_engine.apply(t._stage(vllm_engine, vllm_run, v))
        want = tree_weights_digest(vllm_run.weights[v], vllm_run.plan)
        assert vllm_engine.verify_digest(want) == want, f"v{v} differs from the Trainer's"
    g = vllm_engine.generate([[1, 5, 6]], group=1, max_new_tokens=4, seed=1)
    assert g.new_tokens > 0


@needs_vllm
@pytest.mark.long
def test_tensor_parallel_vllm_verifies_whole_tensors_gathered_to_one_rank(tmp_path: Path) -> None:
    import test_vllm_engine as t
    from vllm_fixtures import make_run

    from workers.engine.vllm_engine import VLLMConfig, VLLMEngine

    run = make_run(tmp_path / "run")
    e = VLLMEngine(t.TOK, VLLMConfig(kv_cache_mib=64, tensor_parallel_size=2))
    try:
        e.load(run.skeleton)
        assert e.bootstrap_from_store(run.store, {}, 0, 2) == (0, run.states[0])
        for v in range(1, 3):
            e.apply(t._stage(e, run, v))
        want = tree_weights_digest(run.weights[2], run.plan)
        assert e.verify_digest(want) == want
        assert e.verify_digest(run.digests[2]) == run.digests[2]
    finally:
        e.close()
    shutil.rmtree(tmp_path, ignore_errors=True)
