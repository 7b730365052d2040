"""A sharded Trainer's ranks on a GLM-4-MoE: the float32 router bias is read from the checkpoint, never trained, and published.

A sharded rank builds the model on the meta device and reads only its shard
of each *parameter* from the safetensors files; buffers are left as the
constructor makes them (zeros, for ``e_score_correction_bias``). The bias
is a frozen parameter in the models the workers build
(:mod:`workers.router_bias`), so two FSDP2 ranks hold the checkpoint's
float32 values, a GRPO update leaves them as they were while it moves the
experts, and rank 0's bf16 gather (what it publishes) holds their rounding.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from aurora_store.testing.servers import free_port
from aurora_tools.tinymodel import MOE_SPECS, make_model_dir
from workers.model import logprobs
from workers.pretrained import build_empty
from workers.trainer.fsdp import GrpoBatch, exit_process, gather_bf16, grpo_epochs, init_from_env, leave
from workers.trainer.sharding import load_hf_shards, materialize_sharded, params_on_meta

# long: sharded MoE loading and training stay in CI through tests/test_moe_train.py (Qwen3-MoE).
pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.usefixtures("one_torch_thread")]

BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"
LAYERS = MOE_SPECS["glm4_moe"].layers


def _batch(vocab: int) -> GrpoBatch:
    g = torch.Generator().manual_seed(5)
    rows, width = 4, 16
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    comp = torch.zeros(rows, width, dtype=torch.long)
    comp[:, 6:] = 1
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])
    old = (-math.log(vocab) + 0.05 * torch.randn(rows, width, generator=g)) * comp
    return GrpoBatch(ids, torch.ones(rows, width, dtype=torch.long), comp, adv, old, None, 0, False, 0.0)


def _rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    ctx = init_from_env({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    with params_on_meta():
        model = build_empty(path)
    materialize_sharded(model, ctx, lambda m: load_hf_shards(m, path))
    loaded = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    grpo_epochs(
        model, opt, _batch(int(model.config.vocab_size)), ctx, epochs=1, clip=0.2, kl_coef=0.0, logprobs=logprobs, max_grad_norm=math.inf
    )
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    bf16 = gather_bf16(list(model.named_parameters(remove_duplicate=False)), ctx)
    if ctx.leader:
        torch.save({"loaded": loaded, "frozen": frozen, "full": full, "bf16": bf16}, out)
    leave(ctx)
    exit_process(0)


def test_two_ranks_read_the_bias_keep_it_through_an_update_and_publish_its_rounding(tmp_path: Path) -> None:
    path = make_model_dir(tmp_path / "glm4_moe", "glm4_moe")
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(2, free_port(), path, str(out)), nprocs=2)
    got = torch.load(out)
    disk = load_file(str(Path(path) / "model.safetensors"))
    names = [BIAS.format(layer) for layer in range(1, LAYERS)]
    assert got["frozen"] == names
    for n in names:
        want = disk[n]
        assert want.dtype == torch.float32 and want.abs().min() > 0  # zeros would be the constructor's, not the checkpoint's
        assert torch.equal(got["loaded"][n], want) and torch.equal(got["full"][n], want)
        assert torch.equal(got["bf16"][n], want.to(torch.bfloat16))
    moved = [n for n in got["full"] if not torch.equal(got["full"][n], got["loaded"][n])]
    assert any(".experts." in n for n in moved) and not set(moved) & set(names)
