"""Extraction, encoding, apply and tree digest of a ~1% delta of an 8B-shaped bf16 model, on the device.

No Hugging Face model is built: the tensors of a Llama-3-8B-shaped model
(hidden 4096, 32 layers, intermediate 14336, 32 heads / 8 kv heads of 128,
vocab 128256, untied head; 8.03 B parameters, 16.1 GB in bf16) are allocated
on the device under their Hugging Face names, filled with random bf16, and
go through the same code as the Trainer's and the engine's weights: the
fusion plan of :func:`aurora_store.codec.extract.plan_of`,
:func:`~aurora_store.codec.extract.extract`, the encoder of
:func:`~aurora_store.format.checkpoint.encode_segments`, and
:func:`~aurora_store.apply.sink.apply_delta` into
:class:`~aurora_store.apply.sink.SplitWeights`.

The delta flips the lowest bit of ``density`` x numel random elements of
each tensor (drawn with repetition, so slightly fewer distinct ones): every
drawn element changes, which is what extraction must find. Timings are the
best of ``reps`` runs after one untimed warm-up (kernel launch set-up,
allocator growth); the device is synchronized before a clock is read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from aurora_store.apply.sink import SplitWeights, apply_delta, tree_weights_digest
from aurora_store.codec.entries import DecodedEntry
from aurora_store.codec.extract import ParamDelta, bits_view, changed_indices, extract, plan_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.format.checkpoint import StagedDelta, encode_segments
from aurora_store.lineage.publish import PublishConfig, estimate_delta_bytes

__all__ = ["LLAMA3_8B", "SMALL", "Shape", "measure", "make_weights"]


@dataclass(frozen=True, slots=True)
class Shape:
    """The tensor shapes of a Llama-style decoder."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape, in a model's own order."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out |= {
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (self.intermediate, h),
                p + "mlp.up_proj.weight": (self.intermediate, h),
                p + "mlp.down_proj.weight": (h, self.intermediate),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        out |= {"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)}
        return out

    def numel(self) -> int:
        return sum(int(np.prod(s)) for s in self.tensors().values())


LLAMA3_8B = Shape(hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
"""Meta-Llama-3-8B's shapes (8,030,261,248 parameters)."""

SMALL = Shape(hidden=256, layers=2, intermediate=896, heads=8, kv_heads=2, vocab=2048)
"""What ``--small`` uses (CI on a CPU): the same structure, 2.75 M parameters."""


def make_weights(shape: Shape, device: torch.device, seed: int, density: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(base, new): random bf16 tensors on ``device`` and a copy with ~``density`` of each changed."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    base: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for name, dims in shape.tensors().items():
        t = torch.randn(dims, dtype=torch.bfloat16, device=device, generator=gen)
        n = t.clone()
        flat = bits_view(n)
        k = max(1, int(flat.numel() * density))
        idx = torch.randint(0, flat.numel(), (k,), device=device, generator=gen)
        flat[idx] = flat[idx] ^ 1  # the lowest mantissa bit: every drawn element changes
        base[name], new[name] = t, n
    return base, new


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> tuple[float, Any]:
    """(best wall milliseconds of ``reps`` runs after one warm-up, the last result)."""
    out = fn()
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best, out


def copy_gbps(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Device memory bandwidth: a device-to-device copy of ``nbytes``, read plus written bytes per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    ms, _ = _best_ms(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / (ms / 1e3) / 1e9


def _device_scan(plan: FusionPlan, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """The on-device part of extraction alone: changed indices and their gathered bits, left on the device."""
    total = 0
    for p in plan:
        for b in p.blocks:
            idx = changed_indices(base[b.source], new[b.source])
            bits_view(new[b.source])[idx]
            bits_view(base[b.source])[idx]
            total += int(idx.numel())
    return total


def _staged(deltas: list[ParamDelta]) -> StagedDelta:
    """The delta as the engine receives it: one ``new``-values entry per changed parameter."""
    entries = tuple(DecodedEntry(d.name, d.spec, 0, d.spec.numel, d.nnz, d.indices, d.new_bits, "new") for d in deltas if d.nnz)
    return StagedDelta(1, 0, entries)


def measure(shape: Shape, device: torch.device, density: float = 0.01, reps: int = 3, seed: int = 0) -> dict[str, Any]:
    """Every figure of the 8B part of the report (keys ending in ``_8b`` whatever ``shape`` is)."""
    numel = shape.numel()
    base, new = make_weights(shape, device, seed, density)
    plan = plan_of(base, tied=False)
    gbps = copy_gbps(device, min(1 << 31, max(1 << 24, numel)))
    # What the Trainer calls: every parameter's changes on the host, ready to encode.
    extract_ms, deltas = _best_ms(lambda: list(extract(plan, base, new)), device, reps)
    scan_ms, nnz_dev = _best_ms(lambda: _device_scan(plan, base, new), device, reps)
    nnz = sum(d.nnz for d in deltas)
    # The truth to check both against: one elementwise comparison on the device.
    expected = sum(int((bits_view(base[n]) != bits_view(new[n])).sum()) for n in base)
    # Encoding runs on the CPU, apart from the scan: the adaptive segment size, as publish_delta picks it.
    segment_bytes = PublishConfig().segment_bytes_for(estimate_delta_bytes(deltas))
    t0 = time.perf_counter()
    params: dict[str, dict[str, object]] = {}
    delta_bytes = sum(len(s.data) for s in encode_segments(deltas, 1, PublishConfig().options, segment_bytes, params))
    encode_ms = (time.perf_counter() - t0) * 1e3
    # Apply into a copy of the base on the device, through the engine's sink.
    target = {n: t.clone() for n, t in base.items()}
    sink = SplitWeights(target, plan)
    staged = _staged(deltas)
    apply_ms, _ = _best_ms(lambda: apply_delta(staged, sink), device, reps)
    exact = all(torch.equal(bits_view(target[n]), bits_view(new[n])) for n in base)
    # The tree digest (FORMAT.md §4.1) of the weights where an engine holds them: what an Actor
    # computes to verify a version. Once, untimed warm-up included: it reads every byte.
    _sync(device)
    t0 = time.perf_counter()
    tree_weights_digest(target, plan)
    digest_ms = (time.perf_counter() - t0) * 1e3
    read_bytes = 2 * 2 * numel  # base and new, bf16
    out = {
        "shape_8b": "llama3-8b" if shape == LLAMA3_8B else "small",
        "params_8b": numel,
        "nnz_8b": nnz,
        "density_8b": round(nnz / numel, 6),
        "device_gbps": round(gbps, 1),
        "extract_ms_8b": round(extract_ms, 2),
        "extract_device_ms_8b": round(scan_ms, 2),
        "extract_floor_ms_8b": round(read_bytes / (gbps * 1e9) * 1e3, 2),
        "extract_target_ms_8b": 50.0,
        "encode_ms_8b": round(encode_ms, 1),
        "delta_bytes_8b": delta_bytes,
        "apply_ms_8b": round(apply_ms, 2),
        "apply_exact_8b": exact,
        "digest_ms_8b": round(digest_ms, 1),
        "extract_exact_8b": nnz == nnz_dev == expected,
    }
    return out
