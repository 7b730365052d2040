"""An optimizer's state in a checkpoint: its tensors by name, the rest as JSON, and the state
an Adam optimizer starts with (made before the first checkpoint).

Split from :mod:`~workers.trainer.checkpoint` (which re-exports these names): the
checkpoint's records and objects there, the optimizer's own bookkeeping here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["load_optimizer", "make_optimizer_state", "optimizer_tensors"]


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's state as (tensors, JSON): per-parameter tensors by ``opt.<i>.<name>``,
    non-tensor values and the parameter groups in the JSON part."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt.{idx}.{k}"] = v
            else:
                scalars.setdefault(str(idx), {})[k] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    """Restore what :func:`optimizer_tensors` saved."""
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        if name.startswith("opt."):
            _, idx, k = name.split(".", 2)
            state.setdefault(int(idx), {})[k] = t
    for idx, kv in (meta.get("scalars") or {}).items():
        state.setdefault(int(idx), {}).update(kv)
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def make_optimizer_state(opt: torch.optim.Optimizer) -> bool:
    """Give an Adam or AdamW optimizer whose state is still empty the state its first step would
    make (step 0, zero moments); True if it did. Any other optimizer is left as it is.

    Why: the first checkpoint (before step 0) then holds what every later one holds, so the
    local spool it is copied into (:mod:`~workers.trainer.ckpt_async`) has its full size from the
    start and the checkpoints after it are copied into pages already there; the moments take
    their memory at the start instead of at the first step. The first step finds the state and
    computes exactly what it would have from an empty one.
    """
    if not isinstance(opt, torch.optim.Adam) or opt.state:  # AdamW is an Adam
        return False
    from torch.optim.optimizer import _get_scalar_dtype

    for group in opt.param_groups:
        on_device = bool(group.get("capturable")) or bool(group.get("fused"))
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = opt.state[p]
            # As torch's Adam._init_group: the step on the parameter's device only when capturable or fused.
            if on_device:
                state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=bool(group.get("fused"))), device=p.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return True
