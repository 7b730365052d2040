"""The Hugging Face names and shapes of a run's parameters, recovered from the fused ones its manifests list.

A snapshot manifest lists every parameter under its fused name
(FORMAT.md §2: ``qkv_proj``, ``gate_up_proj``, a mixture-of-experts layer's
``experts.w13_weight`` and ``experts.w2_weight``) with its shape. A replica
that yields weights to a server expecting Hugging Face names (verl's
server adapters feed vLLM's and SGLang's ``load_weights``) needs the split
back; the manifest holds enough for it, so nothing else (a model config,
a side file) has to travel or be kept in step with the run. Kept apart
from :mod:`aurora_store.integrations.verl` so that it is usable, and
tested, without verl installed.

Routed experts come back as a checkpoint names them, one tensor per expert
and projection (``…mlp.experts.{e}.gate_proj.weight``; Mixtral, whose
format module is ``block_sparse_moe``, ``…experts.{e}.w1.weight``): the
names vLLM's and SGLang's ``load_weights`` take during a live update (verl's
own FSDP engine unpacks transformers 5's packed experts into them before it
sends, ``verl/workers/engine/fsdp/utils.py:unfuse_moe_params``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.experts import LAYOUTS, expert_sources
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ConfigError, FormatError

__all__ = ["checkpoint_module", "hf_layout"]

_MAX_EXPERTS = 1 << 16
"""More experts than any model has: a manifest saying more is refused before a name is made for each."""
_IN_MEMORY = re.compile(r"^(?P<layer>.+?)\.(?P<mod>mlp|block_sparse_moe)\.(?P<rest>experts\..+|gate\.(?:weight|e_score_correction_bias))$")


def hf_layout(fused: Mapping[str, ParamSpec], where: str = "the run") -> dict[str, ParamSpec]:
    """Hugging Face names and shapes of the parameters a run carries under fused names (FORMAT.md §2).

    ``qkv_proj`` splits by its layer's ``o_proj`` (whose input width is q's
    rows; k and v share the rest), ``gate_up_proj`` in halves, an experts
    layer's ``w13_weight`` ``[E, 2I, H]`` into each expert's gate and up
    ``[I, H]`` and its ``w2_weight`` ``[E, H, I]`` into each expert's down
    ``[H, I]``. The result must fuse back to exactly ``fused``, else
    :class:`ConfigError`: what a manifest says is untrusted.
    """
    out: dict[str, ParamSpec] = {}
    for name, spec in fused.items():
        if spec.dtype != "bfloat16" or not spec.shape:
            raise ConfigError(f"{where}: {name} is {spec.dtype} {list(spec.shape)}; versions are bfloat16 tensors")
        pre, qkv, suf = name.rpartition(".qkv_proj.")
        pre2, gate_up, suf2 = name.rpartition(".gate_up_proj.")
        rows, rest = spec.shape[0], spec.shape[1:]
        if name.endswith((".experts.w13_weight", ".experts.w2_weight")):
            per_expert = expert_sources(name, spec, "per_expert") if 0 < spec.shape[0] <= _MAX_EXPERTS else None
            if not per_expert:
                raise ConfigError(f"{where}: cannot split {name} {list(spec.shape)} into its experts ([E, 2I, H] / [E, H, I])")
            out.update(per_expert)
        elif qkv:
            o = fused.get(f"{pre}.o_proj.weight")
            q = o.shape[1] if o is not None and len(o.shape) == 2 else None
            if q is None or not 0 < q < rows or (rows - q) % 2:
                raise ConfigError(f"{where}: cannot split {name} {list(spec.shape)} into q, k and v (by {pre}.o_proj.weight)")
            for part, n in (("q", q), ("k", (rows - q) // 2), ("v", (rows - q) // 2)):
                out[f"{pre}.{part}_proj.{suf}"] = ParamSpec((n, *rest), spec.dtype)
        elif gate_up:
            if rows % 2:
                raise ConfigError(f"{where}: cannot split {name} {list(spec.shape)} into gate and up halves")
            for part in ("gate", "up"):
                out[f"{pre2}.{part}_proj.{suf2}"] = ParamSpec((rows // 2, *rest), spec.dtype)
        else:
            out[name] = spec
    try:
        back = {n: (tuple(s.shape), s.dtype) for n, s in FusionPlan.from_specs(out).specs().items()}
    except FormatError as e:  # an experts layer a manifest describes inconsistently (its router's rows …)
        raise ConfigError(f"{where}: its parameters do not map back to Hugging Face names: {e}") from None
    if back != {n: (tuple(s.shape), s.dtype) for n, s in fused.items()}:
        raise ConfigError(f"{where}: its parameters do not map back to Hugging Face names (an unknown fusion?)")
    return out


def checkpoint_module(names: Mapping[str, object] | list[str], family: str | None) -> dict[str, str]:
    """Old name -> checkpoint name for the experts and routers ``family`` holds elsewhere in memory.

    transformers 5 holds Mixtral's experts and router under ``mlp`` (and
    verl's FSDP engine unpacks them there, as ``…mlp.experts.{e}.gate_proj.weight``);
    a checkpoint, vLLM and the format keep them under ``block_sparse_moe``.
    Names cannot tell a Mixtral from a Qwen3-MoE, so the family is the
    caller's (verl: ``engine_kwargs.aurora.model_type``). Only the names that
    move are in the result; none for families whose modules agree.
    """
    layout = LAYOUTS.get(family or "")
    if layout is None or layout.module == layout.packed_module:
        return {}
    out = {}
    for name in names:
        m = _IN_MEMORY.match(name)
        if m is not None and m["mod"] == layout.packed_module:
            out[name] = f"{m['layer']}.{layout.module}.{m['rest']}"
    return out
