"""The weight of a mixture-of-experts model's router auxiliary loss in the Trainer's GRPO loss.

A mixture-of-experts model trained by RL alone can route most tokens to a few
experts (the policy gradient rewards whatever routing sampled well); the
model's authors train it with a load-balancing term that keeps the experts
used, and transformers computes that term as the model defines it when the
forward is asked for ``output_router_logits`` (``aux_loss``, weighted by the
config's ``router_aux_loss_coef`` in its own loss). The Trainer keeps the
same term at the same weight unless told otherwise
(:attr:`~workers.trainer.config.TrainerConfig.router_aux_loss_coef`); the
term itself is added in :func:`workers.trainer.fsdp.grpo_epochs`.
"""

from __future__ import annotations

from typing import Any

from aurora_store.errors import ConfigError

__all__ = ["has_router", "router_aux_coef"]


def has_router(model: Any) -> bool:
    """Whether ``model``'s forward can return a router auxiliary loss: its config declares ``output_router_logits``."""
    return hasattr(getattr(model, "config", None), "output_router_logits")


def router_aux_coef(model: Any, configured: float | None) -> float:
    """The weight the Trainer gives ``model``'s router auxiliary loss: ``configured``, or the
    model config's ``router_aux_loss_coef`` when None; 0 for a model without a router.

    A weight > 0 for a model without a router is refused with one line: it would
    silently train something other than what was asked for.
    """
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", type(model).__name__)
    if not has_router(model):
        if configured:
            raise ConfigError(f"router_aux_loss_coef {configured}: a {family} model has no router (only mixture-of-experts models do)")
        return 0.0
    if configured is not None:
        return float(configured)
    coef = getattr(config, "router_aux_loss_coef", 0.0)
    if not isinstance(coef, (int, float)) or not 0 <= coef < float("inf"):
        raise ConfigError(f"{family} config: router_aux_loss_coef {coef!r} is not a number >= 0")
    return float(coef)
