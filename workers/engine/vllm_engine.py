"""The ``vllm`` engine: an Actor generates with vLLM and patches vLLM's own weights in place.

:class:`VLLMEngine` is an :class:`~workers.engine.protocol.Engine` like
:class:`~workers.engine.torch_engine.TorchEngine`. vLLM runs the model in worker
processes of its own (one per tensor-parallel rank); this class drives them
through ``LLM.collective_rpc`` and the methods of
:class:`workers.engine.vllm_worker.AuroraWorkerExtension`, which vLLM mixes into
its workers. Deltas are written into the fused parameters vLLM generates
with (``qkv_proj``, ``gate_up_proj``: FORMAT.md §2 names), in place, between
two model steps; no reload, no second copy of the weights. Mixture-of-experts
layers too: their ``w13_weight``/``w2_weight`` are reached through vLLM's
padding and kernel packing (:mod:`workers.engine.vllm_moe`), split by
intermediate block (tensor parallelism) or by expert (``expert_parallel``).

Two ways in, both checked against the whole model before a single write:

- :meth:`VLLMEngine.stage_from_store` then :meth:`VLLMEngine.apply`: each
  worker reads, verifies and decodes the segments itself, in a background
  thread, while generation goes on; activation is one RPC that applies what
  the worker already holds. The delta never crosses a process boundary.
- :meth:`VLLMEngine.apply` with a :class:`~aurora_store.format.checkpoint.StagedDelta`
  decoded in this process: the entries are shipped to the workers (the
  generic :class:`~workers.engine.protocol.Engine` path; also used for ``memory://``
  stores, which other processes cannot read).

vLLM is imported lazily; choosing this engine without it installed raises
:class:`~aurora_store.errors.ConfigError` naming the install command.
Configuration (:class:`VLLMConfig`) comes from ``AURORA_VLLM_*`` variables;
see docs/WORKERS.md for the CPU settings and their defaults. Errors raised in
the workers come back as the same Aurora error classes, fields intact
(:func:`aurora_store.errors.error_to_wire` there, ``error_from_wire`` here).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.extract import fuse_weights, spec_of
from aurora_store.codec.fusion import TIED_HEAD, FusionPlan
from aurora_store.config import DEFAULT_STREAMS
from aurora_store.errors import (
    AuroraError,
    ChainError,
    ConfigError,
    EngineError,
    IntegrityError,
    ModelMismatchError,
    error_from_wire,
)
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.format.manifest import Manifest, manifest_key
from aurora_store.lineage.fetch import fetch_delta, read_manifest
from aurora_store.storage import Store
from workers.engine.protocol import Completion, Generation, RemoteStaged, TokenCodec
from workers.engine.vllm_config import (
    CPU_HEAD_SIZES,
    ENV_PREFIX,
    VLLM_MISSING,
    VLLMConfig,
    import_vllm,
    spawn_env,
)
from workers.engine.vllm_wire import encode_entries

__all__ = ["ENV_PREFIX", "VLLM_MISSING", "VLLMConfig", "VLLMEngine", "import_vllm"]

_EXTENSION = "workers.engine.vllm_worker.AuroraWorkerExtension"


class VLLMEngine:
    """vLLM behind the :class:`~workers.engine.protocol.Engine` interface, patched in place by deltas.

    Public methods take the engine's lock: vLLM's ``LLM`` is not thread-safe,
    and a delta must land between two ``generate`` calls (inside the worker,
    RPCs run between model steps anyway).
    """

    def __init__(self, tokenizer: TokenCodec, config: VLLMConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config or VLLMConfig()
        self._lock = threading.RLock()
        self._llm: Any = None
        self._dir: str | None = None
        self._specs: dict[str, ParamSpec] = {}
        self._plan: FusionPlan | None = None
        self._version: int | None = None
        self._vocab = 0
        self._family: str | None = None
        self.worker_pids: list[int] = []
        self.start_s = 0.0
        """Seconds vLLM took to start (:meth:`load`)."""
        self.last_apply_s = 0.0
        """Seconds the slowest worker spent writing the last delta (:meth:`apply`), RPC excluded."""

    # -- loading -----------------------------------------------------------
    def load(self, model: Any, version: int | None = None) -> None:
        """Start vLLM for ``model``'s architecture (a Hugging Face model or its config).

        Only the config is used: vLLM starts with placeholder weights
        (``load_format="dummy"``); :meth:`load_weights` or
        :meth:`bootstrap_from_store` writes the real ones.
        """
        vllm = import_vllm()
        cfg = getattr(model, "config", model)
        cfg_dict = json.loads(cfg.to_json_string()) if hasattr(cfg, "to_json_string") else dict(cfg)
        if not cfg_dict.get("architectures"):
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

            arch = (
                type(model).__name__ if hasattr(model, "config") else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg_dict.get("model_type", ""))
            )
            if not arch:
                raise ConfigError("the model config names no architecture (config.architectures)")
            cfg_dict["architectures"] = [arch]
        head = cfg_dict.get("head_dim") or cfg_dict["hidden_size"] // cfg_dict["num_attention_heads"]
        on_cpu = not torch.cuda.is_available()
        if on_cpu and head not in CPU_HEAD_SIZES:
            raise ConfigError(f"vLLM's CPU attention supports head sizes {list(CPU_HEAD_SIZES)}; this model's is {head}")
        with self._lock:
            self.close()
            self._dir = tempfile.mkdtemp(prefix="aurora-vllm-")
            with open(os.path.join(self._dir, "config.json"), "w") as f:
                json.dump(cfg_dict, f)
            env: dict[str, str] = {}
            if on_cpu and self.config.cpu_threads > 0 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(self.config.cpu_threads))
            t0 = time.perf_counter()
            with spawn_env(env):
                self._llm = vllm.LLM(
                    model=self._dir,
                    skip_tokenizer_init=True,
                    load_format="dummy",
                    dtype=self.config.dtype,
                    tensor_parallel_size=self.config.tensor_parallel_size,
                    enable_expert_parallel=self.config.expert_parallel,
                    max_model_len=self.config.max_model_len,
                    kv_cache_memory_bytes=self.config.kv_cache_mib << 20,
                    gpu_memory_utilization=self.config.gpu_memory_utilization,
                    enforce_eager=self.config.enforce_eager,
                    worker_extension_cls=_EXTENSION,
                    seed=self.config.seed,
                    disable_log_stats=True,
                )
            self.start_s = time.perf_counter() - t0
            attached = self._call_all("aurora_attach", os.getpid())
            self._specs = {n: ParamSpec(tuple(s), d) for n, (s, d) in attached[0]["specs"].items()}
            self._plan = FusionPlan.from_specs(self._specs)
            self.worker_pids = [int(a["pid"]) for a in attached]
            self._vocab = int(cfg_dict["vocab_size"])
            self._family = cfg_dict.get("model_type")
            self._version = version

    def close(self) -> None:
        """Stop vLLM's processes and remove the config folder."""
        with self._lock:
            llm, self._llm = self._llm, None
            if llm is not None:
                core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
                with contextlib.suppress(Exception):
                    if core is not None:
                        core.shutdown()
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    @property
    def version(self) -> int | None:
        return self._version

    def fusion_plan(self) -> FusionPlan:
        self._need()
        assert self._plan is not None
        return self._plan

    def param_specs(self) -> dict[str, ParamSpec]:
        self._need()
        return dict(self._specs)

    # -- weights -----------------------------------------------------------
    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Copy a full version into vLLM's parameters (fused or Hugging Face names), in place.

        The tensors are shipped to every worker; :meth:`bootstrap_from_store`
        avoids that by reading the store in the workers.
        """
        with self._lock:
            self._need()
            fused = self._fused(tensors)
            wire = {n: [self._specs[n].dtype, list(t.shape), _bits(t).numpy().tobytes()] for n, t in fused.items()}
            self._call_all("aurora_load", wire, version)
            self._weights_changed()
            self._version = version

    def bootstrap_from_store(
        self,
        store: Store,
        storage_options: Mapping[str, Any] | None = None,
        version: int | None = None,
        streams: int = DEFAULT_STREAMS,
        manifests: Sequence[Manifest] | None = None,
    ) -> tuple[int, str]:
        """Reach ``version`` (default: the newest) inside the workers: snapshot, then deltas, in place.

        Returns (version, state), as every rank reports it. ``manifests``: the
        chain the caller checked (snapshot manifest, then each delta's, ending
        at ``version``); the workers follow exactly it, read no manifest
        themselves, and write nothing before every object of it is verified.
        Ranks that report another version or state than that chain's end
        raise :class:`~aurora_store.errors.EngineError`: the weights they hold
        are not the checked ones. Nothing else crosses into this process.
        """
        with self._lock:
            self._need()
            url = _readable(store)
            wire = None if manifests is None else [m.to_bytes() for m in manifests]
            if manifests is not None and (not manifests or (version is not None and manifests[-1].version != version)):
                raise ChainError(f"bootstrap to v{version}: the handed chain does not end there")
            outs = self._call_all("aurora_bootstrap", url, dict(storage_options or {}), version, streams, wire)
            self._weights_changed()
            got = {(int(o["version"]), str(o["state"])) for o in outs}
            v, state = next(iter(got))
            self._version = v
            if len(got) > 1 or (manifests is not None and (v, state) != (manifests[-1].version, manifests[-1].state)):
                self._version = None  # holds nothing anyone checked
                said = "" if manifests is None else f"; the Actor checked v{manifests[-1].version} ({manifests[-1].state})"
                raise IntegrityError(f"vLLM's ranks report {sorted(got)} after a bootstrap{said}")
            return v, state

    def stage_from_store(
        self,
        store: Store,
        storage_options: Mapping[str, Any] | None,
        version: int,
        expect_base_state: str | None,
        streams: int = DEFAULT_STREAMS,
        manifest: Manifest | None = None,
    ) -> tuple[Manifest, RemoteStaged | StagedDelta]:
        """Stage delta ``version`` in the workers (they fetch, verify and decode it themselves).

        Returns its manifest and a handle for :meth:`apply`. Only the
        manifest is read here (it names the state the Actor settles with),
        or ``manifest`` is the one the caller already read and checked; it
        is handed to the workers, which never read it again (a store that
        answers a second read differently cannot slip them other weights),
        and every rank must report staging its state
        (:class:`~aurora_store.errors.IntegrityError` otherwise). Generation
        goes on while the workers stage. A ``memory://`` store is read here
        instead and the delta shipped at activation.
        """
        if manifest is not None and (manifest.kind, manifest.version) != ("delta", version):
            raise ValueError(f"stage_from_store({version}) was handed the manifest of {manifest.kind} {manifest.version}")
        m = manifest if manifest is not None else read_manifest(store, "delta", version)
        if expect_base_state is not None and m.base_state != expect_base_state:
            raise ChainError(
                f"{store.where(manifest_key('delta', version))}: base_state {m.base_state} does not match "
                f"the held version's state {expect_base_state}"
            )
        if store.url.startswith("memory://"):
            _, staged = fetch_delta(store, version, self.param_specs(), streams, expect_base_state, manifest=m)
            return m, staged
        with self._lock:
            self._need()
            self._call_all("aurora_stage", store.url, dict(storage_options or {}), version, expect_base_state, streams, m.to_bytes())
        while True:
            with self._lock:
                done = self._call_all("aurora_staged", version, 0.0)
            if all(d is not None for d in done):
                states = {str(d["state"]) for d in done}
                if states != {m.state}:
                    raise IntegrityError(
                        f"delta {version}: vLLM's ranks staged state(s) {sorted(states)}, the manifest checked here says {m.state}"
                    )
                return m, RemoteStaged(version, version - 1, m.state, int(done[0]["nnz"]))
            time.sleep(self.config.stage_poll_s)

    def apply(self, staged: StagedDelta | RemoteStaged) -> None:
        """Activate a delta in place: one staged in the workers, or one decoded here (shipped).

        Refused with no element written: a delta on another base than the
        held version, a parameter the model lacks, a range or values that do
        not fit (each worker checks every entry before its first write).
        """
        with self._lock:
            self._need()
            if self._version is not None and staged.base_version != self._version:
                raise ChainError(
                    f"delta {staged.version} is based on version {staged.base_version}, the engine holds version {self._version}"
                )
            if isinstance(staged, RemoteStaged):
                # Each rank refuses, before writing, a staged delta of another state.
                outs = self._call_all("aurora_activate", staged.version, staged.state)
                took = [o["seconds"] for o in outs]
                want: tuple[int, str] | None = (staged.version, staged.state)
            else:
                outs, took, want = [], self._call_all("aurora_apply", encode_entries(staged)), None
            self.last_apply_s = max(float(t) for t in took)
            self._weights_changed()
            self._version = staged.version
            held = {(o["version"], o["state"]) for o in outs}
            if want is not None and held != {want}:
                self._version = None  # holds nothing anyone checked
                raise IntegrityError(f"vLLM's ranks report {sorted(held)} after activating v{want[0]} ({want[1]})")

    def held(self, digest: bool = False) -> tuple[int | None, str | None, str | None]:
        """(version, state, weights digest when asked) as the workers hold them; ranks that disagree raise EngineError."""
        with self._lock:
            self._need()
            outs = {(o["version"], o["state"], o.get("digest")) for o in self._call_all("aurora_held", digest)}
        if len(outs) != 1:
            raise EngineError(f"vLLM's ranks hold different versions: {sorted(outs, key=str)}")
        v, state, d = next(iter(outs))
        return (None if v is None else int(v)), (None if state is None else str(state)), (None if d is None else str(d))

    def digest(self) -> str:
        """``weights_digest`` computed inside the workers over vLLM's own parameters."""
        with self._lock:
            self._need()
            return str(self._call_all("aurora_digest")[0])

    def verify_digest(self, expected: str) -> str | None:
        """The weights' digest in ``expected``'s form (FORMAT.md §4.1); None when a weight write raced it.

        Why this shape: the Actor verifies while it generates. At tp=1 the
        worker hashes in a background thread and generation goes on; the
        engine's lock is taken only for each short RPC. Under tensor
        parallelism each whole tensor is gathered to rank 0 and hashed
        there, in one RPC between two model steps (collectives stay on
        vLLM's worker thread): no rank receives the whole model.
        """
        if self.config.tensor_parallel_size > 1:
            with self._lock:
                self._need()
                got = self._call_all("aurora_digest_gathered", expected)[0]
            return None if got is None else str(got)
        with self._lock:
            self._need()
            self._call_all("aurora_digest_start", expected)
        while True:
            with self._lock:
                out = self._call_all("aurora_digest_result", 0.0)[0]
            if out is not None:
                return None if out["digest"] is None else str(out["digest"])
            time.sleep(self.config.stage_poll_s)

    def probe(self, raw: bool = False) -> list[dict[str, Any]]:
        """Per rank: pid, resident bytes, parameter storage addresses, staged versions (``raw``: each tensor's sha256 as held)."""
        with self._lock:
            self._need()
            return self._call_all("aurora_probe", raw)

    def reload_seconds(self, store: Store, storage_options: Mapping[str, Any] | None = None, streams: int = DEFAULT_STREAMS) -> float:
        """Benchmark baseline: seconds for vLLM's own ``load_weights`` of the held version, whole."""
        with self._lock:
            self._need()
            if self._version is None:
                raise ChainError("reload: the engine was never told its version")
            out = self._call_all("aurora_reload", _readable(store), dict(storage_options or {}), self._version, streams)
            return max(float(x) for x in out)

    # -- generation --------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group: int,
        max_new_tokens: int,
        seed: int,
        temperature: float = 1.0,
    ) -> Generation:
        """``group`` samples of every prompt; sample ``j`` of prompt ``i`` has its own seed.

        The seeds derive from ``seed``, ``i`` and ``j``, so the same seed and
        weights give the same samples whatever the batch around them. No
        top-k/top-p: the model's own distribution, as with the torch engine.
        """
        if group < 1 or max_new_tokens < 1:
            raise ValueError(f"group and max_new_tokens must be >= 1, got {group}, {max_new_tokens}")
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        vllm = import_vllm()
        # Every end-of-sequence id of the generation config (Qwen3 and Llama 3 have several).
        stops = [int(i) for i in getattr(self.tokenizer, "stop_ids", (self.tokenizer.eos_id,))]
        reqs: list[dict[str, list[int]]] = []
        params = []
        for i, p in enumerate(prompts):
            ids = [int(x) for x in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty (at least bos is needed)")
            bad = [x for x in ids if not 0 <= x < self._vocab]
            if bad:
                raise ValueError(f"prompt {i}: ids {bad[:5]} are outside the vocabulary ({self._vocab})")
            for j in range(group):
                reqs.append({"prompt_token_ids": ids})
                params.append(
                    vllm.SamplingParams(
                        n=1,
                        temperature=temperature,
                        max_tokens=max_new_tokens,
                        seed=_request_seed(seed, i, j),
                        stop_token_ids=stops,
                        detokenize=False,
                    )
                )
        with self._lock:
            llm, _ = self._need()
            t0 = time.perf_counter()
            outs = llm.generate(reqs, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        comps = []
        for o in outs:
            c = o.outputs[0]
            toks = tuple(int(t) for t in c.token_ids)
            comps.append(Completion(toks, self.tokenizer.decode(toks), bool(toks) and toks[-1] in stops))
        done = tuple(tuple(comps[i * group : (i + 1) * group]) for i in range(len(prompts)))
        return Generation(done, sum(len(c.token_ids) for c in comps), seconds)

    # -- helpers -----------------------------------------------------------
    def _need(self) -> tuple[Any, FusionPlan]:
        if self._llm is None or self._plan is None:
            raise RuntimeError("vLLM is not started: call VLLMEngine.load(model) first")
        return self._llm, self._plan

    def _weights_changed(self) -> None:
        """Drop vLLM's prefix cache: its KV blocks were computed with the previous weights.

        Without this a prompt seen before the switch would reuse keys and
        values of the old version: samples would no longer come from the
        version the Actor reports.
        """
        if not self._llm.reset_prefix_cache():
            raise AuroraError("vLLM refused to drop its prefix cache (requests still running?)")

    def _call_all(self, method: str, *args: Any) -> list[Any]:
        """``collective_rpc`` on every rank; the ranks' values, or the first error, raised as ours."""
        if self._llm is None:
            raise RuntimeError("vLLM is not started: call VLLMEngine.load(model) first")
        replies = self._llm.collective_rpc(method, args=args)
        for r in replies:
            if "error" in r:
                raise error_from_wire(r["error"])
        return [r["ok"] for r in replies]

    def _fused(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._specs.keys() <= tensors.keys():
            out = {n: tensors[n] for n in self._specs}
        else:
            specs = {n: spec_of(t, n) for n, t in tensors.items()}
            plan = FusionPlan.from_specs(specs, tied_lm_head=TIED_HEAD not in self._specs, family=self._family)
            if plan.specs().keys() != self._specs.keys():
                lack = sorted(self._specs.keys() - plan.specs().keys())
                raise ModelMismatchError(
                    f"weights lack {len(lack)} of the engine's parameters (e.g. {lack[:3]}), under fused and under Hugging Face names"
                )
            out = fuse_weights(tensors, plan)
        for n, t in out.items():
            if spec_of(t, n) != self._specs[n]:
                raise ModelMismatchError(
                    f"{n}: given {list(t.shape)} {t.dtype}, the engine holds {list(self._specs[n].shape)} {self._specs[n].dtype}"
                )
        return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _readable(store: Store) -> str:
    if store.url.startswith("memory://"):
        raise ConfigError(f"{store.url}: a memory:// store lives in this process; vLLM's workers need file:// or s3://")
    return store.url


def _request_seed(seed: int, prompt: int, sample: int) -> int:
    h = hashlib.blake2b(f"aurora/{seed}/{prompt}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2  # vLLM wants a non-negative int64
