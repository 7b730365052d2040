"""Mixture-of-experts tensors under FORMAT.md §2's names, from either form a Hugging Face model uses, and back.

A checkpoint saves each routed expert's projections on their own
(``…experts.{e}.gate_proj.weight``; Mixtral ``…experts.{e}.w1.weight``),
``E x 3`` tensors per layer; transformers 5 holds them packed in memory
(``…experts.gate_up_proj`` ``[E, 2I, H]``, ``…experts.down_proj``
``[E, H, I]``) and writes the per-expert names back when it saves. vLLM,
and so the format, holds two tensors per layer: ``…experts.w13_weight``
``[E, 2I, H]`` (each expert's gate rows, then its up rows) and
``…experts.w2_weight`` ``[E, H, I]``. Both forms are the same bytes in the
same order, so the per-expert form is ``2E`` (or ``E``) blocks stacked along
dim 0 and the packed form is one block: the fusion plan's block model
carries both, and a payload under the format's names reaches either.

The module that holds the experts is fixed by the family (Mixtral:
``block_sparse_moe``, everything else: ``mlp``); transformers 5 holds
Mixtral's under ``mlp`` in memory, so with the family known its router is
renamed too. Without a family the experts keep the module they were found in.

Everything here is checked before a plan exists, so a bad checkpoint is
refused with one line and nothing of it is used: an expert missing, shapes
that disagree (``E``, ``I`` or ``H``), two forms mixed in one layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from aurora_store.codec.entry_types import ParamSpec
from aurora_store.errors import ModelMismatchError

__all__ = [
    "LAYOUTS",
    "ExpertTensor",
    "MoeLayout",
    "MoePlan",
    "check_config",
    "expert_dims",
    "expert_name",
    "expert_sources",
    "plan_experts",
    "router_source",
    "router_target",
]

Form = Literal["per_expert", "packed"]


@dataclass(frozen=True, slots=True)
class MoeLayout:
    """Where one family keeps its experts, and what it calls their projections."""

    module: str
    """The module holding experts and router in the format and in checkpoints (``block_sparse_moe`` or ``mlp``)."""
    packed_module: str
    """Where transformers 5 holds them in memory (packed)."""
    gate: str
    up: str
    down: str
    """Per-expert projection names (``gate_proj`` / ``w1`` …)."""
    experts_key: str
    """config.json's number of routed experts."""
    intermediate_key: str
    """config.json's intermediate size of one expert."""


_QWEN = MoeLayout("mlp", "mlp", "gate_proj", "up_proj", "down_proj", "num_experts", "moe_intermediate_size")
LAYOUTS: dict[str, MoeLayout] = {
    "mixtral": MoeLayout("block_sparse_moe", "mlp", "w1", "w3", "w2", "num_local_experts", "intermediate_size"),
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    # DeepSeek-style without MLA: shared experts, a router bias (e_score_correction_bias).
    "glm4_moe": MoeLayout("mlp", "mlp", "gate_proj", "up_proj", "down_proj", "n_routed_experts", "moe_intermediate_size"),
}
"""``model_type`` -> its layout, for the families whose experts the format names."""

_MOD = r"(?P<layer>.+?)\.(?P<mod>mlp|block_sparse_moe)\."
_PER_EXPERT = re.compile(_MOD + r"experts\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PACKED = re.compile(_MOD + r"experts\.(?P<which>gate_up_proj|down_proj)$")
_FORMAT = re.compile(_MOD + r"experts\.(?P<which>w13_weight|w2_weight)$")
_ROUTER = re.compile(_MOD + r"gate\.(?P<what>weight|e_score_correction_bias)$")
_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MAX_EXPERTS = 1 << 16
"""More experts than any model has: an index past it is a malformed name, not a model."""


@dataclass(frozen=True, slots=True)
class ExpertTensor:
    """One format tensor (``w13_weight`` or ``w2_weight``) and the Hugging Face tensors it is made of, in order."""

    name: str
    spec: ParamSpec
    sources: tuple[tuple[str, ParamSpec], ...]
    """(source name, its spec), stacked along dim 0 in this order."""


@dataclass(slots=True)
class MoePlan:
    """What :func:`plan_experts` found: the expert tensors, the renamed routers, every name it took."""

    tensors: list[ExpertTensor] = field(default_factory=list)
    renames: dict[str, str] = field(default_factory=dict)
    """Source name -> format name, for routers whose module differs in memory (Mixtral in transformers 5)."""
    consumed: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Layer:
    mods: set[str] = field(default_factory=set)
    kinds: dict[str, str] = field(default_factory=dict)
    """kind ("per-expert", "packed", "fused") -> one name of that kind, for messages."""
    experts: dict[int, dict[str, tuple[str, ParamSpec]]] = field(default_factory=dict)
    whole: dict[str, tuple[str, ParamSpec]] = field(default_factory=dict)
    """"w13" / "w2" -> the packed or already-fused tensor."""


def _module(family: str | None, found: str) -> str:
    layout = LAYOUTS.get(family or "")
    return layout.module if layout is not None else found


def plan_experts(specs: Mapping[str, ParamSpec], family: str | None = None) -> MoePlan:
    """Group every expert tensor of ``specs`` into its layer's ``w13_weight`` and ``w2_weight``, checked.

    Raises :class:`~aurora_store.errors.ModelMismatchError` (one line naming
    the layer or tensor) for: a layer mixing per-expert, packed and format
    names (or two modules); an expert missing or a projection of one
    missing; expert shapes or dtypes that disagree; a router whose rows or
    columns are not ``E`` and ``H``.
    """
    layers: dict[str, _Layer] = {}
    for name, spec in specs.items():
        m = _PER_EXPERT.match(name)
        if m:
            e = m["e"]
            if e != str(int(e)) or int(e) >= _MAX_EXPERTS:
                raise ModelMismatchError(f"{name}: malformed expert index {e!r}")
            lay = layers.setdefault(m["layer"], _Layer())
            part = _PART[m["proj"]]
            have = lay.experts.setdefault(int(e), {})
            if part in have:
                raise ModelMismatchError(f"{name}: expert {e} already has a {part} projection ({have[part][0]})")
            have[part] = (name, spec)
            lay.kinds.setdefault("per-expert", name)
        else:
            m = _PACKED.match(name) or _FORMAT.match(name)
            if not m:
                continue
            lay = layers.setdefault(m["layer"], _Layer())
            key = "w13" if m["which"] in ("gate_up_proj", "w13_weight") else "w2"
            lay.whole[key] = (name, spec)
            lay.kinds.setdefault("packed" if m["which"] in ("gate_up_proj", "down_proj") else "fused", name)
        lay.mods.add(m["mod"])
    out = MoePlan()
    for layer, lay in layers.items():
        where = f"{layer}: experts"
        if len(lay.kinds) > 1:
            shown = ", ".join(f"{k} ({n})" for k, n in lay.kinds.items())
            raise ModelMismatchError(f"{where} are named in more than one form in one layer: {shown}; a checkpoint uses one")
        if len(lay.mods) > 1:
            raise ModelMismatchError(f"{where} sit under two modules ({' and '.join(sorted(lay.mods))}) in one layer")
        found = next(iter(lay.mods))
        mod = _module(family, found)
        router = _router(specs, layer, found)
        w13, w2 = f"{layer}.{mod}.experts.w13_weight", f"{layer}.{mod}.experts.w2_weight"
        if lay.experts:
            tensors, (e_, i_, h_) = _per_expert(where, lay.experts, router, w13, w2)
        else:
            tensors, (e_, i_, h_) = _whole(where, lay.whole, w13, w2)
        _check_router(where, specs, layer, found, e_, h_)
        for rname in (f"{layer}.{found}.gate.weight", f"{layer}.{found}.gate.e_score_correction_bias"):
            if rname in specs and found != mod:
                out.renames[rname] = rname.replace(f"{layer}.{found}.", f"{layer}.{mod}.", 1)
                out.consumed.add(rname)
        out.tensors += tensors
        out.consumed.update(n for t in tensors for n, _ in t.sources)
    return out


def _router(specs: Mapping[str, ParamSpec], layer: str, mod: str) -> tuple[str, ParamSpec] | None:
    name = f"{layer}.{mod}.gate.weight"
    return (name, specs[name]) if name in specs else None


def _per_expert(
    where: str, experts: dict[int, dict[str, tuple[str, ParamSpec]]], router: tuple[str, ParamSpec] | None, w13: str, w2: str
) -> tuple[list[ExpertTensor], tuple[int, int, int]]:
    n_router = router[1].shape[0] if router is not None and len(router[1].shape) == 2 else None
    top = max(experts)
    n = n_router if n_router is not None else top + 1
    if top >= n:
        assert router is not None
        raise ModelMismatchError(f"{where}: expert {top} is named, but the router {router[0]} has {n} rows (experts 0..{n - 1})")
    for e in range(n):
        lack = [p for p in ("gate", "up", "down") if p not in experts.get(e, {})]
        if lack:
            absent = [x for x in range(n) if x not in experts]
            what = "is absent" if e not in experts else f"has no {' / '.join(lack)} projection"
            more = f" (absent: {len(absent)} of {n} experts)" if len(absent) > 1 else ""
            raise ModelMismatchError(f"{where}: expert {e} of {n} {what}{more}; a checkpoint must hold every expert")
    first_name, first = experts[0]["gate"]
    if len(first.shape) != 2:
        raise ModelMismatchError(f"{first_name}: {list(first.shape)}, an expert's projection is 2-D [I, H]")
    i_, h_ = first.shape
    want = {"gate": (i_, h_), "up": (i_, h_), "down": (h_, i_)}
    for e in range(n):
        for part, (name, spec) in experts[e].items():
            if spec.shape != want[part] or spec.dtype != first.dtype:
                raise ModelMismatchError(
                    f"{name}: {list(spec.shape)} {spec.dtype}, expected {list(want[part])} {first.dtype} (I={i_}, H={h_} from {first_name})"
                )
    gate_up = tuple(experts[e][p] for e in range(n) for p in ("gate", "up"))
    down = tuple(experts[e]["down"] for e in range(n))
    return [
        ExpertTensor(w13, ParamSpec((n, 2 * i_, h_), first.dtype), gate_up),
        ExpertTensor(w2, ParamSpec((n, h_, i_), first.dtype), down),
    ], (n, i_, h_)


def _whole(where: str, whole: dict[str, tuple[str, ParamSpec]], w13: str, w2: str) -> tuple[list[ExpertTensor], tuple[int, int, int]]:
    if len(whole) != 2:
        (name, _), lack = next(iter(whole.values())), "w13" if "w13" not in whole else "w2"
        want = "gate_up_proj / w13_weight" if lack == "w13" else "down_proj / w2_weight"
        raise ModelMismatchError(f"{where}: {name} is there but its {want} is not")
    (gu_name, gu), (d_name, d) = whole["w13"], whole["w2"]
    if len(gu.shape) != 3 or gu.shape[1] % 2:
        raise ModelMismatchError(f"{gu_name}: {list(gu.shape)}, expected [E, 2I, H] (each expert's gate rows, then its up rows)")
    e_, i_, h_ = gu.shape[0], gu.shape[1] // 2, gu.shape[2]
    if d.shape != (e_, h_, i_) or d.dtype != gu.dtype:
        raise ModelMismatchError(
            f"{d_name}: {list(d.shape)} {d.dtype}, expected [E, H, I] = {[e_, h_, i_]} {gu.dtype} beside {gu_name} "
            f"{list(gu.shape)}; other packings (transposed, interleaved) are refused"
        )
    return [
        ExpertTensor(w13, ParamSpec(gu.shape, gu.dtype), (whole["w13"],)),
        ExpertTensor(w2, ParamSpec(d.shape, d.dtype), (whole["w2"],)),
    ], (
        e_,
        i_,
        h_,
    )


def _check_router(where: str, specs: Mapping[str, ParamSpec], layer: str, mod: str, e_: int, h_: int) -> None:
    gate, bias = f"{layer}.{mod}.gate.weight", f"{layer}.{mod}.gate.e_score_correction_bias"
    if gate in specs and specs[gate].shape != (e_, h_):
        raise ModelMismatchError(f"{gate}: {list(specs[gate].shape)}, expected [E, H] = {[e_, h_]} for the {where}")
    if bias in specs and specs[bias].shape != (e_,):
        raise ModelMismatchError(f"{bias}: {list(specs[bias].shape)}, expected [E] = [{e_}] for the {where}")


def expert_name(name: str, family: str | None = None) -> tuple[str, str, int] | None:
    """(format name, part, block position) of one expert tensor's name; None for any other name.

    Per-expert projections: part ``gate`` / ``up`` at position ``2e`` /
    ``2e + 1`` of ``w13_weight``, ``down`` at ``e`` of ``w2_weight``; packed
    and format names: part ``gate_up`` / ``down`` at position 0.
    """
    m = _PER_EXPERT.match(name)
    if m is not None:
        base = f"{m['layer']}.{_module(family, m['mod'])}.experts."
        part, e = _PART[m["proj"]], int(m["e"])
        return (base + "w2_weight", part, e) if part == "down" else (base + "w13_weight", part, 2 * e + (part == "up"))
    m = _PACKED.match(name) or _FORMAT.match(name)
    if m is None:
        return None
    base = f"{m['layer']}.{_module(family, m['mod'])}.experts."
    return (base + "w13_weight", "gate_up", 0) if m["which"] in ("gate_up_proj", "w13_weight") else (base + "w2_weight", "down", 0)


def router_target(name: str, family: str | None = None) -> str:
    """The format name of a router tensor (``…gate.weight``, ``…gate.e_score_correction_bias``): itself unless ``family`` moves it."""
    m = _ROUTER.match(name)
    if m is None:
        return name
    return f"{m['layer']}.{_module(family, m['mod'])}.gate.{m['what']}"


def expert_dims(name: str, spec: ParamSpec) -> tuple[int, int, int] | None:
    """``(E, I, H)`` of a format expert tensor (``…experts.w13_weight`` / ``w2_weight``); None for any other name."""
    m = _FORMAT.match(name)
    if not m or len(spec.shape) != 3:
        return None
    e_, a, b = spec.shape
    return (e_, a // 2, b) if m["which"] == "w13_weight" else (e_, b, a)


def expert_sources(name: str, spec: ParamSpec, form: Form, family: str | None = None) -> tuple[tuple[str, ParamSpec], ...] | None:
    """The reverse map: the Hugging Face tensors of a format expert tensor, in stacking order; None for any other name.

    ``form="per_expert"``: a checkpoint's names (``…experts.{e}.gate_proj.weight``,
    Mixtral ``w1``/``w3``/``w2``), ``2E`` or ``E`` tensors; ``"packed"``: the
    one tensor transformers 5 holds in memory (``…experts.gate_up_proj``,
    under ``mlp`` for Mixtral too).
    """
    m = _FORMAT.match(name)
    dims = expert_dims(name, spec)
    if not m or dims is None:
        return None
    layout = LAYOUTS.get(family or "")
    layer, mod = m["layer"], m["mod"]
    w13 = m["which"] == "w13_weight"
    if form == "packed":
        pmod = layout.packed_module if layout is not None else mod
        return ((f"{layer}.{pmod}.experts.{'gate_up_proj' if w13 else 'down_proj'}", spec),)
    e_, i_, h_ = dims
    gate, up, down = (
        (layout.gate, layout.up, layout.down)
        if layout is not None
        else (("w1", "w3", "w2") if mod == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj"))
    )
    base = f"{layer}.{mod}.experts"
    if w13:
        one = ParamSpec((i_, h_), spec.dtype)
        return tuple((f"{base}.{e}.{p}.weight", one) for e in range(e_) for p in (gate, up))
    return tuple((f"{base}.{e}.{down}.weight", ParamSpec((h_, i_), spec.dtype)) for e in range(e_))


def router_source(name: str, form: Form, family: str | None = None) -> str | None:
    """The Hugging Face name of a router tensor under its format name, in ``form``; None for any other name."""
    m = _ROUTER.match(name)
    if m is None:
        return None
    layout = LAYOUTS.get(family or "")
    mod = layout.packed_module if layout is not None and form == "packed" else m["mod"]
    return f"{m['layer']}.{mod}.gate.{m['what']}"


def check_config(specs: Mapping[str, ParamSpec], config: Mapping[str, object], where: str) -> None:
    """Every format expert tensor of ``specs`` against config.json's ``E``, ``I`` and ``H``; one line on the first difference.

    Families without a layout here, and config keys that are absent, are not checked.
    """
    layout = LAYOUTS.get(str(config.get("model_type")))
    if layout is None:
        return
    expect = {
        "E": (layout.experts_key, config.get(layout.experts_key)),
        "I": (layout.intermediate_key, config.get(layout.intermediate_key)),
    }
    expect["H"] = ("hidden_size", config.get("hidden_size"))
    for name in sorted(specs):
        dims = expert_dims(name, specs[name])
        if dims is None:
            continue
        for (sym, (key, want)), got in zip(expect.items(), dims, strict=True):
            if isinstance(want, int) and got != want:
                raise ModelMismatchError(f"{where}: {name} {list(specs[name].shape)} has {sym}={got}, config.json says {key}={want}")
