"""The synthetic workload: the real Trainer and Actor processes with simulated compute.

``aurora bench wan`` compares ways of shipping weights (deltas, full
broadcast, lag bounds, streams, Relays) on a model far larger than this
machine can train or sample. It runs the real workers, ledger, store, bus
and Relays, and replaces only the two things a CPU box cannot do at 1B
parameters:

- **training**: :class:`SyntheticTrainer` takes an RL-like step on real bf16
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
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.fusion import FusionPlan
from aurora_store.format.checkpoint import StagedDelta
from aurora_tools.synthetic.shapes import Qwen3Shape, make_weights, qwen3_shapes
from workers.actor import Actor, ActorConfig
from workers.trainer.trainer import Trainer, TrainerConfig, unshipped_state

__all__ = [
    "QWEN3_1_7B",
    "SyntheticSpec",
    "synthetic_shape",
    "base_weights",
    "sparse_update",
    "SyntheticEngine",
    "SyntheticTrainer",
    "SyntheticActor",
    "wan_key",
    "add_trainer_arguments",
    "add_actor_arguments",
    "trainer_main",
    "actor_main",
]

log = logging.getLogger("aurora.synthetic")

#: Qwen3-1.7B's published dimensions (hidden 2048, 28 layers, tied embeddings).
QWEN3_1_7B = Qwen3Shape(vocab=151936, hidden=2048, layers=28, intermediate=6144, heads=16, kv_heads=8, head_dim=128)
#: Parameters of the paper's Qwen3-8B, against which its 45 s generation window is scaled.
PAPER_PARAMS = 8.2e9
PAPER_GEN_WINDOW_S = 45.0
#: Density of ``MasterWeights.step`` at lr 2e-7 in steady state (docs/BENCHMARKS.md, codec).
DEFAULT_DENSITY = 0.0107


def wan_key(run: str, what: str) -> str:
    """Redis keys the synthetic workers write for ``aurora bench wan`` (``aurora:{run}:wan:{what}``)."""
    from aurora_store.coordination.redisconn import key_prefix

    return f"{key_prefix(run)}wan:{what}"


def synthetic_shape(params: float) -> Qwen3Shape:
    """A Qwen3-shaped model of about ``params`` parameters.

    From about 0.9 B up: Qwen3-1.7B's geometry with as many layers as fit
    (1.0 B: 14 layers, the 311 M-element tied embedding kept); below, the
    shapes of ``aurora bench transfer``.
    """
    if params >= 0.9e9:
        fixed = dataclasses.replace(QWEN3_1_7B, layers=0).params
        per_layer = dataclasses.replace(QWEN3_1_7B, layers=1).params - fixed
        return dataclasses.replace(QWEN3_1_7B, layers=max(1, round((params - fixed) / per_layer)))
    from aurora_tools.bench.transfer import shape_for_params

    return cast(Qwen3Shape, shape_for_params(params))


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
            raise ValueError(f"bad synthetic workload: density {self.density}, gen_s_per_prompt {self.gen_s_per_prompt}, tokens {self.tokens}")

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


def _cache_dir() -> str:
    return os.environ.get("AURORA_SYNTHETIC_CACHE") or "/tmp/aurora-synthetic"


def base_weights(shape: Qwen3Shape, seed: int = 0, cache: bool = True) -> dict[str, torch.Tensor]:
    """Version 0 (Hugging Face names, bf16): ``make_weights(shape, seed)``, cached as a file.

    Every process that needs the base loads the same file (the page cache
    shares it); the first one writes it, atomically.
    """
    if not cache:
        return make_weights(shape, seed)
    from safetensors.torch import load_file, save_file

    key = hashlib.sha256(json.dumps([dataclasses.asdict(shape), seed]).encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"base-{shape.params}-{key}.safetensors")
    if os.path.exists(path):
        return load_file(path)
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


# ---------------------------------------------------------------------------
# engine


@dataclass(frozen=True, slots=True)
class StagedSnapshot:
    """A full version staged by a ``full``-transfer Actor (``tensors`` None unless it holds weights)."""

    version: int
    base_version: int
    tensors: dict[str, torch.Tensor] | None


@dataclass(frozen=True, slots=True)
class StagedAnnouncement:
    """A version that moved no bytes (``none`` transfer): activating it changes nothing."""

    version: int
    base_version: int


class SyntheticEngine:
    """The :class:`~workers.engine.torch_engine.Engine` of the synthetic workload.

    ``generate`` sleeps ``gen_s_per_prompt`` per prompt (simulated GPU time:
    no CPU is used); ``apply`` really writes staged deltas and snapshots into
    held bf16 weights when ``hold``, else only checks that they fit.
    """

    def __init__(self, spec: SyntheticSpec, hold: bool, digests: bool = False) -> None:
        self.spec = spec
        self.hold = hold
        self.digests = digests and hold
        shapes = qwen3_shapes(spec.shape)
        self._plan = FusionPlan.from_specs({n: ParamSpec(tuple(s), "bfloat16") for n, s in shapes.items()}, tied_lm_head=spec.shape.tied)
        self._weights: dict[str, torch.Tensor] = {}
        self._sink: Any = None
        self._version: int | None = None
        self._lock = threading.RLock()

    def load_base(self) -> None:
        """Version 0: the base weights (held) or nothing (not held)."""
        from aurora_store.apply.sink import SplitWeights

        with self._lock:
            if self.hold:
                self._weights = base_weights(self.spec.shape, self.spec.seed)
                self._sink = SplitWeights({n: self._weights[n] for p in self._plan for n in (b.source for b in p.blocks)}, self._plan)
            self._version = 0

    @property
    def version(self) -> int | None:
        return self._version

    def generate(self, prompts: Any, group: int, max_new_tokens: int, seed: int, temperature: float = 1.0) -> Any:
        from workers.engine.torch_engine import Completion, Generation

        t0 = time.perf_counter()
        time.sleep(len(prompts) * self.spec.gen_s_per_prompt)
        ids = tuple(range(1, self.spec.tokens + 1))
        one = Completion(ids, "", False)
        comps = tuple(tuple(one for _ in range(group)) for _ in prompts)
        return Generation(comps, len(prompts) * group * len(ids), time.perf_counter() - t0)

    def apply(self, staged: Any) -> None:
        from aurora_store.apply.sink import apply_delta, check_fits

        with self._lock:
            if isinstance(staged, StagedDelta):
                check_fits(staged, self._plan.specs())
                if self.hold:
                    apply_delta(staged, self._sink)
            elif isinstance(staged, StagedSnapshot):
                if self.hold and staged.tensors is not None:
                    self.load_weights(staged.tensors)
            elif not isinstance(staged, StagedAnnouncement):
                raise TypeError(f"cannot apply {type(staged).__name__}")
            self._version = staged.version

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Copy a full version (fused names) into the held weights."""
        with self._lock:
            if self.hold:
                for p in self._plan:
                    flat = tensors[p.name].reshape(-1)
                    for b in p.blocks:
                        self._weights[b.source].view(-1).copy_(flat[b.offset : b.offset + b.numel])
            if version is not None:
                self._version = version

    def digest(self) -> str:
        """Weights digest when held and asked for; else a placeholder (hashing 2 GB per version costs a second)."""
        from aurora_store.apply.sink import weights_digest

        with self._lock:
            if self.digests:
                return weights_digest(self._weights, self._plan)
            return f"unverified:{self._version}"

    def fusion_plan(self) -> FusionPlan:
        return self._plan

    def param_specs(self) -> dict[str, ParamSpec]:
        return self._plan.specs()


# ---------------------------------------------------------------------------
# trainer


@dataclass(frozen=True, slots=True)
class SyntheticTrainerOptions:
    train_s: float = 0.0
    """Simulated training time per step (the sparse update's own time counts towards it)."""
    digests: bool = False
    """Record the weights digest of every version (costs a sha256 over the weights)."""
    shard_bytes: int = 64 << 20
    """Snapshot shard size (``full`` transfer)."""
    keep_snapshots: int = 6
    """``full`` transfer: snapshots older than this many versions are deleted (memory of the S3 server)."""


class SyntheticTrainer(Trainer):
    """The Trainer with simulated training on a synthetic model (see the module doc).

    Everything after the update (extraction, publishing, announcements,
    scheduling, settlement) is :class:`~workers.trainer.trainer.Trainer`'s own code.
    """

    def __init__(
        self, ep: Any, cfg: TrainerConfig, spec: SyntheticSpec, opts: SyntheticTrainerOptions | None = None, on_step: Any = None
    ) -> None:
        super().__init__(ep, cfg, on_step)
        self.spec = spec
        self.opts = opts or SyntheticTrainerOptions()

    def setup(self) -> None:
        from aurora_store.lineage.fetch import scan_versions
        from workers.common import write_model_description
        from workers.model import fusion_plan_for

        if scan_versions(self.store).latest is not None:
            raise RuntimeError(f"{self.store.url} already holds versions; use a fresh run root")
        from aurora_store.codec.kernels import warm_up

        t0 = time.perf_counter()
        warm_up()
        w = base_weights(self.spec.shape, self.spec.seed)
        self.published = w
        self._buffers: list[dict[str, torch.Tensor]] = [w]
        self.versions_bf16 = {0: w}
        self.plan = fusion_plan_for(w, tied=self.spec.shape.tied)
        write_model_description(self.store, self.spec.to_json(), "{}")
        self.states[0] = self.spec.base_state
        self.full_bytes = sum(x.numel() * x.element_size() for x in w.values())
        self._after_publish(0, self.spec.base_state, "base", 0)
        log.info("synthetic base ready: %.3g params, %d bytes, in %.1fs", self.spec.params, self.full_bytes, time.perf_counter() - t0)
        for b in range(self.cfg.max_lag + 1):
            self._create_batch(b, 0)

    def _pub_cfg(self) -> Any:
        from aurora_store.lineage.publish import PublishConfig

        return PublishConfig(streams=self.cfg.streams, segment_bytes=self.cfg.segment_bytes, options=self.cfg.options, shard_bytes=self.opts.shard_bytes)

    def _batch_prompts(self, b: int) -> list[tuple[str, bytes]]:
        return [(f"b{b}-{i}", json.dumps({"id": f"b{b}-{i}", "ids": [1, 2, 3]}).encode()) for i in range(self.cfg.batch)]

    def _rollouts(self, b: int) -> tuple[list[list[int]], list[list[int]], list[float], list[int], int, dict[str, int], int]:
        tokens = bad = 0
        by_actor: dict[str, int] = {}
        gen_s: dict[str, float] = {}
        gen_tok: dict[str, int] = {}
        for r in self.collected[b].values():
            try:
                body = json.loads(r.payload)
                n = int(body["new_tokens"])
            except (ValueError, KeyError, TypeError):
                bad += 1
                continue
            by_actor[r.actor] = by_actor.get(r.actor, 0) + 1
            tokens += n
            gen_tok[r.actor] = gen_tok.get(r.actor, 0) + n
            gen_s[r.actor] = gen_s.get(r.actor, 0.0) + max(1e-3, float(body.get("gen_s", 0.0)))
        self._update_tau(gen_tok, gen_s)
        return [], [], [], [], tokens, by_actor, bad

    def _grpo(self, prompts: Any, comps: Any, rewards: Any, gen_version: int) -> None:
        """The simulated optimizer step: a sparse update of a copy (delta) or in place, then sleep out ``train_s``."""
        t0 = time.perf_counter()
        v = len(self.logs) + 1
        if self.cfg.transfer == "delta":
            # Two buffers: the published version and the one being made (extraction compares them).
            if len(self._buffers) == 1:
                self._buffers.append({n: x.clone() for n, x in self.published.items()})
            new = self._buffers[1] if self._buffers[0] is self.published else self._buffers[0]
            for n, x in new.items():
                x.copy_(self.published[n])
        else:
            new = self.published
        sparse_update(new, self.spec.density, self.spec.seed, v)
        self._new = new
        left = self.opts.train_s - (time.perf_counter() - t0)
        if left > 0:
            self.stop.wait(left)

    def _bf16_weights(self) -> dict[str, torch.Tensor]:
        return cast(dict[str, torch.Tensor], cast(Any, self)._new)

    def _snapshot_tensors(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Unlike fused_weights, unfused parameters are not cloned: publishing only reads them.
        return {
            p.name: torch.cat([weights[b.source].reshape(-1) for b in p.blocks]).view(p.spec.shape) if len(p.blocks) > 1 else weights[p.blocks[0].source]
            for p in self.plan
        }

    def _publish_version(self, v: int, b: int, new: dict[str, torch.Tensor]) -> tuple[int, int]:
        self._pub_t0_ms = time.time() * 1000
        out = super()._publish_version(v, b, new)
        if self.cfg.transfer == "full":
            self._drop_snapshots_before(v - self.opts.keep_snapshots + 1)
        return out

    def _drop_snapshots_before(self, oldest_kept: int) -> None:
        from aurora_store.format.manifest import manifest_key, version_dir

        for v in range(max(1, oldest_kept - 2), oldest_kept):
            keys = self.store.list(version_dir("snapshot", v))
            man = manifest_key("snapshot", v)
            for k in sorted(keys, key=lambda k: k != man):  # the manifest first: the version disappears before its objects
                self.store.delete(k)

    def _after_publish(self, v: int, state: str, kind: str, nbytes: int) -> None:
        from aurora_store.coordination.bus import VERSION
        from workers.common import record_digest

        if self.opts.digests:
            from aurora_store.apply.sink import weights_digest

            record_digest(self.redis, self.keys, "trainer", v, weights_digest(self.published, self.plan))
        now_ms = time.time() * 1000
        self.redis.hset(self.keys.trainer, mapping={"head": v, "head_state": state, "published_ms": int(now_ms), "status": "running"})
        self.redis.hset(
            wan_key(self.ep.run, "published"), str(v),
            json.dumps({"start_ms": getattr(self, "_pub_t0_ms", now_ms), "end_ms": now_ms, "bytes": nbytes, "kind": kind}),
        )
        self.bus.announce(VERSION, v, kind=kind, state=state, bytes=nbytes)



# ---------------------------------------------------------------------------
# actor


class _CountingStore:
    """A store that counts the bytes it read (what crossed from origin into the Actor's region)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.bytes_read = 0

    def get(self, key: str) -> bytes:
        data = self._inner.get(key)
        with self._lock:
            self.bytes_read += len(data)
        return cast(bytes, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass(frozen=True, slots=True)
class SyntheticActorOptions:
    transfer: str = "delta"
    hold: bool = True
    digests: bool = False


class SyntheticActor(Actor):
    """An Actor with the synthetic engine; ``full`` and ``none`` transfer stage snapshots or announcements."""

    def __init__(self, ep: Any, cfg: ActorConfig, opts: SyntheticActorOptions | None = None) -> None:
        super().__init__(ep, cfg)
        self.opts = opts or SyntheticActorOptions()
        self.counter = _CountingStore(self.origin)
        self.origin = cast(Any, self.counter)

    def prepare(self) -> None:
        from aurora_store.errors import ObjectNotFound
        from workers.common import MODEL_CONFIG_KEY

        # Started alongside the Trainer: wait for the description it writes before version 0.
        while True:
            try:
                raw = self.origin.get(MODEL_CONFIG_KEY)
                break
            except ObjectNotFound:
                if self.stop.wait(0.2):
                    raise SystemExit(0) from None
        self.spec = SyntheticSpec.from_json(raw)
        self.synthetic = SyntheticEngine(self.spec, hold=self.opts.hold, digests=self.opts.digests)
        self.engine = cast(Any, self.synthetic)

    def bootstrap(self) -> None:
        from workers.common import record_digest

        if not hasattr(self, "engine"):
            self.prepare()
        from aurora_store.codec.kernels import warm_up

        t0 = time.perf_counter()
        warm_up()  # compile or load the codec kernels now, not inside the first activation
        self.synthetic.load_base()
        self.active = self.staged_version = 0
        self.active_state = self.staged_state = self.spec.base_state
        record_digest(self.redis, self.keys, self.cfg.actor_id, 0, self.engine.digest())
        log.info("%s: base loaded in %.2fs (hold=%s)", self.cfg.actor_id, time.perf_counter() - t0, self.opts.hold)
        self.ledger.register(self.cfg.actor_id, self.cfg.region, self.cfg.engine)
        self._heartbeat()

    def _stage_available(self, polled: tuple[str | None, int | None] | None = None) -> None:
        if self.opts.transfer == "delta":
            super()._stage_available(polled)
        elif self.opts.transfer == "none":
            head = self.redis.hget(self.keys.trainer, "head")
            for v in range(self.staged_version + 1, (int(head) if head is not None else -1) + 1):
                state = unshipped_state(v)
                self._push(StagedAnnouncement(v, v - 1), state, 0.0, v)
                self._on_staged(v, 0, 0.0, False)
        else:
            self._stage_snapshots()

    def _push(self, staged: Any, state: str, seconds: float, v: int) -> None:
        with self.lock:
            self.staged.append((cast(StagedDelta, staged), state, seconds))
            self.staged_version, self.staged_state = v, state

    def _stage_snapshots(self) -> None:
        """``full`` transfer: fetch, verify and decode every newer snapshot, oldest first."""
        from safetensors.torch import load

        from aurora_store.errors import AuroraError
        from aurora_store.lineage.fetch import (
            fetch_objects,
            fetch_snapshot,
            read_manifest,
            scan_versions,
        )

        for v in sorted(s for s in scan_versions(self.origin).snapshots if s > self.staged_version):
            if self.stop.is_set():
                return
            # Never stage far ahead of what runs: each staged full version is a model's worth of memory.
            while self.staged_version > self.active + 1 and not self.stop.is_set():
                self.stop.wait(0.05)
            t0 = time.perf_counter()
            before = self.counter.bytes_read
            try:
                if self.opts.hold:
                    m, tensors = fetch_snapshot(self.origin, v, self.cfg.streams)
                    staged = StagedSnapshot(v, self.staged_version, tensors)
                else:
                    m = read_manifest(self.origin, "snapshot", v)
                    fetch_objects(self.origin, m, self.cfg.streams, lambda where, data: len(load(data)))
                    staged = StagedSnapshot(v, self.staged_version, None)
            except AuroraError as e:
                # Deleted by retention while we were behind: the next listing finds a newer one.
                log.warning("stage snapshot v%d failed: %s", v, e)
                return
            self._push(staged, m.state, time.perf_counter() - t0, v)
            self._on_staged(v, self.counter.bytes_read - before, time.perf_counter() - t0, False)

    def _on_staged(self, version: int, nbytes: int, seconds: float, from_mirror: bool) -> None:
        self.redis.hset(
            wan_key(self.ep.run, "staged"), f"{self.cfg.actor_id}|{version}",
            json.dumps({"t_ms": time.time() * 1000, "stage_s": seconds, "bytes": nbytes, "mirror": from_mirror, "origin_bytes": self.counter.bytes_read}),
        )



# ---------------------------------------------------------------------------
# command line


def default_gen_s_per_prompt(params: float, prompts_per_actor: int) -> float:
    """The paper's 45 s generation window for 8.2 B parameters, scaled to ``params``, per prompt."""
    return PAPER_GEN_WINDOW_S * params / PAPER_PARAMS / max(1, prompts_per_actor)


def add_trainer_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("synthetic workload (aurora bench wan)")
    g.add_argument("--workload", choices=("grpo", "synthetic"), default="grpo", help="grpo: the real GRPO run; synthetic: simulated compute on a large model")
    g.add_argument("--transfer", choices=("delta", "full", "none"), default="delta", help="how versions are shipped (default delta)")
    g.add_argument("--max-lag", type=int, default=1, metavar="K", help="batch b is generated on version b-K (default 1)")
    g.add_argument("--split", choices=("proportional", "uniform"), default="proportional", help="how a batch is split over Actors")
    g.add_argument("--params", type=float, default=1e8, help="synthetic model size (default 1e8)")
    g.add_argument("--density", type=float, default=DEFAULT_DENSITY)
    g.add_argument("--gen-s-per-prompt", type=float, default=None, help="simulated generation seconds per prompt (default: 45 s x params/8.2e9 over 16 prompts)")
    g.add_argument("--train-s", type=float, default=None, help="simulated training seconds per step (default: 0.3 x the scaled 45 s window)")
    g.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    g.add_argument("--segment-bytes", type=int, default=1 << 20)
    g.add_argument("--shard-bytes", type=int, default=64 << 20)
    g.add_argument("--heartbeat-timeout", type=float, default=8.0)
    g.add_argument("--min-lease-s", type=float, default=2.0, help="floor of a lease: longer than one claim's simulated generation")
    g.add_argument("--keep-snapshots", type=int, default=6, help="full transfer: versions kept in the store (memory of an in-memory S3 server)")
    g.add_argument("--digests", action="store_true", help="record the weights digest of every version")


def add_actor_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("synthetic workload (aurora bench wan)")
    g.add_argument("--workload", choices=("grpo", "synthetic"), default="grpo")
    g.add_argument("--transfer", choices=("delta", "full", "none"), default="delta", help="what the Trainer ships (must match it)")
    g.add_argument("--streams", type=int, default=8, help="connections per fetched version")
    g.add_argument("--hold-weights", choices=("yes", "no"), default="yes", help="keep real weights and apply every version (no: fetch, verify, decode, drop)")
    g.add_argument("--digests", action="store_true", help="digest the weights after every activation (needs --hold-weights yes)")


def trainer_main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    from aurora_store.coordination.redisconn import connect
    from aurora_store.coordination.scheduler import SchedulerConfig
    from workers.common import Endpoints, install_stop_handlers, limit_torch_threads, setup_logging

    setup_logging("trainer")
    limit_torch_threads()
    shape = synthetic_shape(args.params)
    per_prompt = args.gen_s_per_prompt if args.gen_s_per_prompt is not None else default_gen_s_per_prompt(shape.params, 16)
    spec = SyntheticSpec(shape, args.seed, args.density, per_prompt, args.tokens)
    train_s = args.train_s if args.train_s is not None else 0.3 * PAPER_GEN_WINDOW_S * shape.params / PAPER_PARAMS
    cfg = TrainerConfig(
        steps=args.steps, batch=args.batch, group=args.group, snapshot_every=0, streams=args.streams, seed=args.seed,
        segment_bytes=args.segment_bytes, heartbeat_timeout_s=args.heartbeat_timeout, transfer=args.transfer, max_lag=args.max_lag,
        scheduler=SchedulerConfig(split=args.split, min_lease_ms=int(1000 * args.min_lease_s)),
    )
    ep = Endpoints(args.store, args.redis, args.run, storage_options)
    r = connect(args.redis)

    def on_step(lg: Any) -> None:
        r.rpush(wan_key(args.run, "steps"), json.dumps({**dataclasses.asdict(lg), "t_ms": time.time() * 1000}))

    tr = SyntheticTrainer(ep, cfg, spec, SyntheticTrainerOptions(train_s=train_s, digests=args.digests, shard_bytes=args.shard_bytes, keep_snapshots=args.keep_snapshots), on_step)
    install_stop_handlers(tr.stop)
    try:
        tr.run()
    except KeyboardInterrupt:
        return 130
    return 0


def actor_main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    from workers.actor import run_until_stopped
    from workers.common import Endpoints, limit_torch_threads, setup_logging

    setup_logging(f"actor[{args.actor_id or ''}]")
    limit_torch_threads()
    cfg = ActorConfig(
        **({"actor_id": args.actor_id} if args.actor_id else {}),
        region=args.region, engine="synthetic", claim=args.claim, slowdown=args.slowdown, seed=args.seed, streams=args.streams,
        mirror_grace_s=args.mirror_grace_s, relay_wait_s=args.relay_wait_s,
    )
    opts = SyntheticActorOptions(args.transfer, args.hold_weights == "yes", args.digests)
    return run_until_stopped(SyntheticActor(Endpoints(args.store, args.redis, args.run, storage_options), cfg, opts), args.join_at_version)
