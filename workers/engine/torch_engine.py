"""The torch engine: any Hugging Face causal LM on CPU or CUDA, patched in place by deltas.

:class:`TorchEngine` is an :class:`~workers.engine.protocol.Engine`. The
weights that deltas are written into are the very tensors that generate:
there is no second copy in another dtype, so an applied version is the
version sampled from. Generation and weight writes share one lock, so a
delta lands between batches (the paper's safe point), never inside one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from aurora_store.apply.sink import SplitWeights, apply_delta, weights_digest
from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.extract import spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.config import from_env
from aurora_store.errors import ChainError, ConfigError, ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta
from workers.engine.protocol import Completion, Generation, TokenCodec
from workers.model import fusion_plan_for, hf_weights

__all__ = ["ENV_PREFIX", "EngineConfig", "TorchEngine"]

ENV_PREFIX = "AURORA_ENGINE_"
"""Prefix of :class:`EngineConfig`'s environment variables."""

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How a :class:`TorchEngine` holds and runs its model."""

    device: str = "cpu"
    """``cpu``, ``cuda`` or ``cuda:N`` (env ``AURORA_ENGINE_DEVICE``)."""
    dtype: str = "bfloat16"
    """Dtype the weights are held, generated with, and patched in (env ``AURORA_ENGINE_DTYPE``).
    bf16 is what RL deltas are cut in; on CPU it samples at about 60% of float32's speed."""
    max_batch_rows: int = 256
    """Most sequences (prompts x group) in one forward pass; more are run in turns
    (env ``AURORA_ENGINE_MAX_BATCH_ROWS``)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(
                f"EngineConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            raise ConfigError(
                f"EngineConfig.device: {self.device!r} is not a torch device"
            ) from None
        if dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"EngineConfig.device must be cpu or cuda, got {self.device!r}")
        if self.max_batch_rows < 1:
            raise ConfigError(
                f"EngineConfig.max_batch_rows must be >= 1, got {self.max_batch_rows}"
            )

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, **overrides: Any) -> EngineConfig:
        """Defaults, then ``AURORA_ENGINE_DEVICE``/``_DTYPE``/``_MAX_BATCH_ROWS``, then ``overrides``."""
        return from_env(cls, prefix, **overrides)


# ---------------------------------------------------------------------------
# torch engine


class TorchEngine:
    """A Hugging Face causal LM held in place, sampled in batches, patched by deltas.

    Public methods take the engine's lock and delegate to ``_impl`` methods;
    a delta therefore never lands in the middle of a ``generate`` call.
    """

    def __init__(self, tokenizer: TokenCodec, config: EngineConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.device = torch.device(self.config.device)
        self.dtype = _DTYPES[self.config.dtype]
        self._lock = threading.RLock()
        self._model: torch.nn.Module | None = None
        self._weights: dict[str, torch.Tensor] = {}
        self._plan: FusionPlan | None = None
        self._sink: SplitWeights | None = None
        self._version: int | None = None
        self._vocab = 0

    # -- loading -----------------------------------------------------------
    def load(self, model: torch.nn.Module, version: int | None = None) -> None:
        """Take ``model`` over: moved to the engine's device and dtype, eval, no grads.

        The engine keeps the module itself (not a copy); its parameters are
        the tensors deltas are written into. Anything that held references
        to the old parameter storage must take them again after this call.
        """
        with self._lock:
            model.to(device=self.device, dtype=self.dtype)
            model.eval().requires_grad_(False)
            embedding = cast(Any, model).get_input_embeddings()
            weights = hf_weights(model)
            plan = fusion_plan_for(weights)
            sink = SplitWeights(
                {n: weights[n] for p in plan for n in (b.source for b in p.blocks)}, plan
            )
            self._model, self._weights, self._plan, self._sink = model, weights, plan, sink
            self._vocab = int(embedding.weight.shape[0])
            self._version = version

    @property
    def model(self) -> torch.nn.Module:
        return self._need()[0]

    @property
    def version(self) -> int | None:
        return self._version

    def fusion_plan(self) -> FusionPlan:
        return self._need()[1]

    def param_specs(self) -> dict[str, ParamSpec]:
        return self._need()[1].specs()

    def sink(self) -> SplitWeights:
        """The :class:`~aurora_store.apply.sink.WeightSink` over the model's own parameter storage.

        Writing through it bypasses the engine's lock; :meth:`apply` is the
        safe way in while other threads generate.
        """
        self._need()
        assert self._sink is not None
        return self._sink

    # -- weights -----------------------------------------------------------
    def apply(self, staged: StagedDelta) -> None:
        """Write a staged delta into the model's parameters, in place, between batches.

        Refused, with no element written: a delta on another base than the
        held version (when the engine was told its version), a parameter the
        model lacks, a range past a parameter's end, values of another width
        than the parameter's dtype. Stage with ``param_specs()`` as the model
        to have shapes and dtypes checked already while fetching.
        """
        with self._lock:
            self._apply_impl(staged)

    def _apply_impl(self, staged: StagedDelta) -> None:
        _, plan = self._need()
        if self._version is not None and staged.base_version != self._version:
            raise ChainError(
                f"delta {staged.version} is based on version {staged.base_version}, "
                f"the engine holds version {self._version}"
            )
        _check_entries(staged, plan.specs())
        assert self._sink is not None
        apply_delta(staged, self._sink)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._version = staged.version

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Copy a full version into the held parameters (no reallocation).

        ``tensors`` is keyed by fused names (a snapshot from
        :func:`aurora_store.lineage.fetch.fetch_snapshot` or ``materialize``) or by
        the model's own Hugging Face names. Every name, shape and dtype is
        checked before the first element is copied.
        """
        with self._lock:
            self._load_weights_impl(tensors, version)

    def _load_weights_impl(self, tensors: Mapping[str, torch.Tensor], version: int | None) -> None:
        _, plan = self._need()
        fused = set(plan.params)
        sources = {b.source: b for p in plan for b in p.blocks}
        if fused <= tensors.keys():
            copies = []
            for p in plan:
                t = tensors[p.name]
                if spec_of(t, p.name) != p.spec:
                    raise ModelMismatchError(
                        f"{p.name}: given {list(t.shape)} {t.dtype}, the engine holds "
                        f"{list(p.spec.shape)} {p.spec.dtype}"
                    )
                flat = t.reshape(-1)
                copies += [(b.source, flat[b.offset : b.offset + b.numel]) for b in p.blocks]
        elif sources.keys() <= tensors.keys():
            copies = []
            for name, b in sources.items():
                t = tensors[name]
                if spec_of(t, name) != b.spec:
                    raise ModelMismatchError(
                        f"{name}: given {list(t.shape)} {t.dtype}, the engine holds "
                        f"{list(b.spec.shape)} {b.spec.dtype}"
                    )
                copies.append((name, t.reshape(-1)))
        else:
            lack = sorted(fused - tensors.keys())
            raise ModelMismatchError(
                f"weights lack {len(lack)} of the engine's parameters (e.g. {lack[:3]}), "
                "under fused and under Hugging Face names"
            )
        with torch.no_grad():
            for name, src in copies:
                self._weights[name].view(-1).copy_(src)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._version = version

    def digest(self) -> str:
        with self._lock:
            _, plan = self._need()
            return weights_digest(self._weights, plan)

    # -- generation --------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group: int,
        max_new_tokens: int,
        seed: int,
        temperature: float = 1.0,
    ) -> Generation:
        """Sample ``group`` completions of every prompt, up to ``max_new_tokens`` each.

        Prompts are token ids (``bos`` first, as :mod:`workers.model` trains
        them), left-padded into batches of at most ``max_batch_rows``
        sequences. ``temperature=0`` is greedy. Sampling draws from one
        generator seeded with ``seed``, so the same seed, weights, prompts
        and config give the same completions. The distribution is the
        model's own, unfiltered (no top-k/top-p), so a Trainer's
        log-probabilities are those the samples were drawn from.
        """
        if group < 1 or max_new_tokens < 1:
            raise ValueError(
                f"group and max_new_tokens must be >= 1, got {group}, {max_new_tokens}"
            )
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        with self._lock:
            return self._generate_impl(prompts, group, max_new_tokens, seed, temperature)

    def _generate_impl(
        self,
        prompts: Sequence[Sequence[int]],
        group: int,
        max_new_tokens: int,
        seed: int,
        temperature: float,
    ) -> Generation:
        model, _ = self._need()
        vocab = self._vocab
        rows: list[list[int]] = []
        for i, p in enumerate(prompts):
            ids = [int(x) for x in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty (at least bos is needed)")
            bad = [x for x in ids if not 0 <= x < vocab]
            if bad:
                raise ValueError(f"prompt {i}: ids {bad[:5]} are outside the vocabulary ({vocab})")
            rows.extend([ids] * group)
        t0 = time.perf_counter()
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        out: list[Completion] = []
        step = self.config.max_batch_rows
        with torch.inference_mode():
            for lo in range(0, len(rows), step):
                out.extend(
                    self._sample(model, rows[lo : lo + step], max_new_tokens, temperature, gen)
                )
        seconds = time.perf_counter() - t0
        done = tuple(tuple(out[i * group : (i + 1) * group]) for i in range(len(prompts)))
        return Generation(done, sum(len(c.token_ids) for c in out), seconds)

    def _sample(
        self,
        model: torch.nn.Module,
        rows: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        gen: torch.Generator,
    ) -> list[Completion]:
        dev, pad = self.device, self.tokenizer.pad_id
        # Every end-of-sequence id of the generation config (Qwen3 and Llama 3 have several).
        stops = torch.tensor(list(getattr(self.tokenizer, "stop_ids", (self.tokenizer.eos_id,))), dtype=torch.long, device=dev)
        b, width = len(rows), max(len(r) for r in rows)
        ids = torch.full((b, width), pad, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            attn[i, width - len(r) :] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1
        )
        next_pos = pos[:, -1:] + 1
        finished = torch.zeros(b, dtype=torch.bool, device=dev)
        lengths = torch.zeros(b, dtype=torch.long, device=dev)
        ones = torch.ones((b, 1), dtype=attn.dtype, device=dev)
        steps: list[torch.Tensor] = []
        for t in range(max_new_tokens):
            logits = out.logits[:, -1, :].float()
            if temperature == 0.0:
                nxt = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            lengths += (~finished).long()
            finished |= torch.isin(nxt, stops)
            steps.append(nxt)
            # One host sync per token; it ends the batch as soon as every row stopped.
            if t == max_new_tokens - 1 or bool(finished.all()):
                break
            attn = torch.cat([attn, ones], dim=-1)
            out = model(
                input_ids=nxt.unsqueeze(-1),
                attention_mask=attn,
                position_ids=next_pos,
                past_key_values=out.past_key_values,
                use_cache=True,
                logits_to_keep=1,
            )
            next_pos = next_pos + 1
        toks = torch.stack(steps, dim=1).cpu().tolist()
        lens = lengths.cpu().tolist()
        fin = finished.cpu().tolist()
        return [
            Completion(
                tuple(toks[i][: lens[i]]), self.tokenizer.decode(toks[i][: lens[i]]), bool(fin[i])
            )
            for i in range(b)
        ]

    # -- helpers -----------------------------------------------------------
    def _need(self) -> tuple[torch.nn.Module, FusionPlan]:
        if self._model is None or self._plan is None:
            raise RuntimeError("no model loaded: call TorchEngine.load(model) first")
        return self._model, self._plan


def _check_entries(staged: StagedDelta, specs: Mapping[str, ParamSpec]) -> None:
    """Every entry fits the held parameters: name, range, index bounds, value count and width.

    ``apply_delta`` re-checks what a staged delta declares; these are the
    facts a write relies on, checked here on the (delta-sized) arrays
    themselves so that no entry can fail halfway through an activation
    after others were written, whoever built the staged delta.
    """
    for e in staged.entries:
        spec = specs.get(e.param)
        where = f"delta {staged.version}: {e.param}"
        if spec is None:
            raise ModelMismatchError(
                f"delta {staged.version}: the model has no parameter {e.param!r}"
            )
        if not 0 <= e.start <= e.stop <= spec.numel:
            raise ModelMismatchError(
                f"{where} range [{e.start}, {e.stop}) does not fit its {spec.numel} elements"
            )
        width = DTYPES[spec.dtype].bits.itemsize
        if e.bits.dtype.itemsize != width:
            raise ModelMismatchError(
                f"{where} carries {e.bits.dtype.itemsize}-byte values, the engine holds {spec.dtype}"
            )
        if e.indices is None:
            if e.bits.size != e.stop - e.start:
                raise ModelMismatchError(
                    f"{where} dense range of {e.stop - e.start} elements carries {e.bits.size} values"
                )
        elif e.bits.size != e.indices.size or (
            e.indices.size and (int(e.indices.min()) < e.start or int(e.indices.max()) >= e.stop)
        ):
            raise ModelMismatchError(
                f"{where} has {e.indices.size} indices and {e.bits.size} values, "
                f"indices must lie in [{e.start}, {e.stop})"
            )
