"""Two GRPO steps on the device, each shipped as a delta through a ``file://`` store into a torch engine.

The Trainer's pieces, one process, no Redis: the fp32 master of a tiny Qwen3
(:func:`workers.model.tiny_qwen3`) trains on the device through
:func:`workers.trainer.fsdp.grpo_epochs` (the one-process context, with the
device set); the behaviour copy stays in host memory as the Trainer keeps it
(:func:`workers.trainer.grpo.grpo_batch`). Each step:

1. the engine (:class:`~workers.engine.torch_engine.TorchEngine` on the
   device) samples a group per prompt from the version it holds;
2. the Trainer scores every completion with :func:`workers.task.reward`.
   One completion of each group is the problem's worked solution instead
   of a sample: a tiny random model never answers right, and a batch whose
   groups all score alike gives GRPO no signal (no update, an empty delta,
   nothing checked);
3. one GRPO update; the new bf16 weights are cast on the device and the
   delta is extracted there, against the previous version, and published
   with its weights digest (:func:`aurora_store.lineage.publish.publish_delta`,
   as :func:`workers.trainer.publishing.publish_version` does);
4. the engine fetches the delta (:func:`aurora_store.lineage.fetch.fetch_delta`,
   checked against the chain's state), applies it in place, and its
   :meth:`~workers.engine.torch_engine.TorchEngine.digest` must equal the
   Trainer's.

Version 0 is a snapshot the engine bootstraps from, checked the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import torch

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import extract, fuse_weights
from aurora_store.codec.fusion import FusionPlan
from aurora_store.lineage.fetch import fetch_delta, fetch_snapshot
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.storage import open_store
from workers.engine.torch_engine import EngineConfig, TorchEngine
from workers.model import fusion_plan_for, hf_weights, is_tied, logprobs, tiny_qwen3
from workers.task import make_problems, reward
from workers.tokenizer import CharTokenizer
from workers.trainer.fsdp import SINGLE, grpo_epochs
from workers.trainer.grpo import grpo_batch

__all__ = ["run_grpo_check"]

RUN = "gpucheck"


def _bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The version the Trainer ships: the bf16 rounding of the master, on the master's device."""
    return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters(remove_duplicate=False)}


def run_grpo_check(
    device: torch.device,
    steps: int = 2,
    prompts: int = 8,
    group: int = 4,
    max_new_tokens: int = 16,
    seed: int = 0,
    model_kw: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the steps; ``grpo_steps_ok`` is true only if every check of every step held."""
    tok = CharTokenizer()
    master = tiny_qwen3(tok.vocab_size, seed=seed, dtype=torch.float32, **dict(model_kw or {}))
    tied = is_tied(hf_weights(master))
    behavior = copy.deepcopy(master).eval().requires_grad_(False)  # host memory, as the Trainer keeps it
    torch.nn.Module.to(master, device).train()
    ctx = dataclasses.replace(SINGLE, device=device)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3, weight_decay=0.0)
    plan: FusionPlan = fusion_plan_for(_bf16(master), tied=tied)
    engine = TorchEngine(tok, EngineConfig(device=str(device)))
    engine.load(copy.deepcopy(behavior))
    cfg = PublishConfig()
    checks: dict[str, bool] = {}
    steps_out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="aurora-gpucheck-") as root:
        store = open_store(f"file://{root}/run")
        published = _bf16(master)
        snap = publish_snapshot(store, RUN, 0, fuse_weights(published, plan), None, cfg)
        states = {0: snap.state}
        _, tensors = fetch_snapshot(store, 0)
        engine.load_weights(tensors, version=0)
        checks["v0_digest"] = engine.digest() == weights_digest(published, plan)
        for step in range(steps):
            v = step + 1
            t0 = time.perf_counter()
            problems = make_problems(prompts, seed=seed * 1000 + step)
            ids = [tok.encode(p.prompt_text, bos=True) for p in problems]
            gen = engine.generate(ids, group, max_new_tokens, seed=seed * 1000 + step)
            flat_prompts: list[list[int]] = []
            comps: list[list[int]] = []
            rewards: list[float] = []
            sampled: list[float] = []
            for p, pid, outs in zip(problems, ids, gen.completions, strict=True):
                group_ids = [list(c.token_ids) or [tok.eos_id] for c in outs]
                group_ids[-1] = tok.encode(p.solution, eos=True)[:max_new_tokens]
                for j, c in enumerate(group_ids):
                    r = reward(tok.decode(c), p.answer)
                    flat_prompts.append(pid)
                    comps.append(c)
                    rewards.append(r)
                    if j < group - 1:
                        sampled.append(r)
            t_gen = time.perf_counter() - t0
            batch = grpo_batch(flat_prompts, comps, rewards, group, tok.pad_id, behavior, published, None)
            checks[f"step{v}_signal"] = batch is not None
            if batch is None:
                break
            t1 = time.perf_counter()
            grpo_epochs(master, opt, batch, ctx, 1, 0.2, 0.0, logprobs)
            new = _bf16(master)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t_train = time.perf_counter() - t1
            digest = weights_digest(new, plan)
            t2 = time.perf_counter()
            m = publish_delta(
                store, RUN, v, extract(plan, published, new), states[v - 1], cfg, producer={"step": step}, weights_digest=digest
            )
            t_pub = time.perf_counter() - t2
            states[v] = m.state
            t3 = time.perf_counter()
            _, staged = fetch_delta(store, v, engine.param_specs(), expect_base_state=states[v - 1])
            engine.apply(staged)
            t_apply = time.perf_counter() - t3
            got = engine.digest()
            checks[f"step{v}_changed"] = m.nnz > 0
            checks[f"step{v}_digest"] = got == digest and engine.version == v
            steps_out.append(
                {
                    "version": v,
                    "sampled_reward": round(sum(sampled) / max(1, len(sampled)), 3),
                    "nnz": m.nnz,
                    "delta_bytes": m.total_bytes,
                    "gen_s": round(t_gen, 3),
                    "train_s": round(t_train, 3),
                    "publish_s": round(t_pub, 3),
                    "fetch_apply_s": round(t_apply, 3),
                    "digest": digest,
                }
            )
            published = new
    ok = len(steps_out) == steps and all(checks.values())
    return {
        "grpo_steps_ok": ok,
        "grpo_checks": checks,
        "grpo_steps": steps_out,
        "grpo_model_params": sum(p.numel() for p in master.parameters()),
    }
