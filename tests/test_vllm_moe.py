"""The vLLM engine on a mixture-of-experts model: deltas in place through vLLM's padded, packed experts.

vLLM's CPU build pads each rank's expert intermediate size up to a multiple
of 32 and prepacks every expert into its kernel's tile order after loading
(workers/engine/vllm_moe.py). The tiny Qwen3-MoE here has an intermediate
size of 40, so both happen. The check that matters: after a chain of deltas
the bytes vLLM holds (padded, packed, per rank) equal those of vLLM's own
load of the same version, and the weights read back in FORMAT.md §2's form
equal the Trainer's. Slow (vLLM starts in 20-60 s); the two-rank tests are
``long``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from vllm_fixtures import CFG, TOK, needs_vllm

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.entries import DecodedEntry, ParamSpec
from aurora_store.codec.extract import extract, fuse_weights, plan_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.lineage.fetch import fetch_delta
from aurora_store.lineage.publish import publish_delta, publish_snapshot
from aurora_store.storage import Store, open_store

pytestmark = [pytest.mark.slow]

VERSIONS = 3
FAMILY = "qwen3_moe"
EXPERTS, MOE_INTERMEDIATE, HIDDEN = 4, 40, 64
"""40 is no multiple of 32 (vLLM pads it to 64), nor is 20 (its half per rank at tp=2)."""


@dataclass
class MoeRun:
    store: Store
    config: dict[str, object]
    plan: FusionPlan
    digests: dict[int, str]
    states: dict[int, str]
    fused: dict[int, dict[str, torch.Tensor]]
    """FORMAT.md §2 weights of each version."""


def _config(family: str = FAMILY) -> dict[str, object]:
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=TOK.vocab_size,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention: 32 or more
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        cfg = MixtralConfig(**common, intermediate_size=MOE_INTERMEDIATE, num_local_experts=EXPERTS, architectures=["MixtralForCausalLM"])
    else:
        cfg = Qwen3MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=MOE_INTERMEDIATE,
            num_experts=EXPERTS,
            architectures=["Qwen3MoeForCausalLM"],
        )
    return json.loads(cfg.to_json_string())


def _nudged(w: dict[str, torch.Tensor], seed: int, p: float = 0.03) -> dict[str, torch.Tensor]:
    """An RL-like step: a fraction ``p`` of the elements move by one unit in the last place."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, t in w.items():
        bits = t.clone().view(torch.int16)
        hit = torch.rand(bits.shape, generator=g) < p
        step = torch.where(torch.rand(bits.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
        bits[hit] += step[hit]
        out[n] = bits.view(torch.bfloat16)
    return out


def make_moe_run(root: Path, family: str = FAMILY) -> MoeRun:
    """Snapshot v0 and deltas 1..VERSIONS of a tiny Qwen3-MoE (or Mixtral), as transformers holds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = _config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).to(torch.bfloat16)
    hf = {n: t.detach().clone() for n, t in model.state_dict().items()}
    plan = plan_of(hf, tied=False, family=family)
    assert f"model.layers.0.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}.experts.w13_weight" in plan.specs()
    root.mkdir(parents=True)
    store = open_store(f"file://{root}")
    base = fuse_weights(hf, plan)
    snap = publish_snapshot(store, "moe", 0, base, None, CFG)
    fplan = FusionPlan.from_specs({n: plan.specs()[n] for n in base})
    run = MoeRun(store, config, fplan, {0: weights_digest(base, fplan)}, {0: snap.state}, {0: base})
    for v in range(1, VERSIONS + 1):
        new = _nudged(base, seed=v)
        m = publish_delta(store, "moe", v, extract(fplan, base, new), run.states[v - 1], CFG)
        run.digests[v], run.states[v], run.fused[v], base = weights_digest(new, fplan), m.state, new, new
    return run


@pytest.fixture(scope="module", params=[FAMILY, "mixtral"])
def moe_run(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> MoeRun:
    return make_moe_run(tmp_path_factory.mktemp("moe") / "run", request.param)


def _engine(**overrides: object) -> Iterator[object]:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed: pip install 'aurora-store[vllm]'")
    from workers.engine.vllm_engine import VLLMConfig, VLLMEngine

    return VLLMEngine(TOK, VLLMConfig(kv_cache_mib=64, **overrides))  # type: ignore[arg-type]


def _raw(engine: object) -> list[dict[str, str]]:
    return [p["raw"] for p in engine.probe(raw=True)]  # type: ignore[attr-defined]


def _chain_then_reload(e: object, run: MoeRun, shipped_last: bool, generate: bool = True) -> None:
    """Bootstrap v0, deltas to VERSIONS (the last one decoded here and shipped, when asked), then
    vLLM's own load of VERSIONS: the bytes held must not move, and both read back as the Trainer's."""
    assert e.bootstrap_from_store(run.store, {}, 0, 2) == (0, run.states[0])  # type: ignore[attr-defined]
    assert e.verify_digest(run.digests[0]) == run.digests[0]  # type: ignore[attr-defined]
    ptrs = [p["ptrs"] for p in e.probe()]  # type: ignore[attr-defined]
    for v in range(1, VERSIONS + 1):
        if shipped_last and v == VERSIONS:
            _, staged = fetch_delta(run.store, v, e.param_specs(), expect_base_state=run.states[v - 1])  # type: ignore[attr-defined]
        else:
            _, staged = e.stage_from_store(run.store, {}, v, run.states[v - 1], 2)  # type: ignore[attr-defined]
        e.apply(staged)  # type: ignore[attr-defined]
        assert e.verify_digest(run.digests[v]) == run.digests[v], f"v{v} read back differs from the Trainer's"
    after_chain = _raw(e)
    # Version 0's whole weights, through the engine's own map (labelled VERSIONS: what reload reads) ...
    e.load_weights(run.fused[0], version=VERSIONS)  # type: ignore[attr-defined]
    assert e.verify_digest(run.digests[0]) == run.digests[0]  # type: ignore[attr-defined]
    assert _raw(e) != after_chain
    # ... then vLLM's own load of VERSIONS (its loaders, padding and packing) writes every expert back.
    e.reload_seconds(run.store, {})  # type: ignore[attr-defined]
    assert _raw(e) == after_chain, "vLLM's own load of the same version holds other bytes"
    assert e.verify_digest(run.digests[VERSIONS]) == run.digests[VERSIONS]
    assert [p["ptrs"] for p in e.probe()] == ptrs  # type: ignore[attr-defined]
    if generate:
        g = e.generate([[1, 5, 6]], group=1, max_new_tokens=3, seed=1)  # type: ignore[attr-defined]
        assert g.new_tokens > 0


@needs_vllm
def test_vllm_moe_deltas_in_place_equal_vllms_own_load(moe_run: MoeRun) -> None:
    e = _engine()
    try:
        e.load(moe_run.config)  # type: ignore[attr-defined]
        specs = e.param_specs()  # type: ignore[attr-defined]
        assert specs == moe_run.plan.specs()  # FORMAT names and shapes: no padding, no routed_experts
        experts = next(
            n for n in specs if n.endswith("layers.1.mlp.experts.w13_weight") or n.endswith("layers.1.block_sparse_moe.experts.w13_weight")
        )
        assert specs[experts].shape == (EXPERTS, 2 * MOE_INTERMEDIATE, HIDDEN)
        _chain_then_reload(e, moe_run, shipped_last=True)
        # An expert tensor of the wrong E (beside a fitting entry): one line, nothing applied.
        raw = _raw(e)
        fits = DecodedEntry("model.norm.weight", specs["model.norm.weight"], 0, 1, 1, np.array([0]), np.array([7], np.uint16), "new")
        wrong = ParamSpec((EXPERTS + 1, 2 * MOE_INTERMEDIATE, HIDDEN), "bfloat16")
        bad = DecodedEntry(experts, wrong, 0, 1, 1, np.array([0]), np.array([7], np.uint16), "new")
        with pytest.raises(ModelMismatchError) as info:
            e.apply(StagedDelta(VERSIONS + 1, VERSIONS, (fits, bad)))  # type: ignore[attr-defined]
        assert "\n" not in str(info.value) and f"{EXPERTS + 1} experts" in str(info.value)
        assert _raw(e) == raw and e.version == VERSIONS  # type: ignore[attr-defined]
    finally:
        e.close()  # type: ignore[attr-defined]


@needs_vllm
@pytest.mark.long
@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_vllm_moe_two_ranks_write_their_slices(tmp_path: Path, ep: bool) -> None:
    """tp=2: each rank holds every expert's half of the intermediate size (20, padded to 32);
    expert parallelism: each rank holds two whole experts (40, padded to 64). vLLM 0.32's CPU build
    crashes generating with expert parallelism (a worker segfaults, Aurora or not): weights only there."""
    run = make_moe_run(tmp_path / "run")
    e = _engine(tensor_parallel_size=2, expert_parallel=ep)
    try:
        e.load(run.config)  # type: ignore[attr-defined]
        _chain_then_reload(e, run, shipped_last=False, generate=not ep)
    finally:
        e.close()  # type: ignore[attr-defined]
    shutil.rmtree(tmp_path, ignore_errors=True)


# ---------------------------------------------------------------------------
# the kernel probe and the refusals, without starting vLLM


class _PadAndTranspose:
    """A kernel like vLLM's CPU one in kind: pads the intermediate size to 32, then transposes each expert."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        s, two_i, h = w13.shape
        i, ip = two_i // 2, -(-two_i // 64) * 32
        p13 = w13.new_zeros(s, 2 * ip, h)
        p13[:, :i], p13[:, ip : ip + i] = w13[:, :i], w13[:, i:]
        p2 = w2.new_zeros(s, h, ip)
        p2[:, :, :i] = w2
        layer.w13_weight = torch.nn.Parameter(p13.transpose(1, 2).contiguous().view(p13.shape), requires_grad=False)
        layer.w2_weight = torch.nn.Parameter(p2.transpose(1, 2).contiguous().view(p2.shape), requires_grad=False)


class _Rescales(_PadAndTranspose):
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.w2_weight.data.mul_(2)


def test_probe_follows_a_kernels_padding_and_packing_element_by_element() -> None:
    from workers.engine.vllm_moe import PackedExperts, _probe

    il, h = 20, 64
    probed = _probe(_PadAndTranspose(), il, h, torch.bfloat16, "model.layers.0.mlp.experts")
    g = torch.Generator().manual_seed(0)
    for kind, created in (("w13", (3, 2 * il, h)), ("w2", (3, h, il))):
        shape, pack = probed[kind]
        assert shape == ((64, h) if kind == "w13" else (h, 32))
        lay = PackedExperts(kind, 3, il, h, (0, 1, 2), 1, 0, 32, h, "model.layers.0.mlp.experts", pack)
        full = torch.randn(lay.global_shape, generator=g).to(torch.bfloat16)
        layer = torch.nn.Module()
        layer.register_parameter(
            "w13_weight", torch.nn.Parameter(full if kind == "w13" else torch.zeros(3, 2 * il, h, dtype=torch.bfloat16))
        )
        layer.register_parameter("w2_weight", torch.nn.Parameter(full if kind == "w2" else torch.zeros(3, h, il, dtype=torch.bfloat16)))
        _PadAndTranspose().process_weights_after_loading(layer)
        kernel_made = getattr(layer, f"{kind}_weight").data
        assert tuple(created) == tuple(full.shape)
        assert torch.equal(lay.shard(full).view(torch.int16), kernel_made.view(torch.int16)), kind  # a whole load
        out = torch.zeros_like(full)
        lay.place(out, kernel_made)
        assert torch.equal(out, full), kind  # read back in FORMAT.md's form
        # A sparse write: each chosen element lands where the kernel put it.
        idx = torch.randperm(full.numel(), generator=g)[:50].sort().values.numpy()
        sel, phys = lay.localize_np(idx)
        assert np.array_equal(np.sort(sel), np.arange(50)) and np.all(np.diff(phys) > 0)
        assert torch.equal(kernel_made.reshape(-1)[torch.from_numpy(phys)], full.reshape(-1)[torch.from_numpy(idx[sel])])


def test_a_kernel_that_changes_values_or_a_layout_not_known_is_refused_in_one_line() -> None:
    from types import SimpleNamespace

    from workers.engine.vllm_moe import _kernel, _probe

    with pytest.raises(ModelMismatchError) as info:
        _probe(_Rescales(), 20, 64, torch.bfloat16, "model.layers.3.mlp.experts")
    assert "model.layers.3.mlp.experts" in str(info.value) and "\n" not in str(info.value)

    class Fp8MoEMethod:  # a quantized method's name, as vLLM's
        pass

    class UnquantizedFusedMoEMethod:
        unquantized_backend = SimpleNamespace(name="FLASHINFER_TRTLLM")
        moe_kernel = None

    def layer(qm: object, eplb: bool = False) -> object:
        return SimpleNamespace(quant_method=qm, moe_config=SimpleNamespace(moe_parallel_config=SimpleNamespace(enable_eplb=eplb)))

    for stand_in, setting in (
        (layer(Fp8MoEMethod()), "quantization"),
        (layer(UnquantizedFusedMoEMethod(), eplb=True), "enable_eplb"),
        (layer(UnquantizedFusedMoEMethod()), "moe_backend"),
    ):
        with pytest.raises(ModelMismatchError) as info:
            _kernel(stand_in, "model.layers.1.block_sparse_moe.experts")
        msg = str(info.value)
        assert msg.startswith("model.layers.1.block_sparse_moe.experts: ") and setting in msg and "\n" not in msg
