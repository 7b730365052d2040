"""What the public API accepts as "a set of tensors", and how it reads them one parameter at a time.

A ``torch.nn.Module`` (its parameters, tied names included), or a mapping of
names to tensors: Hugging Face names (``q_proj`` ...) or fused names
(``qkv_proj`` ...), on any device. Parameters sharded by FSDP2 (DTensors)
are gathered one at a time (a collective every rank joins), so the full
model is never held twice on one device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from aurora_store.codec.fusion import EMBED, TIED_HEAD
from aurora_store.errors import ConfigError

__all__ = ["ROUTER_BIAS", "Tensors", "family_of", "gather_bf16", "is_distributed_rank", "leader", "named_tensors", "tied_head"]

ROUTER_BIAS = "e_score_correction_bias"
"""A DeepSeek-style router's bias buffer (``…mlp.gate.e_score_correction_bias``), published with the weights."""

Tensors = torch.nn.Module | Mapping[str, torch.Tensor]
"""A model, or a mapping name -> tensor (Hugging Face or fused names)."""


def named_tensors(weights: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter, tied names included, and of every DeepSeek-style router bias
    (:data:`ROUTER_BIAS`); DTensors as they are (see :func:`full`).

    Why the router biases: transformers keeps them as buffers (saved in the checkpoint, never
    trained), and an engine that did not receive them would route tokens with zeros in their place:
    another model. They travel like weights, under their own names."""
    if isinstance(weights, torch.nn.Module):
        for n, p in weights.named_parameters(remove_duplicate=False):
            yield n, p.data if not _is_dtensor(p) else p
        for n, b in weights.named_buffers():
            if n.rsplit(".", 1)[-1] == ROUTER_BIAS:
                yield n, b
        return
    if not isinstance(weights, Mapping):
        raise ConfigError(f"expected a torch.nn.Module or a mapping of names to tensors, got {type(weights).__name__}")
    for n, t in weights.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{n!r}: expected a tensor, got {type(t).__name__}")
        yield n, t


def _is_dtensor(t: Any) -> bool:
    return callable(getattr(t, "full_tensor", None))


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (collective: every rank must call this in the same order)."""
    return t.full_tensor() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def gather_bf16(
    named: Iterable[tuple[str, torch.Tensor]],
    leader: bool,
    device: torch.device | None = None,
    owned: bool = False,
) -> dict[str, torch.Tensor]:
    """bf16 copies of every named tensor on the leader (``{}`` elsewhere), gathered one at a time.

    Every rank must pass the same names in the same order: a sharded tensor's
    gather is a collective. Tied names (one tensor twice) are gathered once
    and share the copy, as in the model. ``device``: where the copies go
    (default: where each tensor is). ``owned``: a tensor already bf16 where it
    is may be used as it is instead of copied (the caller never writes it again).
    """
    out: dict[str, torch.Tensor] = {}
    seen: dict[Any, torch.Tensor] = {}
    for name, t in named:
        key = id(t) if _is_dtensor(t) else (t.device, t.data_ptr(), tuple(t.shape))
        if key in seen:
            if leader:
                out[name] = seen[key]
            continue
        whole = full(t.detach())
        if leader:
            copy = whole.to(device=device if device is not None else whole.device, dtype=torch.bfloat16)
            if copy.data_ptr() == whole.data_ptr() and not owned:
                copy = copy.clone()
            seen[key] = out[name] = copy.contiguous()
        else:
            seen[key] = torch.empty(0)
        del whole
    return out


def tied_head(weights: Tensors, named: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``lm_head.weight`` is the embedding (one storage under two names)."""
    if TIED_HEAD not in named or EMBED not in named:
        return False
    if isinstance(weights, torch.nn.Module):
        cfg = getattr(weights, "config", None)
        tie = getattr(cfg, "tie_word_embeddings", None)
        if isinstance(tie, bool):
            return tie
        params = dict(weights.named_parameters(remove_duplicate=False))
        return params[TIED_HEAD] is params[EMBED]
    a, b = named[TIED_HEAD], named[EMBED]
    return bool(a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.device == b.device)


def family_of(weights: Tensors) -> str | None:
    """A model's ``config.model_type`` (None for a mapping, or a module without a config).

    The fused names of some families' experts depend on it (Mixtral's live
    under ``block_sparse_moe`` in the format, under ``mlp`` in transformers 5's
    memory: FORMAT.md §2), and names alone cannot tell.
    """
    cfg = getattr(weights, "config", None) if isinstance(weights, torch.nn.Module) else None
    family = getattr(cfg, "model_type", None)
    return family if isinstance(family, str) else None


def is_distributed_rank() -> tuple[bool, int]:
    """(torch.distributed is initialized, this process's rank)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return True, int(dist.get_rank())
    return False, 0


def leader() -> bool:
    """Rank 0, or no process group at all."""
    return is_distributed_rank()[1] == 0


def copy_into(dst: MutableMapping[str, torch.Tensor] | torch.nn.Module, src: Mapping[str, torch.Tensor]) -> None:
    """Write ``src`` into ``dst``'s tensors in place (names must match; dtypes and devices converted)."""
    targets = dict(named_tensors(dst))
    missing = sorted(set(targets) - set(src))
    if missing:
        raise ConfigError(f"the version does not hold {missing[:3]}{' …' if len(missing) > 3 else ''} that the target has")
    with torch.no_grad():
        for n, t in targets.items():
            s = src[n]
            if tuple(s.shape) != tuple(t.shape):
                raise ConfigError(f"{n}: the version holds shape {tuple(s.shape)}, the target {tuple(t.shape)}")
            t.copy_(s.to(device=t.device, dtype=t.dtype))
