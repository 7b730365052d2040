"""The policy model: a tiny Qwen3 built from a config, its weights, and training helpers.

Nothing is downloaded: :func:`tiny_qwen3` builds a ``Qwen3ForCausalLM`` from
a ``Qwen3Config`` with seeded initialisation, so every process that calls it
with the same arguments holds the same bits. :func:`hf_weights` and
:func:`fusion_plan_for` are the one place that decides which tensors of a
Hugging Face model travel in a delta, so the Trainer (which extracts) and
the Actor's engine (which applies) cannot disagree: a tied ``lm_head.weight``
is the embedding's storage and is dropped from the plan
(``tied_lm_head=True``), as ``model.state_dict()`` lists it under both names.

:func:`warm_start` is a short supervised fine-tune on correct worked answers
that lifts sampling accuracy off zero, so GRPO has a signal; it trains in
float32 and casts back, because bf16 weights swallow most Adam-sized steps.
:func:`logprobs` is what the Trainer's GRPO loss needs.

Prompts are encoded with ``bos`` first (``tokenizer.encode(text, bos=True)``)
and completions end with ``eos``, here and in the engine.
"""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch

from aurora_store.api.weights import family_of
from aurora_store.codec.extract import fuse_weights, plan_of
from aurora_store.codec.fusion import EMBED, TIED_HEAD, FusionPlan
from aurora_store.errors import ModelMismatchError
from workers.activations import ACTIVATION_FLOOR_BYTES, LOGITS_CHUNK_BYTES, PASS_TOKENS, pass_tokens, rows_per_pass
from workers.fused_grad import embed as fused_embed
from workers.fused_grad import fusable, head_logprobs
from workers.task import Problem
from workers.tokenizer import CharTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "Packed",
    "WarmStartReport",
    "fused_weights",
    "fusion_plan_for",
    "hf_weights",
    "is_tied",
    "load_model",
    "logprobs",
    "pack_completions",
    "ACTIVATION_FLOOR_BYTES",
    "LOGITS_CHUNK_BYTES",
    "PASS_TOKENS",
    "pass_tokens",
    "rows_per_pass",
    "save_model",
    "tiny_qwen3",
    "warm_start",
]


# ---------------------------------------------------------------------------
# building


def tiny_qwen3(
    vocab_size: int,
    seed: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 192,
    max_positions: int = 256,
    tie_word_embeddings: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
) -> PreTrainedModel:
    """A ``Qwen3ForCausalLM`` of the given size, initialised from ``seed``.

    Initialisation runs in float32 under a forked RNG (the caller's global
    RNG state is left as it was), then the model is cast to ``dtype``; the
    same arguments give bit-identical weights on every machine and torch
    thread count we have seen. The defaults make about 0.1 M parameters (fast
    tests); the demo trains ``hidden=256, intermediate=768`` (1.3 M), wide
    enough that a gradient-sized step leaves most bf16 elements where they
    were, so a delta is sparse, while the narrow default changes 5-20% of
    its elements for the same effect (docs/BENCHMARKS.md, "The demo's regime")
    With ``tie_word_embeddings`` the output head *is* the embedding (one
    storage under two names); see :func:`fusion_plan_for`.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        attention_dropout=0.0,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    torch.nn.Module.to(model, dtype=dtype)
    model.generation_config.pad_token_id = pad_id
    return model.eval()


def save_model(model: PreTrainedModel, path: str | os.PathLike[str], tokenizer: CharTokenizer | None = None) -> None:
    """``save_pretrained`` (safetensors, config) plus ``tokenizer.json`` when given."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(os.fspath(path))
    if tokenizer is not None:
        tokenizer.save(os.path.join(os.fspath(path), "tokenizer.json"))


def load_model(path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    """A causal LM saved by :func:`save_model` (or any local Hugging Face folder); offline."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype, local_files_only=True)
    return model.eval()


# ---------------------------------------------------------------------------
# which tensors travel


def hf_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name: param.data}`` for every parameter name, tied names included.

    The tensors *are* the model's storage (no copies): writing into them
    changes the model. Buffers are not weights (rotary tables are recomputed).
    """
    return {n: p.data for n, p in model.named_parameters(remove_duplicate=False)}


def is_tied(weights: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``lm_head.weight`` shares storage with the embedding.

    Any other aliasing between parameters is refused: a delta would reach
    the same elements under two names and the digest would count them twice.
    """
    seen: dict[tuple[torch.device, int], str] = {}
    tied = False
    for name, t in weights.items():
        key = (t.device, t.untyped_storage().data_ptr())
        other = seen.get(key)
        if other is None:
            seen[key] = name
        elif {name, other} == {TIED_HEAD, EMBED} and t.data_ptr() == weights[other].data_ptr():
            tied = True
        else:
            raise ModelMismatchError(f"{name} shares storage with {other}; only {TIED_HEAD} may alias {EMBED}")
    return tied


def fusion_plan_for(
    weights: Mapping[str, torch.Tensor] | torch.nn.Module, tied: bool | None = None, family: str | None = None
) -> FusionPlan:
    """The fused view (FORMAT.md §2) of a Hugging Face model or its :func:`hf_weights`.

    ``tied=None`` reads tying from storage sharing (:func:`is_tied`); pass it
    explicitly for copies of the weights (``clone()`` unties them), or build
    the plan once from the model and reuse it. ``family`` (``model_type``)
    names the expert prefix of mixture-of-experts models (Mixtral's experts sit
    under ``block_sparse_moe.`` in FORMAT, under ``mlp.`` in transformers'
    modules); from a module it is read from its config when not given. The
    plan itself is :func:`aurora_store.codec.extract.plan_of`'s.
    """
    if isinstance(weights, torch.nn.Module):
        family = family or family_of(weights)
        w: Mapping[str, torch.Tensor] = hf_weights(weights)
    else:
        w = weights
    if tied is None:
        tied = is_tied(w)
    return plan_of(w, tied=tied, family=family)


def fused_weights(weights: Mapping[str, torch.Tensor], plan: FusionPlan | None = None) -> dict[str, torch.Tensor]:
    """New tensors under fused names (qkv_proj, gate_up_proj): what a snapshot or vLLM holds.

    :func:`aurora_store.codec.extract.fuse_weights` with the plan of
    :func:`fusion_plan_for` when none is given; the result never aliases ``weights``.
    """
    return fuse_weights(weights, plan if plan is not None else fusion_plan_for(weights))


# ---------------------------------------------------------------------------
# log-probabilities


class Packed(NamedTuple):
    """Prompt + completion rows, right-padded."""

    input_ids: torch.Tensor
    """[B, T] token ids, ``pad_id`` after each row's end."""
    attention_mask: torch.Tensor
    """[B, T] 1 over prompt and completion, 0 over padding."""
    completion_mask: torch.Tensor
    """[B, T] 1 over completion tokens only."""


def pack_completions(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    pad_id: int,
    device: torch.device | str | None = None,
) -> Packed:
    """Rows ``prompt + completion``, right-padded to the longest, with their masks."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not prompts:
        raise ValueError("nothing to pack")
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    comp = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if not p:
            raise ValueError(f"row {i}: empty prompt (at least bos is needed)")
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor([*p, *c], dtype=torch.long)
        attn[i, :n] = 1
        comp[i, len(p) : n] = 1
    return Packed(ids.to(device), attn.to(device), comp.to(device))


def logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    reduction: Literal["sum", "mean", "none"] = "sum",
    micro_batch: int = 0,
    chunk_tokens: int | None = None,
    router_aux: list[torch.Tensor] | None = None,
    fuse_grads: bool = False,
) -> torch.Tensor:
    """Log-probabilities of the completion tokens under ``model``, differentiable.

    ``reduction="none"`` gives [B, T] aligned with ``input_ids`` (entry ``t``
    is ``log p(input_ids[t] | input_ids[:t])``, 0 outside the completion);
    ``"sum"`` and ``"mean"`` reduce each row to [B]. Positions come from
    ``attention_mask``, so left- and right-padded rows both work. Softmax
    runs in float32 whatever the model's dtype.

    Memory does not grow with batch x tokens x vocabulary: the model's output
    head is applied only to completion positions, ``chunk_tokens`` of them at
    a time (default: about 64 MiB of float32 logits per chunk), and with
    gradients each chunk is recomputed in the backward pass instead of kept.
    ``micro_batch`` > 0 runs that many rows per forward; meant for calls
    without gradients (with gradients, every micro-batch's graph would be
    kept until the caller's backward: micro-batch the backward instead, as
    :func:`workers.trainer.fsdp.grpo_epochs` does).

    ``router_aux``: a mixture-of-experts model is asked for its router's auxiliary
    (load-balancing) loss as it defines it (``output_router_logits``), one tensor
    appended per forward, from the same pass as the log-probabilities.

    ``fuse_grads``: for a caller that only ever calls ``.backward()`` on the result (the GRPO
    update's passes, whose gradients accumulate): in one process, the embedding's and the output
    head's weight gradients are then added into their ``.grad`` in place by the backward pass
    (:mod:`workers.fused_grad`) instead of being handed to autograd, so no pass builds a second
    whole ``vocab x hidden`` gradient. ``torch.autograd.grad`` would not see them: leave it off there.
    """
    if input_ids.shape != attention_mask.shape or input_ids.shape != completion_mask.shape:
        raise ValueError(
            f"shapes differ: ids {list(input_ids.shape)}, attention {list(attention_mask.shape)}, completion {list(completion_mask.shape)}"
        )
    if bool(completion_mask[:, 0].any()):
        raise ValueError("a completion token at position 0 has no context to be predicted from")
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    rows = int(input_ids.shape[0])
    step = micro_batch if 0 < micro_batch < rows else rows
    parts = [
        _token_logprobs(
            model,
            input_ids[lo : lo + step],
            attention_mask[lo : lo + step],
            completion_mask[lo : lo + step],
            chunk_tokens,
            router_aux,
            fuse_grads,
        )
        for lo in range(0, rows, step)
    ]
    tok = parts[0] if len(parts) == 1 else torch.cat(parts)
    if reduction == "none":
        return tok
    total = tok.sum(-1)
    if reduction == "sum":
        return total
    return total / completion_mask[:, 1:].sum(-1).clamp(min=1).to(total.dtype)


def _token_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attn: torch.Tensor,
    comp: torch.Tensor,
    chunk_tokens: int | None,
    router_aux: list[torch.Tensor] | None = None,
    fuse_grads: bool = False,
) -> torch.Tensor:
    """[B, T] per-token log-probabilities of one micro-batch, 0 outside the completion (see :func:`logprobs`)."""
    position_ids = (attn.long().cumsum(-1) - 1).clamp(min=0)
    extra = {"output_router_logits": True} if router_aux is not None else {}
    head = _output_head(model)
    if head is None:  # not a Hugging Face causal LM: the plain computation
        out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=False, **extra)
        _keep_aux(out, router_aux)
        logits = out.logits[:, :-1].float()
        tok = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
        return torch.nn.functional.pad(tok * comp[:, 1:].to(tok.dtype), (1, 0))
    # The head runs inside the model's forward (where a sharded model's weights are
    # gathered), on the completion positions only, in chunks. In one process the embedding's and
    # the head's weight gradients are added into .grad in place (workers.fused_grad), not built whole.
    one_process = fuse_grads and not _sharded(model)
    chunked = _CompletionHead(head, ids, comp, chunk_tokens, fuse=one_process)
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    if one_process and isinstance(emb, torch.nn.Embedding) and fusable(emb, torch.nn.Embedding):
        inputs = {"inputs_embeds": fused_embed(emb, ids)}
    setter = getattr(model, "set_output_embeddings")  # noqa: B009 - the Hugging Face API, checked by _output_head
    setter(chunked)
    try:
        out = model(**inputs, attention_mask=attn, position_ids=position_ids, use_cache=False, **extra)
    finally:
        setter(head)
    _keep_aux(out, router_aux)
    tok = out.logits
    assert isinstance(tok, torch.Tensor) and tok.shape == ids.shape
    return tok


def _sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP shards ``model`` (it then reduce-scatters each pass's gradients itself)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _keep_aux(out: object, router_aux: list[torch.Tensor] | None) -> None:
    """Append a forward's router auxiliary loss to ``router_aux`` (when asked for one)."""
    if router_aux is None:
        return
    aux = getattr(out, "aux_loss", None)
    if not isinstance(aux, torch.Tensor):
        raise TypeError(f"{type(out).__name__}: the model returned no router auxiliary loss (aux_loss): not a mixture-of-experts model")
    router_aux.append(aux)


def _output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """A Hugging Face causal LM's output projection, when it can be swapped for a call."""
    get = getattr(model, "get_output_embeddings", None)
    if get is None or not callable(getattr(model, "set_output_embeddings", None)):
        return None
    head = get()
    return head if isinstance(head, torch.nn.Module) else None


class _CompletionHead(torch.nn.Module):
    """Stands in for the output head during one forward: returns [B, T] token log-probs, not [B, T, vocab] logits."""

    def __init__(self, head: torch.nn.Module, ids: torch.Tensor, comp: torch.Tensor, chunk_tokens: int | None, fuse: bool = False) -> None:
        super().__init__()
        self.head = head
        self.ids = ids
        self.comp = comp
        self.chunk_tokens = chunk_tokens
        self.fuse = fuse
        """Whether a plain float32 head may accumulate its weight gradient in place (:func:`workers.fused_grad.head_logprobs`)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.head
        b, t = self.ids.shape
        where = self.comp[:, 1:].bool()
        h = hidden[:, :-1][where]  # [N, H]: the states that predict a completion token
        targets = self.ids[:, 1:][where]
        n = int(h.shape[0])
        vocab = int(getattr(head, "out_features", 0) or getattr(getattr(head, "weight", None), "shape", (1,))[0])
        step = self.chunk_tokens or max(1, LOGITS_CHUNK_BYTES // (4 * max(1, vocab)))
        grad = torch.is_grad_enabled() and h.requires_grad
        fused = grad and self.fuse and fusable(head, torch.nn.Linear)
        parts = []
        for lo in range(0, n, step):
            if fused:  # recomputes the chunk's logits in its backward, as the checkpoint below does
                assert isinstance(head, torch.nn.Linear)
                parts.append(head_logprobs(head, h[lo : lo + step], targets[lo : lo + step]))
            elif grad:
                from torch.utils.checkpoint import checkpoint

                parts.append(checkpoint(_chunk_logprobs, head, h[lo : lo + step], targets[lo : lo + step], use_reentrant=False))
            else:
                parts.append(_chunk_logprobs(head, h[lo : lo + step], targets[lo : lo + step]))
        flat = torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)
        out = hidden.new_zeros((b, t - 1), dtype=torch.float32)
        out = out.masked_scatter(where, flat) if n else out
        return torch.nn.functional.pad(out, (1, 0))


def _chunk_logprobs(head: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(h).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


# ---------------------------------------------------------------------------
# warm start


@dataclass(frozen=True, slots=True)
class WarmStartReport:
    """What a warm start did."""

    steps: int
    seconds: float
    first_loss: float
    """Mean completion-token NLL of the first batch."""
    last_loss: float
    """Mean completion-token NLL of the last batch."""


def warm_start(
    model: torch.nn.Module,
    tokenizer: CharTokenizer,
    problems: Sequence[Problem],
    steps: int = 100,
    lr: float = 1e-2,
    seed: int = 0,
    batch_size: int = 64,
) -> WarmStartReport:
    """Supervised fine-tune on ``problem.solution`` + ``eos``, written back in place.

    AdamW on a float32 master copy, loss = mean NLL of the completion tokens,
    batches drawn with ``seed``; the result is rounded into the model's own
    parameter storage (same tensors, same dtype), so an engine that holds
    the model sees it without reloading (its digest changes, of course). Meant to be short: enough for GRPO to find
    some rewarded samples, not to solve the task.
    """
    if steps < 0 or batch_size < 1:
        raise ValueError(f"steps must be >= 0 and batch_size >= 1, got {steps}, {batch_size}")
    if not problems:
        raise ValueError("warm start needs problems")
    missing = [p.id for p in problems if not p.solution]
    if missing:
        raise ValueError(f"problems without a worked solution: {missing[:5]}")
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    rng = random.Random(f"aurora-warm-start/{seed}")
    encoded = [(tokenizer.encode(p.prompt_text, bos=True), tokenizer.encode(p.solution, eos=True)) for p in problems]
    # Float32 master copy for the run; its result is copied back into the
    # model's own storage, so tensors held elsewhere (an engine) stay valid.
    master = copy.deepcopy(model).float().train().requires_grad_(True)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (1.0 - s / max(1, steps)))
    first = last = float("nan")
    for step in range(steps):
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
        packed = pack_completions([b[0] for b in batch], [b[1] for b in batch], tokenizer.pad_id, device)
        loss = -logprobs(master, *packed, reduction="mean").mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        opt.step()
        sched.step()
        last = float(loss.detach())
        if step == 0:
            first = last
    with torch.no_grad():
        for (name, dst), (mname, src) in zip(model.named_parameters(), master.named_parameters(), strict=True):
            assert name == mname
            dst.copy_(src)
    return WarmStartReport(steps, time.perf_counter() - t0, first, last)
