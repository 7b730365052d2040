"""Tensor-parallel shard maps (aurora_store.apply.tp) for TP = 1, 2 and 4.

The pure tests need no vLLM and no GPU: each layout must cut the same shard
from a whole parameter as its flat-index map says (``shard`` vs
``localize``), cover every element on the right number of ranks, and patch
a rank's shard exactly as the whole parameter is patched. The last tests
build vLLM's own layers (``vllm/model_executor/layers/linear.py``,
``vocab_parallel_embedding.py``) for a pretended rank and load a whole
parameter through their ``weight_loader``: the shard vLLM keeps must be the
shard our layout computes.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from aurora_store.apply.sink import apply_delta
from aurora_store.apply.tp import (
    Piece,
    ShardedWeights,
    ShardLayout,
    assemble,
    column_parallel,
    merged_column_parallel,
    pad_vocab,
    qkv_parallel,
    replicated,
    row_parallel,
    vocab_parallel,
)
from aurora_store.codec.entries import DecodedEntry, ParamSpec
from aurora_store.errors import ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta

# A Qwen3-like layer: 8 query heads, 2 KV heads (so TP=4 replicates each KV head twice).
HIDDEN, HEAD, HEADS, KV, INTER, VOCAB = 32, 8, 8, 2, 48, 100

Build = Callable[[int, int], ShardLayout]

LAYOUTS: dict[str, Build] = {
    "qkv_proj.weight": lambda tp, r: qkv_parallel(HEAD, HEADS, KV, (HIDDEN,), tp, r),
    "qkv_proj.bias": lambda tp, r: qkv_parallel(HEAD, HEADS, KV, (), tp, r),
    "gate_up_proj.weight": lambda tp, r: merged_column_parallel([INTER, INTER], (HIDDEN,), tp, r),
    "o_proj.weight": lambda tp, r: row_parallel((HIDDEN, HEADS * HEAD), tp, r),
    "down_proj.weight": lambda tp, r: row_parallel((HIDDEN, INTER), tp, r),
    "column.weight": lambda tp, r: column_parallel((INTER, HIDDEN), tp, r),
    "embed_tokens.weight": lambda tp, r: vocab_parallel(VOCAB, HIDDEN, tp, r),
    "norm.weight": lambda tp, r: replicated((HIDDEN,)),
}


def whole(lay: ShardLayout) -> torch.Tensor:
    """A parameter whose every element is its own flat index (exact in float64)."""
    n = int(np.prod(lay.global_shape))
    return torch.arange(n, dtype=torch.float64).reshape(lay.global_shape)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_localize_agrees_with_shard_and_covers_everything(name: str, tp: int) -> None:
    layouts = [LAYOUTS[name](tp, r) for r in range(tp)]
    g = whole(layouts[0])
    idx = torch.arange(g.numel())
    hits = torch.zeros(g.numel(), dtype=torch.long)
    for lay in layouts:
        local = lay.shard(g)
        assert tuple(local.shape) == lay.local_shape
        sel, loc = lay.localize(idx)
        # The map and the cut agree element by element.
        assert torch.equal(local.reshape(-1)[loc], g.reshape(-1)[idx[sel]])
        # Each held element is reached once; padding rows are never written.
        assert loc.unique().numel() == loc.numel() == lay.held
        assert bool((sel[1:] > sel[:-1]).all()) and bool((loc[1:] > loc[:-1]).all())
        hits[idx[sel]] += 1
    assert bool((hits >= 1).all()), "some elements live on no rank"
    if name.startswith("norm"):
        assert bool((hits == tp).all())
    elif name.startswith("qkv"):
        q_numel = HEADS * HEAD * (HIDDEN if name.endswith("weight") else 1)
        kv_copies = max(1, tp // KV)
        assert bool((hits[:q_numel] == 1).all()) and bool((hits[q_numel:] == kv_copies).all())
    else:
        assert bool((hits == 1).all())
    assert torch.equal(assemble([(lay, lay.shard(g)) for lay in layouts]), g)


def test_qkv_replicates_kv_heads_when_tp_exceeds_them() -> None:
    # TP=4 over 2 KV heads: ranks 0,1 hold KV head 0, ranks 2,3 hold KV head 1.
    q_rows, k_rows = HEADS * HEAD, KV * HEAD
    for r in range(4):
        lay = qkv_parallel(HEAD, HEADS, KV, (HIDDEN,), 4, r)
        q, k, v = lay.pieces
        assert q == Piece(r * 2 * HEAD, 0, 2 * HEAD)
        assert k == Piece(q_rows + (r // 2) * HEAD, 2 * HEAD, HEAD)
        assert v == Piece(q_rows + k_rows + (r // 2) * HEAD, 3 * HEAD, HEAD)
        assert lay.local_shape == (4 * HEAD, HIDDEN)
    # TP=2 over 2 KV heads: one each, no replication.
    lay = qkv_parallel(HEAD, HEADS, KV, (HIDDEN,), 2, 1)
    assert lay.pieces[1] == Piece(q_rows + HEAD, 4 * HEAD, HEAD)


def test_vocab_padding_and_split() -> None:
    assert pad_vocab(100) == 128 and pad_vocab(128) == 128 and pad_vocab(30) == 64
    one = vocab_parallel(30, HIDDEN, 1, 0)
    assert one.local_shape == (64, HIDDEN) and one.is_prefix
    # TP=4 over 100 tokens padded to 128: 32 rows per rank; rank 3 holds tokens 96..99 only.
    last = vocab_parallel(VOCAB, HIDDEN, 4, 3)
    assert last.pieces == (Piece(96, 0, 4),) and last.local_shape == (32, HIDDEN)
    # A rank may hold no real token at all (tiny vocabulary, many ranks).
    empty = vocab_parallel(30, HIDDEN, 2, 1)
    assert empty.pieces == () and empty.held == 0
    sel, loc = empty.localize(torch.arange(30 * HIDDEN))
    assert sel.numel() == loc.numel() == 0


def test_layout_rejects_what_does_not_divide() -> None:
    with pytest.raises(ValueError, match="divisible"):
        qkv_parallel(HEAD, 6, 2, (HIDDEN,), 4, 0)
    with pytest.raises(ValueError, match="divisible"):
        row_parallel((HIDDEN, 30), 4, 0)
    with pytest.raises(ValueError, match="out of range"):
        column_parallel((INTER, HIDDEN), 2, 2)
    with pytest.raises(ModelMismatchError):
        column_parallel((INTER, HIDDEN), 2, 0).shard(torch.zeros(INTER, HIDDEN + 1))


def _random_delta(lay: ShardLayout, name: str, seed: int) -> tuple[StagedDelta, torch.Tensor]:
    """A delta over the whole parameter (a sparse XOR entry, a dense range, a sparse overwrite)."""
    rng = np.random.default_rng(seed)
    numel = int(np.prod(lay.global_shape))
    spec = ParamSpec(lay.global_shape, "bfloat16")
    a, b = numel // 3, 2 * numel // 3
    idx1 = np.unique(rng.integers(0, a, size=max(1, a // 20))).astype(np.int64)
    idx3 = np.unique(rng.integers(b, numel, size=max(1, (numel - b) // 10))).astype(np.int64)
    dense = rng.integers(-(2**15), 2**15, size=b - a).astype(np.int16).view(np.uint16)
    entries = (
        DecodedEntry(name, spec, 0, a, idx1.size, idx1, rng.integers(1, 2**15, size=idx1.size).astype(np.uint16), "xor"),
        DecodedEntry(name, spec, a, b, b - a, None, dense, "new"),
        DecodedEntry(name, spec, b, numel, idx3.size, idx3, rng.integers(0, 2**15, size=idx3.size).astype(np.uint16), "new"),
    )
    # Expected: the same entries applied to the whole parameter.
    full = torch.from_numpy(rng.integers(-(2**15), 2**15, size=numel).astype(np.int16)).view(torch.bfloat16).reshape(lay.global_shape)
    return StagedDelta(1, 0, entries), full


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_sharded_weights_patch_each_rank_like_the_whole(name: str, tp: int) -> None:
    from aurora_store.apply.sink import FusedWeights

    layouts = [LAYOUTS[name](tp, r) for r in range(tp)]
    staged, full = _random_delta(layouts[0], name, seed=tp)
    shards = [lay.shard(full) for lay in layouts]
    before_padding = [s.clone() for s in shards]
    expect = full.clone()
    apply_delta(staged, FusedWeights({name: expect}))
    for lay, shard, before in zip(layouts, shards, before_padding, strict=True):
        ptr = shard.data_ptr()
        apply_delta(staged, ShardedWeights({name: shard}, {name: lay}, {name: "bfloat16"}))
        assert shard.data_ptr() == ptr
        want = lay.shard(expect)
        if lay.cols is None:
            # Padding rows keep what they held (vLLM's zeros); held rows match the whole.
            held = torch.zeros(lay.local_shape[0], dtype=torch.bool)
            for p in lay.pieces:
                held[p.local_row : p.local_row + p.rows] = True
            assert torch.equal(shard[held].view(torch.int16), want[held].view(torch.int16))
            assert torch.equal(shard[~held].view(torch.int16), before[~held].view(torch.int16))
        else:
            assert torch.equal(shard.view(torch.int16), want.view(torch.int16))


def test_sharded_weights_validate_against_the_whole_parameter() -> None:
    lay = row_parallel((HIDDEN, INTER), 2, 1)
    shard = torch.zeros(lay.local_shape, dtype=torch.bfloat16)
    sink = ShardedWeights({"w": shard}, {"w": lay}, {"w": "bfloat16"})
    assert sink.specs()["w"] == ParamSpec((HIDDEN, INTER), "bfloat16")
    bad_spec = ParamSpec(lay.local_shape, "bfloat16")  # a delta cut for the shard, not the model
    idx = np.array([0], dtype=np.int64)
    staged = StagedDelta(1, 0, (DecodedEntry("w", bad_spec, 0, 1, 1, idx, np.ones(1, np.uint16), "new"),))
    with pytest.raises(ModelMismatchError):
        apply_delta(staged, sink)
    assert not shard.any()
    with pytest.raises(ModelMismatchError):
        ShardedWeights({"w": torch.zeros(HIDDEN, INTER, dtype=torch.bfloat16)}, {"w": lay}, {"w": "bfloat16"})


# ---------------------------------------------------------------------------
# against vLLM's own layers (runs where vllm is installed; needs no GPU)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install 'aurora-store[vllm]')")


@contextlib.contextmanager
def _pretend_rank(tp: int, rank: int) -> Iterator[None]:
    """vLLM's layers ask the distributed state for their rank; answer for one rank."""
    from unittest import mock

    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.layers.vocab_parallel_embedding as vocab
    import vllm.model_executor.parameter as parameter

    with contextlib.ExitStack() as stack:
        for mod in (linear, vocab, parameter):
            for fn, value in (("get_tensor_model_parallel_rank", rank), ("get_tensor_model_parallel_world_size", tp)):
                if hasattr(mod, fn):
                    stack.enter_context(mock.patch.object(mod, fn, lambda v=value: v))
        yield


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_layouts_match_vllm_weight_loaders(tp: int) -> None:
    import vllm.model_executor.layers.linear as vl
    import vllm.model_executor.layers.vocab_parallel_embedding as vv

    f32 = torch.float32
    for rank in range(tp):
        with _pretend_rank(tp, rank):
            qkv = vl.QKVParallelLinear(HIDDEN, HEAD, HEADS, KV, bias=True, params_dtype=f32)
            gate_up = vl.MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, params_dtype=f32)
            o = vl.RowParallelLinear(HEADS * HEAD, HIDDEN, bias=False, params_dtype=f32)
            col = vl.ColumnParallelLinear(HIDDEN, INTER, bias=False, params_dtype=f32)
            emb = vv.VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=f32)
            head = vv.ParallelLMHead(VOCAB, HIDDEN, params_dtype=f32)
        assert (qkv.tp_rank, qkv.tp_size) == (rank, tp)

        # qkv: q, k, v loaded as the Hugging Face parts, compared with the fused layout.
        lay = qkv_parallel(HEAD, HEADS, KV, (HIDDEN,), tp, rank)
        g = whole(lay).float()
        q_rows, kv_rows = HEADS * HEAD, KV * HEAD
        for part, lo, hi in (("q", 0, q_rows), ("k", q_rows, q_rows + kv_rows), ("v", q_rows + kv_rows, q_rows + 2 * kv_rows)):
            qkv.weight_loader(qkv.weight, g[lo:hi], part)
        assert torch.equal(qkv.weight.data, lay.shard(g)), f"qkv weight, rank {rank}/{tp}"
        blay = qkv_parallel(HEAD, HEADS, KV, (), tp, rank)
        gb = whole(blay).float()
        for part, lo, hi in (("q", 0, q_rows), ("k", q_rows, q_rows + kv_rows), ("v", q_rows + kv_rows, q_rows + 2 * kv_rows)):
            qkv.weight_loader(qkv.bias, gb[lo:hi], part)
        assert torch.equal(qkv.bias.data, blay.shard(gb)), f"qkv bias, rank {rank}/{tp}"

        lay = merged_column_parallel([INTER, INTER], (HIDDEN,), tp, rank)
        g = whole(lay).float()
        gate_up.weight_loader(gate_up.weight, g[:INTER], 0)
        gate_up.weight_loader(gate_up.weight, g[INTER:], 1)
        assert torch.equal(gate_up.weight.data, lay.shard(g)), f"gate_up, rank {rank}/{tp}"

        lay = row_parallel((HIDDEN, HEADS * HEAD), tp, rank)
        g = whole(lay).float()
        o.weight_loader(o.weight, g)
        assert torch.equal(o.weight.data, lay.shard(g)), f"o_proj, rank {rank}/{tp}"

        lay = column_parallel((INTER, HIDDEN), tp, rank)
        g = whole(lay).float()
        col.weight_loader(col.weight, g)
        assert torch.equal(col.weight.data, lay.shard(g)), f"column, rank {rank}/{tp}"

        for layer in (emb, head):
            lay = vocab_parallel(VOCAB, HIDDEN, tp, rank, padded=layer.num_embeddings_padded)
            assert lay.local_shape == tuple(layer.weight.shape)
            g = whole(lay).float()
            layer.weight_loader(layer.weight, g)
            assert torch.equal(layer.weight.data, lay.shard(g)), f"{type(layer).__name__}, rank {rank}/{tp}"
