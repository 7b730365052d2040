"""``aurora bench e2e``: what the weight path adds to a step, with one-step asynchrony.

Runs the demo's workload twice in one invocation, on the same machine and
servers: with the weight path (every version published as a delta, staged
and activated by every Actor) and without it (the ideal baseline: versions
trained but never shipped, every batch generated on v0). The difference in
mean step time is what shipping weights costs end to end.

With ``--parity`` it runs the paper's parity check instead: the same model,
task and seed trained asynchronously (K=1, deltas) and synchronously (K=0:
each batch generated on the version just published), the held-out accuracy
recorded by version in each (``parity_accuracy_async``,
``parity_accuracy_sync``, at ``parity_versions``).

Reported per step: the Trainer's wait for rollouts (generation it could not
hide), training, extract + publish, and the Actors' stage and activation
times (off the critical path: they overlap generation).

With ``--engine vllm`` the Actors generate with vLLM, and after the runs one
vLLM engine replays the run's versions to time, side by side, activating
each delta in place (``activation_s_delta``) against vLLM's own
``load_weights`` of the same whole version (``activation_s_reload``), both
measured inside the vLLM worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from aurora_tools.demo.system import DemoConfig, DemoResult, run_system_demo

__all__ = ["add_arguments", "main", "summarize", "vllm_activation"]


def summarize(res: DemoResult, skip: int) -> dict[str, Any]:
    logs = res.logs[skip:] or res.logs
    acts = list(res.activations.values())

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else 0.0

    return {
        "steps_measured": len(logs),
        "step_s": mean([lg.step_s for lg in logs]),
        "wait_rollouts_s": mean([lg.wait_s for lg in logs]),
        "train_s": mean([lg.train_s for lg in logs]),
        "extract_publish_s": mean([lg.extract_publish_s for lg in logs]),
        "stage_s": mean([a["stage_s"] for a in acts]),
        "activate_s": mean([a["activate_s"] for a in acts]),
        "tokens_per_s": mean([lg.tokens_per_s for lg in logs]),
        "delta_bytes": mean([float(lg.delta_bytes) for lg in logs]),
        "reward_last": mean([lg.reward for lg in res.logs[-3:]]),
    }


def vllm_activation(store_url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every delta of a run, activated in one vLLM engine: in place vs a whole ``load_weights``.

    Per version v: bootstrap (untimed) at v-1 is done once, then for each v
    the workers stage delta v (untimed), apply it in place (timed in the
    worker, and as the caller waits for it), then reload the same version
    whole through vLLM's weight loaders (timed in the worker; the weights
    are read and split before the clock starts).
    """
    import statistics

    from aurora_store.lineage.plan import scan_versions
    from aurora_store.storage import open_store
    from workers.common import MODEL_CONFIG_KEY, TOKENIZER_KEY
    from workers.engine.vllm_engine import VLLMConfig, VLLMEngine
    from workers.tokenizer import CharTokenizer

    store = open_store(store_url, storage_options)
    # The config only: a model skeleton of a large shape would cost seconds and gigabytes here.
    config = json.loads(store.get(MODEL_CONFIG_KEY))
    tokenizer = CharTokenizer.from_json(store.get(TOKENIZER_KEY).decode("utf-8"), where=store.where(TOKENIZER_KEY))
    engine = VLLMEngine(tokenizer, VLLMConfig.from_env())
    engine.load(config)
    try:
        deltas = sorted(scan_versions(store).deltas)
        if not deltas:
            raise ValueError(f"{store_url}: no delta to activate")
        _, state = engine.bootstrap_from_store(store, storage_options, deltas[0] - 1)
        delta_s, delta_rpc_s, reload_s, nnz = [], [], [], []
        for v in deltas:
            m, staged = engine.stage_from_store(store, storage_options, v, state)
            t0 = time.perf_counter()
            engine.apply(staged)
            delta_rpc_s.append(time.perf_counter() - t0)
            delta_s.append(engine.last_apply_s)
            reload_s.append(engine.reload_seconds(store, storage_options))
            nnz.append(m.nnz)
            state = m.state
        numel = sum(s.numel for s in engine.param_specs().values())
        return {
            "versions": len(deltas),
            "params": numel,
            "changed_mean": statistics.fmean(nnz),
            "activation_s_delta": statistics.fmean(delta_s),
            "activation_s_delta_rpc": statistics.fmean(delta_rpc_s),
            "activation_s_reload": statistics.fmean(reload_s),
            "vllm_start_s": engine.start_s,
        }
    finally:
        engine.close()


#: ``--activation-shape`` choices: Qwen3-0.6B, and a Qwen3-MoE small enough for vLLM's CPU build here
#: (12 layers of 32 experts, 8 active, hidden 512, expert intermediate 192 as Qwen3-30B-A3B-mini's:
#: about 155 M parameters, 1,263 checkpoint tensors; vLLM prepacks every expert after loading).
ACTIVATION_SHAPES = ("qwen3-0.6b", "qwen3-moe-mini")


def activation_shape(name: str) -> Any:
    """The synthetic shape ``--activation-shape`` names."""
    from aurora_tools.synthetic.shapes import QWEN3_0_6B, Qwen3MoeShape

    if name == "qwen3-moe-mini":
        return Qwen3MoeShape(
            vocab=32768, hidden=512, layers=12, moe_intermediate=192, experts=32, active=8, heads=8, kv_heads=2, head_dim=64
        )
    return QWEN3_0_6B


def synthetic_run(root: str, shape: Any, versions: int = 3, lr: float = 2e-7, seed: int = 0) -> str:
    """A run of random Qwen3-shaped (or Qwen3-MoE-shaped) weights taking Adam-sized steps (about 1% of
    elements change per step at lr 2e-7, as in RL post-training), published to ``file://root``; returns its URL."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from aurora_store.codec.extract import extract, fuse_weights, plan_of
    from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
    from aurora_store.storage import open_store
    from aurora_tools.synthetic.shapes import MasterWeights, Qwen3MoeShape, make_weights
    from workers.common import write_model_description
    from workers.tokenizer import CharTokenizer

    url = f"file://{os.path.abspath(root)}"
    store = open_store(url)
    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        tie_word_embeddings=shape.tied,
        max_position_embeddings=512,
    )
    moe = isinstance(shape, Qwen3MoeShape)
    if moe:
        cfg: Any = Qwen3MoeConfig(
            **common,
            moe_intermediate_size=shape.moe_intermediate,
            num_experts=shape.experts,
            num_experts_per_tok=shape.active,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            architectures=["Qwen3MoeForCausalLM"],
        )
    else:
        cfg = Qwen3Config(**common, intermediate_size=shape.intermediate, architectures=["Qwen3ForCausalLM"])
    write_model_description(store, cfg.to_json_string(), CharTokenizer().to_json())
    base = make_weights(shape, seed=seed)
    plan = plan_of(base, tied=False, family="qwen3_moe" if moe else None)
    pub = PublishConfig()
    state = publish_snapshot(store, "activation", 0, fuse_weights(base, plan), None, pub).state
    master = MasterWeights(base, seed=seed)
    for v in range(1, versions + 1):
        new = master.step(lr)
        state = publish_delta(store, "activation", v, extract(plan, base, new), state, pub).state
        base = new
    return url


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument(
        "--parity",
        action="store_true",
        help="the paper's parity check instead: held-out accuracy by version of an asynchronous delta run (K=1) "
        "against a synchronous run (K=0, each batch on the version just published), same model, task, seed and steps",
    )
    g = p.add_argument_group("model and task (--parity; default: the demo's built-in model and arithmetic)")
    g.add_argument("--model", metavar="DIR", default=None, help="a local Hugging Face causal-LM directory")
    g.add_argument("--task", default="arithmetic", help="arithmetic, gsm8k, math or package.module:factory")
    g.add_argument("--data", metavar="FILE", default=None, help="training problems (JSON lines, Parquet; local or s3://)")
    g.add_argument("--eval-data", metavar="FILE", default=None, help="held-out problems (default: a held-out slice of --data)")
    g.add_argument("--eval-every", type=int, default=2, metavar="N", help="evaluate every N versions (default 2)")
    g.add_argument("--eval-size", type=int, default=64, metavar="N", help="held-out problems per evaluation (default 64)")
    g.add_argument("--group", type=int, default=8, help="completions per prompt")
    g.add_argument("--max-new-tokens", type=int, default=None, metavar="N", help="longest completion (default: the Trainer's)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--tiny-size",
        nargs=2,
        type=int,
        default=None,
        metavar=("HIDDEN", "INTERMEDIATE"),
        help="widths of the built-in model (default: the demo's 256 768)",
    )
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the means")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--engine", default="torch", choices=("torch", "vllm"), help="the Actors' engine; vllm adds delta vs reload activation times"
    )
    p.add_argument(
        "--activation-shape",
        default=None,
        choices=ACTIVATION_SHAPES,
        help="with --engine vllm: also time delta vs reload activation on random weights of this shape (about 1%% of elements change per delta)",
    )


def parity(args: argparse.Namespace) -> dict[str, Any]:
    """Accuracy by version of an asynchronous (K=1) and a synchronous (K=0) delta run of the same model, task and seed."""
    from aurora_store.coordination.evals import read_evals
    from aurora_store.coordination.keys import RunKeys
    from aurora_store.coordination.redisconn import connect
    from aurora_store.testing.servers import RedisServer

    extra: dict[str, Any] = {"task": args.task, "eval_every": args.eval_every, "eval_size": args.eval_size}
    for k in ("model", "data", "eval_data", "max_new_tokens"):
        if getattr(args, k) is not None:
            extra[k] = getattr(args, k)
    out: dict[str, Any] = {"parity": True, "steps": args.steps, "task": args.task, "model": args.model or "built-in", "seed": args.seed}
    curves: dict[str, dict[int, float]] = {}
    with RedisServer() as rs:
        for mode, lag in (("async", 1), ("sync", 0)):
            run = f"parity-{mode}"
            cfg = DemoConfig(
                steps=args.steps,
                batch=args.batch,
                group=args.group,
                actors_relay=0,
                actors_origin=2,
                relay=False,
                kill_at=-1,
                join_at=-1,
                redis=rs.url,
                run=run,
                workdir=tempfile.mkdtemp(prefix=f"aurora-parity-{mode}-"),
                display=False,
                seed=args.seed,
                engine=args.engine,
                trainer_extra={**extra, "max_lag": lag, "min_actors": 2},
                **({"tiny_hidden": args.tiny_size[0], "tiny_intermediate": args.tiny_size[1]} if args.tiny_size else {}),
            )
            if not args.json:
                print(
                    f"running {mode} ({'K=1: batch b on version b-1' if lag else 'K=0: batch b on version b'}), {args.steps} steps ...",
                    flush=True,
                )
            t0 = time.perf_counter()
            res = run_system_demo(cfg, say=lambda *a, **k: None)
            curves[mode] = {v: e["accuracy"] for v, e in read_evals(connect(rs.url), RunKeys(run)).items()}
            out[f"wall_s_{mode}"] = time.perf_counter() - t0
            out[f"reward_{mode}"] = [lg.reward for lg in res.logs]
            out[f"gen_version_{mode}"] = [lg.gen_version for lg in res.logs]
            out[f"bit_identical_{mode}"] = res.bit_identical
    versions = sorted(set(curves["async"]) & set(curves["sync"]))
    out["parity_versions"] = versions
    out["parity_accuracy_async"] = [curves["async"][v] for v in versions]
    out["parity_accuracy_sync"] = [curves["sync"][v] for v in versions]
    gaps = [a - b for a, b in zip(out["parity_accuracy_async"], out["parity_accuracy_sync"], strict=True)]
    out["parity_gap_mean"] = statistics.fmean(gaps) if gaps else None
    out["parity_gap_last"] = gaps[-1] if gaps else None
    return out


def _print_parity(out: dict[str, Any]) -> None:
    print(f"\nheld-out accuracy by version ({out['model']}, task {out['task']}, seed {out['seed']})")
    print(f"{'version':>8} {'async K=1':>10} {'sync K=0':>10} {'gap':>8}")
    for v, a, b in zip(out["parity_versions"], out["parity_accuracy_async"], out["parity_accuracy_sync"], strict=True):
        print(f"{v:>8} {a:>10.3f} {b:>10.3f} {a - b:>+8.3f}")
    if out["parity_gap_mean"] is not None:
        print(
            f"mean gap {out['parity_gap_mean']:+.3f}, last {out['parity_gap_last']:+.3f}; wall {out['wall_s_async']:.0f}s async, {out['wall_s_sync']:.0f}s sync"
        )


def main(args: argparse.Namespace) -> int:
    from aurora_tools.bench.json_stdout import json_only
    from workers.process import limit_torch_threads

    limit_torch_threads()
    parity_run = bool(getattr(args, "parity", False))
    with json_only(args.json):  # vLLM's logs and its workers' go to stderr: stdout holds the JSON alone
        out = parity(args) if parity_run else _measure(args)
    if args.json:
        print(json.dumps(out))
        return 0
    if parity_run:
        _print_parity(out)
        return 0
    _print_table(out, args)
    return 0


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    """Both runs (and the vLLM replay with ``--engine vllm``): the JSON object."""
    from aurora_store.testing.servers import RedisServer

    if args.engine == "vllm":
        from workers.engine.vllm_engine import import_vllm

        import_vllm()
    out: dict[str, Any] = {"engine": args.engine}
    results = {}
    workdirs = {}
    with RedisServer() as rs:
        for mode, transfer in (("aurora", True), ("ideal", False)):
            cfg = DemoConfig(
                steps=args.steps,
                batch=args.batch,
                actors_relay=2,
                actors_origin=2,
                kill_at=-1,
                join_at=-1,
                redis=rs.url,
                run=f"bench-{mode}",
                workdir=tempfile.mkdtemp(prefix=f"aurora-bench-{mode}-"),
                display=False,
                weight_transfer=transfer,
                engine=args.engine,
            )
            workdirs[mode] = cfg.workdir
            if not args.json:
                print(
                    f"running {mode} ({'weights shipped as deltas' if transfer else 'no weight transfer'}), {args.steps} steps ...",
                    flush=True,
                )
            res = run_system_demo(cfg, say=lambda *a, **k: None)
            results[mode] = res
            out[mode] = summarize(res, args.skip)
    a, i = out["aurora"], out["ideal"]
    out["weight_path_overhead_fraction"] = (a["step_s"] - i["step_s"]) / i["step_s"] if i["step_s"] > 0 else None
    out["bit_identical"] = results["aurora"].bit_identical
    out["target"] = {
        "weight_path_overhead_fraction_max": 0.05,
        "met": out["weight_path_overhead_fraction"] is not None and out["weight_path_overhead_fraction"] < 0.05,
    }
    if args.engine == "vllm":
        if not args.json:
            print("replaying the run's deltas in one vLLM engine: in-place activation vs full load_weights ...", flush=True)
        act = vllm_activation(f"file://{os.path.join(workdirs['aurora'] or '', 'store')}")
        out.update(act)
        if args.activation_shape:
            if not args.json:
                print(f"the same on a {args.activation_shape}-shaped model (random weights, sparse steps) ...", flush=True)
            with tempfile.TemporaryDirectory(prefix="aurora-bench-activation-") as d:
                out[f"activation_{args.activation_shape}"] = vllm_activation(synthetic_run(d, activation_shape(args.activation_shape)))
    return out


def _print_table(out: dict[str, Any], args: argparse.Namespace) -> None:
    a, i = out["aurora"], out["ideal"]
    rows = (
        "step_s",
        "wait_rollouts_s",
        "train_s",
        "extract_publish_s",
        "stage_s",
        "activate_s",
        "tokens_per_s",
        "delta_bytes",
        "reward_last",
    )
    print(f"\n{'per step (mean)':<22} {'aurora':>12} {'ideal':>12}")
    for k in rows:
        print(f"{k:<22} {a[k]:>12.4f} {i[k]:>12.4f}")
    f = out["weight_path_overhead_fraction"]
    print(
        f"\nweight path overhead: {100 * f:+.1f}% of step time (target < 5%: {'met' if out['target']['met'] else 'NOT met'}); bit-identical: {out['bit_identical']}"
    )
    if args.engine == "vllm":
        print(
            f"vLLM activation ({out['versions']} versions, {out['params']} parameters, {out['changed_mean']:.0f} changed per delta): "
            f"delta in place {1e3 * out['activation_s_delta']:.3f} ms (caller waits {1e3 * out['activation_s_delta_rpc']:.2f} ms), "
            f"full load_weights {1e3 * out['activation_s_reload']:.3f} ms"
        )
        big = out.get(f"activation_{args.activation_shape}")
        if big:
            print(
                f"vLLM activation, {args.activation_shape} ({big['params']} parameters, {big['changed_mean']:.0f} changed per delta): "
                f"delta in place {1e3 * big['activation_s_delta']:.1f} ms (caller waits {1e3 * big['activation_s_delta_rpc']:.1f} ms), "
                f"full load_weights {1e3 * big['activation_s_reload']:.1f} ms ({big['activation_s_reload'] / big['activation_s_delta']:.0f}x)"
            )
