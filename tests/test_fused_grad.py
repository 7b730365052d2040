"""workers.fused_grad: the embedding's and the head's weight gradients added into ``.grad`` in place
are autograd's, over several passes (micro-batches) that accumulate, and nothing else changes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from workers.fused_grad import HEAD_BLOCK_BYTES, embed, fusable, head_logprobs
from workers.model import _chunk_logprobs, logprobs, pack_completions, tiny_qwen3


def _passes(
    vocab: int, hidden: int, seed: int, n_passes: int = 3, tokens: int = 37
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(hidden states, targets, upstream gradient) per pass; targets repeat within and across passes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_passes):
        h = torch.randn(tokens, hidden, generator=g)
        targets = torch.randint(0, min(vocab, 11), (tokens,), generator=g)  # few distinct ids: many repeats
        targets[::5] = torch.randint(0, vocab, (len(targets[::5]),), generator=g)
        up = torch.randn(tokens, generator=g)
        up[::7] = 0.0  # clipped or masked tokens give exact zeros upstream
        out.append((h, targets, up))
    return out


@pytest.mark.parametrize("vocab", [1000, 40001])
def test_head_gradient_is_autograds_bit_for_bit(vocab: int) -> None:
    hidden = 64
    torch.manual_seed(0)
    ref = torch.nn.Linear(hidden, vocab, bias=False)
    fused = copy.deepcopy(ref)
    assert fusable(fused, torch.nn.Linear)
    # 40,001 rows: two blocks of the gradient, the second short (one block holds 32,768 rows of 64).
    assert vocab < HEAD_BLOCK_BYTES // (hidden * 4) or vocab % (HEAD_BLOCK_BYTES // (hidden * 4))
    for h, targets, up in _passes(vocab, hidden, seed=vocab):
        h_ref = h.clone().requires_grad_(True)
        h_fused = h.clone().requires_grad_(True)
        out_ref = checkpoint(_chunk_logprobs, ref, h_ref, targets, use_reentrant=False)  # the path before fusion
        out_fused = head_logprobs(fused, h_fused, targets)
        assert torch.equal(out_ref, out_fused)
        (out_ref * up).sum().backward()
        (out_fused * up).sum().backward()
        assert h_ref.grad is not None and h_fused.grad is not None
        assert torch.equal(h_ref.grad, h_fused.grad)
        assert ref.weight.grad is not None and fused.weight.grad is not None
        torch.testing.assert_close(fused.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-7)
        assert torch.equal(fused.weight.grad, ref.weight.grad)  # same products, same order of sums


def test_embedding_gradient_is_autograds_bit_for_bit() -> None:
    vocab, hidden = 500, 48
    torch.manual_seed(1)
    ref = torch.nn.Embedding(vocab, hidden, padding_idx=0)
    fused = copy.deepcopy(ref)
    assert fusable(fused, torch.nn.Embedding)
    for _, ids, _ in _passes(vocab, hidden, seed=3, tokens=60):
        ids = ids.view(4, 15)
        ids[:, -2:] = 0  # padding: no gradient for its row
        up = torch.randn(4, 15, hidden)
        (ref(ids) * up).sum().backward()
        out = embed(fused, ids)
        assert torch.equal(out, ref(ids))
        (out * up).sum().backward()
        assert ref.weight.grad is not None and fused.weight.grad is not None
        torch.testing.assert_close(fused.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-7)
        assert torch.equal(fused.weight.grad, ref.weight.grad)
        assert not bool(fused.weight.grad[0].any())


def test_not_fused_where_someone_else_owns_the_gradient() -> None:
    assert not fusable(torch.nn.Linear(4, 8), torch.nn.Linear)  # a bias
    assert not fusable(torch.nn.Linear(4, 8, bias=False).to(torch.bfloat16), torch.nn.Linear)
    assert not fusable(torch.nn.Embedding(8, 4, max_norm=1.0), torch.nn.Embedding)
    frozen = torch.nn.Embedding(8, 4).requires_grad_(False)
    assert not fusable(frozen, torch.nn.Embedding)
    with torch.no_grad():
        assert not fusable(torch.nn.Embedding(8, 4), torch.nn.Embedding)
    hooked = torch.nn.Linear(4, 8, bias=False)
    hooked.weight.register_post_accumulate_grad_hook(lambda p: None)
    assert not fusable(hooked, torch.nn.Linear)


def _graph_nodes(t: torch.Tensor) -> set[str]:
    names: set[str] = set()
    visited: set[int] = set()
    todo = [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in visited:
            continue
        visited.add(id(fn))
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


class _Plain(torch.nn.Module):
    """The same model seen without Hugging Face's accessors: logprobs' unfused path (full logits, autograd)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kw: object) -> object:
        return self.model(**kw)


def test_model_gradients_over_micro_batches_match_autograd() -> None:
    """A whole model in float32, an untied head, three passes accumulating: every parameter's gradient
    through the fused path is the unfused path's within float tolerance."""
    model = tiny_qwen3(64, seed=5, tie_word_embeddings=False, dtype=torch.float32).train()
    other = copy.deepcopy(model)
    assert fusable(model.lm_head, torch.nn.Linear) and fusable(model.model.embed_tokens, torch.nn.Embedding)  # the fused path runs
    g = torch.Generator().manual_seed(7)
    prompts = [[1, *torch.randint(3, 64, (int(n),), generator=g).tolist()] for n in (3, 5, 4, 6, 2, 7)]
    comps = [torch.randint(3, 64, (int(n),), generator=g).tolist() for n in (4, 2, 6, 3, 5, 1)]
    packed = pack_completions(prompts, comps, pad_id=0)
    for lo in range(0, 6, 2):  # three micro-batches, gradients accumulate
        rows = [t[lo : lo + 2] for t in packed]
        w = torch.randn(2, rows[0].shape[1], generator=g)
        loss = (logprobs(model, *rows, reduction="none", fuse_grads=True) * w).sum()
        assert {"_HeadLogprobsBackward", "_EmbedBackward"} <= _graph_nodes(loss)  # the fused path ran
        loss.backward()
        (logprobs(_Plain(other), *rows, reduction="none") * w).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert bool(model.lm_head.weight.grad.any()) and bool(model.model.embed_tokens.weight.grad.any())
