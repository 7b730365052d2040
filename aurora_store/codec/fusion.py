"""Hugging Face names to the fused inference names of FORMAT.md §2, and back.

Llama, Qwen2, Qwen3 and Mistral checkpoints name attention and MLP projections
separately; vLLM fuses ``q_proj, k_proj, v_proj`` into ``qkv_proj`` and
``gate_proj, up_proj`` into ``gate_up_proj`` by stacking along dim 0 (a
shared expert's too). As the tensors are row-major, element ``i`` of the
second block sits at flat index ``numel(first) + i`` of the fused tensor. A
:class:`FusionPlan` records those block offsets, so a payload written under
fused names applies to fused engine parameters directly, or to split ones
through :meth:`FusionPlan.split`.

Mixture-of-experts layers are the same block model with more blocks: a
layer's ``w13_weight`` ``[E, 2I, H]`` is its ``2E`` per-expert gate and up
matrices stacked (or one packed ``gate_up_proj``), ``w2_weight`` its ``E``
down matrices (or one ``down_proj``); :mod:`aurora_store.codec.experts`
finds and checks them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from aurora_store.codec import experts
from aurora_store.codec.entries import ParamSpec
from aurora_store.errors import ModelMismatchError

__all__ = ["Block", "FusedParam", "FusionPlan", "fused_name", "TIED_HEAD", "EMBED"]

TIED_HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"

# (pattern, fused replacement, order of the parts inside the fused tensor)
_RULES: tuple[tuple[re.Pattern[str], str, tuple[str, ...]], ...] = (
    (
        re.compile(r"^(?P<pre>.*\.self_attn\.)(?P<part>q|k|v)_proj\.(?P<suf>weight|bias)$"),
        "qkv_proj",
        ("q", "k", "v"),
    ),
    (
        re.compile(r"^(?P<pre>.*\.mlp\.(?:shared_experts?\.)?)(?P<part>gate|up)_proj\.(?P<suf>weight)$"),
        "gate_up_proj",
        ("gate", "up"),
    ),
)


def fused_name(hf_name: str, family: str | None = None) -> tuple[str, str | None, int]:
    """(fused name, part, position of the part) for one Hugging Face name.

    Names outside the fusion rules map to themselves with part ``None``. A
    routed expert's projection maps to its layer's ``w13_weight`` (part
    ``gate`` or ``up``, position ``2e`` or ``2e + 1``) or ``w2_weight`` (part
    ``down``, position ``e``); a packed ``gate_up_proj`` / ``down_proj`` to the
    same names (part ``gate_up`` / ``down``, position 0); with ``family``
    ``mixtral``, a router held under ``mlp`` moves to ``block_sparse_moe``
    (part ``None``). Only the name is read: whether the layer is complete and
    consistent is :meth:`FusionPlan.from_specs`'s to check.
    """
    moe = experts.expert_name(hf_name, family)
    if moe is not None:
        return moe
    moved = experts.router_target(hf_name, family)
    if moved != hf_name:
        return moved, None, 0
    for pat, fused, order in _RULES:
        m = pat.match(hf_name)
        if m:
            return f"{m['pre']}{fused}.{m['suf']}", m["part"], order.index(m["part"])
    return hf_name, None, 0


@dataclass(frozen=True, slots=True)
class Block:
    """One source tensor inside a fused parameter."""

    source: str
    """Its Hugging Face name (equal to the fused name for unfused parameters)."""
    offset: int
    """Flat index of its first element inside the fused parameter."""
    spec: ParamSpec
    """Its own shape and dtype."""

    @property
    def numel(self) -> int:
        return self.spec.numel


@dataclass(frozen=True, slots=True)
class FusedParam:
    """A parameter under its fused name and the blocks it is made of."""

    name: str
    spec: ParamSpec
    blocks: tuple[Block, ...]

    @property
    def is_fused(self) -> bool:
        return len(self.blocks) > 1 or self.blocks[0].source != self.name


class FusionPlan:
    """The fused view of one model's parameters."""

    def __init__(self, params: Mapping[str, FusedParam], dropped: tuple[str, ...] = (), family: str | None = None) -> None:
        self.params: dict[str, FusedParam] = dict(params)
        self.dropped = dropped
        """Source names not carried (a tied ``lm_head.weight``)."""
        self.family = family
        """The ``model_type`` the plan was built for (None: names alone decided)."""
        self._by_source = {b.source: (p.name, b) for p in self.params.values() for b in p.blocks}

    @classmethod
    def from_specs(cls, specs: Mapping[str, ParamSpec], tied_lm_head: bool = False, family: str | None = None) -> FusionPlan:
        """Build the plan from Hugging Face (or already fused) names.

        A fused group is formed only when all its parts are present (q, k and
        v; gate and up); a lone part keeps its own name. With
        ``tied_lm_head``, ``lm_head.weight`` is dropped: it is the embedding.
        Routed experts (per-expert or packed) become their layer's
        ``w13_weight`` and ``w2_weight``, checked first: an expert missing,
        shapes that disagree or two forms in one layer raise
        :class:`~aurora_store.errors.ModelMismatchError` naming the layer.
        ``family`` (the config's ``model_type``) fixes the experts' module
        where memory and format differ (Mixtral); None keeps the module found.
        """
        moe = experts.plan_experts(specs, family)
        out: dict[str, FusedParam] = {}

        def put(p: FusedParam) -> None:
            if p.name in out:
                raise ModelMismatchError(f"{p.name}: two tensors map to it ({out[p.name].blocks[0].source} and {p.blocks[0].source})")
            out[p.name] = p

        for t in moe.tensors:
            blocks, offset = [], 0
            for name, spec in t.sources:
                blocks.append(Block(name, offset, spec))
                offset += spec.numel
            put(FusedParam(t.name, t.spec, tuple(blocks)))
        groups: dict[str, dict[int, tuple[str, ParamSpec]]] = {}
        sizes: dict[str, int] = {}
        dropped: list[str] = []
        for name, spec in specs.items():
            if tied_lm_head and name == TIED_HEAD:
                dropped.append(name)
                continue
            if name in moe.consumed:
                if name in moe.renames:
                    put(FusedParam(moe.renames[name], spec, (Block(name, 0, spec),)))
                continue
            fused, part, pos = fused_name(name)
            if part is None:
                fused, pos = name, 0
            groups.setdefault(fused, {})[pos] = (name, spec)
            sizes[fused] = 3 if fused.endswith(("qkv_proj.weight", "qkv_proj.bias")) else 2 if part else 1
        for fused, parts in groups.items():
            if fused in specs and len(parts) > 1:
                raise ModelMismatchError(f"{fused}: both the fused tensor and its parts are present")
            if len(parts) != sizes[fused] and fused not in specs:
                # Incomplete group: keep each part under its own name.
                for _, (name, spec) in sorted(parts.items()):
                    put(FusedParam(name, spec, (Block(name, 0, spec),)))
                continue
            members = [parts[i] for i in sorted(parts)]
            first = members[0][1]
            for name, spec in members[1:]:
                if spec.dtype != first.dtype or spec.shape[1:] != first.shape[1:]:
                    raise ModelMismatchError(
                        f"{fused}: cannot stack {name} {list(spec.shape)} {spec.dtype} under "
                        f"{members[0][0]} {list(first.shape)} {first.dtype}"
                    )
            blocks = []
            offset = 0
            for name, spec in members:
                blocks.append(Block(name, offset, spec))
                offset += spec.numel
            rows = sum(s.shape[0] for _, s in members) if first.shape else 0
            shape = (rows, *first.shape[1:]) if first.shape else ()
            put(FusedParam(fused, ParamSpec(shape, first.dtype), tuple(blocks)))
        return cls(out, tuple(dropped), family)

    def with_experts(self, form: experts.Form) -> FusionPlan:
        """The same fused parameters reached through the other Hugging Face form of the experts (the reverse map).

        ``"per_expert"``: a checkpoint's names (what ``save_pretrained``
        writes and ``from_pretrained`` reads); ``"packed"``: what transformers
        5 holds in memory (``…experts.gate_up_proj``, Mixtral's router under
        ``mlp``). Every other parameter keeps its blocks.
        """
        out: dict[str, FusedParam] = {}
        for p in self.params.values():
            srcs = experts.expert_sources(p.name, p.spec, form, self.family)
            if srcs is None:
                router = experts.router_source(p.name, form, self.family)
                srcs = None if router is None else ((router, p.spec),)
            if srcs is None:
                out[p.name] = p
                continue
            blocks, offset = [], 0
            for name, spec in srcs:
                blocks.append(Block(name, offset, spec))
                offset += spec.numel
            out[p.name] = FusedParam(p.name, p.spec, tuple(blocks))
        return FusionPlan(out, self.dropped, self.family)

    # ------------------------------------------------------------------
    def specs(self) -> dict[str, ParamSpec]:
        """Fused name -> spec, the model description readers validate against."""
        return {n: p.spec for n, p in self.params.items()}

    def __iter__(self) -> Iterator[FusedParam]:
        return iter(self.params.values())

    def __len__(self) -> int:
        return len(self.params)

    def source(self, hf_name: str) -> tuple[str, Block]:
        """(fused name, block) holding a Hugging Face tensor."""
        try:
            return self._by_source[hf_name]
        except KeyError:
            raise ModelMismatchError(f"{hf_name!r} is not part of this model's fused plan") from None

    def split(self, fused: str, indices: np.ndarray) -> list[tuple[Block, np.ndarray]]:
        """Reverse map: sorted fused flat indices -> (block, local indices) per block.

        Each block's indices are a contiguous slice of ``indices`` (they are
        sorted), so this costs two binary searches per block, not a pass per
        element.
        """
        p = self.params[fused]
        if len(p.blocks) == 1:
            return [(p.blocks[0], indices)]
        out: list[tuple[Block, np.ndarray]] = []
        for b in p.blocks:
            lo, hi = np.searchsorted(indices, [b.offset, b.offset + b.numel])
            if hi > lo:
                out.append((b, indices[lo:hi] - b.offset))
        return out

    def split_range(self, fused: str, start: int, stop: int) -> list[tuple[Block, int, int, int]]:
        """Reverse map of a dense range: (block, local start, local stop, offset into the range)."""
        p = self.params[fused]
        out: list[tuple[Block, int, int, int]] = []
        for b in p.blocks:
            lo, hi = max(start, b.offset), min(stop, b.offset + b.numel)
            if hi > lo:
                out.append((b, lo - b.offset, hi - b.offset, lo - start))
        return out
