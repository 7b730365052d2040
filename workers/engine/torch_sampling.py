"""Batched sampling for the torch engine: prompts left-padded, a KV cache, every stop id honoured."""

from __future__ import annotations

import torch

from workers.engine.protocol import Completion, TokenCodec

__all__ = ["sample_rows"]


def sample_rows(
    model: torch.nn.Module,
    tokenizer: TokenCodec,
    dev: torch.device,
    rows: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    gen: torch.Generator,
) -> list[Completion]:
    """Sample one batch of left-padded ``rows`` to ``max_new_tokens`` each (greedy at temperature 0).

    One forward pass over the prompts, then one per token with the KV cache,
    ending as soon as every row emitted a stop id.
    """
    pad = tokenizer.pad_id
    # Every end-of-sequence id of the generation config (Qwen3 and Llama 3 have several).
    stops = torch.tensor(list(getattr(tokenizer, "stop_ids", (tokenizer.eos_id,))), dtype=torch.long, device=dev)
    b, width = len(rows), max(len(r) for r in rows)
    ids = torch.full((b, width), pad, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        attn[i, width - len(r) :] = 1
    ids, attn = ids.to(dev), attn.to(dev)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1)
    next_pos = pos[:, -1:] + 1
    finished = torch.zeros(b, dtype=torch.bool, device=dev)
    lengths = torch.zeros(b, dtype=torch.long, device=dev)
    ones = torch.ones((b, 1), dtype=attn.dtype, device=dev)
    steps: list[torch.Tensor] = []
    for t in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()
        if temperature == 0.0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
        lengths += (~finished).long()
        finished |= torch.isin(nxt, stops)
        steps.append(nxt)
        # One host sync per token; it ends the batch as soon as every row stopped.
        if t == max_new_tokens - 1 or bool(finished.all()):
            break
        attn = torch.cat([attn, ones], dim=-1)
        out = model(
            input_ids=nxt.unsqueeze(-1),
            attention_mask=attn,
            position_ids=next_pos,
            past_key_values=out.past_key_values,
            use_cache=True,
            logits_to_keep=1,
        )
        next_pos = next_pos + 1
    toks = torch.stack(steps, dim=1).cpu().tolist()
    lens = lengths.cpu().tolist()
    fin = finished.cpu().tolist()
    return [Completion(tuple(toks[i][: lens[i]]), tokenizer.decode(toks[i][: lens[i]]), bool(fin[i])) for i in range(b)]
