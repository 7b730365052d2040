"""The policy model and the torch engine: generation, digests, deltas applied in place.

Deltas here are real aurora_store deltas: extracted from the engine's
weights against a Trainer's copy after an optimizer step, published to a
``memory://`` store and fetched back (or staged straight from segments).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import extract
from aurora_store.errors import ChainError, ConfigError, FormatError, ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta, encode_segments, stage_segments
from aurora_store.lineage.fetch import fetch_delta, fetch_snapshot
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.storage import Store
from workers.engine.protocol import Engine, evaluate
from workers.engine.torch_engine import EngineConfig, TorchEngine
from workers.model import (
    fused_weights,
    fusion_plan_for,
    hf_weights,
    is_tied,
    load_model,
    logprobs,
    pack_completions,
    save_model,
    tiny_qwen3,
    warm_start,
)
from workers.task import make_problems
from workers.tokenizer import CharTokenizer

CFG = PublishConfig(streams=2, segment_bytes=16 << 10)
TOK = CharTokenizer()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def engine() -> TorchEngine:
    e = TorchEngine(TOK)
    e.load(tiny_qwen3(TOK.vocab_size, seed=0), version=0)
    return e


def prompts_of(n: int, seed: int = 7) -> list[list[int]]:
    return [TOK.encode(p.prompt_text, bos=True) for p in make_problems(n, seed)]


def trainer_step(model: torch.nn.Module, lr: float, seed: int = 0) -> torch.nn.Module:
    """The Trainer's copy of ``model`` after one Adam step (float32 master, rounded to bf16)."""
    master = copy.deepcopy(model).float().train().requires_grad_(True)
    probs = make_problems(16, seed)
    packed = pack_completions(
        [TOK.encode(p.prompt_text, bos=True) for p in probs],
        [TOK.encode(p.solution, eos=True) for p in probs],
        TOK.pad_id,
    )
    opt = torch.optim.Adam(master.parameters(), lr=lr)
    (-logprobs(master, *packed, reduction="mean").mean()).backward()
    opt.step()
    return master.to(torch.bfloat16).eval().requires_grad_(False)


def ptrs(model: torch.nn.Module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters(remove_duplicate=False)}


# ---------------------------------------------------------------------------
# model and plan


def test_tiny_qwen3_is_seeded_and_tied() -> None:
    rng_before = torch.random.get_rng_state()
    a, b = tiny_qwen3(TOK.vocab_size, seed=0), tiny_qwen3(TOK.vocab_size, seed=0)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # caller's RNG untouched
    wa, wb = hf_weights(a), hf_weights(b)
    assert all(torch.equal(wa[n].view(torch.int16), wb[n].view(torch.int16)) for n in wa)
    assert all(t.dtype == torch.bfloat16 for t in wa.values())
    wc = hf_weights(tiny_qwen3(TOK.vocab_size, seed=1))
    assert not all(torch.equal(wc[n], wa[n]) for n in wa)
    # state_dict lists the tied head under its own name, on the embedding's storage.
    sd = a.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    plan = fusion_plan_for(a)
    assert plan.dropped == ("lm_head.weight",)
    assert "model.layers.0.self_attn.qkv_proj.weight" in plan.params
    assert "model.layers.0.mlp.gate_up_proj.weight" in plan.params
    # Clones untie: the plan must then be told.
    clones = {n: t.clone() for n, t in wa.items()}
    assert "lm_head.weight" in fusion_plan_for(clones).params
    assert fusion_plan_for(clones, tied=True).specs() == plan.specs()


def test_untied_model_carries_its_head() -> None:
    m = tiny_qwen3(TOK.vocab_size, seed=0, tie_word_embeddings=False)
    plan = fusion_plan_for(m)
    assert plan.dropped == () and "lm_head.weight" in plan.params
    e = TorchEngine(TOK)
    e.load(m)
    assert e.digest() == weights_digest(fused_weights(hf_weights(m), plan))


def test_digest_equals_fused_holders(engine: TorchEngine) -> None:
    """The engine's split weights digest like the same weights held fused (what vLLM holds)."""
    fused = fused_weights(hf_weights(engine.model), engine.fusion_plan())
    assert "model.layers.1.self_attn.qkv_proj.weight" in fused and "lm_head.weight" not in fused
    assert engine.digest() == weights_digest(fused)  # plan rebuilt from fused names
    assert engine.digest() == weights_digest(hf_weights(engine.model), engine.fusion_plan())
    assert engine.param_specs() == {n: p.spec for n, p in engine.fusion_plan().params.items()}
    assert isinstance(engine, Engine)


# ---------------------------------------------------------------------------
# log-probabilities


def test_logprobs_match_unpadded_rows() -> None:
    m = tiny_qwen3(TOK.vocab_size, seed=0, dtype=torch.float32)
    probs = make_problems(5, seed=2, difficulty=3)
    ps = [TOK.encode(p.prompt_text, bos=True) for p in probs]
    cs = [TOK.encode(p.solution[: 3 + i], eos=True) for i, p in enumerate(probs)]
    packed = pack_completions(ps, cs, TOK.pad_id)
    with torch.no_grad():
        got = logprobs(m, *packed)
        per_tok = logprobs(m, *packed, reduction="none")
        mean = logprobs(m, *packed, reduction="mean")
        for i, (p, c) in enumerate(zip(ps, cs, strict=True)):
            ids = torch.tensor([p + c])
            lsm = torch.log_softmax(m(input_ids=ids).logits[0].float(), -1)
            want = sum(lsm[len(p) - 1 + k, c[k]] for k in range(len(c)))
            assert got[i].item() == pytest.approx(float(want), abs=1e-4)
            assert mean[i].item() == pytest.approx(float(want) / len(c), abs=1e-4)
        assert per_tok.shape == packed.input_ids.shape
        assert torch.allclose(per_tok.sum(-1), got)
        assert (per_tok[packed.completion_mask == 0] == 0).all()
        # Left padding gives the same numbers (positions follow the mask).
        w = packed.input_ids.shape[1]
        n = packed.attention_mask.sum(-1)
        left = [torch.roll(t, shifts=int(w - k), dims=0) for t, k in zip(packed.input_ids, n, strict=True)]
        lmask = [torch.roll(t, shifts=int(w - k), dims=0) for t, k in zip(packed.attention_mask, n, strict=True)]
        lcomp = [torch.roll(t, shifts=int(w - k), dims=0) for t, k in zip(packed.completion_mask, n, strict=True)]
        got_left = logprobs(m, torch.stack(left), torch.stack(lmask), torch.stack(lcomp))
        assert torch.allclose(got_left, got, atol=1e-4)
    # Differentiable.
    m.requires_grad_(True)
    logprobs(m, *packed).sum().backward()
    assert m.model.embed_tokens.weight.grad is not None
    with pytest.raises(ValueError, match="position 0"):
        logprobs(m, packed.input_ids, packed.attention_mask, torch.ones_like(packed.input_ids))


# ---------------------------------------------------------------------------
# generation


def test_generate_is_seeded_and_shaped(engine: TorchEngine) -> None:
    prompts = prompts_of(6)
    a = engine.generate(prompts, group=3, max_new_tokens=12, seed=5)
    b = engine.generate(prompts, group=3, max_new_tokens=12, seed=5)
    c = engine.generate(prompts, group=3, max_new_tokens=12, seed=6)
    assert a.completions == b.completions
    assert a.completions != c.completions
    assert len(a.completions) == 6 and all(len(g) == 3 for g in a.completions)
    flat = [x for g in a.completions for x in g]
    assert a.new_tokens == sum(len(x.token_ids) for x in flat) > 0
    assert a.tokens_per_s > 0
    for x in flat:
        assert 1 <= len(x.token_ids) <= 12
        assert x.finished == (x.token_ids[-1] == TOK.eos_id)
        assert TOK.eos_id not in x.token_ids[:-1]
        assert x.text == TOK.decode(x.token_ids)
    # Batches cut into turns still give every prompt its group.
    small = TorchEngine(TOK, EngineConfig(max_batch_rows=4))
    small.load(engine.model)
    d = small.generate(prompts, group=3, max_new_tokens=4, seed=5)
    assert [len(g) for g in d.completions] == [3] * 6
    greedy = engine.generate(prompts[:1], group=2, max_new_tokens=8, seed=0, temperature=0.0)
    assert greedy.completions[0][0] == greedy.completions[0][1]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[TOK.bos_id, 999]], group=1, max_new_tokens=1, seed=0)
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], group=1, max_new_tokens=1, seed=0)


def test_engine_config() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="int8")
    with pytest.raises(ConfigError, match="device"):
        EngineConfig(device="tpu")
    with pytest.raises(ConfigError, match="max_batch_rows"):
        EngineConfig(max_batch_rows=0)
    with pytest.raises(RuntimeError, match="no model loaded"):
        TorchEngine(TOK).digest()


def test_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AURORA_ENGINE_MAX_BATCH_ROWS", "32")
    monkeypatch.setenv("AURORA_ENGINE_DTYPE", "float32")
    assert EngineConfig.from_env() == EngineConfig(dtype="float32", max_batch_rows=32)
    monkeypatch.setenv("AURORA_ENGINE_MAX_BATCH_ROWS", "many")
    with pytest.raises(ConfigError, match="MAX_BATCH_ROWS"):
        EngineConfig.from_env()


# ---------------------------------------------------------------------------
# deltas


def test_apply_published_delta_in_place(engine: TorchEngine, memory_store: Store) -> None:
    """Trainer: snapshot v0, one optimizer step, delta v1. Actor: fetch, validate, apply."""
    model, plan = engine.model, engine.fusion_plan()
    base = {n: t.clone() for n, t in hf_weights(model).items()}
    snap = publish_snapshot(memory_store, "t", 0, fused_weights(base, plan), None, CFG)
    # An RL-sized step: a minority of the bf16 elements change (sparse entries).
    new = hf_weights(trainer_step(model, lr=1e-5))
    m = publish_delta(memory_store, "t", 1, extract(plan, base, new), snap.state, CFG)
    assert 0 < m.nnz < sum(p.spec.numel for p in plan) // 2

    digest_before, before_ptrs = engine.digest(), ptrs(model)
    params_before = list(model.parameters())

    _, staged = fetch_delta(memory_store, 1, engine.param_specs(), expect_base_state=snap.state)
    engine.apply(staged)

    assert engine.version == 1
    want = weights_digest(new, plan)
    assert engine.digest() == want != digest_before
    assert weights_digest(fused_weights(new, plan)) == want  # the Trainer's fused view agrees
    assert ptrs(model) == before_ptrs and list(model.parameters()) == params_before
    assert is_tied(hf_weights(model))  # the head still is the embedding

    # A second Actor joins from the snapshot and replays the delta: same bits.
    late = TorchEngine(TOK)
    late.load(tiny_qwen3(TOK.vocab_size, seed=123))
    late_ptrs = ptrs(late.model)
    late.load_weights(fetch_snapshot(memory_store, 0)[1], version=0)
    assert late.digest() == digest_before and ptrs(late.model) == late_ptrs
    late.apply(fetch_delta(memory_store, 1, late.param_specs())[1])
    assert late.digest() == want


def staged_v1(engine: TorchEngine) -> StagedDelta:
    """Delta v1 for ``engine``, staged straight from encoded segments (no store)."""
    plan = engine.fusion_plan()
    base = {n: t.clone() for n, t in hf_weights(engine.model).items()}
    new = hf_weights(trainer_step(engine.model, lr=1e-2, seed=1))
    segs = [(f"seg-{s.index}", s.data) for s in encode_segments(extract(plan, base, new), 1, segment_bytes=4096)]
    assert len(segs) > 1
    return stage_segments(segs, 1, engine.param_specs())


def test_staged_delta_applies_to_split_weights(engine: TorchEngine) -> None:
    staged = staged_v1(engine)
    want_params = {e.param for e in staged.entries}
    assert any(p.endswith("qkv_proj.weight") for p in want_params)
    assert any(p.endswith("gate_up_proj.weight") for p in want_params)
    prompts = prompts_of(16)
    gen_before = engine.generate(prompts, group=4, max_new_tokens=16, seed=11)
    before = engine.digest()
    engine.apply(staged)
    assert engine.digest() != before and engine.version == 1
    # Same seed, new weights: the samples move (and stay reproducible).
    gen_after = engine.generate(prompts, group=4, max_new_tokens=16, seed=11)
    assert gen_after.completions != gen_before.completions
    assert engine.generate(prompts, group=4, max_new_tokens=16, seed=11).completions == gen_after.completions
    # Replaying the same delta on the new version is refused (wrong base).
    with pytest.raises(ChainError, match="based on version 0"):
        engine.apply(staged)


def _bad(staged: StagedDelta, how: str) -> StagedDelta:
    good = list(staged.entries)
    e = good[-1]
    if how == "unknown param":
        bad = dataclasses.replace(e, param="model.layers.9.mlp.gate_up_proj.weight")
    elif how == "range":
        bad = dataclasses.replace(e, stop=10**9)
    elif how == "index":
        idx = np.arange(e.start, e.start + e.bits.size, dtype=np.int64)
        idx[-1] = 10**9
        bad = dataclasses.replace(e, indices=idx)
    else:  # float32-wide values for a bf16 parameter
        bad = dataclasses.replace(e, bits=e.bits.astype(np.uint32))
    # Valid entries come first: the refusal must still precede every write.
    return StagedDelta(staged.version, staged.base_version, (*good, bad))


@pytest.mark.parametrize("how", ["unknown param", "range", "index", "width"])
def test_delta_failing_validation_changes_nothing(engine: TorchEngine, how: str) -> None:
    staged = staged_v1(engine)
    before = {n: t.clone() for n, t in hf_weights(engine.model).items()}
    digest = engine.digest()
    with pytest.raises(ModelMismatchError):
        engine.apply(_bad(staged, how))
    assert engine.digest() == digest and engine.version == 0
    now = hf_weights(engine.model)
    assert all(torch.equal(before[n].view(torch.int16), now[n].view(torch.int16)) for n in now)


def test_wrong_base_and_wrong_model_are_refused(engine: TorchEngine) -> None:
    staged = staged_v1(engine)
    digest = engine.digest()
    with pytest.raises(ChainError, match="holds version 0"):
        engine.apply(StagedDelta(2, 1, staged.entries))
    # A delta cut for another model shape fails validation while staging.
    other = TorchEngine(TOK)
    other.load(tiny_qwen3(TOK.vocab_size, seed=0, hidden=32, intermediate=96))
    with pytest.raises(FormatError, match="in the model"):
        stage_segments(_segments(engine), 1, other.param_specs())
    # Staged without a model (no check then), it is refused at apply, untouched.
    other_digest = other.digest()
    with pytest.raises(ModelMismatchError):
        other.apply(stage_segments(_segments(engine), 1, None))
    assert other.digest() == other_digest and engine.digest() == digest


def _segments(engine: TorchEngine) -> list[tuple[str, bytes]]:
    new = hf_weights(trainer_step(engine.model, lr=1e-2))
    deltas = extract(engine.fusion_plan(), hf_weights(engine.model), new)
    return [(f"seg-{s.index}", s.data) for s in encode_segments(deltas, 1)]


def test_load_weights_checks_before_copying(engine: TorchEngine) -> None:
    src = tiny_qwen3(TOK.vocab_size, seed=9)
    digest = engine.digest()
    fused = fused_weights(hf_weights(src), fusion_plan_for(src))
    broken = dict(fused)
    broken["model.norm.weight"] = broken["model.norm.weight"].float()
    with pytest.raises(ModelMismatchError, match="model.norm.weight"):
        engine.load_weights(broken)
    with pytest.raises(ModelMismatchError, match="lack"):
        engine.load_weights({"model.norm.weight": fused["model.norm.weight"]})
    assert engine.digest() == digest
    engine.load_weights(hf_weights(src), version=4)  # Hugging Face names work too
    assert engine.digest() == fusion_digest(src) and engine.version == 4


def fusion_digest(model: torch.nn.Module) -> str:
    return weights_digest(hf_weights(model), fusion_plan_for(model))


def test_save_and_load_model(tmp_path: Path) -> None:
    m = tiny_qwen3(TOK.vocab_size, seed=3)
    save_model(m, tmp_path / "ckpt", TOK)
    back = load_model(tmp_path / "ckpt")
    assert fusion_digest(back) == fusion_digest(m)
    assert is_tied(hf_weights(back))
    assert CharTokenizer.load(tmp_path / "ckpt") == TOK


# ---------------------------------------------------------------------------
# warm start


@pytest.mark.slow
def test_warm_start_lifts_sampling_accuracy(engine: TorchEngine) -> None:
    evalset = make_problems(40, seed=99)
    acc0 = evaluate(engine, TOK, evalset, samples=4, max_new_tokens=16, seed=1).accuracy
    before_ptrs, digest = ptrs(engine.model), engine.digest()
    rep = warm_start(engine.model, TOK, make_problems(500, seed=1), steps=80, lr=1e-2, seed=0)
    assert rep.last_loss < rep.first_loss
    # Written back in place: the engine samples from the warmed weights without reloading.
    assert ptrs(engine.model) == before_ptrs and engine.digest() != digest
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in engine.model.parameters())
    acc1 = evaluate(engine, TOK, evalset, samples=4, max_new_tokens=16, seed=1).accuracy
    assert acc1 > acc0 and acc1 >= 0.05, (acc0, acc1)
