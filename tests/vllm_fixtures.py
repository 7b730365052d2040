"""A Trainer's run in a ``file://`` store and one vLLM engine over it, for the vLLM tests.

``vllm_run`` (:class:`Run`) is snapshot v0 and deltas 1..``VERSIONS`` of the
tiny Qwen3 of ``workers.model`` (head size 32: vLLM's CPU attention needs at
least that) taking real Adam steps. ``vllm_engine`` is a vLLM engine with
that model's skeleton loaded, one per test module (it takes 20-40 s to
start); it skips the test when vLLM is not installed. Importing this module
does not import vLLM: the engine's module is imported inside the fixture.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import extract
from aurora_store.codec.fusion import FusionPlan
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.storage import Store, open_store
from workers.model import fused_weights, fusion_plan_for, hf_weights, tiny_qwen3
from workers.tokenizer import CharTokenizer

TOK = CharTokenizer()
CFG = PublishConfig(streams=2, segment_bytes=16 << 10)
HEAD_DIM = 32
VERSIONS = 4
BIG_STEP = 3
"""Version made by a large step: its logits differ visibly from its base's."""

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed: pip install 'aurora-store[vllm]' (make venv installs it)",
)


@dataclass
class Run:
    store: Store
    root: Path
    plan: FusionPlan
    digests: dict[int, str]
    """The Trainer's weights_digest of each version."""
    states: dict[int, str]
    skeleton: torch.nn.Module
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """The Trainer's weights (Hugging Face names) of each version."""


def make_run(root: Path) -> Run:
    """Snapshot v0 and deltas 1..VERSIONS of a Trainer taking Adam steps, under ``root``."""
    from test_engine import trainer_step  # the Trainer's update, shared with the torch engine's tests

    root.mkdir(parents=True)
    store = open_store(f"file://{root}")
    model = tiny_qwen3(TOK.vocab_size, seed=0, head_dim=HEAD_DIM)
    plan = fusion_plan_for(model)
    base = {n: t.clone() for n, t in hf_weights(model).items()}
    snap = publish_snapshot(store, "t", 0, fused_weights(base, plan), None, CFG)
    digests, states, weights = {0: weights_digest(base, plan)}, {0: snap.state}, {0: base}
    for v in range(1, VERSIONS + 1):
        model = trainer_step(model, lr=1e-2 if v == BIG_STEP else 1e-5, seed=v)
        new = {n: t.clone() for n, t in hf_weights(model).items()}
        m = publish_delta(store, "t", v, extract(plan, base, new), states[v - 1], CFG)
        digests[v], states[v], base = weights_digest(new, plan), m.state, new
        weights[v] = new
    return Run(store, root, plan, digests, states, tiny_qwen3(TOK.vocab_size, seed=0, head_dim=HEAD_DIM), weights)


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return make_run(tmp_path_factory.mktemp("vllm") / "run")


@pytest.fixture(scope="module")
def vllm_engine(vllm_run: Run) -> Iterator[object]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed: pip install 'aurora-store[vllm]'")
    from workers.engine.vllm_engine import VLLMConfig, VLLMEngine

    e = VLLMEngine(TOK, VLLMConfig(kv_cache_mib=64))
    e.load(vllm_run.skeleton)
    yield e
    e.close()
