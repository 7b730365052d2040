"""GRPO on mixture-of-experts models, in one process and over FSDP2 ranks.

Tiny Qwen3-MoE and Mixtral directories (``aurora tiny-model``: experts saved
one by one, held packed in memory by transformers) are trained as a user's
``--model``: the router's auxiliary loss is the model's own at the weight its
config or ``--router-aux-loss-coef`` gives; a sharded rank reads only its
experts' rows from the per-expert checkpoint names; the sharded update is the
one-process update; the versions carry FORMAT.md §2's names (Mixtral's under
``block_sparse_moe``); and ``aurora trainer --nproc 2`` publishes versions a
real Actor applies bit for bit, a checkpoint of which a resumed Trainer
continues on the same chain.
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
from moe_fixtures import moe_dir

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.records import read_digests
from aurora_store.coordination.redisconn import connect
from aurora_store.errors import ConfigError
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.materialize import materialize
from aurora_store.storage import open_store
from aurora_store.testing.servers import free_port
from aurora_store.testing.wait import wait_until
from workers.model import fused_weights, fusion_plan_for, logprobs
from workers.pretrained import build_empty, load_pretrained
from workers.trainer.checkpoint import list_checkpoints
from workers.trainer.config import TrainerConfig
from workers.trainer.fsdp import SINGLE, DistContext, GrpoBatch, exit_process, gather_bf16, grpo_epochs, init_from_env, leave
from workers.trainer.hf_rows import CheckpointRows
from workers.trainer.router_loss import router_aux_coef
from workers.trainer.sharding import load_hf_shards, materialize_sharded, params_on_meta

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

FAMILIES = ("qwen3_moe", "mixtral")
EXPERTS = {"qwen3_moe": "model.layers.{}.mlp.experts.", "mixtral": "model.layers.{}.block_sparse_moe.experts."}
"""Where FORMAT.md §2 puts each family's experts."""


@pytest.fixture(scope="module")
def dirs(shared_tmp: Path) -> dict[str, Path]:
    return {f: moe_dir(shared_tmp, f)[0] for f in FAMILIES}


def _batch(rows: int, vocab: int, adv: float | None = None, coef: float = 0.0, alike: bool = False) -> GrpoBatch:
    """``rows`` sequences of 16 tokens, completions from position 6, old log-probs near uniform.

    ``alike``: every row the same tokens, none padded (advantages still differ). The router's loss
    is a mean over one forward's tokens, taken per pass as transformers computes it, so only for
    such a batch is it the same however the rows are split over passes and ranks.
    """
    g = torch.Generator().manual_seed(11)
    width = 16
    ids = torch.randint(3, vocab, (1 if alike else rows, width), generator=g).expand(rows, width).clone()
    attn = torch.ones(rows, width, dtype=torch.long)
    comp = torch.zeros(rows, width, dtype=torch.long)
    comp[:, 6:] = 1
    if not alike:
        attn[-1, -3:] = 0  # one padded row
        comp[-1, -3:] = 0
    a = torch.randn(rows, generator=g).abs() + 0.1 if adv is None else torch.full((rows,), adv)
    a[1::2] *= -1
    old = (-math.log(vocab) + 0.05 * torch.randn(rows, width, generator=g)) * comp
    return GrpoBatch(ids, attn, comp, a, old, None, 0, False, coef)


def _step(vocab: int) -> GrpoBatch:
    """The sharded test's update: alike rows (their advantages differ, 3 on one rank, 2 on the
    other) with the router's loss. One update only: routing is a discrete choice, and after a
    first step the last-bit differences of the ranks' reduction order can flip a token's
    expert, which no tolerance covers."""
    return _batch(5, vocab, coef=0.3, alike=True)


def _update(model: torch.nn.Module, ctx: DistContext, batch: GrpoBatch) -> None:
    """Plain SGD without clipping: a wrong normalisation of either term across ranks would show."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    grpo_epochs(model, opt, batch, ctx, epochs=1, clip=0.2, kl_coef=0.0, logprobs=logprobs, max_grad_norm=math.inf)


# -- the router's auxiliary loss -------------------------------------------------------------------


def test_the_router_loss_weight_is_the_config_s_unless_set_and_refused_for_a_dense_model(dirs: dict[str, Path]) -> None:
    for family, d in dirs.items():
        with params_on_meta():
            model = build_empty(d)
        assert router_aux_coef(model, None) == model.config.router_aux_loss_coef > 0, family
        assert router_aux_coef(model, 0.0) == 0.0 and router_aux_coef(model, 0.25) == 0.25
    from workers.model import tiny_qwen3

    dense = tiny_qwen3(40, seed=0)
    assert router_aux_coef(dense, None) == 0.0 and router_aux_coef(dense, 0.0) == 0.0
    with pytest.raises(ConfigError, match=r"^router_aux_loss_coef 0\.5: a qwen3 model has no router"):
        router_aux_coef(dense, 0.5)
    with pytest.raises(ConfigError, match="finite number >= 0"):
        TrainerConfig(router_aux_loss_coef=-1.0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_with_no_grpo_signal_only_the_router_loss_moves_the_weights_as_the_model_defines_it(
    dirs: dict[str, Path], family: str, checkpointing: bool
) -> None:
    """Advantages of 0 give the GRPO term no gradient: what moves is ``coef`` x the model's own
    ``aux_loss`` (transformers' ``output_router_logits``), step for step, with activations kept or
    recomputed in the backward pass, and nothing at weight 0."""
    d = dirs[family]
    coef = 0.5
    model = load_pretrained(d).train()
    vocab = int(model.config.vocab_size)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = _batch(6, vocab, adv=0.0, coef=coef)
    batch.checkpointing = checkpointing
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    grpo_epochs(model, opt, batch, SINGLE, epochs=1, clip=0.2, kl_coef=0.0, logprobs=logprobs, max_grad_norm=math.inf)
    # The same step from the model's own definition of the loss.
    ref = load_pretrained(d).train()
    out = ref(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_router_logits=True, use_cache=False)
    (coef * out.aux_loss).backward()
    with torch.no_grad():
        for p in ref.parameters():
            if p.grad is not None:
                p.sub_(p.grad)
    want = dict(ref.named_parameters())
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.endswith("gate.weight") for n in moved), moved  # the routers learn to balance
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[n].detach(), rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    # At weight 0 the same batch moves nothing.
    still = load_pretrained(d).train()
    grpo_epochs(
        still,
        torch.optim.SGD(still.parameters(), lr=1.0),
        _batch(6, vocab, adv=0.0, coef=0.0),
        SINGLE,
        epochs=1,
        clip=0.2,
        kl_coef=0.0,
        logprobs=logprobs,
        max_grad_norm=math.inf,
    )
    assert all(torch.equal(p, before[n]) for n, p in still.named_parameters())


# -- sharded loading and training ----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rank_reads_only_its_experts_rows_from_the_per_expert_names(dirs: dict[str, Path], family: str) -> None:
    d = str(dirs[family])
    ref = load_pretrained(d)
    with params_on_meta():
        meta = build_empty(d)
    packed = [n for n, _ in ref.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert packed  # held packed, saved per expert: the rows come from the per-expert tensors
    with CheckpointRows(d, meta) as saved:
        for name, p in ref.named_parameters():
            e = p.shape[0]
            for lo, hi in ((0, e), (e // 2, e), (1, min(e, 3)), (e, e)):
                got = saved.rows(name, lo, hi, tuple(p.shape))
                assert torch.equal(got.float(), p.detach()[lo:hi]), (name, lo, hi)
        with pytest.raises(ConfigError, match="no tensor 'model.layers.0.nothing'"):
            saved.rows("model.layers.0.nothing", 0, 1, (1,))


def _rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    ctx = init_from_env({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    with params_on_meta():
        model = build_empty(path)
    materialize_sharded(model, ctx, lambda m: load_hf_shards(m, path))
    loaded = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[operator]
    local = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[attr-defined]
    model.train()
    _update(model, ctx, _step(int(model.config.vocab_size)))
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[operator]
    bf16 = gather_bf16(list(model.named_parameters(remove_duplicate=False)), ctx)
    if ctx.leader:
        torch.save({"loaded": loaded, "local": local, "full": full, "bf16": bf16}, out)
    leave(ctx)
    exit_process(0)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_load_their_experts_and_update_as_one_process_does(dirs: dict[str, Path], family: str, tmp_path: Path) -> None:
    path = str(dirs[family])
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(2, free_port(), path, str(out)), nprocs=2)
    got = torch.load(out)
    ref = load_pretrained(path).train()
    want = {n: p.detach().clone() for n, p in ref.named_parameters()}
    assert set(got["loaded"]) == set(want)
    for n, t in want.items():
        assert torch.equal(got["loaded"][n], t), n
    assert got["local"] <= sum(t.numel() for t in want.values()) // 2 + 4096  # each rank holds half
    _update(ref, SINGLE, _step(int(ref.config.vocab_size)))
    moved = 0
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got["full"][n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        moved += int((p.detach() != want[n]).sum())
    assert moved > 0
    # What rank 0 publishes: the bf16 rounding, under FORMAT.md §2's names.
    plan = fusion_plan_for(got["bf16"], tied=True, family=family)
    fused = fused_weights(got["bf16"], plan)
    pre = EXPERTS[family].format(1)
    e, i2, h = ref.model.layers[1].mlp.experts.gate_up_proj.shape
    assert fused[pre + "w13_weight"].shape == (e, i2, h) and fused[pre + "w2_weight"].shape == (e, h, i2 // 2)
    assert torch.equal(fused[pre + "w13_weight"], got["full"]["model.layers.1.mlp.experts.gate_up_proj"].to(torch.bfloat16))
    assert not any(".gate_up_proj" in n or ".experts.0." in n for n in fused)


# -- the Trainer: --nproc 2, a real Actor, a checkpoint and a resume --------------------------------


def _trainer(store: str, redis_url: str, run: str, model: Path, data: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "aurora_tools.cli", "trainer", "--store", store, "--redis", redis_url, "--run", run]
    cmd += ["--model", str(model), "--task", "gsm8k", "--data", str(data), "--batch", "4", "--group", "4"]
    cmd += ["--max-new-tokens", "24", "--eval-every", "0", "--snapshot-every", "0", "--checkpoint-every", "1", "--digest-every", "1"]
    env = {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([*cmd, *extra], env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115


def _finish(p: subprocess.Popen[bytes], log: Path, timeout: float = 600) -> str:
    try:
        rc = p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text(errors="replace")
    assert rc == 0 and "Traceback" not in text, text[-4000:]
    return text


@pytest.mark.server
def test_trainer_nproc2_on_a_qwen3_moe_ships_versions_an_actor_applies_and_resumes_on_the_chain(
    shared_tmp: Path, tmp_path: Path, redis_url: str
) -> None:
    model, data = moe_dir(shared_tmp, "qwen3_moe", supervised=True)
    store, run = f"file://{tmp_path}/run", "moe-nproc2"
    tlog, alog = tmp_path / "trainer.log", tmp_path / "actor.log"
    r = connect(redis_url)
    env = {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    trainer = _trainer(store, redis_url, run, model, data, tlog, "--steps", "2", "--nproc", "2")
    actor: subprocess.Popen[bytes] | None = None
    try:
        wait_until(
            lambda: r.hget(RunKeys(run).trainer, "head") is not None, "v0", timeout=600, processes={"the Trainer": trainer}, logs=[tlog]
        )
        with open(alog, "wb") as out:
            argv = ["actor", "--store", store, "--redis", redis_url, "--run", run, "--id", "a0"]
            actor = subprocess.Popen([sys.executable, "-m", "aurora_tools.cli", *argv], env=env, stdout=out, stderr=subprocess.STDOUT)
        text = _finish(trainer, tlog)
        assert "rank 1: " in text and " updates, done" in text, text[-3000:]
        assert 2 in list_checkpoints(open_store(store))
        # Resumed on one rank from the two ranks' checkpoint: v3 follows v2 on the same chain.
        resumed = _trainer(store, redis_url, run, model, data, tlog, "--steps", "3", "--resume")
        text = _finish(resumed, tlog)
        assert "resumed epoch 2 from the checkpoint before step 2" in text, text[-3000:]
        wait_until(
            lambda: ("a0", 3) in read_digests(r, RunKeys(run))[1],
            "the Actor on v3",
            timeout=300,
            processes={"the Actor": actor},
            logs=[alog],
        )
    finally:
        for p in (trainer, actor):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
    s = open_store(store)
    states = [read_manifest(s, "snapshot" if v == 0 else "delta", v).state for v in range(4)]
    assert read_manifest(s, "delta", 3).base_state == states[2]
    tdig, adig = read_digests(r, RunKeys(run))
    assert sorted(tdig) == [0, 1, 2, 3]
    compared = sorted(v for who, v in adig if who == "a0")
    assert 3 in compared and len(compared) >= 3, (adig, alog.read_text(errors="replace")[-2000:])
    for v in compared:
        assert adig[("a0", v)] == tdig[v], f"v{v}: the Actor's weights differ from the Trainer's"
    # Where GRPO moved the weights it moved the experts too: the weights an Actor builds from the store
    # differ in w13/w2 between v0 and v3. (The supervised tiny model can answer every group alike at
    # every step, a batch without signal that trains nothing: the chain, digests and resume are still
    # checked above; the sharded update test above checks the experts' update against one process.)
    first, last = materialize(s, 0)[0], materialize(s, 3)[0]
    experts = [n for n in first if n.endswith(("experts.w13_weight", "experts.w2_weight"))]
    assert experts and not any(".experts.0." in n or "gate_up_proj" in n.split("experts.")[-1] for n in first)
    moved = [n for n in first if not torch.equal(first[n], last[n])]
    assert not moved or any(n in experts for n in moved), moved
