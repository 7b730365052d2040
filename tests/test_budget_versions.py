"""The Trainer's memory per parameter: one full bf16 version, no fp32 behaviour model, batches where the model runs.

The older version a batch was generated on is rebuilt bit for bit from the
newest one and an undo sized by the elements that changed
(:mod:`workers.trainer.held`); the behaviour module has no weights of its own
(:mod:`workers.trainer.behaviour`); the packed batch goes to the device the
behaviour module runs on.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from workers.model import hf_weights, logprobs, pack_completions, tiny_qwen3
from workers.trainer import grpo
from workers.trainer import held as held_module
from workers.trainer.behaviour import BehaviourModel, versions_device
from workers.trainer.config import TrainerConfig
from workers.trainer.fsdp import SINGLE, GrpoBatch
from workers.trainer.grpo import Rollouts, grpo_batch
from workers.trainer.held import HeldWeights, Undo, bf16_version
from workers.trainer.policy import GrpoPolicy
from workers.trainer.versions import VersionPublisher

# -- the held versions -------------------------------------------------------------


def _version(seed: int, changed: float, base: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if base is None:
        emb = torch.randn(50, 16, generator=g).to(torch.bfloat16)
        return {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "w": torch.randn(64, 32, generator=g).to(torch.bfloat16)}
    out: dict[str, torch.Tensor] = {}
    for name, t in base.items():
        if name == "lm_head.weight":
            continue
        new = t.clone()
        pick = torch.rand(t.shape, generator=g) < changed
        new[pick] = (new[pick].float() + 0.5).to(torch.bfloat16)
        out[name] = new
    out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def test_older_versions_are_rebuilt_bit_for_bit_from_the_newest_and_undos_sized_by_the_change() -> None:
    held = HeldWeights()
    versions = [_version(0, 0.0)]
    for i, frac in enumerate((0.05, 0.9, 0.01, 0.2)):
        versions.append(_version(i + 1, frac, versions[-1]))
    for v, w in enumerate(versions):
        held.hold(v, w)
    assert list(held) == [0, 1, 2, 3, 4] and held[4] is versions[4]
    # Until compacted, an undo is the old tensors themselves: nothing is compared when a version is held.
    assert all(not u.final and u.old is versions[v - 1][n] for v, undo in held.undos.items() for n, u in undo.items())
    for compacted in (False, True):
        if compacted:
            held.compact()
        for v, w in enumerate(versions):
            got = dict(held[v])
            assert set(got) == set(w)
            for name in w:
                assert torch.equal(got[name].view(torch.int16), w[name].view(torch.int16)), (v, name, compacted)
    # Sparse undos hold positions and old values of the changed elements only; a dense one
    # is the old tensor itself (no bigger than its positions would be); tied names share one.
    full = sum(t.numel() * 2 for n, t in versions[0].items() if n != "lm_head.weight")
    assert set(held.undos[1]) == {"model.embed_tokens.weight", "w"}
    assert held.undos[1]["w"].index is not None and held.undos[2]["w"].index is None
    changed = sum(
        int((versions[1][n].view(torch.int16) != versions[0][n].view(torch.int16)).sum()) for n in ("w", "model.embed_tokens.weight")
    )
    assert sum(u.nbytes for u in held.undos[1].values()) == 6 * changed
    sizes = {n: t.numel() for n, t in versions[0].items()}
    assert all(u.nbytes <= 2 * sizes[n] for undo in held.undos.values() for n, u in undo.items())
    assert held.nbytes == full + sum(u.nbytes for undo in held.undos.values() for u in undo.values())
    held.forget_before(3)
    assert list(held) == [3, 4] and 2 not in held and 4 in held
    held.forget_before(99)  # never the newest
    assert list(held) == [4] and held.nbytes == full


def test_holding_the_same_version_again_keeps_the_undos_and_a_gap_drops_them() -> None:
    held = HeldWeights()
    v0 = _version(0, 0.0)
    v1 = _version(1, 0.1, v0)
    held.hold(0, v0)
    held.hold(1, v1)
    held.hold(1, {n: t.clone() for n, t in v1.items()})  # a resumed head, held again
    assert list(held) == [0, 1]
    held.hold(5, v1)
    assert list(held) == [5]


def test_a_version_made_in_one_process_is_the_bf16_rounding_laid_out_in_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    master = tiny_qwen3(40, seed=2, dtype=torch.float32, hidden=64, intermediate=192)
    named = list(master.named_parameters(remove_duplicate=False))
    block = 48 << 10
    monkeypatch.setattr(held_module, "VERSION_BLOCK_BYTES", block)
    v = bf16_version(named)
    assert set(v) == {n for n, _ in named}
    for name, p in named:
        assert v[name].is_contiguous() and torch.equal(v[name].view(torch.int16), p.detach().to(torch.bfloat16).view(torch.int16)), name
    assert v["lm_head.weight"] is v["model.embed_tokens.weight"]  # tied: one copy, as in the model
    storages: dict[int, list[torch.Tensor]] = {}
    for t in {id(t): t for t in v.values()}.values():
        storages.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    # Several tensors share each block; a block is larger than the limit only when one tensor is.
    assert 1 < len(storages) < len({id(t) for t in v.values()})
    for ts in storages.values():
        nbytes = ts[0].untyped_storage().nbytes()
        assert nbytes <= block or (len(ts) == 1 and ts[0].numel() * 2 > block // 2)
    # Where the versions go (a resumed run's, or versions_on): a device of their own.
    assert all(t.device.type == "meta" for t in bf16_version(named, "meta").values())


def test_a_dense_undo_keeps_only_its_own_tensor_not_the_block_it_was_cut_from() -> None:
    old = bf16_version([("a", torch.randn(64, 64)), ("b", torch.randn(32))])
    new = {"a": (old["a"].float() + 1).to(torch.bfloat16), "b": old["b"].clone()}
    u = Undo.between(old["a"], new["a"])
    assert u.index is None and torch.equal(u.old, old["a"])
    assert u.old.untyped_storage().nbytes() == u.old.numel() * 2  # a copy of its own, not a view into the block
    assert Undo.between(old["b"], new["b"]).nbytes == 0  # nothing changed: nothing kept


def test_an_undo_refuses_versions_of_another_shape() -> None:
    with pytest.raises(ValueError, match="shape or dtype"):
        Undo.between(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16))


# -- the behaviour module ------------------------------------------------------------


def test_the_behaviour_module_has_no_weights_and_computes_what_a_bf16_model_computes() -> None:
    master = tiny_qwen3(40, seed=1, dtype=torch.float32)
    beh = BehaviourModel(master, "cpu")
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for _, p in beh.params)
    assert beh.nbytes < 4096  # its rotary table only
    w = {n: t.to(torch.bfloat16) for n, t in hf_weights(master).items()}
    w["lm_head.weight"] = w["model.embed_tokens.weight"]
    packed = pack_completions([[1, 5, 6], [1, 7]], [[8, 9, 2], [10, 2]], 0)
    with torch.no_grad(), beh.lent(w) as lent:
        module: Any = lent
        got = logprobs(module, *packed, reduction="none")
        # The version's tensors are used in place (no copy), the head stays tied.
        assert module.model.embed_tokens.weight.data_ptr() == w["model.embed_tokens.weight"].data_ptr()
        assert module.lm_head.weight is module.model.embed_tokens.weight
    assert all(p.device.type == "meta" for _, p in beh.params)  # given back afterwards
    bf16 = tiny_qwen3(40, seed=1, dtype=torch.bfloat16)
    assert torch.equal(got, logprobs(bf16, *packed, reduction="none").detach())


def test_versions_go_to_the_host_only_when_asked_or_the_device_is_short() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert versions_device("auto", cpu, 10**9) == cpu
    assert versions_device("host", gpu, 10, device_bytes=10**12) == cpu
    assert versions_device("device", gpu, 10**12, device_bytes=1) == gpu
    assert versions_device("auto", gpu, 8 * 10**9, device_bytes=141 * 10**9) == cpu  # an 8B model on one H200: short
    assert versions_device("auto", gpu, 10**9, device_bytes=141 * 10**9) == gpu
    assert versions_device("auto", gpu, 16 * 10**9, device_bytes=141 * 10**9, world=8) == gpu  # 16B over 8 ranks: 32 + 64 GB


# -- placement -------------------------------------------------------------------------


class _Beh:
    """Stands for a behaviour module on ``device`` (``meta``: no data, only where tensors go)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.module = torch.nn.Linear(1, 1)

    def lent(self, weights: Any) -> Any:
        import contextlib

        return contextlib.nullcontext(self.module)


def test_the_packed_batch_lands_on_the_behaviour_modules_device(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, torch.device]] = []

    def fake_logprobs(module: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, comp: torch.Tensor, **_: Any) -> torch.Tensor:
        seen.append(("reference" if module is ref else "behaviour", ids.device))
        assert attn.device == comp.device == ids.device
        return torch.zeros(ids.shape, device=ids.device)

    ref = torch.nn.Linear(1, 1, device="meta")
    monkeypatch.setattr(grpo, "logprobs", fake_logprobs)
    beh = _Beh("meta")
    batch = grpo_batch([[1, 3], [1, 4], [1, 5], [1, 6]], [[7, 2], [8, 2], [9], [10]], [1.0, 0.0, 0.0, 1.0], 2, 0, beh, {}, ref)  # type: ignore[arg-type]
    assert batch is not None
    assert seen == [("behaviour", torch.device("meta")), ("reference", torch.device("meta"))]
    for t in (batch.input_ids, batch.attention_mask, batch.completion_mask, batch.old, batch.advantages, batch.ref):
        assert t is not None and t.device == beh.device
    # Each rank takes its rows of what rank 0 sent (through the host) to its own device, as they are.
    host = GrpoBatch(
        torch.ones(3, 4, dtype=torch.long),
        torch.ones(3, 4, dtype=torch.long),
        torch.ones(3, 4),
        torch.ones(3),
        torch.ones(3, 4),
        None,
        2,
        True,
    )
    mine = host.rows([0, 2], torch.device("meta"))
    assert {t.device.type for t in (mine.input_ids, mine.attention_mask, mine.completion_mask, mine.advantages, mine.old)} == {"meta"}
    assert (mine.micro_batch, mine.checkpointing) == (2, True)
    assert host.to("meta").input_ids.device.type == "meta"
    assert batch.rows([1], torch.device("meta")).input_ids.device.type == "meta"  # rows picked where the batch is
    assert pack_completions([[1]], [[2]], 0, "meta").input_ids.device.type == "meta"


# -- the policy's memory ---------------------------------------------------------------


def _tensor_bytes(*roots: object) -> int:
    """Bytes of every distinct tensor storage reachable from ``roots`` (parameters, gradients, optimizer state, dicts, attributes)."""
    storages: set[int] = set()
    objects: set[int] = set()
    total = 0

    def visit(o: object, depth: int) -> None:
        nonlocal total
        if o is None or id(o) in objects or depth > 8 or isinstance(o, (str, bytes, int, float, bool)):
            return
        objects.add(id(o))
        if isinstance(o, torch.Tensor):
            if o.device.type != "meta":
                key = o.untyped_storage().data_ptr()
                if key not in storages:
                    storages.add(key)
                    total += o.untyped_storage().nbytes()
            visit(o.grad, depth + 1)
            return
        if isinstance(o, torch.nn.Module):
            for t in itertools.chain(o.parameters(), o.buffers()):
                visit(t, depth + 1)
            return
        if isinstance(o, torch.optim.Optimizer):
            visit(o.state, depth + 1)
            return
        if isinstance(o, (dict, list, tuple, set)):
            items: Iterator[Any] = iter(o.values()) if isinstance(o, dict) else iter(o)
            for x in items:
                visit(x, depth + 1)
            return
        fields = getattr(o, "__dict__", None)
        values = (
            list(fields.values()) if fields is not None else [getattr(o, s) for s in getattr(type(o), "__slots__", ()) if hasattr(o, s)]
        )
        for x in values:
            visit(x, depth + 1)

    for r in roots:
        visit(r, 0)
    return total


def _rollouts(tok: Any, rows: int = 8, group: int = 2) -> Rollouts:
    prompts = [tok.encode(f"{i}+{i + 1}=", bos=True) for i in range(rows // group) for _ in range(group)]
    comps = [tok.encode(f" {2 * i + 1}\n#### {2 * i + 1}", eos=True) for i in range(rows)]
    return Rollouts(prompts=prompts, completions=comps, rewards=[float(i % 2) for i in range(rows)], groups=list(range(0, rows, group)))


@pytest.mark.slow
def test_the_policy_holds_no_fp32_behaviour_model_and_one_full_bf16_version() -> None:
    cfg = TrainerConfig(
        optimizer="adamw", lr=1e-3, tiny_hidden=512, tiny_intermediate=1536, head_dim=64, eval_every=0, micro_batch=2, group=2, batch=4
    )
    pol = GrpoPolicy(cfg, SINGLE, {})
    try:
        pol.build_model()
        pol.prepare_training()
        params = pol.params
        assert params > 4_000_000
        vp = VersionPublisher(None, None, None, None, cfg, None, None, threading.Event(), dict)  # type: ignore[arg-type]
        vp.place = pol.versions_device
        # The peak of a step is at the optimizer step: gradients are alive. Measure there.
        at_step: list[int] = []
        assert pol.opt is not None and pol.behavior is not None
        step = pol.opt.step

        def measured(*a: Any, **k: Any) -> Any:
            at_step.append(_tensor_bytes(pol.model, pol.behavior, pol.reference, pol.opt, pol.evaluator, vp.held))
            return step(*a, **k)

        pol.opt.step = measured  # type: ignore[method-assign]
        v0 = pol.weights()
        vp.hold(0, "s0", v0)
        pol.train(_rollouts(pol.tokenizer), vp.behaviour(0, 0))  # batch 0, generated on v0
        vp.hold(1, "s1", pol.weights())
        vp.held.forget_before(1 - cfg.max_lag)
        assert list(vp.held) == [0, 1]
        # Published: the master (4), AdamW's moments (8), the new version and the one its batch still needs (2 + 2).
        published = _tensor_bytes(pol.model, pol.behavior, pol.reference, pol.opt, pol.evaluator, vp.held)
        assert published <= 16 * params * 1.01, published / params
        # Batch 1 was generated on v0 (one step behind): its behaviour log-probs are v0's exactly.
        view = vp.behaviour(0, 2 - cfg.max_lag)
        assert list(vp.held) == [1]  # what rebuilds v0 now lives only as long as the view
        reference = copy.deepcopy(pol.model).to(torch.bfloat16).eval()
        with torch.no_grad():
            for n, t in hf_weights(reference).items():
                t.copy_(v0[n])
        r = _rollouts(pol.tokenizer)
        batch = grpo_batch(r.prompts, r.completions, r.rewards, cfg.group, pol.tokenizer.pad_id, pol.behavior, view, None)
        assert batch is not None
        want = logprobs(reference, batch.input_ids, batch.attention_mask, batch.completion_mask, reduction="none").detach()
        assert torch.equal(batch.old, want)
        del reference, want, batch, v0
        pol.train(r, view)
        assert not view and list(vp.held) == [1]  # released before the backward pass
        # At the optimizer step: the fp32 master (4 bytes per parameter), its gradient (4), AdamW's
        # two moments (8), one bf16 version (2); no fp32 behaviour model, no second version.
        assert len(at_step) == 2 * cfg.epochs
        assert max(at_step) <= 18 * params * 1.01, max(at_step) / params
        # Between steps the gradients are gone too.
        assert all(p.grad is None for p in pol.model.parameters())
        assert all(p.device.type == "meta" for _, p in pol.behavior.params)
        held = _tensor_bytes(pol.model, pol.behavior, pol.reference, pol.opt, pol.evaluator, vp.held)
        assert held <= 14 * params * 1.01, held / params
    finally:
        pol.close()


def test_the_packed_batch_is_on_the_model_device_in_a_real_policy_step() -> None:
    """With the model on the CPU the whole path runs; the batch's device is the behaviour module's."""
    cfg = TrainerConfig(eval_every=0, group=2, batch=4, micro_batch=3)
    pol = GrpoPolicy(cfg, SINGLE, {})
    try:
        pol.build_model()
        pol.prepare_training()
        assert pol.behavior is not None and pol.behavior.device == next(pol.model.parameters()).device
        w = pol.weights()
        r = _rollouts(pol.tokenizer)
        batch = grpo_batch(r.prompts, r.completions, r.rewards, 2, pol.tokenizer.pad_id, pol.behavior, w, None, 3)
        assert batch is not None and batch.micro_batch == 3
        assert batch.input_ids.device == batch.old.device == pol.behavior.device
    finally:
        pol.close()


class _Scores:
    """Stands for the reward runner: keeps the texts it is asked to score."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def score(self, pairs: list[tuple[str, Any]]) -> list[float]:
        self.texts += [t for t, _ in pairs]
        return [0.0] * len(pairs)


def test_evaluation_runs_on_the_behaviour_module_and_generates_what_an_engine_generates() -> None:
    from workers.engine.torch_engine import EngineConfig, TorchEngine
    from workers.task import make_task
    from workers.tokenizer import CharTokenizer
    from workers.trainer.evaluation import Evaluator

    tok = CharTokenizer()
    master = tiny_qwen3(tok.vocab_size, seed=4, dtype=torch.float32)
    version = {n: t.to(torch.bfloat16) for n, t in hf_weights(master).items()}
    version["lm_head.weight"] = version["model.embed_tokens.weight"]
    task = make_task("arithmetic", None, None, seed=0, difficulty=1, storage_options={}, holdout=6)
    scores = _Scores()
    beh = BehaviourModel(master, "cpu")
    res = Evaluator(task, tok, scores, beh, 6, 8, max_batch_rows=4).run(3, version)  # type: ignore[arg-type]
    assert (res.version, res.problems) == (3, 6) and len(scores.texts) == 6
    assert all(p.device.type == "meta" for _, p in beh.params)  # no copy kept after the evaluation
    engine = TorchEngine(tok, EngineConfig(device="cpu"))
    engine.load(copy.deepcopy(master))
    engine.load_weights(version)
    prompts = [tok.render_prompt(p.prompt_text) for p in task.eval_problems(6)]
    want = engine.generate(prompts, 1, 8, seed=0, temperature=0.0)
    assert scores.texts == [g[0].text for g in want.completions]


def test_versions_given_elsewhere_are_held_where_the_trainer_keeps_them_ties_kept() -> None:
    """A resumed run's versions come from the store in host memory; they are held where fresh ones are."""
    vp = VersionPublisher(None, None, None, None, TrainerConfig(), None, None, threading.Event(), dict)  # type: ignore[arg-type]
    vp.place = lambda: torch.device("meta")
    v0 = _version(0, 0.0)
    vp.hold(0, "s0", v0)
    held = vp.held[0]
    assert all(t.device.type == "meta" for t in held.values())
    assert held["lm_head.weight"] is held["model.embed_tokens.weight"]
    assert vp.published is held and vp.states == {0: "s0"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_policy_step_and_an_evaluation_run_on_cuda() -> None:
    cfg = TrainerConfig(eval_every=1, eval_size=4, group=2, batch=4, optimizer="adamw", lr=1e-3)
    ctx = type(SINGLE)(0, 1, torch.device("cuda"))
    pol = GrpoPolicy(cfg, ctx, {})
    try:
        pol.build_model()
        pol.prepare_training()
        vp = VersionPublisher(None, None, None, None, cfg, None, None, threading.Event(), dict)  # type: ignore[arg-type]
        vp.place = pol.versions_device
        vp.hold(0, "s0", {n: t.cpu() for n, t in pol.weights().items()})  # as a resumed run gets it
        assert vp.published["model.norm.weight"].device.type == "cuda"
        pol.train(_rollouts(pol.tokenizer), vp.behaviour(0, 0))
        vp.hold(1, "s1", pol.weights())
        pol.train(_rollouts(pol.tokenizer), vp.behaviour(0, 1))
        assert pol.evaluate(1, vp.published).problems == 4
    finally:
        pol.close()
