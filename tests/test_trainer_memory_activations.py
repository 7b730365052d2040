"""The pass size's estimate of what a decoder layer keeps per token matches what autograd actually keeps."""

from __future__ import annotations

import pytest
import torch

from workers.activations import ACTIVATION_FLOOR_BYTES, LOGITS_CHUNK_BYTES, layer_bytes_per_token, pass_tokens
from workers.model import logprobs, tiny_qwen3


def _saved_bytes(layers: int, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, rows: int, width: int) -> int:
    """Bytes of the distinct storages autograd saves for the backward pass of one ``logprobs`` forward
    (parameters excluded): what a pass keeps between its forward and its backward."""
    # The project's own builder (what the Trainer trains), in float32 and untied, attention through sdpa.
    model = tiny_qwen3(
        512,
        0,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=inter,
        max_positions=512,
        tie_word_embeddings=False,
        dtype=torch.float32,
    ).train()
    model.config._attn_implementation = "sdpa"
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    torch.manual_seed(0)
    ids = torch.randint(0, 500, (rows, width))
    attn = torch.ones(rows, width, dtype=torch.long)
    comp = torch.zeros(rows, width, dtype=torch.long)
    comp[:, -8:] = 1
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs(model, ids, attn, comp, reduction="sum")
    return sum(n for k, n in seen.items() if k not in params)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hidden", "inter", "heads", "kv_heads", "head_dim"),
    [(256, 768, 2, 1, 128), (256, 1536, 2, 1, 128), (256, 768, 4, 4, 64), (384, 768, 2, 1, 128)],
)
def test_a_layer_keeps_what_the_estimate_says_per_token(hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int) -> None:
    rows, width = 2, 48
    per_layer = (
        _saved_bytes(3, hidden, inter, heads, kv_heads, head_dim, rows, width)
        - _saved_bytes(2, hidden, inter, heads, kv_heads, head_dim, rows, width)
    ) / (rows * width)
    est = layer_bytes_per_token(hidden, inter, heads * head_dim, kv_heads * head_dim)
    # Within a few percent either way: too low and passes overrun the budget (as the old 14 h did:
    # 56 h bytes is 0.55 of this estimate at the benchmark's shape), too high and they are needlessly small.
    assert 0.95 * est <= per_layer <= 1.05 * est, (per_layer, est)
    if inter >= 3 * hidden:  # Qwen3's proportions: the estimate before the MLP's intermediate values were counted fell short
        assert per_layer > 1.3 * 56 * hidden


def test_passes_shrink_for_the_output_head_only_up_to_one_chunk() -> None:
    h, layers, params = 768, 21, 200_000_000
    kw = {"intermediate_size": 2304, "q_width": 768, "kv_width": 384}
    no_head = pass_tokens(h, layers, params, False, **kw)
    with_head = pass_tokens(h, layers, params, False, vocab=32768, **kw)
    layer = layer_bytes_per_token(h, 2304, 768, 384)
    assert with_head < no_head
    assert with_head * (layers * layer + 12 * 32768) <= params  # the whole pass within one byte per parameter
    assert (with_head + 1) * (layers * layer + 12 * 32768) > params
    # A huge budget: the head's transient is one chunk's, not one per token of the pass.
    big = pass_tokens(h, layers, 100 * params, False, vocab=32768, **kw)
    chunk = LOGITS_CHUNK_BYTES // (4 * 32768)
    assert big * layers * layer + chunk * 12 * 32768 <= 100 * params < (big + 1) * layers * layer + chunk * 12 * 32768
    assert pass_tokens(64, 2, 1000, False) * 2 * layer_bytes_per_token(64) <= ACTIVATION_FLOOR_BYTES  # small models: the floor
    assert pass_tokens(h, layers, params, True, **kw) > 10 * no_head  # checkpointing keeps one value per layer
