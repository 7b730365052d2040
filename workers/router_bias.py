"""DeepSeek-style router biases (``…mlp.gate.e_score_correction_bias``) held as frozen parameters, so that they travel.

``glm4_moe`` (and DeepSeek-V3) pick experts by ``sigmoid(router logits) +
e_score_correction_bias``; transformers keeps that bias as a float32
*buffer*: saved in the checkpoint, never trained. Everything that moves
weights here (the Trainer's versions, the plan, snapshots and deltas, an
Actor's engine, ``aurora follow``) moves *parameters*; a buffer would be
left behind, and an Actor built from the stored config would route with
transformers' initial zeros: another model, with nothing to show for it.

:func:`bias_as_parameter` re-registers each such buffer as a parameter with
``requires_grad=False`` under the same name, in every model this code
builds (the Trainer's, a sharded Trainer rank's, an Actor's, a follower's).
It then travels like any weight, and its checkpoint value is read like any
weight (a sharded rank reads parameters from the safetensors files, where
a buffer would keep its zeros). The optimizer never moves it (no gradient),
so every delta leaves it as version 0 had it.

Precision: versions are bf16, so the Actors' copy is the bf16 rounding of
the checkpoint's float32 bias. That is what they would hold anyway: an
engine casts a model's floating buffers to its dtype (bf16), and the
Trainer's behaviour model does the same so that its log-probs are the
Actors'. The Trainer's fp32 master keeps the checkpoint's value.
"""

from __future__ import annotations

import torch

__all__ = ["ROUTER_BIAS", "bias_as_parameter"]

ROUTER_BIAS = "e_score_correction_bias"
"""The buffer's attribute name in transformers' DeepSeek-style routers."""


def bias_as_parameter(model: torch.nn.Module) -> list[str]:
    """Re-register every router-bias buffer of ``model`` as a frozen parameter (same name, value, dtype); their names.

    On a model whose parameters are on the meta device (a sharded Trainer
    builds it so and reads each rank's shard afterwards), the parameter is a
    meta tensor too, to be read from the checkpoint with the others.
    Idempotent: a bias that is already a parameter is left as it is.
    """
    meta = any(p.device.type == "meta" for p in model.parameters())
    moved: list[str] = []
    for path, sub in model.named_modules():
        buf = sub._buffers.get(ROUTER_BIAS)
        if buf is None:
            continue
        value = buf.detach().to("meta") if meta else buf.detach().clone()
        del sub._buffers[ROUTER_BIAS]
        sub._non_persistent_buffers_set.discard(ROUTER_BIAS)
        sub.register_parameter(ROUTER_BIAS, torch.nn.Parameter(value, requires_grad=False))
        moved.append(f"{path}.{ROUTER_BIAS}" if path else ROUTER_BIAS)
    return moved
