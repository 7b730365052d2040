"""Synthetic models and RL-like updates, for the demo, tests and benchmarks.

No weights can be downloaded here, so benchmarks use a Qwen3-*shaped* state
dict (Hugging Face names and shapes, random bf16 values) and an update that
behaves like RL post-training: fp32 master weights, an Adam-sized step (lr
about 1e-6, the per-element step size of Adam after its first steps is about
lr), cast back to bf16. Only elements whose master weight crosses a bf16
rounding boundary change, which is what makes deltas ~1% sparse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Qwen3Shape",
    "QWEN3_TINY",
    "QWEN3_0_6B",
    "qwen3_shapes",
    "make_weights",
    "MasterWeights",
]


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


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


#: A few hundred thousand parameters: the demo and unit tests.
QWEN3_TINY = Qwen3Shape(
    vocab=512, hidden=64, layers=2, intermediate=192, heads=4, kv_heads=2, head_dim=16
)
#: Qwen3-0.6B's published dimensions (about 0.6 B parameters, tied embeddings).
QWEN3_0_6B = Qwen3Shape(
    vocab=151936, hidden=1024, layers=28, intermediate=3072, heads=16, kv_heads=8, head_dim=128
)


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


def make_weights(
    s: Qwen3Shape, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """Random weights: N(0, 0.02) matrices, norms near 1."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in qwen3_shapes(s).items():
        if len(shape) == 1:
            t = 1.0 + 0.05 * torch.randn(shape, generator=g)
        else:
            t = 0.02 * torch.randn(shape, generator=g)
        out[name] = t.to(dtype)
    return out


class MasterWeights:
    """fp32 master copy that takes Adam-sized steps and publishes bf16 weights.

    The master starts at the bf16 weights plus a sub-ULP offset (a run in
    steady state is never exactly on a bf16 value), so the very first step
    already changes the fraction of elements an RL run would.
    """

    def __init__(self, weights: dict[str, torch.Tensor], seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.master: dict[str, torch.Tensor] = {}
        for name, t in weights.items():
            m = t.float()
            ulp = _ulp_bf16(m)
            m += (torch.rand(m.shape, generator=self.gen) - 0.5) * ulp
            self.master[name] = m

    def step(self, lr: float = 1e-6, frozen: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """One optimizer step: every element moves by about ``lr``; returns bf16 weights."""
        out: dict[str, torch.Tensor] = {}
        for name, m in self.master.items():
            if name not in frozen:
                # Adam's normalized update m/sqrt(v) is O(1) per element; draw its sign
                # and a magnitude in [0.5, 1.5) so steps are lr-sized, not identical.
                u = torch.rand(m.shape, generator=self.gen)
                step = torch.where(u < 0.5, -(0.5 + 2 * u), (2 * u - 0.5))
                m.add_(step, alpha=lr)
            out[name] = m.to(torch.bfloat16)
        return out


def _ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 values at each element of ``x``."""
    e = torch.frexp(x.abs().clamp_min(1e-30)).exponent.float()
    return torch.pow(2.0, e - 8)
