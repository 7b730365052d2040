"""Log-probabilities in chunks, micro-batches and activation checkpointing: the same numbers and the same update.

:func:`workers.model.logprobs` never builds [batch, tokens, vocab] float32
logits: it projects only the completion positions, a chunk at a time, per
micro-batch. :func:`workers.trainer.fsdp.grpo_epochs` runs ``micro_batch``
rows per forward/backward and accumulates; with the loss normalised by the
whole batch's tokens, one step gives the same weights whatever the split.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from aurora_store.testing.servers import free_port
from workers.model import logprobs, tiny_qwen3
from workers.trainer.fsdp import SINGLE, GrpoBatch, grpo_epochs, micro_batches

VOCAB = 40


def _plain(model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, comp: torch.Tensor) -> torch.Tensor:
    """The computation logprobs replaced: full float32 logits of every position."""
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, :-1].float()
    tok = logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return torch.nn.functional.pad(tok * comp[:, 1:].to(tok.dtype), (1, 0))


def _rows(rows: int = 6, width: int = 14, left: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (rows, width), generator=g)
    attn = torch.ones_like(ids)
    comp = torch.zeros_like(ids)
    comp[:, 6:] = 1
    if left:  # row 1 left-padded by three
        attn[1, :3] = 0
        comp[1, :3] = 0
    attn[2, -5:] = 0  # row 2 right-padded
    comp[2, -5:] = 0
    return ids, attn, comp


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("left", [False, True])
def test_chunked_logprobs_equal_the_plain_computation_and_its_gradient(tied: bool, left: bool) -> None:
    model = tiny_qwen3(VOCAB, seed=2, dtype=torch.float32, tie_word_embeddings=tied).train()
    ids, attn, comp = _rows(left=left)
    want = _plain(model, ids, attn, comp)
    for chunk, mb in ((None, 0), (1, 0), (7, 0), (5, 4), (3, 1)):
        got = logprobs(model, ids, attn, comp, reduction="none", chunk_tokens=chunk, micro_batch=mb)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert bool((got[comp == 0] == 0).all())
    torch.testing.assert_close(logprobs(model, ids, attn, comp, reduction="sum", chunk_tokens=4), want.sum(-1), rtol=1e-5, atol=1e-5)
    mean = want.sum(-1) / comp[:, 1:].sum(-1)
    torch.testing.assert_close(logprobs(model, ids, attn, comp, reduction="mean", chunk_tokens=4), mean, rtol=1e-5, atol=1e-5)
    params = [p for p in model.parameters()]
    g_want = torch.autograd.grad(want.sum(), params)
    g_got = torch.autograd.grad(logprobs(model, ids, attn, comp, reduction="none", chunk_tokens=3).sum(), params)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The model is left as it was (its head is swapped back after each call).
    assert model.get_output_embeddings().__class__ is torch.nn.Linear


def test_no_chunk_holds_logits_of_the_whole_batch() -> None:
    """Every call of the output head sees at most ``chunk_tokens`` positions, never batch x tokens."""
    model = tiny_qwen3(VOCAB, seed=2, dtype=torch.float32)
    ids, attn, comp = _rows(rows=8, width=20)
    seen: list[int] = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, _i, out: seen.append(int(out.numel() // VOCAB)))
    try:
        logprobs(model, ids, attn, comp, reduction="none", chunk_tokens=16)
    finally:
        hook.remove()
    assert seen and max(seen) <= 16
    assert sum(seen) == int(comp[:, 1:].sum())  # only completion positions are projected


def _grpo_batch(rows: int, micro_batch: int = 0, checkpointing: bool = False) -> GrpoBatch:
    g = torch.Generator().manual_seed(7)
    width = 12
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    comp = torch.zeros(rows, width, dtype=torch.long)
    comp[:, 5:] = 1
    attn[-1, -3:] = 0
    comp[-1, -3:] = 0
    adv = torch.randn(rows, generator=g).abs() + 0.1
    adv[1::2] *= -1
    old = (-math.log(VOCAB) + 0.05 * torch.randn(rows, width, generator=g)) * comp
    ref = (-math.log(VOCAB) + 0.05 * torch.randn(rows, width, generator=g)) * comp
    return GrpoBatch(ids, attn, comp, adv, old, ref, micro_batch, checkpointing)


def _step(batch: GrpoBatch, epochs: int = 1) -> dict[str, torch.Tensor]:
    model = tiny_qwen3(VOCAB, seed=3, dtype=torch.float32).train()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    grpo_epochs(model, opt, batch, SINGLE, epochs=epochs, clip=0.2, kl_coef=0.1, logprobs=logprobs, max_grad_norm=math.inf)
    assert all(p.grad is None for p in model.parameters())  # gradients take no memory between steps
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("micro_batch", "checkpointing"), [(1, False), (2, False), (3, True), (0, True)])
def test_micro_batches_and_checkpointing_give_the_whole_batch_update(micro_batch: int, checkpointing: bool) -> None:
    before = {n: p.detach().clone() for n, p in tiny_qwen3(VOCAB, seed=3, dtype=torch.float32).named_parameters()}
    whole = _step(_grpo_batch(7), epochs=2)
    split = _step(_grpo_batch(7, micro_batch, checkpointing), epochs=2)
    moved = 0
    for name, w in whole.items():
        torch.testing.assert_close(split[name], w, rtol=1e-5, atol=1e-6, msg=name)
        moved += int((w != before[name]).sum())
    assert moved > 0


def test_every_rank_runs_the_same_number_of_passes() -> None:
    for n in range(1, 12):
        for world in (1, 2, 3):
            for mb in (0, 1, 2, 5):
                passes = micro_batches(n, world, mb)
                most = -(-n // world)
                assert passes == (1 if mb == 0 else max(1, -(-most // mb)))


def _rank(rank: int, world: int, port: int, out: str) -> None:
    from workers.trainer.fsdp import broadcast_module, exit_process, init_from_env, leave, shard_model

    torch.set_num_threads(1)
    ctx = init_from_env({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    model = tiny_qwen3(VOCAB, seed=3, dtype=torch.float32).train()
    broadcast_module(model)
    shard_model(model, ctx)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # 5 rows over 2 ranks: 3 and 2 rows, one per pass; rank 1 runs an idle third pass.
    grpo_epochs(model, opt, _grpo_batch(5, 1, True), ctx, epochs=2, clip=0.2, kl_coef=0.1, logprobs=logprobs, max_grad_norm=math.inf)
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if ctx.leader:
        torch.save(full, out)
    leave(ctx)
    exit_process(0)


@pytest.mark.slow
def test_sharded_micro_batches_with_checkpointing_equal_one_process(tmp_path: Path) -> None:
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_rank, args=(2, free_port(), out), nprocs=2)
    got = torch.load(out)
    want = _step(_grpo_batch(5), epochs=2)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_passes_are_sized_to_the_model_and_never_empty() -> None:
    from workers.model import ACTIVATION_FLOOR_BYTES, pass_tokens, rows_per_pass

    big = pass_tokens(768, 21, 200_000_000, checkpointing=False)
    assert 56 * 768 * 21 * big <= 200_000_000  # activations near one byte per parameter
    assert pass_tokens(768, 21, 200_000_000, checkpointing=True) > 10 * big  # checkpointing keeps one value per layer
    assert pass_tokens(64, 2, 100_000, False) * 56 * 64 * 2 <= ACTIVATION_FLOOR_BYTES  # small models: the floor
    assert rows_per_pass(0, 40, big) == big // 40 and rows_per_pass(0, 10_000, big) == 1 and rows_per_pass(3, 40, big) == 3
