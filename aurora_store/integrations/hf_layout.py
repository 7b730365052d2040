"""The Hugging Face names and shapes of a run's parameters, recovered from the fused ones its manifests list.

A snapshot manifest lists every parameter under its fused name
(FORMAT.md §2: ``qkv_proj``, ``gate_up_proj``) with its shape. A replica
that yields weights to a server expecting Hugging Face names (verl's
server adapters feed vLLM's and SGLang's ``load_weights``) needs the split
back; the manifest holds enough for it, so nothing else (a model config,
a side file) has to travel or be kept in step with the run. Kept apart
from :mod:`aurora_store.integrations.verl` so that it is usable, and
tested, without verl installed.
"""

from __future__ import annotations

from collections.abc import Mapping

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ConfigError

__all__ = ["hf_layout"]


def hf_layout(fused: Mapping[str, ParamSpec], where: str = "the run") -> dict[str, ParamSpec]:
    """Hugging Face names and shapes of the parameters a run carries under fused names (FORMAT.md §2).

    ``qkv_proj`` splits by its layer's ``o_proj`` (whose input width is q's
    rows; k and v share the rest), ``gate_up_proj`` in halves. The result
    must fuse back to exactly ``fused``, else :class:`ConfigError`: what a
    manifest says is untrusted.
    """
    out: dict[str, ParamSpec] = {}
    for name, spec in fused.items():
        if spec.dtype != "bfloat16" or not spec.shape:
            raise ConfigError(f"{where}: {name} is {spec.dtype} {list(spec.shape)}; versions are bfloat16 tensors")
        if name.endswith(("w13_weight", "w2_weight")):
            raise ConfigError(f"{where}: {name}: mixture-of-experts runs are not supported by the verl backend yet")
        pre, qkv, suf = name.rpartition(".qkv_proj.")
        pre2, gate_up, suf2 = name.rpartition(".gate_up_proj.")
        rows, rest = spec.shape[0], spec.shape[1:]
        if qkv:
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
    back = {n: (tuple(s.shape), s.dtype) for n, s in FusionPlan.from_specs(out).specs().items()}
    if back != {n: (tuple(s.shape), s.dtype) for n, s in fused.items()}:
        raise ConfigError(f"{where}: its parameters do not map back to Hugging Face names (an unknown fusion?)")
    return out
