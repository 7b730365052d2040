"""A version gathered from FSDP2 shards onto rank 0 (gloo, host) is the whole model rounded to bf16, bit for bit.

:func:`workers.trainer.gather.gather_version` receives each rank's bf16 rows
straight into rank 0's blocks; the cases a straight copy gets wrong are the
uneven splits (a short last shard, a rank with no rows at all when a tensor
has fewer rows than there are ranks) and tied names. Three ranks make both
kinds of split; the expected values are the unsharded module's, rounded.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp

from aurora_store.config import free_port

WORLD = 3


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 7)  # 7 rows over 3 ranks: 3, 3, 1
        self.b = torch.nn.Linear(7, 2, bias=False)  # 2 rows over 3 ranks: rank 2 holds none
        self.one = torch.nn.Parameter(torch.randn(1, 4))  # 1 row: only rank 0 holds it
        self.c = torch.nn.Linear(4, 4, bias=False)
        self.d = torch.nn.Linear(4, 4, bias=False)
        self.d.weight = self.c.weight  # tied: one tensor under two names


def _rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from workers.trainer.fsdp import DistContext, exit_process, gather_bf16, init_from_env, leave

    ctx = init_from_env({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.manual_seed(0)
    m = _Model()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1 + 1e-3 * torch.randn_like(p))  # values whose bf16 rounding is not exact
    want = {n: p.detach().to(torch.bfloat16).clone() for n, p in m.named_parameters(remove_duplicate=False)}
    fully_shard(m, mesh=init_device_mesh("cpu", (WORLD,)))
    got = gather_bf16(list(m.named_parameters(remove_duplicate=False)), DistContext(ctx.rank, ctx.world, ctx.device))
    if rank == 0:
        torch.save(
            {
                "want": want,
                "got": {n: t.clone() for n, t in got.items()},
                "tied": got["c.weight"].data_ptr() == got["d.weight"].data_ptr(),
                "contiguous": all(t.is_contiguous() for t in got.values()),
            },
            out,
        )
    elif got:
        raise AssertionError(f"rank {rank} got {sorted(got)}")
    leave(ctx)
    exit_process(0)


def test_gathered_version_is_the_whole_model_rounded(tmp_path: Path) -> None:
    out = str(tmp_path / "gathered.pt")
    mp.start_processes(_rank, args=(free_port(), out), nprocs=WORLD, join=True)
    res = torch.load(out)
    assert sorted(res["got"]) == sorted(res["want"])
    for name, w in res["want"].items():
        g = res["got"][name]
        assert g.dtype == torch.bfloat16 and g.shape == w.shape, name
        assert torch.equal(g.view(torch.int16), w.view(torch.int16)), name
    assert res["tied"], "tied names must share one copy"
    assert res["contiguous"]
