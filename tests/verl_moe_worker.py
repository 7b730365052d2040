"""Mixture-of-experts models through the ``aurora`` verl backend, in one process (tests/test_verl_backend.py).

Run with ``.venv-verl/bin/python tests/verl_moe_worker.py OPTIONS_JSON``; OPTIONS_JSON holds
``root`` (a store URL under which each family gets its own run root), ``run``
(the runs' name prefix) and ``redis``.
Engines are made as verl's workers make them (tests/verl_worker.py): the
backend looked up in verl's registry by name. For each family a trainer
sends three versions of a tiny model through ``send_weights``, its weights
in the form verl's FSDP engine yields them: transformers 5's packed experts
unpacked to one tensor per expert by verl's own ``unfuse_moe_params``
(loaded from verl's source: its module imports peft, which this environment
lacks). Replica A receives every version, replica B joins after the first.
Then bad updates (Qwen3-MoE: an expert missing, one layer naming its
experts in two forms; Mixtral: a router under both modules) must each fail
with one line. One JSON line out.
"""

from __future__ import annotations

import ast
import asyncio
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import verl
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig
from verl_worker import collect, digests, train_step

SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}
SIZES |= {"vocab_size": 128, "num_experts_per_tok": 2}
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=4, moe_intermediate_size=24, intermediate_size=48, **SIZES)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(num_local_experts=4, intermediate_size=24, **SIZES)),
}
MIXTRAL_CKPT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def verl_unfuse() -> Callable[..., Iterator[tuple[str, torch.Tensor]]]:
    """verl's ``unfuse_moe_params``, compiled from verl's own file (importing its module needs peft)."""
    path = Path(verl.__file__).parent / "workers" / "engine" / "fsdp" / "utils.py"
    tree = ast.parse(path.read_text())
    fn = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "unfuse_moe_params"]
    if len(fn) != 1:
        raise SystemExit(f"{path}: no unfuse_moe_params (verl changed how it yields experts: look again)")
    space: dict[str, Any] = {}
    exec(compile(ast.Module(body=fn, type_ignores=[]), str(path), "exec"), space)  # noqa: S102 - verl's own code
    return space["unfuse_moe_params"]  # type: ignore[no-any-return]


def engine(**options: Any) -> Any:
    cfg = CheckpointEngineConfig(
        backend="aurora", engine_kwargs={"aurora": options}, custom_backend_module="aurora_store.integrations.verl"
    )
    import_external_libs(cfg.custom_backend_module)
    return CheckpointEngineRegistry.new(cfg.backend, bucket_size=1 << 20, **cfg.engine_kwargs[cfg.backend])


def checkpoint_names(family: str, pairs: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's tensors under the names a checkpoint gives them (Mixtral's experts: ``block_sparse_moe``, ``w1``/``w3``/``w2``)."""
    for name, t in pairs:
        if family == "mixtral" and (".mlp.experts." in name or ".mlp.gate." in name):
            name = name.replace(".mlp.", ".block_sparse_moe.")
            for hf, ckpt in MIXTRAL_CKPT.items():
                name = name.replace(f".{hf}.", f".{ckpt}.")
        yield name, t


def run_family(family: str, opts: dict[str, str], unfuse: Callable[..., Iterator[tuple[str, torch.Tensor]]]) -> dict[str, Any]:
    options = {
        "store": f"{opts['root']}/{family}",
        "run": f"{opts['run']}-{family}",
        "redis": opts["redis"],
        "poll_s": 0.2,
        "timeout_s": 120,
    }
    torch.manual_seed(0)
    model = MODELS[family]()
    yielded = lambda: unfuse(iter(model.state_dict().items()), family)  # noqa: E731 - what verl's FSDP engine yields
    trainer = engine(**options, is_master=True, **({"model_type": family} if family == "mixtral" else {}))
    replicas = {"a": engine(**options)}
    out: dict[str, Any] = {"steps": [], "packed": [n for n in model.state_dict() if n.endswith("experts.gate_up_proj")][:1]}
    for step in range(3):
        if step:
            train_step(model, step)
            replicas.setdefault("b", engine(**options))  # joins after the first version
        metrics = asyncio.run(trainer.send_weights(yielded(), global_steps=step))
        got = {k: digests(asyncio.run(collect(r.receive_weights(global_steps=step)))) for k, r in replicas.items()}
        paths = {k: [r.last.path, r.last.version] for k, r in replicas.items()}
        sent = digests(checkpoint_names(family, yielded()))
        out["steps"].append({"sent": sent, "got": got, "paths": paths, "metrics": metrics})
    if family == "qwen3_moe":
        out["errors"] = [bad(trainer, yielded, step=3, drop=".layers.0.mlp.experts.1.down_proj."), bad_mixed(trainer, model)]
    else:  # Mixtral's router under both its in-memory module and its checkpoint's
        router = model.state_dict()["model.layers.0.mlp.gate.weight"]
        out["errors"] = [_error(trainer, iter([*yielded(), ("model.layers.0.block_sparse_moe.gate.weight", router)]), 3)]
    for e in (trainer, *replicas.values()):
        e.close()
    return out


def bad(trainer: Any, yielded: Callable[[], Iterator[tuple[str, torch.Tensor]]], step: int, drop: str) -> dict[str, str]:
    return _error(trainer, ((n, t) for n, t in yielded() if drop not in n), step)


def bad_mixed(trainer: Any, model: torch.nn.Module) -> dict[str, str]:
    """Layer 0's experts packed (transformers 5's in-memory form) beside its per-expert down projections."""
    sd = model.state_dict()
    pairs = [(n, t) for n, t in sd.items() if not n.endswith("layers.0.mlp.experts.down_proj")]
    pairs += [(f"model.layers.0.mlp.experts.{e}.down_proj.weight", sd["model.layers.0.mlp.experts.down_proj"][e]) for e in range(4)]
    return _error(trainer, iter(pairs), 3)


def _error(trainer: Any, pairs: Iterator[tuple[str, torch.Tensor]], step: int) -> dict[str, str]:
    try:
        asyncio.run(trainer.send_weights(pairs, global_steps=step))
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": "", "message": "published"}


def main() -> int:
    options = json.loads(sys.argv[1])
    unfuse = verl_unfuse()
    result = {family: run_family(family, options, unfuse) for family in MODELS}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
