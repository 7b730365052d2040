"""Synthetic models and RL-like updates, for the demo, tests and benchmarks.

No weights can be downloaded here, so benchmarks use a Qwen3-*shaped* state
dict (Hugging Face names and shapes, random bf16 values; dense Qwen3 or
Qwen3-MoE, :class:`Qwen3MoeShape`) and an update that
behaves like RL post-training: fp32 master weights, an Adam-sized step (lr
about 1e-6, the per-element step size of Adam after its first steps is about
lr), cast back to bf16. Only elements whose master weight crosses a bf16
rounding boundary change, which is what makes deltas ~1% sparse.

Every pass works through the tensors in cache-sized chunks with reused
buffers: the elementwise arithmetic then runs out of cache and the random
number generator sets the pace (a Qwen3-0.6B step takes seconds, not tens of
seconds, on one core).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "Qwen3Shape",
    "Qwen3MoeShape",
    "Shape",
    "QWEN3_TINY",
    "QWEN3_0_6B",
    "QWEN3_1_7B",
    "QWEN3_MOE_TINY",
    "QWEN3_30B_A3B",
    "QWEN3_30B_A3B_MINI",
    "NAMED_SHAPES",
    "qwen3_shapes",
    "qwen3_moe_shapes",
    "param_shapes",
    "shape_named",
    "shape_for_params",
    "make_weights",
    "MasterWeights",
]

#: Elements per chunk of the elementwise passes (1 MiB of fp32 per buffer:
#: the few buffers of a pass stay in cache).
_CHUNK = 1 << 18
_EXP_MASK = 0x7F800000
_MANT_MASK = 0x007FFFFF
_ONE_EXP_STEP = 1 << 23


@dataclass(frozen=True, slots=True)
class Qwen3Shape:
    """The dimensions of a Qwen3-style decoder."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = True

    @property
    def params(self) -> int:
        return sum(_numel(s) for s in qwen3_shapes(self).values())

    @property
    def hf_tensors(self) -> int:
        """How many tensors a Hugging Face checkpoint of these weights holds."""
        return len(qwen3_shapes(self))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: A few hundred thousand parameters: the demo and unit tests.
QWEN3_TINY = Qwen3Shape(vocab=512, hidden=64, layers=2, intermediate=192, heads=4, kv_heads=2, head_dim=16)
#: Qwen3-0.6B's published dimensions (about 0.6 B parameters, tied embeddings).
QWEN3_0_6B = Qwen3Shape(vocab=151936, hidden=1024, layers=28, intermediate=3072, heads=16, kv_heads=8, head_dim=128)
#: Qwen3-1.7B's published dimensions (hidden 2048, 28 layers, tied embeddings).
QWEN3_1_7B = Qwen3Shape(vocab=151936, hidden=2048, layers=28, intermediate=6144, heads=16, kv_heads=8, head_dim=128)


def qwen3_shapes(s: Qwen3Shape) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Qwen3 model."""
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, s.hidden)}
    for i in range(s.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (s.hidden,)
        out[f"{p}.self_attn.q_proj.weight"] = (s.heads * s.head_dim, s.hidden)
        out[f"{p}.self_attn.k_proj.weight"] = (s.kv_heads * s.head_dim, s.hidden)
        out[f"{p}.self_attn.v_proj.weight"] = (s.kv_heads * s.head_dim, s.hidden)
        out[f"{p}.self_attn.o_proj.weight"] = (s.hidden, s.heads * s.head_dim)
        out[f"{p}.self_attn.q_norm.weight"] = (s.head_dim,)
        out[f"{p}.self_attn.k_norm.weight"] = (s.head_dim,)
        out[f"{p}.post_attention_layernorm.weight"] = (s.hidden,)
        out[f"{p}.mlp.gate_proj.weight"] = (s.intermediate, s.hidden)
        out[f"{p}.mlp.up_proj.weight"] = (s.intermediate, s.hidden)
        out[f"{p}.mlp.down_proj.weight"] = (s.hidden, s.intermediate)
    out["model.norm.weight"] = (s.hidden,)
    if not s.tied:
        out["lm_head.weight"] = (s.vocab, s.hidden)
    return out


@dataclass(frozen=True, slots=True)
class Qwen3MoeShape:
    """The dimensions of a Qwen3-MoE decoder: every layer's MLP is ``experts`` routed experts
    (``decoder_sparse_step`` 1, no dense layers, no shared expert), ``active`` of them per token."""

    vocab: int
    hidden: int
    layers: int
    moe_intermediate: int
    experts: int
    active: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False

    @property
    def params(self) -> int:
        return sum(_numel(s) for s in qwen3_moe_shapes(self).values())

    @property
    def hf_tensors(self) -> int:
        """How many tensors a Hugging Face checkpoint of these weights holds (experts one by one: 3 x E per layer)."""
        return len(qwen3_moe_shapes(self, packed=False))


#: Either kind of model.
Shape = Qwen3Shape | Qwen3MoeShape

#: Qwen3-30B-A3B's published dimensions (30.5 B parameters; Qwen/Qwen3-30B-A3B's config.json and
#: transformers' Qwen3MoeConfig, whose defaults are its values but for 24 layers): 48 layers, 128
#: experts of intermediate size 768, 8 active, hidden 2048, 32 query heads and 4 KV heads of 128,
#: vocab 151936, untied. Too large for this machine: the reference :data:`QWEN3_30B_A3B_MINI` is cut from.
QWEN3_30B_A3B = Qwen3MoeShape(
    vocab=151936, hidden=2048, layers=48, moe_intermediate=768, experts=128, active=8, heads=32, kv_heads=4, head_dim=128
)
#: Qwen3-30B-A3B's structure (layers, experts, active experts, heads, head size, vocab) with hidden
#: and expert intermediate sizes divided by 4: about 2.2 B parameters, 4.4 GB in bf16, the same
#: 18,867 checkpoint tensors (what an apply that goes tensor by tensor pays for).
QWEN3_30B_A3B_MINI = dataclasses.replace(QWEN3_30B_A3B, hidden=512, moe_intermediate=192)
#: A few hundred thousand parameters, 8 experts: unit tests (head size 32, which vLLM's CPU attention takes).
QWEN3_MOE_TINY = Qwen3MoeShape(vocab=512, hidden=64, layers=2, moe_intermediate=32, experts=8, active=2, heads=4, kv_heads=2, head_dim=32)

#: The shapes benchmarks take by name (``--shape``).
NAMED_SHAPES: dict[str, Shape] = {
    "qwen3-tiny": QWEN3_TINY,
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-1.7b": QWEN3_1_7B,
    "qwen3-moe-tiny": QWEN3_MOE_TINY,
    "qwen3-30b-a3b-mini": QWEN3_30B_A3B_MINI,
}


def shape_named(name: str) -> Shape:
    """The shape called ``name`` in :data:`NAMED_SHAPES` (ValueError, one line, naming the choices)."""
    try:
        return NAMED_SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(NAMED_SHAPES)}") from None


def qwen3_moe_shapes(s: Qwen3MoeShape, packed: bool = True) -> dict[str, tuple[int, ...]]:
    """Hugging Face parameter names and shapes of a Qwen3-MoE model.

    ``packed``: as transformers 5 holds the experts in memory, per layer
    ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then
    its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]`` (FORMAT.md §2's
    ``w13_weight`` and ``w2_weight`` layouts). Otherwise as a checkpoint names
    them, ``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj`` and
    ``down_proj`` ``[H, I]`` for every expert. The router is ``mlp.gate.weight`` ``[E, H]``.
    """
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.vocab, s.hidden)}
    i_, h = s.moe_intermediate, s.hidden
    for i in range(s.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out[f"{p}.self_attn.q_proj.weight"] = (s.heads * s.head_dim, h)
        out[f"{p}.self_attn.k_proj.weight"] = (s.kv_heads * s.head_dim, h)
        out[f"{p}.self_attn.v_proj.weight"] = (s.kv_heads * s.head_dim, h)
        out[f"{p}.self_attn.o_proj.weight"] = (h, s.heads * s.head_dim)
        out[f"{p}.self_attn.q_norm.weight"] = (s.head_dim,)
        out[f"{p}.self_attn.k_norm.weight"] = (s.head_dim,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        out[f"{p}.mlp.gate.weight"] = (s.experts, h)
        if packed:
            out[f"{p}.mlp.experts.gate_up_proj"] = (s.experts, 2 * i_, h)
            out[f"{p}.mlp.experts.down_proj"] = (s.experts, h, i_)
        else:
            for e in range(s.experts):
                out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (i_, h)
                out[f"{p}.mlp.experts.{e}.up_proj.weight"] = (i_, h)
                out[f"{p}.mlp.experts.{e}.down_proj.weight"] = (h, i_)
    out["model.norm.weight"] = (s.hidden,)
    if not s.tied:
        out["lm_head.weight"] = (s.vocab, s.hidden)
    return out


def param_shapes(s: Shape, packed: bool = True) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of either kind of model (``packed``: see :func:`qwen3_moe_shapes`)."""
    return qwen3_moe_shapes(s, packed) if isinstance(s, Qwen3MoeShape) else qwen3_shapes(s)


def shape_for_params(params: float) -> Qwen3Shape:
    """A Qwen3-shaped model of about ``params`` parameters: the one generator
    of model sizes that every benchmark and the synthetic workload use.

    From about 0.9 B up: Qwen3-1.7B's geometry with as many layers as fit
    (1.0 B: 14 layers, the 311 M-element tied embedding kept). From about
    171 M: Qwen3-0.6B's geometry (hidden 1024, vocab 151936), so
    ``shape_for_params(QWEN3_0_6B.params) == QWEN3_0_6B``. Below: a narrower
    Qwen3-style model (vocab 32 x hidden) with the widest hidden size that
    leaves room for a layer.
    """
    target = float(params)
    if not target > 0 or not math.isfinite(target):
        raise ValueError(f"--params must be positive, got {params}")

    def fit(base: Qwen3Shape) -> Qwen3Shape | None:
        fixed = dataclasses.replace(base, layers=0).params
        per_layer = dataclasses.replace(base, layers=1).params - fixed
        if target < fixed + per_layer:
            return None
        return dataclasses.replace(base, layers=max(1, round((target - fixed) / per_layer)))

    for geometry in ((QWEN3_1_7B,) if target >= 0.9e9 else ()) + (QWEN3_0_6B,):
        got = fit(geometry)
        if got is not None:
            return got
    for hidden in (768, 512, 384, 256, 192, 128, 96, 64):
        small = Qwen3Shape(
            vocab=32 * hidden,
            hidden=hidden,
            layers=1,
            intermediate=3 * hidden,
            heads=max(2, hidden // 64),
            kv_heads=max(1, hidden // 128),
            head_dim=64 if hidden >= 128 else 32,
        )
        got = fit(small)
        if got is not None:
            return got
    return dataclasses.replace(small, layers=1)  # the smallest model there is


def _chunks(n: int) -> range:
    return range(0, n, _CHUNK)


def make_weights(s: Shape, seed: int = 0, dtype: torch.dtype = torch.bfloat16, packed: bool = True) -> dict[str, torch.Tensor]:
    """Random weights: N(0, 0.02) matrices, norms near 1.

    A Qwen3-MoE shape's experts come packed (as transformers 5 holds them);
    with ``packed=False`` the same values under a checkpoint's per-expert
    names, each its own tensor (cut from the packed ones, so both forms of
    one seed are the same weights).
    """
    if not packed and isinstance(s, Qwen3MoeShape):
        return _per_expert(make_weights(s, seed, dtype), s)
    g = torch.Generator().manual_seed(seed)
    buf = torch.empty(_CHUNK)
    out: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(s).items():
        t = torch.empty(shape, dtype=dtype)
        flat = t.view(-1)
        for lo in _chunks(flat.numel()):
            hi = min(flat.numel(), lo + _CHUNK)
            x = buf[: hi - lo]
            if len(shape) == 1:
                torch.randn(hi - lo, generator=g, out=x).mul_(0.05).add_(1.0)
            else:
                torch.randn(hi - lo, generator=g, out=x).mul_(0.02)
            flat[lo:hi].copy_(x)
        out[name] = t
    return out


def _per_expert(w: dict[str, torch.Tensor], s: Qwen3MoeShape) -> dict[str, torch.Tensor]:
    """``w`` with each layer's packed experts replaced by per-expert copies (checkpoint names and order)."""
    out: dict[str, torch.Tensor] = {}
    n = s.moe_intermediate
    for name in qwen3_moe_shapes(s, packed=False):
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = w[name]
            continue
        e, proj = int(tail.split(".")[0]), tail.split(".")[1]
        if proj == "down_proj":
            out[name] = w[f"{head}.mlp.experts.down_proj"][e].clone()
        else:
            rows = slice(0, n) if proj == "gate_proj" else slice(n, 2 * n)
            out[name] = w[f"{head}.mlp.experts.gate_up_proj"][e, rows].clone()
    return out


class MasterWeights:
    """fp32 master copy that takes Adam-sized steps and publishes bf16 weights.

    The master starts at the bf16 weights plus a sub-ULP offset (a run in
    steady state is never exactly on a bf16 value), so the very first step
    already changes the fraction of elements an RL run would. The offset
    stays inside the bf16 rounding cell of the starting value, including at
    exact powers of two, where the spacing below is half the spacing above.
    """

    def __init__(self, weights: dict[str, torch.Tensor], seed: int = 0) -> None:
        # numpy's generator fills float32 buffers about 1.5x faster than torch's.
        self.gen = np.random.default_rng(seed + 1)
        self.master: dict[str, torch.Tensor] = {}
        r_np = np.empty(_CHUNK, dtype=np.float32)
        r = torch.from_numpy(r_np)
        u = torch.empty(_CHUNK)
        for name, t in weights.items():
            m = torch.empty(t.shape, dtype=torch.float32)
            src, flat = t.contiguous().view(-1), m.view(-1)
            for lo in _chunks(flat.numel()):
                hi = min(flat.numel(), lo + _CHUNK)
                mc = flat[lo:hi]
                mc.copy_(src[lo:hi])
                ulp = _ulp_bf16(mc, u[: hi - lo])
                # (rand - 0.5) * ulp: anywhere in the rounding cell of the start.
                self.gen.random(out=r_np[: hi - lo], dtype=np.float32)
                mc.add_(r[: hi - lo].sub_(0.5).mul_(ulp))
            self.master[name] = m

    def step(self, lr: float = 1e-6, frozen: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """One optimizer step: every element moves by about ``lr``; returns bf16 weights."""
        out: dict[str, torch.Tensor] = {}
        u_np = np.empty(_CHUNK, dtype=np.float32)
        u = torch.from_numpy(u_np)
        s = torch.empty(_CHUNK)
        for name, m in self.master.items():
            b = torch.empty(m.shape, dtype=torch.bfloat16)
            flat, bflat = m.view(-1), b.view(-1)
            for lo in _chunks(flat.numel()):
                hi = min(flat.numel(), lo + _CHUNK)
                mc = flat[lo:hi]
                if name not in frozen:
                    # Adam's normalized update m/sqrt(v) is O(1) per element: a
                    # random sign and a magnitude uniform in [0.5, 1.5), so steps
                    # are lr-sized, not identical. v = 2u - 1 is uniform in
                    # [-1, 1); v + copysign(0.5, v) maps it onto that set.
                    self.gen.random(out=u_np[: hi - lo], dtype=np.float32)
                    v = u[: hi - lo].mul_(2).sub_(1)
                    v.add_(torch.sign(v, out=s[: hi - lo]), alpha=0.5)
                    mc.add_(v, alpha=lr)
                bflat[lo:hi].copy_(mc)
            out[name] = b
        return out


def _ulp_bf16(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """bf16 spacing at each (bf16-valued) element of ``x``, written to ``out``.

    The spacing is 2^(e - 7) for ``2^e <= |x| < 2^(e + 1)``, read off the
    exponent bits. At an exact power of two the spacing *below* is half that
    (frexp's mantissa is 0.5 there), so there it is halved: an offset of up
    to half the spacing either way then stays inside the rounding cell.
    Zero (and subnormals) get 0.
    """
    bits = x.view(torch.int32)
    ob = out.view(torch.int32)
    torch.bitwise_and(bits, _EXP_MASK, out=ob)
    # Exact powers of two (no mantissa bits): one exponent step down.
    ob.sub_((bits & _MANT_MASK).eq_(0).to(torch.int32).mul_(_ONE_EXP_STEP)).clamp_min_(0)
    return out.mul_(2.0**-7)
