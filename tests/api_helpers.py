"""Helpers of the public-API tests: a tiny causal LM, a plain training step, and a follower process.

``python tests/api_helpers.py follow STORE [REDIS] RUN UNTIL`` runs a
:class:`aurora_store.Follower` in its own process: it brings a freshly
initialised model to every version 0..UNTIL in turn and prints one JSON
line ``{"version", "digest", "path"}`` per version.
"""

from __future__ import annotations

import json
import sys

import torch


def tiny_lm(seed: int = 0) -> torch.nn.Module:
    """A Qwen3ForCausalLM of about 0.1 M parameters (tied head), float32."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(cfg)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One step of next-token loss on seeded random tokens."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def digest_of(weights: torch.nn.Module | dict[str, torch.Tensor]) -> str:
    """The FORMAT.md §4.1 digest of a model's (or state dict's) bf16 weights, in the tree form the Publisher writes."""
    from aurora_store.api.weights import named_tensors, tied_head
    from aurora_store.apply.sink import tree_weights_digest
    from aurora_store.codec.extract import plan_of

    named = {n: t.detach().to(torch.bfloat16) for n, t in named_tensors(weights)}
    return tree_weights_digest(named, plan_of(named, tied=tied_head(weights, named)))


def _follow(store: str, redis: str | None, run: str, until: int) -> None:
    from aurora_store import Follower

    model = tiny_lm(seed=99).to(torch.bfloat16)
    with Follower(store, redis=redis, run=run, poll_s=0.05) as f:
        for v in range(until + 1):
            while (f.latest() or -1) < v:
                f.wait(after=v - 1, timeout=30)
            u = f.update(model, version=v)
            print(json.dumps({"version": u.version, "digest": digest_of(model), "path": u.path}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "follow":
        store, redis, run, until = sys.argv[2], sys.argv[3] or None, sys.argv[4], int(sys.argv[5])
        _follow(store, redis, run, until)
