"""How many tokens one forward/backward pass may cover: activations near one byte per parameter.

The Trainer's memory budget (issue 25) is 18 bytes per parameter plus activations
that do not grow with the batch; :func:`pass_tokens` sizes a pass so that what
autograd keeps for it stays near one byte per parameter of the model.

What a pass keeps, traced on Qwen3-style decoder layers in float32 (the bytes of
the distinct storages ``torch.autograd.graph.saved_tensors_hooks`` sees, one layer
more minus one layer less, ``tests/test_trainer_memory_activations.py``): per
token and layer about ``4 x (6 h + 4 I + 4 q + 4 kv)`` bytes, ``h`` the hidden
size, ``I`` the MLP's intermediate size, ``q`` and ``kv`` the widths of the
queries and of the keys (values as wide): the two RMSNorms' inputs and
normalised outputs and the residual stream (6 h); the MLP's gate and up outputs,
the SiLU of the gate and the product that enters ``down_proj`` (4 I); the
queries and keys before and after their norms and the rotary embedding (4 q,
and 4 kv for keys and values). For the 0.2 B shape of ``aurora bench trainer``
(h 768, I 2304, q 768, kv 384) that is 73.7 KB per token and layer; the estimate
used before (14 h float32 values, 43 KB) left out the MLP's intermediate
values, and the passes it sized kept 1.3-1.7 bytes per parameter instead of one.

Then the output head: it runs on the completion positions only, in chunks of
about 64 MiB of float32 logits each recomputed in the backward pass
(:func:`workers.model.logprobs`), so it adds a transient of about three
float32 logits per position of one chunk (the head's output, its float32 copy
and the softmax or its gradient): ``12 x vocab`` bytes per token, up to a
chunk's tokens.

With activation checkpointing a layer keeps only its input (4 h bytes per token)
and one layer at a time is recomputed whole during the backward pass.
"""

from __future__ import annotations

__all__ = [
    "ACTIVATION_FLOOR_BYTES",
    "HEAD_BYTES_PER_LOGIT",
    "LOGITS_CHUNK_BYTES",
    "PASS_TOKENS",
    "layer_bytes_per_token",
    "pass_tokens",
    "rows_per_pass",
]

PASS_TOKENS = 4096
"""Tokens (rows x padded width) one forward/backward pass covers when nothing else is known."""

ACTIVATION_FLOOR_BYTES = 64 << 20
"""Activation memory :func:`pass_tokens` allows whatever the model's size."""

LOGITS_CHUNK_BYTES = 64 << 20
"""Float32 logits one chunk of :func:`workers.model.logprobs` may hold (the default ``chunk_tokens`` follows from it)."""

HEAD_BYTES_PER_LOGIT = 12
"""Bytes the output head holds per logit of the chunk it computes: about three float32 values (see the module)."""


def layer_bytes_per_token(
    hidden_size: int, intermediate_size: int | None = None, q_width: int | None = None, kv_width: int | None = None
) -> int:
    """Bytes one decoder layer keeps per token for its backward pass (see the module's docstring).

    What is not known is taken as a dense Llama-style layer would have it: ``intermediate_size``
    4 h, ``q_width`` h and ``kv_width`` h (no grouped queries).
    """
    h = max(1, hidden_size)
    i = intermediate_size if intermediate_size else 4 * h
    q = q_width if q_width else h
    kv = kv_width if kv_width else h
    return 4 * (6 * h + 4 * i + 4 * q + 4 * kv)


def pass_tokens(
    hidden_size: int,
    layers: int,
    params: int,
    checkpointing: bool,
    *,
    intermediate_size: int | None = None,
    q_width: int | None = None,
    kv_width: int | None = None,
    vocab: int = 0,
) -> int:
    """Tokens per forward/backward pass that keep a causal LM's activations near one byte per
    parameter (at least :data:`ACTIVATION_FLOOR_BYTES`: small models run their batch in few passes).

    Without checkpointing each token costs :func:`layer_bytes_per_token` in every layer; with
    it, its input in every layer plus one layer recomputed whole. The output head adds
    :data:`HEAD_BYTES_PER_LOGIT` x ``vocab`` per token, for at most one chunk's tokens.
    """
    layer = layer_bytes_per_token(hidden_size, intermediate_size, q_width, kv_width)
    n = max(1, layers)
    per_token = 4 * max(1, hidden_size) * n + layer if checkpointing else layer * n
    budget = max(params, ACTIVATION_FLOOR_BYTES)
    head = HEAD_BYTES_PER_LOGIT * max(0, vocab)
    tokens = budget // (per_token + head)
    chunk = LOGITS_CHUNK_BYTES // (4 * vocab) if vocab > 0 else 0
    if head and tokens > chunk:
        # Past one chunk the head's transient stops growing: what is left goes to the layers.
        tokens = max(chunk, (budget - chunk * head) // per_token)
    return max(1, int(tokens))


def rows_per_pass(micro_batch: int, width: int, tokens: int = PASS_TOKENS) -> int:
    """Rows per forward pass: ``micro_batch`` when > 0, else as many rows of ``width`` tokens as
    ``tokens`` holds (at least one), so activations do not grow with the batch."""
    if micro_batch > 0:
        return micro_batch
    return max(1, tokens // max(1, width))
