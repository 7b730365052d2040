"""FSDP2 training on CPU (gloo): the sharded update equals the one-process update,
the gathered bf16 weights are the master's rounding, and a Trainer run with
``--nproc 2`` ships versions an Actor applies bit for bit.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.records import read_digests
from aurora_store.coordination.redisconn import connect
from aurora_store.testing.servers import free_port
from aurora_store.testing.wait import wait_until
from workers.model import logprobs, tiny_qwen3
from workers.trainer.fsdp import (
    SINGLE,
    DistContext,
    GrpoBatch,
    exit_process,
    gather_bf16,
    grpo_epochs,
    init_from_env,
    leave,
    local_rows,
)

pytestmark = pytest.mark.slow

VOCAB = 40


def _batch(rows: int) -> GrpoBatch:
    g = torch.Generator().manual_seed(7)
    width = 12
    ids = torch.randint(1, VOCAB, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    comp = torch.zeros(rows, width, dtype=torch.long)
    comp[:, 5:] = 1
    attn[-1, -2:] = 0  # one padded row
    comp[-1, -2:] = 0
    adv = torch.randn(rows, generator=g).abs() + 0.1
    adv[1::2] *= -1  # both signs
    # Near the model's own log-probs (uniform over the vocabulary at init), so
    # the ratio starts inside the clip range and every row has a gradient.
    old = (-math.log(VOCAB) + 0.05 * torch.randn(rows, width, generator=g)) * comp
    return GrpoBatch(ids, attn, comp, adv, old, None)


def _model(tied: bool = True) -> torch.nn.Module:
    m = tiny_qwen3(VOCAB, seed=3, dtype=torch.float32, tie_word_embeddings=tied)
    m.train()
    return m


def _update(model: torch.nn.Module, ctx: DistContext, rows: int) -> None:
    # Plain SGD and no clipping: the weights move by exactly the gradient, so a
    # wrong normalisation across ranks (which Adam and clipping would hide) shows.
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(2):
        grpo_epochs(model, opt, _batch(rows), ctx, epochs=2, clip=0.2, kl_coef=0.0, logprobs=logprobs, max_grad_norm=math.inf)


def _rank(rank: int, world: int, port: int, rows: int, out: str, tied: bool = True) -> None:
    from workers.trainer.fsdp import broadcast_module, shard_model

    torch.set_num_threads(1)
    ctx = init_from_env({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    model = _model(tied)
    if rank != 0:  # rank 0's weights must win
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    broadcast_module(model)
    shard_model(model, ctx)
    _update(model, ctx, rows)
    params = list(model.named_parameters(remove_duplicate=False))
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[operator]
    bf16 = gather_bf16(params, ctx)
    if ctx.leader:
        torch.save({"full": full, "bf16": bf16, "tied": bf16["lm_head.weight"] is bf16["model.embed_tokens.weight"]}, out)
    leave(ctx)
    exit_process(0)


def test_local_rows_cover_the_batch_once() -> None:
    for world in (1, 2, 3, 4):
        for n in range(0, 9):
            rows = [r for rank in range(world) for r in local_rows(n, DistContext(rank, world, torch.device("cpu")))]
            assert sorted(rows) == list(range(n))


def test_init_from_env_without_world_is_one_process() -> None:
    assert init_from_env({}) is SINGLE
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        init_from_env({"WORLD_SIZE": "2", "RANK": "0"})


@pytest.mark.parametrize(("rows", "tied"), [(5, True), (1, True), (5, False)], ids=["rows-split", "one-rank-idle", "untied-head"])
def test_sharded_update_equals_one_process_update(tmp_path: Path, rows: int, tied: bool) -> None:
    """Untied: the embedding and the head are FSDP units of their own (the embedding not gathered for
    its backward), and the one process accumulates their gradients in place (workers.fused_grad)."""
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_rank, args=(2, free_port(), rows, out, tied), nprocs=2)
    got = torch.load(out)
    ref = _model(tied)
    _update(ref, SINGLE, rows)
    expect = dict(ref.named_parameters())
    assert set(got["full"]) == set(expect)
    before = _model(tied).state_dict()
    moved = 0
    for name, p in expect.items():
        torch.testing.assert_close(got["full"][name], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        moved += int((p.detach() != before[name]).sum())
    assert moved > 0  # the update really changed weights
    # The gathered bf16 copy is exactly the rounding of the gathered master, tied names shared.
    for name, t in got["bf16"].items():
        src = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu"
        assert torch.equal(t, got["full"][src].to(torch.bfloat16)), name
    assert got["tied"] == tied


@pytest.mark.server
@pytest.mark.long  # --nproc 2 to a real Actor stays in CI: tests/test_moe_train.py, tests/test_ckpt_sharded_resume.py
def test_trainer_nproc2_versions_reach_an_actor_bit_identical(tmp_path: Path, redis_url: str) -> None:
    store = f"file://{tmp_path}/run"
    env = {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    common = ["--store", store, "--redis", redis_url, "--run", "fsdp"]
    logs = tmp_path / "trainer.log"
    with open(logs, "wb") as tlog, open(tmp_path / "actor.log", "wb") as alog:
        trainer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aurora_tools.cli",
                "trainer",
                *common,
                "--steps",
                "4",
                "--batch",
                "8",
                "--group",
                "4",
                "--nproc",
                "2",
                "--snapshot-every",
                "1",  # every version hashed (a snapshot's digest): the Actor verifies each against it
            ],
            env=env,
            stdout=tlog,
            stderr=subprocess.STDOUT,
        )
        # An Actor needs the model description and v0, which the Trainer writes after its warm start.
        r = connect(redis_url)
        wait_until(
            lambda: r.hget(RunKeys("fsdp").trainer, "head") is not None,
            "v0",
            timeout=300,
            interval=0.2,
            processes={"the Trainer": trainer},
            logs=[logs],
        )
        actor = subprocess.Popen(
            [sys.executable, "-m", "aurora_tools.cli", "actor", *common, "--id", "a0"],
            env=env,
            stdout=alog,
            stderr=subprocess.STDOUT,
        )
        try:
            rc = trainer.wait(timeout=420)
        finally:
            if trainer.poll() is None:
                trainer.kill()
            actor.send_signal(signal.SIGTERM)
            try:
                actor.wait(timeout=60)
            except subprocess.TimeoutExpired:
                actor.kill()
    text = logs.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    assert "rank 1: " in text and " updates, done" in text, text[-3000:]
    tdig, adig = read_digests(connect(redis_url), RunKeys("fsdp"))
    assert sorted(tdig) == [0, 1, 2, 3, 4]
    compared = [v for (who, v) in adig if who == "a0"]
    assert len(compared) >= 3, (adig, text[-2000:])
    for v in compared:
        assert adig[("a0", v)] == tdig[v], f"v{v}: actor digest differs from the sharded Trainer's"
    # Training really moved the weights (a step whose groups all scored alike moves nothing).
    assert len(set(tdig.values())) >= 2
