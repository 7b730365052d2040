"""The embedding's and the output head's weight gradients, accumulated in place into ``.grad``.

Why: a step runs several forward and backward passes (micro-batches), and
autograd builds each pass's gradient of a weight whole before it adds it into
the ``.grad`` the earlier passes left. For most weights that is one layer's
worth, but the input embedding and the output head are ``vocab x hidden``
each, the largest tensors of a model (a quarter of a 0.2 B one at a vocabulary
of 32,768): every pass after the first held a second float32 copy of one of
them at the step's peak, about 0.5 bytes per parameter at 0.2 B (measured with
``aurora bench trainer --params 2e8``, docs/BENCHMARKS.md). Megatron-LM's
"gradient accumulation fusion" is the same idea for its linear layers.

Here the two weights' gradients never exist whole beside ``.grad``:

- :func:`embed` looks rows up as ``torch.nn.functional.embedding`` does; its
  backward sums each pass's rows per distinct token (a tensor of the pass's
  tokens, not of the vocabulary) and adds them into ``.grad`` with
  ``index_add_``;
- :func:`head_logprobs` is the output head and the log-probability of each
  target token in one function; its backward recomputes the chunk's logits
  (as the checkpointed chunk did) and adds ``grad_logits^T @ hidden`` into
  ``.grad`` a block of vocabulary rows at a time.

Both return no gradient for the weight to autograd. The sums are autograd's:
the same products, added in the same order (per element, ``.grad + this
pass's sum``), so the gradients are bit-identical to autograd's on the BLAS
tested here (tests/test_fused_grad.py checks that, and holds them within
float tolerance anyway). Only plain float32 ``nn.Embedding`` / bias-free
``nn.Linear`` weights that are leaves of one process's model take this path
(:func:`fusable`); a sharded (FSDP) module reduce-scatters each pass's
gradient itself and keeps autograd's path.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HEAD_BLOCK_BYTES", "embed", "fusable", "head_logprobs"]

HEAD_BLOCK_BYTES = 8 << 20
"""Bytes of the head's weight gradient computed at a time (a block of vocabulary rows) before it is added into ``.grad``."""


def fusable(module: Any, kind: type[torch.nn.Module]) -> bool:
    """Whether ``module`` is exactly ``kind`` (``nn.Embedding`` or a bias-free ``nn.Linear``) with a float32
    weight that is a trainable leaf, autograd is recording, and nothing shards or hooks the module."""
    if type(module) is not kind or not torch.is_grad_enabled():
        return False
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.nn.Parameter) or not w.requires_grad or not w.is_leaf or w.dtype != torch.float32:
        return False
    if type(w) is not torch.nn.Parameter or getattr(w, "_backward_hooks", None) or getattr(w, "_post_accumulate_grad_hooks", None):
        return False  # a DTensor or a hooked parameter: someone else handles its gradient
    if module._forward_hooks or module._forward_pre_hooks or torch.nn.modules.module._global_forward_hooks:
        return False  # the module's call is bypassed: whoever hooks it would not see it
    if kind is torch.nn.Linear:
        return getattr(module, "bias", None) is None
    return kind is torch.nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse


def embed(module: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """``module(ids)``, its weight's gradient accumulated in place (see the module's docstring)."""
    out: torch.Tensor = _Embed.apply(ids, module.weight, module.padding_idx)
    return out


def head_logprobs(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(head(hidden).float())[i, targets[i]]`` per row, the head's gradient accumulated in place."""
    out: torch.Tensor = _HeadLogprobs.apply(hidden, head.weight, targets)
    return out


def _grad_of(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``weight.grad``, made (uninitialised) when there is none yet; whether it was made now."""
    if weight.grad is None:
        weight.grad = torch.empty_like(weight, memory_format=torch.contiguous_format)
        return weight.grad, True
    return weight.grad, False


class _Embed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight  # written to, never differentiated through (no saved-tensor version check needed)
        ctx.padding_idx = padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        weight: torch.Tensor = ctx.weight
        g = grads[0]
        flat = ids.reshape(-1)
        rows = g.reshape(-1, weight.shape[1])
        if ctx.padding_idx is not None:
            keep = flat != ctx.padding_idx
            flat, rows = flat[keep], rows[keep]
        # One row per distinct token, summed in the tokens' order (as autograd's dense backward sums them).
        uniq, inverse = torch.unique(flat, return_inverse=True)
        summed = rows.new_zeros((int(uniq.numel()), int(weight.shape[1]))).index_add_(0, inverse, rows.to(weight.dtype))
        grad, fresh = _grad_of(weight)
        with torch.no_grad():
            if fresh:
                grad.zero_()
                grad.index_copy_(0, uniq, summed)
            else:
                grad.index_add_(0, uniq, summed)
        return None, None, None


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden, weight).float()
        lse = logits.logsumexp(-1)
        ctx.save_for_backward(hidden, targets, lse)
        ctx.weight = weight
        return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        hidden, targets, lse = ctx.saved_tensors
        weight: torch.Tensor = ctx.weight
        g = grads[0]
        with torch.no_grad():
            logits = torch.nn.functional.linear(hidden, weight).float()
            # d/dlogits of (logits[target] - logsumexp): -g * softmax, plus g at the target, computed as
            # autograd does (exp(logits - lse) * -g, then + (0 + g) scattered), so the bits are the same.
            dlogits = logits.sub_(lse.unsqueeze(-1)).exp_().mul_(g.neg().unsqueeze(-1))
            dlogits.scatter_add_(-1, targets.unsqueeze(-1), g.add(0.0).unsqueeze(-1))
            dlogits = dlogits.to(weight.dtype)
            grad_hidden = dlogits.mm(weight) if ctx.needs_input_grad[0] else None
            grad, fresh = _grad_of(weight)
            step = max(1, HEAD_BLOCK_BYTES // max(1, weight.shape[1] * weight.element_size()))
            for lo in range(0, int(weight.shape[0]), step):
                part = dlogits[:, lo : lo + step].t().mm(hidden.to(weight.dtype))
                if fresh:
                    grad[lo : lo + step].copy_(part)
                else:
                    grad[lo : lo + step].add_(part)
        return grad_hidden, None, None
