"""One side of verl's weight sync, as verl's workers run it, driven over stdin/stdout (tests/test_verl_backend.py).

Run with ``.venv-verl/bin/python tests/verl_worker.py trainer|replica OPTIONS_JSON``.
The engine is made the way verl's ``CheckpointEngineWorker`` and actor
worker make theirs: a ``CheckpointEngineConfig`` naming the backend and
``custom_backend_module``, the module imported by verl's
``import_external_libs``, the class looked up in verl's registry by name.
Each ``update`` command is one round of ``CheckpointEngineManager.update_weights``:
``build_topology`` over every worker's ``prepare()``, ``init_process_group``,
``send_weights`` or ``receive_weights``, ``finalize``. Every reply is one JSON
line; the trainer's weights are a tiny Qwen3 whose parameters move at each step.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from verl.checkpoint_engine import CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig

TINY = Qwen3Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)


def digests(pairs: Iterator[tuple[str, torch.Tensor]] | list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """name -> sha256 of the tensor as bf16 bytes, with its shape: what "bit-identical" compares."""
    out = {}
    for name, t in pairs:
        b = t.detach().to(torch.bfloat16).contiguous().cpu()
        out[name] = hashlib.sha256(repr(tuple(b.shape)).encode() + b.view(torch.int16).numpy().tobytes()).hexdigest()
    return out


def train_step(model: torch.nn.Module, step: int) -> None:
    """An RL-like step: a few percent of the elements move, by enough to change their bf16 value."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=g) < 0.05
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * mask)


def per_tensor(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What verl's FSDP engine yields: the state dict's names (a tied head under both), full tensors."""
    yield from model.state_dict().items()


async def collect(weights: AsyncIterator[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.clone()) async for n, t in weights]


def main() -> int:
    role, options = sys.argv[1], json.loads(sys.argv[2])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s", force=True)
    cfg = CheckpointEngineConfig(
        backend="aurora", engine_kwargs={"aurora": options}, custom_backend_module="aurora_store.integrations.verl"
    )
    import_external_libs(cfg.custom_backend_module)
    kwargs: dict[str, Any] = dict(cfg.engine_kwargs.get(cfg.backend, {}))
    if role == "trainer":
        kwargs["is_master"] = True  # what verl's actor worker passes on rank 0
    engine = CheckpointEngineRegistry.new(cfg.backend, bucket_size=cfg.update_weights_bucket_megabytes << 20, **kwargs)
    model = None
    if role == "trainer":
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(TINY)
    print(json.dumps({"ready": type(engine).__name__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "prepare":
            print(json.dumps({"metadata": engine.prepare()}), flush=True)
        elif cmd["cmd"] == "update":
            actor_kw, rollout_kw = type(engine).build_topology(1, cmd["rollout_world_size"], cmd["metadata"])
            mine = actor_kw if role == "trainer" else rollout_kw
            engine.init_process_group(**{k: v[cmd["rank"]] for k, v in mine.items()})
            step = cmd["step"]
            if model is not None:
                if step > 0:
                    train_step(model, step)
                metrics = asyncio.run(engine.send_weights(per_tensor(model), global_steps=step))
                reply = {"step": step, "digests": digests(per_tensor(model)), "metrics": metrics}
            else:
                got = asyncio.run(collect(engine.receive_weights(global_steps=step)))
                reply = {"step": step, "digests": digests(got), "path": engine.last.path, "version": engine.last.version}
            engine.finalize()
            print(json.dumps(reply), flush=True)
        elif cmd["cmd"] == "try":  # a config verl would pass: the error a worker would die with, if any
            try:
                engine_ = CheckpointEngineRegistry.new("aurora", bucket_size=1 << 20, **cmd["options"])
                print(json.dumps({"error": None, "metadata": engine_.prepare()}), flush=True)
                engine_.close()
            except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
                print(json.dumps({"error": type(e).__name__, "message": str(e)}), flush=True)
        elif cmd["cmd"] == "quit":
            break
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
