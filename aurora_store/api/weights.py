"""What the public API accepts as "a set of tensors", and how it reads them one parameter at a time.

A ``torch.nn.Module`` (its parameters, tied names included), or a mapping of
names to tensors: Hugging Face names (``q_proj`` ...) or fused names
(``qkv_proj`` ...), on any device. Parameters sharded by FSDP2 (DTensors)
are gathered one at a time (a collective every rank joins), so the full
model is never held twice on one device.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from aurora_store.codec.fusion import EMBED, TIED_HEAD
from aurora_store.errors import ConfigError

__all__ = ["Tensors", "is_distributed_rank", "leader", "named_tensors", "tied_head"]

Tensors = torch.nn.Module | Mapping[str, torch.Tensor]
"""A model, or a mapping name -> tensor (Hugging Face or fused names)."""


def named_tensors(weights: Tensors) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter, tied names included; DTensors as they are (see :func:`full`)."""
    if isinstance(weights, torch.nn.Module):
        for n, p in weights.named_parameters(remove_duplicate=False):
            yield n, p.data if not _is_dtensor(p) else p
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
