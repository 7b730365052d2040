"""The torch engine on mixture-of-experts models: deltas under FORMAT.md §2's expert names, applied in place.

Tiny Qwen3-MoE and Mixtral models are built straight from transformers'
configs (transformers 5 holds each layer's experts packed, ``gate_up_proj``
``[E, 2I, H]`` gate rows first and ``down_proj`` ``[E, H, I]``: the layout of
``w13_weight`` and ``w2_weight``). A Trainer's copy takes RL-sized steps
(most changed elements move by one bf16 unit in the last place, one
expert's rows all at once); each step is a real delta (extracted, encoded
into segments, staged against the engine's specs) that the engine applies
through the sink, through a prepared delta, or (swap activation) into its
spare. After the chain the engine's weights are bit-identical to a fresh
``from_pretrained`` of the same version and to a snapshot loaded by name.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.entries import DecodedEntry, ParamSpec
from aurora_store.codec.extract import extract, fuse_weights
from aurora_store.errors import ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta, encode_segments, stage_segments
from workers.engine.torch_engine import EngineConfig, TorchEngine
from workers.model import hf_weights, load_model
from workers.tokenizer import CharTokenizer

TOK = CharTokenizer()
EXPERTS, INTER, HIDDEN = 4, 24, 32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_moe(family: str, seed: int, experts: int = EXPERTS) -> torch.nn.Module:
    """A two-layer ``family`` model (qwen3_moe or mixtral), seeded, in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    moe: dict[str, int] = {"num_experts_per_tok": 2}
    if family == "mixtral":
        moe |= {"num_local_experts": experts, "intermediate_size": INTER}
    else:
        moe |= {"num_experts": experts, "moe_intermediate_size": INTER, "decoder_sparse_step": 1, "intermediate_size": 2 * INTER}
    cfg = AutoConfig.for_model(
        family,
        vocab_size=TOK.vocab_size,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **moe,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg)
    torch.nn.Module.to(model, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def prefix(family: str, layer: int) -> str:
    return f"model.layers.{layer}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}.experts."


def rl_step(model: torch.nn.Module, rng: np.random.Generator, version: int) -> None:
    """Move about 2% of every parameter's elements by one bf16 ulp, and all of one expert's gate rows (in place)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.data.view(-1).view(torch.int16)
            pos = torch.from_numpy(np.flatnonzero(rng.random(flat.numel()) < 0.02))
            flat[pos] += 1
            if name.endswith("layers.1.mlp.experts.gate_up_proj"):
                e = version % EXPERTS
                p.data[e, :INTER].view(torch.int16).add_(1)  # a dense run: every gate row of expert e


def staged_step(engine: TorchEngine, trainer: torch.nn.Module, rng: np.random.Generator, version: int) -> StagedDelta:
    base = {n: t.clone() for n, t in hf_weights(trainer).items()}
    rl_step(trainer, rng, version)
    deltas = extract(engine.fusion_plan(), base, hf_weights(trainer))
    segs = [(f"seg-{s.index}", s.data) for s in encode_segments(deltas, version, segment_bytes=8 << 10)]
    return stage_segments(segs, version, engine.param_specs())


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def ptrs(model: torch.nn.Module) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_engine_names_packed_experts_as_format_tensors(family: str) -> None:
    engine = TorchEngine(TOK)
    model = tiny_moe(family, seed=0)
    engine.load(model, version=0)
    plan = engine.fusion_plan()
    for layer in range(2):
        p = prefix(family, layer)
        w13, w2 = plan.params[p + "w13_weight"], plan.params[p + "w2_weight"]
        assert w13.spec == ParamSpec((EXPERTS, 2 * INTER, HIDDEN), "bfloat16")
        assert w2.spec == ParamSpec((EXPERTS, HIDDEN, INTER), "bfloat16")
        # One block each: the model's own packed parameter, so a delta is one scatter into it.
        assert [b.source for b in w13.blocks] == [f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        assert [b.source for b in w2.blocks] == [f"model.layers.{layer}.mlp.experts.down_proj"]
        router = f"model.layers.{layer}.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}.gate.weight"
        assert plan.params[router].spec == ParamSpec((EXPERTS, HIDDEN), "bfloat16")
    assert not any(n.endswith(("gate_up_proj", "down_proj")) and ".experts." in n for n in plan.params)
    # The digest covers the format tensors: equal to a holder of the fused (FORMAT) tensors.
    assert engine.digest() == weights_digest(fuse_weights(hf_weights(model), plan))


@pytest.mark.parametrize("activation", ["in-place", "swap"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_chain_of_deltas_equals_a_fresh_load(family: str, activation: str, tmp_path: Path) -> None:
    trainer = tiny_moe(family, seed=0)
    engine = TorchEngine(TOK, EngineConfig(activation=activation))
    engine.load(copy.deepcopy(trainer), version=0)
    model = engine.model
    before = ptrs(model)
    rng = np.random.default_rng(7)
    for v in range(1, 5):
        staged = staged_step(engine, trainer, rng, v)
        touched = {e.param for e in staged.entries}
        assert prefix(family, 1) + "w13_weight" in touched and prefix(family, 0) + "w2_weight" in touched
        if v == 1:
            engine.apply(staged)  # the sink: split over the plan's blocks, one scatter per packed tensor
        else:
            prepared = engine.prepare(staged)
            expert_writes = [w for w in prepared.sparse if w.source.endswith(("experts.gate_up_proj", "experts.down_proj"))]
            sources = [(w.source, w.xor) for w in expert_writes]
            assert len(sources) == len(set(sources)) >= 4  # one sorted write per packed tensor (and mode)
            engine.apply(prepared)
        assert engine.version == v
        if activation == "in-place":
            assert ptrs(model) == before  # written in place: no parameter reallocated
        assert engine.digest() == weights_digest(hf_weights(trainer), engine.fusion_plan())

    # A fresh load of the same version: save_pretrained writes experts one by one, from_pretrained packs them.
    trainer.save_pretrained(tmp_path / "v4")
    fresh = TorchEngine(TOK)
    fresh.load(load_model(tmp_path / "v4"), version=4)
    held, want = hf_weights(engine.model), hf_weights(fresh.model)
    assert held.keys() == want.keys()
    assert all(bits_equal(held[n], want[n]) for n in held), [n for n in held if not bits_equal(held[n], want[n])][:3]
    assert engine.digest() == fresh.digest()
    # And a snapshot under the format's names, loaded into another model of the same shape.
    late = TorchEngine(TOK)
    late.load(tiny_moe(family, seed=5))
    snapshot = fuse_weights(hf_weights(trainer), engine.fusion_plan())
    assert prefix(family, 0) + "w13_weight" in snapshot
    late.load_weights(snapshot, version=4)
    assert late.digest() == engine.digest()
    # The patched experts still run.
    gen = engine.generate([TOK.encode("12+3=", bos=True)], group=2, max_new_tokens=4, seed=1)
    assert len(gen.completions[0]) == 2


@pytest.mark.parametrize("wrong", ["experts", "intermediate", "hidden"])
def test_delta_with_wrong_expert_sizes_is_refused_whole(wrong: str) -> None:
    engine = TorchEngine(TOK)
    engine.load(tiny_moe("qwen3_moe", seed=0), version=0)
    trainer = copy.deepcopy(engine.model)
    good = staged_step(engine, trainer, np.random.default_rng(1), 1)
    e, i, h = EXPERTS + (wrong == "experts"), INTER + 8 * (wrong == "intermediate"), HIDDEN + (wrong == "hidden")
    name = prefix("qwen3_moe", 0) + "w13_weight"
    spec = ParamSpec((e, 2 * i, h), "bfloat16")
    idx = np.array([3, 17, spec.numel - 1], dtype=np.int64)
    bad = DecodedEntry(name, spec, 0, spec.numel, 3, idx, np.ones(3, np.uint16), "xor")
    staged = StagedDelta(1, 0, (*good.entries, bad))  # valid entries first: still nothing may be written
    digest = engine.digest()
    weights = {n: t.clone() for n, t in hf_weights(engine.model).items()}
    for attempt in (engine.prepare, engine.apply):
        with pytest.raises(ModelMismatchError) as info:
            attempt(staged)
        msg = str(info.value)
        assert "\n" not in msg and name in msg
        assert f"{e} experts of intermediate size {i} and hidden size {h} in the delta" in msg
        assert f"the model {EXPERTS} experts of intermediate size {INTER} and hidden size {HIDDEN}" in msg
    assert engine.digest() == digest and engine.version == 0
    now = hf_weights(engine.model)
    assert all(bits_equal(weights[n], now[n]) for n in now)


def test_experts_in_another_layout_are_refused_at_load() -> None:
    model = tiny_moe("qwen3_moe", seed=0)
    model.model.layers[1].mlp.experts.is_transposed = True  # what gpt-oss-style experts hold
    with pytest.raises(ModelMismatchError, match=r"^model\.layers\.1\.mlp\.experts: .*is_transposed=True") as info:
        TorchEngine(TOK).load(model)
    assert "\n" not in str(info.value)
