"""``Publisher.publish(model)`` unchanged on a model sharded by FSDP2 over two gloo ranks.

Every rank calls ``publish`` (the parameters are gathered one at a time, a
collective); rank 0 alone writes. A Follower then reaches every version
bit for bit, and version 0 is the unsharded model's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from api_helpers import digest_of, tiny_lm, train_step

from aurora_store import Follower, Publisher
from aurora_store.config import free_port

pytestmark = pytest.mark.slow


def _rank(rank: int, world: int, port: int, store: str, out: str) -> None:
    import os

    from torch.distributed.fsdp import fully_shard

    from workers.trainer.fsdp import exit_process, init_from_env, leave

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ctx = init_from_env()
    model = tiny_lm()  # the same seed on every rank: the same start
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pub = Publisher(store, digest_every=1)
    got = []
    for v in range(4):
        if v:
            train_step(model, opt, v)
        p = pub.publish(model)
        got.append(None if p is None else {"version": p.version, "digest": p.weights_digest, "kind": p.kind})
    pub.close()
    if ctx.leader:
        Path(out).write_text(json.dumps(got))
    elif any(g is not None for g in got):
        raise SystemExit("a rank other than 0 published")
    leave(ctx)
    exit_process(0)


def test_publisher_on_an_fsdp2_model_over_two_ranks(tmp_path: Path) -> None:
    store, out = f"file://{tmp_path}/run", str(tmp_path / "rank0.json")
    mp.spawn(_rank, args=(2, free_port(), store, out), nprocs=2)
    got = json.loads(Path(out).read_text())
    assert [g["version"] for g in got] == [0, 1, 2, 3] and [g["kind"] for g in got] == ["snapshot", "delta", "delta", "delta"]
    assert got[0]["digest"] == digest_of(tiny_lm())  # the gathered weights are the model's
    target = tiny_lm(seed=7).to(torch.bfloat16)
    f = Follower(store)
    for g in got:
        f.update(target, version=g["version"])
        assert digest_of(target) == g["digest"]
