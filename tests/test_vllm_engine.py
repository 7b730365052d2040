"""The vLLM engine on this machine's CPU: bootstrap, deltas in place, bit-identity with the Trainer.

One vLLM instance serves the whole module (it takes 20-40 s to start). The
"Trainer" here is the tiny Qwen3 of ``workers.model`` (head size 32: vLLM's
CPU attention needs at least that) taking real Adam steps; its versions are
published to a ``file://`` store that vLLM's worker processes read
themselves. Digests are computed inside the workers over vLLM's own fused
parameters and compared with the Trainer's ``weights_digest``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from vllm_fixtures import BIG_STEP, CFG, HEAD_DIM, TOK, VERSIONS, Run, needs_vllm

from aurora_store.codec.entries import DecodedEntry
from aurora_store.codec.extract import extract
from aurora_store.errors import ChainError, ConfigError, IntegrityError, ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.format.manifest import version_dir
from aurora_store.lineage.fetch import fetch_delta, read_manifest
from aurora_store.lineage.publish import publish_delta
from aurora_store.storage import open_store
from workers.engine import Engine, RemoteStaged, StoreStaging, make_engine
from workers.model import hf_weights, tiny_qwen3
from workers.task import make_problems


def test_choosing_vllm_without_it_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine import vllm_engine as engine_vllm

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'aurora-store\[vllm\]'"):
        engine_vllm.import_vllm()
    with pytest.raises(ConfigError, match=r"aurora-store\[vllm\]"):
        make_engine("vllm", TOK)
    with pytest.raises(ConfigError, match="unknown engine"):
        make_engine("tensorrt", TOK)


def test_vllm_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine.vllm_engine import VLLMConfig

    monkeypatch.setenv("AURORA_VLLM_TP", "2")
    monkeypatch.setenv("AURORA_VLLM_KV_CACHE_MIB", "64")
    monkeypatch.setenv("AURORA_VLLM_MAX_MODEL_LEN", "512")
    assert VLLMConfig.from_env() == VLLMConfig(tensor_parallel_size=2, kv_cache_mib=64, max_model_len=512)
    monkeypatch.setenv("AURORA_VLLM_TP", "two")
    with pytest.raises(ConfigError, match="AURORA_VLLM_TP"):
        VLLMConfig.from_env()
    with pytest.raises(ConfigError):
        VLLMConfig(kv_cache_mib=0)


def test_worker_errors_cross_back_with_their_class_and_fields() -> None:
    """A worker's reply carries error_to_wire; the engine raises the same class, fields intact."""
    from aurora_store.errors import EngineError, RedisUnavailable
    from workers.engine.vllm_engine import VLLMEngine
    from workers.engine.vllm_wire import reply

    def unavailable() -> None:
        raise RedisUnavailable("xread", "connection refused")

    def bug() -> None:
        raise KeyError("qkv_proj")

    class FakeLLM:
        def __init__(self, fn: object) -> None:
            self.fn = fn

        def collective_rpc(self, method: str, args: tuple[object, ...] = ()) -> list[dict[str, object]]:
            return [reply(lambda: 7), reply(self.fn)]  # type: ignore[arg-type]

    e = VLLMEngine(TOK)
    e._llm = FakeLLM(unavailable)
    with pytest.raises(RedisUnavailable) as info:
        e._call_all("aurora_probe")
    assert (info.value.op, info.value.reason) == ("xread", "connection refused")
    assert str(info.value) == str(RedisUnavailable("xread", "connection refused"))
    e._llm = FakeLLM(bug)
    with pytest.raises(EngineError, match="KeyError"):
        e._call_all("aurora_probe")
    e._llm = FakeLLM(lambda: 8)
    assert e._call_all("aurora_probe") == [7, 8]
    e._llm = None


# ---------------------------------------------------------------------------
# helpers over the module's engine and run (``vllm_engine``, ``vllm_run``: tests/vllm_fixtures.py)


def _stage(engine: object, run: Run, v: int) -> RemoteStaged:
    assert isinstance(engine, StoreStaging)
    m, staged = engine.stage_from_store(run.store, {}, v, run.states[v - 1], 2)
    assert isinstance(staged, RemoteStaged) and m.state == run.states[v] == staged.state
    return staged


def _ptrs(engine: object) -> list[dict[str, int]]:
    return [p["ptrs"] for p in engine.probe()]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# the engine


pytestmark = [pytest.mark.slow]


@needs_vllm
def test_vllm_bootstraps_and_applies_deltas_bit_identical(vllm_engine, vllm_run: Run) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(vllm_engine, Engine) and isinstance(vllm_engine, StoreStaging)
    assert vllm_engine.param_specs() == vllm_run.plan.specs()  # fused names, whole shapes: vocab padding hidden
    assert vllm_engine.bootstrap_from_store(vllm_run.store, {}, 0, 2) == (0, vllm_run.states[0])
    assert vllm_engine.version == 0 and vllm_engine.digest() == vllm_run.digests[0]
    ptrs = _ptrs(vllm_engine)
    # Deltas staged by the workers themselves, activated in place.
    for v in range(1, VERSIONS):
        vllm_engine.apply(_stage(vllm_engine, vllm_run, v))
        assert vllm_engine.version == v
        assert vllm_engine.digest() == vllm_run.digests[v], f"v{v} differs from the Trainer's"
    # A delta decoded in this process and shipped to the workers: same bits.
    _, staged = fetch_delta(vllm_run.store, VERSIONS, vllm_engine.param_specs(), expect_base_state=vllm_run.states[VERSIONS - 1])
    vllm_engine.apply(staged)
    assert vllm_engine.digest() == vllm_run.digests[VERSIONS]
    assert _ptrs(vllm_engine) == ptrs  # no parameter was reallocated
    assert vllm_engine.probe()[0]["staged"] == []  # nothing left behind in the worker
    # Joining late: newest snapshot plus every delta, inside the worker.
    assert vllm_engine.bootstrap_from_store(vllm_run.store, {}, None, 2) == (VERSIONS, vllm_run.states[VERSIONS])
    assert vllm_engine.digest() == vllm_run.digests[VERSIONS]
    # Whole weights shipped from this process (Hugging Face names), then back to v0 from the store.
    weights = hf_weights(tiny_qwen3(TOK.vocab_size, seed=0, head_dim=HEAD_DIM))
    vllm_engine.load_weights(weights, version=0)
    assert vllm_engine.digest() == vllm_run.digests[0] and _ptrs(vllm_engine) == ptrs


@needs_vllm
def test_vllm_generates_seeded_batches(vllm_engine, vllm_run: Run) -> None:  # type: ignore[no-untyped-def]
    vllm_engine.bootstrap_from_store(vllm_run.store, {}, 0, 2)
    prompts = [TOK.encode(p.prompt_text, bos=True) for p in make_problems(5, seed=3)]
    a = vllm_engine.generate(prompts, group=3, max_new_tokens=10, seed=5)
    b = vllm_engine.generate(prompts, group=3, max_new_tokens=10, seed=5)
    c = vllm_engine.generate(prompts, group=3, max_new_tokens=10, seed=6)
    assert a.completions == b.completions != c.completions
    assert len(a.completions) == 5 and all(len(g) == 3 for g in a.completions)
    assert a.new_tokens == sum(len(x.token_ids) for g in a.completions for x in g) > 0
    assert a.tokens_per_s > 0
    for g in a.completions:
        for x in g:
            assert 1 <= len(x.token_ids) <= 10
            assert x.finished == (x.token_ids[-1] == TOK.eos_id)
            assert TOK.eos_id not in x.token_ids[:-1]
            assert x.text == TOK.decode(x.token_ids)
    # Per-request seeds: a prompt's samples do not depend on the rest of the batch.
    alone = vllm_engine.generate(prompts[:1], group=3, max_new_tokens=10, seed=5)
    assert alone.completions[0] == a.completions[0]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vllm_engine.generate([[1, 10_000]], group=1, max_new_tokens=4, seed=0)


@needs_vllm
def test_vllm_outputs_follow_a_delta_that_changes_the_logits(vllm_engine, vllm_run: Run) -> None:  # type: ignore[no-untyped-def]
    vllm_engine.bootstrap_from_store(vllm_run.store, {}, BIG_STEP - 1, 2)
    prompts = [TOK.encode(p.prompt_text, bos=True) for p in make_problems(6, seed=9)]
    before = vllm_engine.generate(prompts, group=2, max_new_tokens=12, seed=11)
    vllm_engine.apply(_stage(vllm_engine, vllm_run, BIG_STEP))
    after = vllm_engine.generate(prompts, group=2, max_new_tokens=12, seed=11)
    assert before.completions != after.completions
    # And back: the same version gives the same samples again.
    vllm_engine.bootstrap_from_store(vllm_run.store, {}, BIG_STEP - 1, 2)
    assert vllm_engine.generate(prompts, group=2, max_new_tokens=12, seed=11).completions == before.completions


@needs_vllm
def test_vllm_forgets_prompt_kv_of_the_old_weights(vllm_engine, vllm_run: Run) -> None:  # type: ignore[no-untyped-def]
    """vLLM caches the KV of whole prompt blocks (128 tokens on CPU); a switch must not reuse the old version's."""
    long = [TOK.encode((" ".join(p.prompt_text for _ in range(20)))[:230], bos=True) for p in make_problems(3, seed=4)]
    assert all(len(p) > 128 for p in long)
    vllm_engine.bootstrap_from_store(vllm_run.store, {}, BIG_STEP - 1, 2)
    vllm_engine.generate(long, group=2, max_new_tokens=8, seed=3)  # fills the prefix cache at v(BIG_STEP-1)
    vllm_engine.apply(_stage(vllm_engine, vllm_run, BIG_STEP))
    switched = vllm_engine.generate(long, group=2, max_new_tokens=8, seed=3)
    assert vllm_engine._llm.reset_prefix_cache()  # the same weights, nothing cached
    fresh = vllm_engine.generate(long, group=2, max_new_tokens=8, seed=3)
    assert switched.completions == fresh.completions


@needs_vllm
def test_vllm_refuses_a_bad_delta_without_touching_weights(vllm_engine, vllm_run: Run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    vllm_engine.bootstrap_from_store(vllm_run.store, {}, 1, 2)
    digest, ptrs = vllm_engine.digest(), _ptrs(vllm_engine)
    _, good = fetch_delta(vllm_run.store, 2, vllm_engine.param_specs(), expect_base_state=vllm_run.states[1])
    first = good.entries[0]
    # A valid entry first, then one past the end of its parameter: nothing may be written.
    past = DecodedEntry(
        first.param, first.spec, 0, first.spec.numel, 1, np.array([first.spec.numel + 5], dtype=np.int64), np.ones(1, np.uint16), "new"
    )
    unknown = DecodedEntry(
        "model.layers.9.mlp.gate_up_proj.weight", first.spec, 0, 1, 1, np.array([0], dtype=np.int64), np.ones(1, np.uint16), "new"
    )
    wide = DecodedEntry(first.param, first.spec, 0, 1, 1, np.array([0], dtype=np.int64), np.ones(1, np.uint32), "new")
    for bad in (past, unknown, wide):
        with pytest.raises(ModelMismatchError):
            vllm_engine.apply(StagedDelta(2, 1, (*good.entries, bad)))
        assert vllm_engine.digest() == digest and vllm_engine.version == 1
    # On another base than the held version.
    with pytest.raises(ChainError):
        vllm_engine.apply(StagedDelta(3, 2, good.entries))
    # A corrupted segment in the store: the worker refuses it while staging.
    copy_root = tmp_path / "run"
    shutil.copytree(vllm_run.root, copy_root)
    bad_store = open_store(f"file://{copy_root}")
    m = read_manifest(bad_store, "delta", 2)
    seg = copy_root / version_dir("delta", 2) / m.segments[0].key
    raw = bytearray(seg.read_bytes())
    raw[-1] ^= 0xFF
    seg.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError):
        vllm_engine.stage_from_store(bad_store, {}, 2, vllm_run.states[1], 2)
    # A delta on the wrong base state is refused before anything is fetched.
    with pytest.raises(ChainError):
        vllm_engine.stage_from_store(vllm_run.store, {}, 2, vllm_run.states[0], 2)
    assert vllm_engine.digest() == digest and _ptrs(vllm_engine) == ptrs
    # The engine still works: the good delta applies.
    vllm_engine.apply(_stage(vllm_engine, vllm_run, 2))
    assert vllm_engine.digest() == vllm_run.digests[2]


@needs_vllm
def test_vllm_repeated_activations_keep_memory_flat(vllm_engine, vllm_run: Run) -> None:  # type: ignore[no-untyped-def]
    def cycle() -> None:
        vllm_engine.bootstrap_from_store(vllm_run.store, {}, 0, 2)
        for v in range(1, VERSIONS + 1):
            vllm_engine.apply(_stage(vllm_engine, vllm_run, v))

    cycle()  # warm-up: allocator pools, thread pool, store handles
    ptrs = _ptrs(vllm_engine)
    rss0 = vllm_engine.probe()[0]["rss"]
    for _ in range(4):
        cycle()
    # XOR deltas shipped from here: every second one restores the weights.
    spec = vllm_engine.param_specs()["model.layers.0.mlp.gate_up_proj.weight"]
    rng = np.random.default_rng(0)
    idx = np.unique(rng.integers(0, spec.numel, 2000)).astype(np.int64)
    bits = rng.integers(1, 1 << 15, idx.size).astype(np.uint16)
    entry = DecodedEntry("model.layers.0.mlp.gate_up_proj.weight", spec, 0, spec.numel, idx.size, idx, bits, "xor")
    for k in range(40):
        vllm_engine.apply(StagedDelta(VERSIONS + k + 1, VERSIONS + k, (entry,)))
    assert vllm_engine.digest() == vllm_run.digests[VERSIONS]
    rss1 = vllm_engine.probe()[0]["rss"]
    assert _ptrs(vllm_engine) == ptrs
    assert rss1 - rss0 < 48 << 20, f"worker RSS grew by {(rss1 - rss0) >> 20} MiB over 60 activations"


@needs_vllm
def test_vllm_workers_hold_what_the_actor_checked_not_a_second_read(vllm_engine, vllm_run: Run, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A mirror serves the true manifest of v2 to the Actor, then a forged one (same base_state) to anyone after.

    The workers are handed the Actor's manifests and never read them again:
    they stage and reach the true weights; a rank asked to activate another
    state than it staged refuses before writing.
    """
    root = tmp_path / "mirror"
    shutil.copytree(vllm_run.root, root)
    mirror = open_store(f"file://{root}")
    checked = [read_manifest(mirror, "snapshot", 0), read_manifest(mirror, "delta", 1), read_manifest(mirror, "delta", 2)]
    forged_w = {n: t.clone() for n, t in vllm_run.weights[1].items()}
    name = next(n for n in sorted(forged_w) if n.endswith("mlp.down_proj.weight"))
    forged_w[name].view(-1)[:64] += 0.5
    forge = open_store(f"file://{tmp_path / 'forge'}")
    fm = publish_delta(forge, "t", 2, extract(vllm_run.plan, vllm_run.weights[1], forged_w), vllm_run.states[1], CFG)
    shutil.copytree(tmp_path / "forge" / version_dir("delta", 2), root / version_dir("delta", 2), dirs_exist_ok=True)
    assert read_manifest(mirror, "delta", 2).state == fm.state != vllm_run.states[2]  # a second read gets the forgery

    assert vllm_engine.bootstrap_from_store(mirror, {}, 2, 2, manifests=checked) == (2, vllm_run.states[2])
    assert vllm_engine.digest() == vllm_run.digests[2] and vllm_engine.held(digest=True) == (2, vllm_run.states[2], vllm_run.digests[2])

    vllm_engine.bootstrap_from_store(vllm_run.store, {}, 1, 2)
    m, staged = vllm_engine.stage_from_store(mirror, {}, 2, vllm_run.states[1], 2, manifest=checked[2])
    assert isinstance(staged, RemoteStaged) and m.state == staged.state == vllm_run.states[2]
    forged = RemoteStaged(2, 1, fm.state, staged.nnz)
    with pytest.raises(IntegrityError, match="nothing applied"):
        vllm_engine.apply(forged)  # the ranks staged the checked state, not this one
    assert vllm_engine.digest() == vllm_run.digests[1] and vllm_engine.version == 1
    vllm_engine.apply(_stage(vllm_engine, vllm_run, 2))
    assert vllm_engine.digest() == vllm_run.digests[2]


@needs_vllm
def test_a_follower_brings_a_running_vllm_engine_to_each_version(vllm_engine, vllm_run: Run) -> None:  # type: ignore[no-untyped-def]
    """``Follower.update(engine)``: whole weights the first time, then each delta applied in place in the workers."""
    from aurora_store import Follower

    ptrs = _ptrs(vllm_engine)
    f = Follower(vllm_run.store)
    got = f.update(vllm_engine, version=1)
    assert (got.version, got.path, got.deltas) == (1, "snapshot", 1) and got.state == vllm_run.states[1]
    assert vllm_engine.digest() == vllm_run.digests[1] and vllm_engine.version == 1
    for v in range(2, VERSIONS + 1):
        got = f.update(vllm_engine, version=v)
        assert (got.version, got.path, got.deltas) == (v, "deltas", 1) and got.bytes > 0
        assert vllm_engine.digest() == vllm_run.digests[v], f"v{v} differs from the Trainer's"
    assert f.update(vllm_engine).path == "none"  # the newest is held already
    assert _ptrs(vllm_engine) == ptrs  # every write landed in the engine's own tensors
    with pytest.raises(ChainError, match="never goes back"):
        f.update(vllm_engine, version=1)
    assert vllm_engine.digest() == vllm_run.digests[VERSIONS]
