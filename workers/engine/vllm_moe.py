"""Fused experts inside vLLM's workers: FORMAT.md §2 names, and positions through vLLM's padding and kernel packing.

vLLM 0.32 holds a mixture-of-experts layer's routed experts one module
deeper than the format names them (``…experts.routed_experts.w13_weight``
for ``…experts.w13_weight``) and, on CPU, rearranges them after loading:
``CPUUnquantizedExperts.process_weights_after_loading``
(``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``) pads each
rank's intermediate size up to a multiple of 32 (gate rows at row 0, up
rows at row ``Ip``) and prepacks every expert into its kernel's tile order.
A delta written at the format's flat indices would land in the wrong
elements, so each rank maps them: the global index to its unpadded shard
and padded row (:class:`~aurora_store.apply.tp_experts.ExpertLayout`, which
also covers tensor and expert parallelism), then through the packing
(:class:`PackedExperts`).

The packing is not re-implemented here: :func:`_probe` runs vLLM's own
``process_weights_after_loading`` of the layer's kernel on a small tensor
whose elements encode their own positions, and reads back where each one
went. That costs two small prepacks at start, follows whatever vLLM's kernel
does, and refuses (one line, naming the layer and the setting) a kernel
that does more than move elements. Backends this module does not know
(quantized experts, zentorch, EPLB's moving experts, GPU layouts other than
Triton's plain one) are refused the same way when the engine starts.

The measured alternative, keeping an unpacked copy and repacking every
expert a delta touched, is slower at RL densities: about 1% of elements
change per step, which touches nearly every expert, so it costs a whole
prepack of every layer (plus a second copy of the experts); mapping costs
one gather and one sort per changed element, off the safe point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from aurora_store.apply.tp_experts import ExpertLayout, expert_slots, slots_from_expert_map
from aurora_store.errors import ModelMismatchError

__all__ = ["PackedExperts", "expert_builder", "format_name", "hf_experts", "hf_named", "is_routed_experts", "reload_packed"]

WEIGHTS = ("w13_weight", "w2_weight")
_DIGIT = 14
"""Bits of a position carried by one probe pass (values stay normal, finite floats)."""
_BASES = {2: 0x1000, 4: 0x10000000}
"""Bit pattern of digit 0 per element width: 0x1000..0x4FFF are normal bf16 and fp16 numbers."""


def is_routed_experts(module: torch.nn.Module) -> bool:
    """vLLM's ``RoutedExperts`` (the module that holds ``w13_weight``/``w2_weight``)."""
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:
        return False
    return isinstance(module, RoutedExperts)


def format_name(vllm_name: str) -> str:
    """``…experts.routed_experts.w13_weight`` -> ``…experts.w13_weight`` (FORMAT.md §2)."""
    return vllm_name.replace(".experts.routed_experts.", ".experts.")


@dataclass(frozen=True, slots=True)
class PackedExperts(ExpertLayout):
    """An :class:`ExpertLayout` whose padded slots are further permuted by the engine's kernel packing.

    ``pack[w]`` is where element ``w`` of a padded, unpacked slot sits in the
    packed slot (the same for every slot: vLLM packs expert by expert).
    """

    pack: np.ndarray | None = field(default=None, compare=False, repr=False)
    _pack_t: torch.Tensor | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        ExpertLayout.__post_init__(self)
        if self.pack is not None:
            s = self.local_shape
            if self.pack.shape != (s[1] * s[2],):
                raise ModelMismatchError(f"{self.where}: a packing of {self.pack.size} elements for slots of {s[1:]}")
            object.__setattr__(self, "_pack_t", torch.from_numpy(self.pack.astype(np.int64)))

    @property
    def is_prefix(self) -> bool:
        return self.pack is None and ExpertLayout.is_prefix.fget(self)  # type: ignore[attr-defined]

    def localize_np(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As :meth:`ExpertLayout.localize_np`, into the packed tensor (sorted by packed index)."""
        sel, loc = ExpertLayout.localize_np(self, indices)
        if self.pack is None or loc.size == 0:
            return sel, loc
        n = self.pack.size
        slot, within = np.divmod(loc, n)
        phys = slot * n + self.pack[within]
        order = np.argsort(phys, kind="stable")
        return sel[order], phys[order]

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's packed tensor cut from the whole parameter (padding zero), as vLLM's loader leaves it."""
        padded = ExpertLayout.shard(self, full)
        if self._pack_t is None:
            return padded
        s = padded.shape[0]
        out = torch.empty_like(padded)
        out.view(s, -1)[:, self._pack_t.to(padded.device)] = padded.view(s, -1)
        return out

    def place(self, out: torch.Tensor, local: torch.Tensor) -> None:
        """The held elements of the packed ``local`` into the whole parameter ``out``."""
        if self._pack_t is not None and tuple(local.shape) == self.local_shape:
            s = local.shape[0]
            local = local.reshape(s, -1)[:, self._pack_t.to(local.device)].view(self.local_shape)
        ExpertLayout.place(self, out, local)


def _refuse(where: str, what: str) -> ModelMismatchError:
    return ModelMismatchError(f"{where}: {what}; Aurora cannot write deltas into that layout in place")


def _kernel(module: Any, where: str) -> Any:
    """The experts kernel whose packing :func:`_probe` reads, None for a plain layout; refuses the rest."""
    qm = getattr(module, "quant_method", None)
    pc = module.moe_config.moe_parallel_config
    if type(qm).__name__ != "UnquantizedFusedMoEMethod":
        raise _refuse(where, f"vLLM holds quantized experts ({type(qm).__name__}, engine setting quantization)")
    if getattr(pc, "enable_eplb", False):
        raise _refuse(where, "vLLM moves experts between ranks while serving (engine setting enable_eplb)")
    backend = getattr(getattr(qm, "unquantized_backend", None), "name", str(getattr(qm, "unquantized_backend", None)))
    fe = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    if backend == "CPU":
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        if isinstance(fe, CPUUnquantizedExperts) and not getattr(fe, "_use_zentorch", False):
            return fe
        raise _refuse(where, f"vLLM runs these experts through {type(fe).__name__} with zentorch (installed here), in its own layout")
    if backend in ("TRITON", "BATCHED_TRITON") and torch.cuda.is_available() and not getattr(torch.version, "hip", None):
        return None
    raise _refuse(
        where, f"vLLM's MoE backend {backend} ({type(fe).__name__}) keeps experts in a kernel layout (engine setting moe_backend)"
    )


def expert_builder(module: Any, pname: str, tensor: torch.Tensor, where: str, rank: int) -> Callable[[int], ExpertLayout]:
    """How ``module``'s ``pname`` (``w13_weight``/``w2_weight``) is laid out on each tensor-parallel rank.

    Checked here against the live tensor of ``rank``: shape, expert map,
    and the kernel packing (probed once per shape).
    """
    if pname not in WEIGHTS:
        raise ModelMismatchError(f"{where}.{pname}: vLLM holds an expert tensor FORMAT.md §2 has no name for (expert biases?)")
    mc = module.moe_config
    pc = mc.moe_parallel_config
    kind = pname.split("_")[0]
    experts = int(mc.num_logical_experts)
    tp = int(pc.tp_size) if not pc.use_ep else 1
    il = int(mc.intermediate_size_per_partition_unpadded or module.intermediate_size_per_partition)
    hidden = int(mc.hidden_dim_unpadded or mc.hidden_dim)
    shape = tuple(tensor.shape)
    if len(shape) != 3 or not getattr(mc, "is_act_and_mul", True):
        raise _refuse(where, f"vLLM holds {pname} as {list(shape)} (a non-gated MoE)")
    li, lh = (shape[1] // 2, shape[2]) if kind == "w13" else (shape[2], shape[1])
    live = slots_from_expert_map(getattr(module, "expert_map", None), experts=experts, where=where)
    placement = "linear"
    if pc.use_ep:
        ep = int(pc.ep_size)
        for placement in ("linear", "round_robin"):
            if expert_slots(experts, ep, int(pc.ep_rank), placement, where=where) == live:
                break
        else:
            raise _refuse(
                where, f"rank {pc.ep_rank} holds experts {list(live)[:6]}, in no placement known here (expert_placement_strategy)"
            )
        if experts % ep:
            raise _refuse(where, f"{experts} experts do not split evenly over {ep} expert-parallel ranks (enable_expert_parallel)")
    kernel = _kernel(module, where)
    pack = None
    if kernel is not None:
        probed = _probe(kernel, int(module.intermediate_size_per_partition), int(module.hidden_size), tensor.dtype, where)
        got, pack = probed[kind]
        if got != shape[1:]:
            raise _refuse(where, f"vLLM's kernel packs {pname} into {list(shape)}, its probe into {list(got)}")

    def build(r: int) -> ExpertLayout:
        slots = expert_slots(experts, int(pc.ep_size), r, placement, where=where) if pc.use_ep else tuple(range(experts))
        return PackedExperts(kind, experts, il * tp, hidden, slots, tp, 0 if pc.use_ep else r, li, lh, where, pack)

    mine = build(rank)
    if mine.local_shape != shape or mine.slots != live:
        raise _refuse(where, f"vLLM holds {pname} as {list(shape)}, experts {list(live)[:6]}; expected {list(mine.local_shape)}")
    return build


# ---------------------------------------------------------------------------
# the probe

_PROBED: dict[tuple[Any, ...], dict[str, tuple[tuple[int, ...], np.ndarray]]] = {}


def _probe(kernel: Any, il: int, hidden: int, dtype: torch.dtype, where: str) -> dict[str, tuple[tuple[int, ...], np.ndarray]]:
    """Per kind: (packed slot shape, ``pack``) of ``kernel`` for slots created ``il`` x ``hidden``."""
    key = (type(kernel), getattr(kernel, "isa", None), il, hidden, dtype)
    if key in _PROBED:
        return _PROBED[key]
    width = torch.empty(0, dtype=dtype).element_size()
    if width not in _BASES:
        raise _refuse(where, f"experts held in {dtype}")
    sig = torch.int16 if width == 2 else torch.int32
    base = _BASES[width]
    created = {"w13": (2 * il, hidden), "w2": (hidden, il)}
    n_u = {k: a * b for k, (a, b) in created.items()}
    digits = max(1, math.ceil(math.log2(2 * max(n_u.values()) + 1) / _DIGIT))
    raw: dict[str, list[torch.Tensor]] = {"w13": [], "w2": []}
    zen = getattr(kernel, "_use_zentorch", None)
    for d in range(digits):
        layer = torch.nn.Module()
        for kind, (a, b) in created.items():
            pos = torch.arange(2 * n_u[kind], dtype=torch.int64)
            bits = ((pos >> (_DIGIT * d)) & ((1 << _DIGIT) - 1)) + base
            w = bits.to(sig).view(dtype).reshape(2, a, b)
            layer.register_parameter(f"{kind}_weight", torch.nn.Parameter(w, requires_grad=False))
        try:
            kernel.process_weights_after_loading(layer)
        finally:
            if zen is not None:
                kernel._use_zentorch = zen
        for kind in created:
            raw[kind].append(getattr(layer, f"{kind}_weight").data.contiguous())
    out = {kind: _decode(where, kind, raw[kind], created[kind], n_u[kind], base, sig) for kind in created}
    _PROBED[key] = out
    return out


def _decode(
    where: str, kind: str, passes: list[torch.Tensor], created: tuple[int, int], n_u: int, base: int, sig: torch.dtype
) -> tuple[tuple[int, ...], np.ndarray]:
    """Where each element of a padded, unpacked slot went, from the probe's passes; refuses anything but a move."""
    shape = tuple(passes[0].shape)
    if len(shape) != 3 or shape[0] != 2:
        raise _refuse(where, f"vLLM's kernel turns {kind} of 2 experts into {list(shape)}")
    n_p = shape[1] * shape[2]
    src = np.zeros(2 * n_p, dtype=np.int64)
    zero = None
    for d, t in enumerate(passes):
        v = t.view(sig).reshape(-1).to(torch.int64).numpy()
        z = v == 0
        if zero is None:
            zero = z
        ok = (z == zero) & (z | ((v >= base) & (v < base + (1 << _DIGIT))))
        if not ok.all():
            raise _refuse(where, f"vLLM's kernel does more than move the elements of {kind} (its probe came back changed)")
        src += np.where(z, 0, v - base) << (_DIGIT * d)
    assert zero is not None
    z0, z1 = zero[:n_p], zero[n_p:]
    s0, s1 = src[:n_p], src[n_p:]
    if not np.array_equal(z0, z1) or not np.array_equal(s1[~z1], s0[~z0] + n_u) or int((~z0).sum()) != n_u:
        raise _refuse(where, f"vLLM's kernel does not pack {kind} expert by expert")
    rows, cols = created
    li, lh = (shape[1] // 2, shape[2]) if kind == "w13" else (shape[2], shape[1])
    at = np.flatnonzero(~z0)
    fits = li >= rows // 2 and lh >= cols if kind == "w13" else lh >= rows and li >= cols
    if int(s0[at].max(initial=0)) >= n_u or np.unique(s0[at]).size != n_u or not fits:
        raise _refuse(where, f"vLLM's kernel does more than move the elements of {kind} (its probe came back changed)")
    r, c = np.divmod(s0[at], cols)
    if kind == "w13":
        il = rows // 2
        q = np.where(r < il, r, r - il + li) * lh + c
    else:
        q = r * li + c
    pack = np.full(n_p, -1, dtype=np.int64)
    pack[q] = at  # q is unique and inside the slot: the sources were, and padding only adds rows
    pack[pack < 0] = np.flatnonzero(z0)  # padding: any of the zero places, in order
    return shape[1:], pack


# ---------------------------------------------------------------------------
# vLLM's own full load, for packed experts


def hf_experts(name: str, t: torch.Tensor, family: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    """A FORMAT.md §2 experts tensor as the per-expert Hugging Face tensors a checkpoint holds."""
    from aurora_store.codec.entries import ParamSpec
    from aurora_store.codec.experts import expert_sources

    spec = ParamSpec(tuple(t.shape), str(t.dtype).removeprefix("torch."))
    sources = expert_sources(name, spec, "per_expert", family)
    if sources is None:
        yield name, t
        return
    flat = t.reshape(-1)
    off = 0
    for src, s in sources:
        yield src, flat[off : off + s.numel].view(s.shape)
        off += s.numel


def hf_named(model: torch.nn.Module, fused: Mapping[str, torch.Tensor], family: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused whole tensors back under Hugging Face names (q/k/v, gate/up, each expert), as checkpoints name them."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    for name, t in fused.items():
        if name.endswith(WEIGHTS) and ".experts." in name:
            yield from hf_experts(name, t, family)
            continue
        mod_name, _, pname = name.rpartition(".")
        m: Any = model.get_submodule(mod_name)
        pre = mod_name.rpartition(".")[0]
        if isinstance(m, QKVParallelLinear):
            q = m.total_num_heads * m.head_size
            k = m.total_num_kv_heads * m.head_size
            for part, lo, hi in (("q", 0, q), ("k", q, q + k), ("v", q + k, t.shape[0])):
                yield f"{pre}.{part}_proj.{pname}", t[lo:hi]
        elif isinstance(m, MergedColumnParallelLinear) and name.endswith("gate_up_proj.weight"):
            g = m.output_sizes[0]
            yield f"{pre}.gate_proj.{pname}", t[:g]
            yield f"{pre}.up_proj.{pname}", t[g:]
        else:
            yield name, t


def reload_packed(model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    """``model.load_weights(weights)`` with every packed experts layer re-padded and re-packed, in place.

    vLLM's own reload (``reload_weights``) fails on CPU experts whose
    intermediate size it padded; plain ``load_weights`` would write
    checkpoint-shaped experts into the packed tensors. So the experts get
    back their creation shape, vLLM loads into it, its kernel pads and packs
    as at start, and the result is copied into the tensors the model (and
    the Actor) holds. The benchmark times all of it: that is what a whole
    load of this model costs.
    """
    saved: list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.Tensor]] = []
    kernels: list[tuple[torch.nn.Module, Any]] = []
    for _, mod in model.named_modules():
        if not is_routed_experts(mod):
            continue
        kernel = _kernel(mod, type(mod).__name__)
        if kernel is None:
            continue
        s, il, h = int(mod.local_num_experts), int(mod.intermediate_size_per_partition), int(mod.hidden_size)
        for pname, created in (("w13_weight", (s, 2 * il, h)), ("w2_weight", (s, h, il))):
            p = getattr(mod, pname)
            saved.append((mod, pname, p, p.data))
            p.data = torch.zeros(created, dtype=p.dtype, device=p.device)
        kernels.append((mod, kernel))
    done = False
    try:
        model.load_weights(iter(weights))  # type: ignore[operator]
        for mod, kernel in kernels:
            kernel.process_weights_after_loading(mod)
        done = True
    finally:
        for mod, pname, p, data in saved:
            fresh = getattr(mod, pname).data
            if done:
                if fresh.shape != data.shape:
                    raise ModelMismatchError(f"{pname}: vLLM packed {list(fresh.shape)} on reload, {list(data.shape)} at start")
                data.copy_(fresh)
            p.data = data
            setattr(mod, pname, p)
