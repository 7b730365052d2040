"""A user's model and data set through the whole system: Trainer, Relay, a torch and a vLLM Actor.

The body of ``test_hf_system_<family>.py`` (one file per family, so that xdist runs the two
families on different workers).

Per family (a tiny Qwen3 on GSM8K-format data, a tiny Llama on MATH-format
data; :mod:`hf_fixtures`): the Trainer is given ``--model DIR --task T
--data FILE``; the Actors get nothing but the bucket URL, Redis (through
the environment) and the run name, and build model and tokenizer from the
run root. Checked: bit-identical weights at every version on both Actors,
version 0 the checkpoint's tensors bit for bit, rewards from the task, the
held-out accuracy recorded by version, in Redis and in the run root.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hf_fixtures import Pretrained
from safetensors.torch import load_file

from aurora_store.apply.sink import tree_weights_digest
from aurora_store.coordination.evals import read_evals, read_store_evals
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.records import read_digests
from aurora_store.coordination.redisconn import connect
from aurora_store.storage import open_store
from aurora_store.testing.servers import RedisServer
from aurora_tools.demo.system import DemoConfig, run_system_demo
from workers.model import fusion_plan_for
from workers.pretrained import load_pretrained

# Looked up, not imported: importing vllm at collection costs every xdist worker seconds.
MARKS = [
    pytest.mark.slow,
    pytest.mark.server,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vLLM Actor needs the vllm extra (make test installs it)"),
]


def run_family(pretrained: dict[str, Pretrained], tmp_path: Path, family: str, task: str) -> None:
    """One family's model and task through the whole system, every check made."""
    steps = 4
    with RedisServer() as rs:
        p = pretrained[family]
        run = f"hf-{family}"
        cfg = DemoConfig(
            steps=steps,
            batch=8,
            group=4,
            actors_relay=1,
            actors_origin=1,
            kill_at=-1,
            join_at=-1,
            snapshot_every=3,
            redis=rs.url,
            run=run,
            workdir=str(tmp_path / family),
            display=False,
            engines=("torch", "vllm"),
            trainer_extra={
                "model": str(p.model),
                "task": task,
                "data": str(getattr(p, task)),
                "eval_every": 2,
                "eval_size": 8,
                "max_new_tokens": 32,
                "min_actors": 2,
            },
        )
        res = run_system_demo(cfg, say=lambda *a, **k: None)
        logs = {n: (tmp_path / family / "logs" / f"{n}.log").read_text(errors="replace")[-3000:] for n in ("eu-0", "us-0")}
        assert len(res.logs) == steps, logs
        assert res.bit_identical, (res.mismatches, logs)
        r = connect(rs.url)
        keys = RunKeys(run)
        tdig, adig = read_digests(r, keys)
        # Both Actors (eu-0 torch behind the Relay, us-0 vLLM from origin) activated versions past
        # v0 (each one compared above), and together every version a batch was generated on.
        for actor in ("eu-0", "us-0"):
            assert len({v for a, v in adig if a == actor}) >= 2, (actor, sorted(adig), logs[actor])
            assert any(actor in lg.by_actor for lg in res.logs), (actor, [lg.by_actor for lg in res.logs])
        assert set(range(steps)) <= {v for _, v in adig}
        # Version 0 is the directory's checkpoint, bit for bit.
        model = load_pretrained(p.model, torch.bfloat16)
        plan = fusion_plan_for(model)
        raw = load_file(str(p.model / "model.safetensors"))
        raw.setdefault("lm_head.weight", raw["model.embed_tokens.weight"])
        assert tdig[0] == tree_weights_digest({n: raw[n] for n, _ in model.named_parameters(remove_duplicate=False)}, plan)
        # Rewards are the task's: the fine-tuned checkpoint earns some, and GRPO moved the weights.
        assert any(lg.reward > 0 for lg in res.logs)
        assert all(lg.delta_bytes > 0 for lg in res.logs if lg.changed)
        assert res.prompts_lost == 0 and res.accepted_twice == 0 and res.accepted_wrong_version == 0
        # Held-out accuracy by version: v0, v2, v4, in Redis and in the run root.
        evals = read_evals(r, keys)
        assert sorted(evals) == [0, 2, 4]
        assert all(e["problems"] == 8 for e in evals.values())
        stored = read_store_evals(open_store(f"file://{tmp_path / family / 'store'}"))
        assert {v: e["accuracy"] for v, e in stored.items()} == {v: e["accuracy"] for v, e in evals.items()}
        # The Actors built their model from the run root: the vLLM one says so in its log.
        assert "activated v3" in (tmp_path / family / "logs" / "us-0.log").read_text(errors="replace")
        json.dumps(res.to_json())
