"""The torch engine's fused view of a model, mixture-of-experts layers included.

transformers 5 holds a layer's routed experts packed, ``…experts.gate_up_proj``
``[E, 2I, H]`` (each expert's gate rows, then its up rows) and
``…experts.down_proj`` ``[E, H, I]``: the very layout of FORMAT.md §2's
``…experts.w13_weight`` and ``…experts.w2_weight``. The fusion plan maps
each to its format name as a single block, so a delta's entries land in the
packed parameter with one scatter over flat indices per tensor, in place,
with no per-expert loop and no copy; the digest reads the same bytes under
the format names. Mixtral's format module (``block_sparse_moe``) differs
from its module in memory (``mlp``), which only the family tells, hence
the plan is built with the model's ``model_type``.

transformers can hold experts in other layouts (``is_transposed``,
interleaved gate and up rows, no gate): those are refused when the model is
loaded, with one line naming the module, never written at the wrong
places. Per-expert modules (older code) still work, one block per expert.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from aurora_store.api.weights import family_of
from aurora_store.codec.extract import plan_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ModelMismatchError
from workers.model import is_tied

__all__ = ["engine_plan"]

#: transformers' experts attributes (``use_experts_implementation``) and the values FORMAT.md §2's layout needs.
_FORMAT_LAYOUT = {"is_transposed": False, "is_concatenated": True, "has_gate": True}

#: packed parameter -> the format tensor it must be the single block of.
_PACKED = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


def engine_plan(model: torch.nn.Module, weights: Mapping[str, torch.Tensor]) -> FusionPlan:
    """The fusion plan of ``model`` (its :func:`~workers.model.hf_weights` ``weights``), its experts checked.

    Raises :class:`~aurora_store.errors.ModelMismatchError` (one line) for
    packed experts in a layout other than FORMAT.md §2's, or packed experts
    the fusion map does not carry under a format name (a family it does not know).
    """
    plan = plan_of(weights, tied=is_tied(weights), family=family_of(model))
    for mod_name, module in model.named_modules():
        packed = [p for p in _PACKED if isinstance(getattr(module, p, None), torch.nn.Parameter) and getattr(module, p).dim() == 3]
        if not packed:
            continue
        for attr, want in _FORMAT_LAYOUT.items():
            got = getattr(module, attr, want)
            if got != want:
                raise ModelMismatchError(
                    f"{mod_name}: {type(module).__name__} holds its experts with {attr}={got}; "
                    f"deltas name them in FORMAT.md §2's layout ({attr}={want}) and are not written into another"
                )
        for p in packed:
            source = f"{mod_name}.{p}"
            fused, block = plan.source(source)
            param = plan.params[fused]
            if not fused.endswith(f"experts.{_PACKED[p]}") or len(param.blocks) != 1 or block.offset:
                raise ModelMismatchError(
                    f"{source}: packed experts of a model_type ({family_of(model)}) the fusion map does not name; "
                    f"FORMAT.md §2 carries them as …experts.{_PACKED[p]}"
                )
    return plan
