"""workers.trainer.host_comms: FSDP2's gather and scatter on the host give gloo's own results, bit for bit,
and a sharded host model gets them (two gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aurora_store.testing.servers import free_port

pytestmark = pytest.mark.slow


def _rank(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from workers.model import tiny_qwen3
    from workers.trainer.fsdp import exit_process, init_from_env, leave, shard_model
    from workers.trainer.host_comms import install_host_comms

    torch.set_num_threads(1)
    ctx = init_from_env({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    group = dist.group.WORLD
    model = shard_model(tiny_qwen3(40, seed=3, dtype=torch.float32, tie_word_embeddings=False), ctx)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    comms = {type(g._reduce_scatter_comm).__name__ for m in units for g in m._get_fsdp_state()._fsdp_param_groups}
    assert install_host_comms(units)
    gather = units[0]._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm
    scatter = units[0]._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
    g = torch.Generator().manual_seed(100 + rank)
    results = {}
    for n in (1, 7, 4096):
        mine = torch.randn(n, generator=g)
        want = torch.empty(n * world)
        dist.all_gather_into_tensor(want, mine)
        got = gather.allocate((n * world,), dtype=torch.float32, device=torch.device("cpu"))
        assert gather(got, mine, group) is None
        results[f"gather{n}"] = bool(torch.equal(got, want))
        full = torch.randn(n * world, generator=g)
        for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):  # AVG: FSDP's, for float32
            want_rs = torch.empty(n)
            dist.reduce_scatter_tensor(want_rs, full.clone(), op=op, group=group)
            got_rs = torch.empty(n)
            assert scatter(got_rs, full.clone(), group, op) is None  # not handed back to gloo's own
            results[f"scatter-{name}{n}"] = bool(torch.equal(got_rs, want_rs))
    if ctx.leader:
        torch.save({"results": results, "comms": comms}, out)
    leave(ctx)
    exit_process(0)


def test_host_gather_and_scatter_are_gloos_bit_for_bit(tmp_path: Path) -> None:
    out = str(tmp_path / "r0.pt")
    mp.spawn(_rank, args=(2, free_port(), out), nprocs=2)
    got = torch.load(out)
    assert got["comms"] == {"HostReduceScatter"}  # shard_model installed them on every unit
    assert got["results"] and all(got["results"].values()), got["results"]
