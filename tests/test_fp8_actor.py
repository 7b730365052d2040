"""FP8 serving in the Actor (issue 27): ``--serve-dtype fp8-block128`` on the torch engine.

The engine keeps the bf16 weights deltas land in and an FP8 copy it
generates from; after every activation the copy must be, byte for byte, the
from-scratch quantization of that version's bf16 weights. Checked here on
the engine directly (staged and prepared deltas, sparse and dense, stacked
experts), then in a real run: the Actor on a real Redis and an S3 server,
the digest of its serving copy compared at every version it activated.
Refusals come last: each one line, nothing applied.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from actor_fixtures import TinyRun, running

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.encode_options import EncodeOptions
from aurora_store.codec.extract import extract
from aurora_store.errors import ConfigError, ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta, encode_segments, stage_segments
from aurora_store.quant import is_quantized
from aurora_store.quant.weights import Fp8Weights
from aurora_store.storage import Store
from aurora_store.testing.servers import RedisServer, S3Server
from aurora_store.testing.wait import wait_until
from workers.actor import Actor, ActorConfig
from workers.common import Endpoints
from workers.engine.factory import make_engine
from workers.engine.torch_config import EngineConfig
from workers.engine.torch_engine import TorchEngine
from workers.engine.torch_fp8 import _exchange
from workers.engine.vllm_config import fp8_refusal
from workers.model import hf_weights, tiny_qwen3
from workers.tokenizer import CharTokenizer

TOK = CharTokenizer()
FP8 = EngineConfig(serve_dtype="fp8-block128")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _scratch(weights: dict[str, torch.Tensor]) -> Fp8Weights:
    """The from-scratch quantization of ``weights`` (every quantized one, Hugging Face names)."""
    return Fp8Weights.of({n: t.contiguous() for n, t in weights.items()})


def _moved(weights: dict[str, torch.Tensor], density: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of ``weights`` with about ``density`` of each tensor's elements moved (one being each quantized tensor's largest)."""
    g = torch.Generator().manual_seed(seed)
    out = {n: t.clone() for n, t in weights.items() if n != "lm_head.weight"}
    for name, t in out.items():
        flat = t.view(-1)
        k = max(1, int(flat.numel() * density))
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        flat[idx] = (flat[idx].float() + 0.02 * torch.randn(k, generator=g)).to(flat.dtype)
        if is_quantized(name, tuple(t.shape)):
            top = int(flat.float().abs().argmax())
            flat[top] = flat[top] * (0.25 if seed % 2 else 3.0)  # the block's largest shrinks, or grows past the rest
    if "lm_head.weight" in weights:
        out["lm_head.weight"] = (
            out["model.embed_tokens.weight"]
            if weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
            else weights["lm_head.weight"].clone()
        )
    return out


def _delta(engine: TorchEngine, new: dict[str, torch.Tensor], version: int, mode: str | None = None) -> StagedDelta:
    """The delta from the engine's weights to ``new``; ``mode``: its values all ``new`` or all ``xor`` (default: the encoder's pick)."""
    plan = engine.fusion_plan()
    base = {n: t.clone() for n, t in hf_weights(engine.model).items()}
    opts = EncodeOptions(value_modes=(mode,)) if mode else None
    segs = [(f"seg-{s.index}", s.data) for s in encode_segments(extract(plan, base, new), version, opts, segment_bytes=1 << 14)]
    return stage_segments(segs, version, engine.param_specs())


def _engine(model: torch.nn.Module, config: EngineConfig = FP8) -> TorchEngine:
    e = TorchEngine(TOK, config)
    e.load(copy.deepcopy(model), version=0)
    return e


def _dequantized(copy_: Fp8Weights, name: str) -> torch.Tensor:
    """Each FP8 value times its block's scale, computed here with numpy (independently of the engine)."""
    blk = copy_.blocks[name]
    q = torch.from_numpy(blk.q.copy()).view(torch.float8_e4m3fn).float().numpy()
    s = np.kron(blk.scale_inv, np.ones((128, 128), np.float32))[: q.shape[0], : q.shape[1]]
    return torch.from_numpy(q * s).to(torch.bfloat16)


def test_generation_reads_the_fp8_copy_and_deltas_keep_it_the_from_scratch_quantization() -> None:
    model = tiny_qwen3(TOK.vocab_size, seed=3)
    e = _engine(model)
    plain = _engine(model, EngineConfig())
    ids = torch.tensor([TOK.encode("12+34=", bos=True)])
    # What the engine computes equals a bf16 model holding the dequantized copy, not the bf16 weights.
    ref = copy.deepcopy(model)
    want = _scratch(hf_weights(model))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in want:
                p.copy_(_dequantized(want, name))
    with torch.inference_mode():
        got, bf16, deq = e.model(ids).logits, plain.model(ids).logits, ref(ids).logits
    assert torch.equal(got, deq) and not torch.equal(got, bf16)
    assert e.serving_digest() == want.digest() != plain.serving_digest()
    weights = hf_weights(model)
    for v, density in enumerate((0.01, 0.6, 0.002, 0.3), start=1):  # sparse and dense entries
        weights = _moved(weights, density, seed=v)
        staged = _delta(e, weights, v, ("xor", "new", None, None)[v - 1])
        e.apply(e.prepare(staged) if v % 2 else staged)  # prepared at the safe point, or staged
        assert e.version == v and e.digest() == weights_digest(weights, e.fusion_plan())
        assert e.serving_digest() == _scratch(weights).digest(), f"v{v}"
    gen = e.generate([TOK.encode("7+1=", bos=True)], group=2, max_new_tokens=4, seed=5)
    assert gen.new_tokens == 8
    # A full version loaded in place: quantized again from scratch.
    e.load_weights({n: t for n, t in hf_weights(model).items()}, version=0)
    assert e.serving_digest() == want.digest()


def test_stacked_experts_are_quantized_per_expert_and_kept_current() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    def moe(inter: int) -> torch.nn.Module:
        cfg = AutoConfig.for_model(
            "qwen3_moe",
            vocab_size=TOK.vocab_size,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=3,
            num_experts_per_tok=2,
            moe_intermediate_size=inter,
            intermediate_size=64,
            decoder_sparse_step=1,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).eval().requires_grad_(False)

    model = moe(128)
    e = _engine(model)
    stacked = [n for n in e._fp8.names if n.endswith("experts.gate_up_proj")] if e._fp8 else []
    assert stacked and e._fp8 is not None and e._fp8.copy.blocks[stacked[0]].scale_inv.shape == (3, 2, 1)
    weights = hf_weights(model)
    for v in (1, 2):
        weights = _moved(weights, 0.05, seed=v)
        e.apply(e.prepare(_delta(e, weights, v)))
        assert e.serving_digest() == _scratch(weights).digest()
    e.generate([TOK.encode("1+1=", bos=True)], group=1, max_new_tokens=3, seed=0)
    # Gate and up rows of 24 each: a 128-row block would straddle them.
    with pytest.raises(ModelMismatchError, match="straddle"):
        TorchEngine(TOK, FP8).load(moe(24))


@pytest.mark.parametrize("mode", ["new", "xor"])
def test_a_delta_putting_a_nan_into_a_quantized_weight_is_refused_with_nothing_written(mode: str) -> None:
    model = tiny_qwen3(TOK.vocab_size, seed=4)
    e = _engine(model)
    before, serving = e.digest(), e.serving_digest()
    weights = _moved(hf_weights(model), 0.01, seed=2)
    weights["model.layers.1.mlp.down_proj.weight"].view(-1)[5] = float("nan")  # after other quantized weights' changes
    with pytest.raises(ModelMismatchError, match="infinite or NaN"):
        e.apply(e.prepare(_delta(e, weights, 1, mode)))
    assert (e.version, e.digest(), e.serving_digest()) == (0, before, serving)


@pytest.mark.parametrize("xor", [False, True])
def test_the_compiled_exchange_and_its_numpy_twin_agree(xor: bool) -> None:
    rng = np.random.default_rng(int(xor))
    flat = rng.integers(0, 1 << 16, 5000, dtype=np.uint16)
    idx = np.sort(rng.choice(5000, 700, replace=False)).astype(np.int32)
    bits = rng.integers(0, 1 << 16, 700, dtype=np.uint16)
    got = []
    for jit in (True, False):
        f, old = flat.copy(), np.empty(700, np.uint16)
        _exchange(f, idx, bits, xor, old, jit)
        got.append((f, old))
    want = flat.copy()
    want[idx] = flat[idx] ^ bits if xor else bits
    for f, old in got:
        assert np.array_equal(old, flat[idx]) and np.array_equal(f, want)


def test_refusals_are_one_line_each(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="serves bf16 or fp8-block128"):
        EngineConfig(serve_dtype="int4")
    with pytest.raises(ConfigError, match="bf16 weights held on cpu"):
        EngineConfig(serve_dtype="fp8-block128", dtype="float32")
    with pytest.raises(ConfigError, match="vllm engine cannot serve"):
        make_engine("vllm", TOK, serve_dtype="fp8-block128")
    assert cast(TorchEngine, make_engine("torch", TOK, serve_dtype="fp8-block128")).config.serve_dtype == "fp8-block128"
    # The probe reads the processor's flags: with AMX the reason given is another one.
    (tmp_path / "amx").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile amx_int8\n")
    (tmp_path / "none").write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert "need AMX (amx_tile), which this processor lacks" in fp8_refusal("fp8-block128", str(tmp_path / "none"))
    assert "does not keep an FP8 copy current in its workers yet (on any device: not built)" in fp8_refusal(
        "fp8-block128", str(tmp_path / "amx")
    )
    model = tiny_qwen3(TOK.vocab_size, seed=5)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.data = model.model.layers[0].mlp.up_proj.weight.data.to(torch.float8_e4m3fn)
    e = TorchEngine(TOK, FP8)
    with pytest.raises(ModelMismatchError, match="quantized checkpoint.*must be the bf16 weights"):
        e.load(model)
    with pytest.raises(RuntimeError, match="no model loaded"):
        e.digest()


def _cfg(**kw: Any) -> ActorConfig:
    base: dict[str, Any] = {"actor_id": "a", "claim": 2, "heartbeat_s": 0.2, "run_poll_s": 0.05, "stage_block_ms": 100}
    return ActorConfig(**(base | kw))


class _Recording(TorchEngine):
    """The FP8 engine, noting the digest of its serving copy right after each activation (still under its lock)."""

    def __init__(self) -> None:
        super().__init__(TOK, FP8)
        self.serving: dict[int, str] = {}

    def apply(self, staged: Any) -> None:
        with self._lock:
            super().apply(staged)
            assert self.version is not None
            self.serving[self.version] = self.serving_digest()


@pytest.mark.server
def test_the_actor_s_serving_copy_is_the_from_scratch_quantization_at_every_activated_version(
    s3_store: Store, s3_server: S3Server, redis_server: RedisServer, run_name: str
) -> None:
    run = TinyRun(s3_store, redis_server.url, run_name)
    run.record_states = True
    run.start()
    engine = _Recording()
    engine.load(copy.deepcopy(run.model))
    a = Actor.from_endpoints(
        Endpoints(s3_store.url, redis_server.url, run_name, s3_server.storage_options()), _cfg(serve_dtype="fp8-block128"), engine=engine
    )
    with running(a) as r:
        wait_until(lambda: a.holding.bootstrapped, "bootstrap")
        for v in range(1, 4):  # a step on each version: the Actor activates it and generates from its FP8 copy
            run.step(1, density=0.02 * v)
            run.open_step(v, v, prompts=2, group=1)
            wait_until(lambda v=v: run.settled(v) == 2, f"the step on v{v} settled")  # type: ignore[misc]
        assert r["error"] is None
    assert sorted(engine.serving) == [1, 2, 3]
    for v, got in engine.serving.items():
        assert got == _scratch(run.weights[v]).digest(), f"v{v}"
    assert engine.digest() == run.digest(3)  # the state chain and the held weights stay bf16
    run.close()


def test_a_bf16_engine_taking_a_model_over_from_an_fp8_one_generates_from_bf16_again() -> None:
    model = tiny_qwen3(TOK.vocab_size, seed=6)
    want = copy.deepcopy(model)
    ids = torch.tensor([TOK.encode("3+4=", bos=True)])
    TorchEngine(TOK, FP8).load(model)
    with torch.inference_mode():
        fp8 = model(ids).logits
    TorchEngine(TOK).load(model)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, want(ids).logits) and not torch.equal(fp8, want(ids).logits)


@pytest.mark.slow
def test_bench_activate_times_the_fp8_safe_point_beside_the_bf16_one() -> None:
    from aurora_tools.bench.activate import measure

    r = measure(params=5e6, reps=1, serve_dtype="fp8-block128", swap_max_bytes=0)
    assert r["exact"] is True  # the FP8 copy after the timed safe point is the from-scratch quantization
    assert r["safe_point_s_fp8"] > 0 and r["fp8_over_bf16"] == pytest.approx(
        r["safe_point_s_fp8"] / r["safe_point_s"], rel=2e-2
    )  # times rounded to 10 us
    assert len(r["safe_point_runs_s_fp8"]) == 1
