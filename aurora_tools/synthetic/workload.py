"""The synthetic workload: the real Trainer and Actor processes with simulated compute.

``aurora bench wan`` compares ways of shipping weights (deltas, full
broadcast, lag bounds, streams, Relays) on a model far larger than this
machine can train or sample. It runs the real workers, ledger, store, bus
and Relays, and replaces only the two things a CPU box cannot do at 1B
parameters:

- **training**: :class:`~aurora_tools.synthetic.trainer.SyntheticWorkload` (the real Trainer's step and
  weights source) takes an RL-like step on real bf16
  weights with :func:`sparse_update` (about 1% of the elements move by one
  unit in the last place, the statistics of ``aurora_tools.synthetic.shapes``'s
  Adam-sized step at lr 2e-7, at a few tenths of a second per billion
  parameters instead of ~170 s), then sleeps out the rest of ``train_s``;
  extraction, encoding, upload, announcements, scheduling and settlement
  are the Trainer's own code;
- **generation**: :class:`SyntheticEngine` sleeps ``gen_s_per_prompt`` per
  prompt (times the Actor's ``--slowdown``) and returns token ids of a fixed
  length; staging, verification, decoding and activation are the Actor's own
  code. With ``hold`` the engine keeps real bf16 weights and applies every
  delta or snapshot to them (digests prove them equal to the Trainer's);
  without it (many Actors, little memory) it fetches, verifies and decodes
  every version and drops it.

Version 0 is the base model every process already has on local disk (as a
real run starts from a downloaded checkpoint): random weights from the seed,
cached in ``AURORA_SYNTHETIC_CACHE`` (default ``/tmp/aurora-synthetic``). Its
``state`` is the sha256 of the workload description, which the Trainer
writes to ``model/config.json``; only versions after it cross the network.

How a version is shipped (``--transfer``): ``delta`` (Aurora), ``full`` (a
full snapshot per version: the broadcast baselines) or ``none`` (nothing
moves; the version is announced and Actors advance for free: the ideal).

This module holds what every process of the workload shares (its
description, the base weights, the update); the parts are
:mod:`~aurora_tools.synthetic.engine`, :mod:`~aurora_tools.synthetic.trainer`
(with ``trainer_main``), :mod:`~aurora_tools.synthetic.actor` (with
``actor_main``) and :mod:`~aurora_tools.synthetic.args` (the options of
``aurora bench synthetic-trainer|synthetic-actor``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from aurora_store.config import Switch
from aurora_tools.synthetic.shapes import Qwen3Shape, make_weights

__all__ = [
    "PAPER_PARAMS",
    "PAPER_GEN_WINDOW_S",
    "DEFAULT_DENSITY",
    "SyntheticSpec",
    "base_weights",
    "sparse_update",
    "default_gen_s_per_prompt",
    "wan_key",
]

#: Parameters of the paper's Qwen3-8B, against which its 45 s generation window is scaled.
PAPER_PARAMS = 8.2e9
PAPER_GEN_WINDOW_S = 45.0
#: Density of ``MasterWeights.step`` at lr 2e-7 in steady state (docs/BENCHMARKS.md, codec).
DEFAULT_DENSITY = 0.0107


def wan_key(run: str, what: str) -> str:
    """Redis keys the synthetic workers write for ``aurora bench wan`` (``aurora:{run}:wan:{what}``)."""
    from aurora_store.coordination.keys import RunKeys

    return RunKeys(run).wan(what)


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """The workload, as the Trainer writes it to ``model/config.json``."""

    shape: Qwen3Shape
    seed: int = 0
    density: float = DEFAULT_DENSITY
    """Fraction of elements one step changes (by one bf16 ulp each)."""
    gen_s_per_prompt: float = 0.1
    """Simulated generation time of one prompt (its whole group) at speed 1."""
    tokens: int = 32
    """Tokens per completion."""

    def __post_init__(self) -> None:
        if not 0 < self.density < 1 or self.gen_s_per_prompt < 0 or self.tokens < 1:
            raise ValueError(
                f"bad synthetic workload: density {self.density}, gen_s_per_prompt {self.gen_s_per_prompt}, tokens {self.tokens}"
            )

    @property
    def params(self) -> int:
        return self.shape.params

    @property
    def base_state(self) -> str:
        """``state`` of version 0: a name for the base weights (they never travel)."""
        d = {"shape": dataclasses.asdict(self.shape), "seed": self.seed}
        return "sha256:" + hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        return json.dumps({"model_type": "aurora-synthetic", **d, "base_state": self.base_state}, sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> SyntheticSpec:
        d = json.loads(raw)
        if d.get("model_type") != "aurora-synthetic":
            raise ValueError(f"not a synthetic workload description (model_type {d.get('model_type')!r})")
        return cls(Qwen3Shape(**d["shape"]), int(d["seed"]), float(d["density"]), float(d["gen_s_per_prompt"]), int(d["tokens"]))


SYNTHETIC_CACHE = Switch("AURORA_SYNTHETIC_CACHE", str, "/tmp/aurora-synthetic", "folder of the synthetic workload's cached base weights")


def _cache_dir() -> str:
    return str(SYNTHETIC_CACHE.get())


def base_weights(shape: Qwen3Shape, seed: int = 0, cache: bool = True) -> dict[str, torch.Tensor]:
    """Version 0 (Hugging Face names, bf16): ``make_weights(shape, seed)``, cached as a file.

    Every process that needs the base loads the same file (the page cache
    shares it); the first one writes it, atomically. The tensors are copied
    out of the file's private mapping into memory of their own, as a real
    model's weights are: every holder writes into them, and the first write
    into mapped pages would pay a copy-on-write fault per page (seconds at
    1 B, on the cores the next version's fetch needs).
    """
    if not cache:
        return make_weights(shape, seed)
    from safetensors.torch import load_file, save_file

    key = hashlib.sha256(json.dumps([dataclasses.asdict(shape), seed]).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"base-{shape.params}-{key}.safetensors")
    if os.path.exists(path):
        return {n: t.clone() for n, t in load_file(path).items()}
    w = make_weights(shape, seed)
    os.makedirs(_cache_dir(), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(w, tmp)
    os.replace(tmp, path)
    return w


def sparse_update(weights: Mapping[str, torch.Tensor], density: float, seed: int, version: int) -> int:
    """One RL-like step in place: ``density`` of each parameter's elements move by one bf16 ulp.

    Positions are uniform, the direction a fair coin (towards zero is never
    taken at zero itself); duplicate positions (about density/2 of them)
    move once. Deterministic in (seed, version). Returns elements written.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + version)
    n_written = 0
    for name in sorted(weights):
        t = weights[name]
        bits = t.view(torch.int16).view(-1)
        n = bits.numel()
        k = int(round(n * density))
        if k == 0:
            continue
        idx = torch.randint(0, n, (k,), generator=g)
        step = torch.randint(0, 2, (k,), generator=g, dtype=torch.int16).mul_(2).sub_(1)
        old = bits[idx]
        # +-1 on the bit pattern is +-1 ulp of the magnitude; at +-0 only away from zero.
        step = torch.where((old & 0x7FFF) == 0, torch.ones_like(step), step)
        bits[idx] = old + step
        n_written += k
    return n_written


def default_gen_s_per_prompt(params: float, prompts_per_actor: int) -> float:
    """The paper's 45 s generation window for 8.2 B parameters, scaled to ``params``, per prompt."""
    return PAPER_GEN_WINDOW_S * params / PAPER_PARAMS / max(1, prompts_per_actor)
