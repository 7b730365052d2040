"""A sharded Trainer's ranks never hold the whole model while they load it (gloo on CPU).

Each rank builds ``--model`` on the meta device and reads only its own rows
from the safetensors files: rank 0 through :class:`~workers.trainer.policy.GrpoPolicy`,
rank 1 through :func:`~workers.trainer.follower.build_sharded`, the code the
Trainer's ranks run. Inside each rank the kernel's high-water mark of its
resident memory is reset before the load and read after it: the load's
peak must stay below the bytes of the whole fp32 model, plus the pages of
the rank's own rows of the (bf16) files, which stay mapped while the files
are open. Building the model whole first, as ranks once did, costs the
whole fp32 model and every page of the files (measured: 367 MB against a
limit of 299 MB here; the sharded load 180-250 MB). The gathered weights
must then be the files' own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from aurora_store.config import free_port

pytestmark = pytest.mark.slow

PARAMS = 6e7
"""About 60 M parameters (240 MB in fp32): far above what a process's own allocations move."""


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """The high-water mark restarts from the resident set now (``clear_refs`` 5, Linux)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def _rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401 - imported before the measurement, as in a Trainer

    from workers.trainer.config import TrainerConfig
    from workers.trainer.follower import build_sharded
    from workers.trainer.fsdp import exit_process, gather_bf16, init_from_env, leave
    from workers.trainer.policy import GrpoPolicy

    torch.set_num_threads(1)
    ctx = init_from_env({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    cfg = TrainerConfig(model=path, optimizer="adamw", lr=1e-6)
    pol = GrpoPolicy(cfg, ctx, {}) if ctx.leader else None  # its reward runner starts before the measurement
    before = _status("VmRSS")
    _reset_peak()
    if pol is not None:
        pol.build_model()
        pol.prepare_training()
        model = pol.model
    else:
        model, _ = build_sharded(cfg, ctx, fresh=True)
    peak = _status("VmHWM") - before
    local = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    whole = gather_bf16(list(model.named_parameters(remove_duplicate=False)), ctx)
    torch.save({"peak": peak, "local": local, "whole": whole}, f"{out}.{rank}")
    if pol is not None:
        pol.rewards.close()
    leave(ctx)
    exit_process(0)


def test_no_rank_holds_the_whole_model_while_it_loads(tmp_path: Path) -> None:
    from aurora_tools.bench.trainer.shape import build_model_dir, shape_for
    from workers.pretrained import load_pretrained

    try:
        _reset_peak()
    except OSError as e:
        pytest.skip(f"the high-water mark cannot be reset here ({e}): the peak of a load cannot be isolated")
    path = build_model_dir(tmp_path / "model", shape_for(PARAMS))
    out = str(tmp_path / "rank")
    mp.spawn(_rank, args=(2, free_port(), path, out), nprocs=2)
    got: list[dict[str, Any]] = [torch.load(f"{out}.{r}") for r in range(2)]
    ref = load_pretrained(path, torch.bfloat16)
    want = dict(ref.named_parameters(remove_duplicate=False))
    full = sum(p.numel() for p in ref.parameters()) * 4  # the whole model in fp32
    mapped = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) // 2  # a rank's rows of the files
    for r, g in enumerate(got):
        print(f"rank {r}: load peak {g['peak'] / 1e6:.0f} MB, shard {g['local'] / 1e6:.0f} MB, whole model {full / 1e6:.0f} MB in fp32")
        assert g["local"] <= full / 2 * 1.01, r  # its half (rank 0 takes the odd row of a tensor)
        assert g["peak"] < full + mapped, f"rank {r} peaked {g['peak']} bytes while loading; the whole fp32 model is {full}"
    assert set(got[0]["whole"]) == set(want)
    for name, p in want.items():
        assert torch.equal(got[0]["whole"][name], p.detach()), name  # the files' bf16, through fp32 and back


def test_tying_is_read_from_a_meta_models_parameters(tmp_path: Path) -> None:
    """Meta tensors have no storage to compare (every address reads 0): tying is read from the parameters."""
    from aurora_store.errors import ModelMismatchError
    from aurora_tools.tinymodel import TinySpec, make_model_dir
    from workers.pretrained import build_empty
    from workers.trainer.sharding import is_meta, params_on_meta, tied_by_identity

    for tie in (True, False):
        path = make_model_dir(tmp_path / f"tied-{tie}", "qwen3", spec=TinySpec(tie_word_embeddings=tie))
        with params_on_meta():
            model = build_empty(path, torch.float32)
        assert is_meta(model) and tied_by_identity(model) is tie
    layer = model.model.layers[0]
    layer.self_attn.o_proj.weight = layer.self_attn.q_proj.weight  # any other alias is refused
    with pytest.raises(ModelMismatchError, match="only lm_head.weight may alias"):
        tied_by_identity(model)
