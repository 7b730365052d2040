"""The torch engine: any Hugging Face causal LM on CPU or CUDA, patched in place by deltas.

:class:`TorchEngine` is an :class:`~workers.engine.protocol.Engine`. The
weights that deltas are written into are the very tensors that generate:
there is no second copy in another dtype, so an applied version is the
version sampled from. Generation and weight writes share one lock, so a
delta lands between batches (the paper's safe point), never inside one.

:meth:`TorchEngine.prepare` does everything of an activation but the write
while the engine generates (aurora_store.apply.prepare): checks, splitting
over the source tensors, sorting, and the digest the weights will have. The
safe point then writes one sorted pass per tensor, or, with
``EngineConfig.activation = "swap"``, only swaps in a spare copy the delta
was written into beforehand (workers.engine.spare). With ``serve_dtype``
``fp8-block128`` generation reads an FP8 copy kept current inside the safe
point (workers.engine.torch_fp8).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch

from aurora_store.apply.predict import predicted_digest
from aurora_store.apply.prepare import prepare_delta, prepare_part
from aurora_store.apply.prepared_delta import PreparedDelta, PreparedPart, layout_of_plan, parts_of
from aurora_store.apply.sink import SplitWeights, apply_delta, digest_as, weights_digest
from aurora_store.apply.tp_experts import mismatch
from aurora_store.codec.encodings import DTYPES
from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.extract import spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ChainError, ModelMismatchError
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.format.segment import Segment
from workers.engine.protocol import Completion, Generation, TokenCodec
from workers.engine.spare import SpareWeights, swap_fits
from workers.engine.torch_config import DTYPES_BY_NAME, ENV_PREFIX, EngineConfig
from workers.engine.torch_experts import engine_plan
from workers.engine.torch_fp8 import Fp8Serving, refuse_quantized_base
from workers.engine.torch_sampling import sample_rows
from workers.model import hf_weights

__all__ = ["ENV_PREFIX", "EngineConfig", "TorchEngine"]

log = logging.getLogger("aurora.engine")


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
        self.dtype = DTYPES_BY_NAME[self.config.dtype]
        self._lock = threading.RLock()
        self._model: torch.nn.Module | None = None
        self._weights: dict[str, torch.Tensor] = {}
        self._plan: FusionPlan | None = None
        self._sink: SplitWeights | None = None
        self._version: int | None = None
        self._vocab = 0
        self._seq = 0
        """Weight writes so far, twice each (odd while one is under way): what a predicted digest is tied to."""
        self._digest: tuple[int, str] | None = None
        """(``_seq`` it was predicted for, digest) of the held weights: what a prepared delta said they would be."""
        self._spare: SpareWeights | None = None
        self._fp8: Fp8Serving | None = None
        self._swap_decided = self.config.activation != "auto" or self.config.serve_dtype != "bf16"  # FP8: in place
        if self.config.activation == "swap":
            self._spare = SpareWeights()

    # -- loading -----------------------------------------------------------
    def load(self, model: torch.nn.Module, version: int | None = None) -> None:
        """Take ``model`` over: moved to the engine's device and dtype, eval, no grads.

        The engine keeps the module itself (not a copy); its parameters are
        the tensors deltas are written into. Anything that held references
        to the old parameter storage must take them again after this call.
        """
        with self._lock:
            refuse_quantized_base(model)
            model.to(device=self.device, dtype=self.dtype)
            model.eval().requires_grad_(False)
            embedding = cast(Any, model).get_input_embeddings()
            weights = hf_weights(model)
            plan = engine_plan(model, weights)  # packed experts: one block each, under FORMAT.md §2's names
            sink = SplitWeights({n: weights[n] for p in plan for n in (b.source for b in p.blocks)}, plan)
            fp8 = Fp8Serving.serving(model, sink.tensors, self.config.serve_dtype)
            self._seq += 2
            self._fp8 = fp8
            self._model, self._weights, self._plan, self._sink = model, weights, plan, sink
            if self._spare is not None:
                self._spare.forget()
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
        self._seq += 2  # the caller may write: no predicted digest or prepared spare holds past this
        if self._fp8 is not None:
            self._fp8.stale = True  # a write it does not see: quantized again before the next generation
        return self._sink

    # -- weights -----------------------------------------------------------
    def prepare_segment(self, seg: Segment) -> PreparedPart:
        """The per-entry part of :meth:`prepare` for one decoded segment, run in its download
        thread while the other segments are on the wire (``fetch_delta(prepare=...)``); what is
        left for :meth:`prepare` is the checks across entries (and the digest)."""
        _, plan = self._need()
        return prepare_part(seg.version, seg.entries, plan.specs(), layout_of_plan(plan), basis=plan)

    def prepare(self, staged: StagedDelta) -> PreparedDelta:
        """Everything of :meth:`apply` but the write, done now (the stager, while others generate).

        Checks ``staged`` against the held parameters, splits it over the
        source tensors, sorts and groups its writes
        (:func:`~aurora_store.apply.prepare.prepare_delta`), moves them to
        the engine's device, and, with ``predict_digest`` when the engine
        holds the delta's base, computes the digest the weights will have.
        Takes no lock that generation takes; nothing is written. Raises
        :class:`~aurora_store.errors.ModelMismatchError` for a delta that
        does not fit (then :meth:`apply` would have refused it too).
        """
        _, plan = self._need()
        sink = self._sink
        assert sink is not None
        tensors = sink.tensors
        prepared = prepare_delta(
            staged, plan.specs(), layout_of_plan(plan), device=lambda n: tensors[n].device, parts=parts_of(staged, plan)
        )
        spare = self._spare_for(tensors)
        if spare is not None and self._version == staged.base_version:
            with spare.lock:
                try:
                    if spare.prepare_into(prepared, tensors, lambda: self._seq, lambda w: weights_digest(w, plan)):
                        return prepared
                except Exception as e:  # noqa: BLE001 - the spare is an optimisation: in place it is
                    log.warning("engine: the spare copy failed (%s: %s); activating in place", type(e).__name__, e)
                    spare.forget()
                    spare.tensors = None
        if self.config.predict_digest and self.device.type == "cpu":
            seq = self._seq
            if seq % 2 == 0 and self._version == staged.base_version:
                digest = predicted_digest(prepared, tensors, plan)
                # Valid only if no write began or ended while the weights were read.
                if digest is not None and self._seq == seq and self._sink is sink:
                    prepared.digest, prepared.digest_basis = digest, seq
        return prepared

    def apply(self, staged: StagedDelta | PreparedDelta) -> None:
        """Write a staged (or prepared, :meth:`prepare`) delta into the model's parameters, in place, between batches.

        Refused, with no element written: a delta on another base than the
        held version (when the engine was told its version), a parameter the
        model lacks, a range past a parameter's end, values of another width
        than the parameter's dtype. Stage with ``param_specs()`` as the model
        to have shapes and dtypes checked already while fetching; prepare it
        to have all of that (and the grouping of its writes) done before the
        safe point, which then only writes.
        """
        with self._lock:
            if isinstance(staged, PreparedDelta):
                self._apply_prepared(staged)
            else:
                self._apply_impl(staged)

    def _base_check(self, version: int, base: int) -> None:
        if self._version is not None and base != self._version:
            raise ChainError(f"delta {version} is based on version {base}, the engine holds version {self._version}")

    def _apply_impl(self, staged: StagedDelta) -> None:
        _, plan = self._need()
        self._base_check(staged.version, staged.base_version)
        _check_entries(staged, plan.specs())
        assert self._sink is not None
        if self._fp8 is not None:  # the FP8 copy follows the sorted writes a prepared delta holds
            self._apply_prepared(prepare_delta(staged, plan.specs(), layout_of_plan(plan), parts=parts_of(staged, plan)))
            return
        if self._spare is not None:
            self._spare.forget()  # a write the spare cannot replay
        self._seq += 1
        try:
            apply_delta(staged, self._sink)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self._seq += 1
        self._version = staged.version

    def _apply_prepared(self, prepared: PreparedDelta) -> None:
        self._need()
        self._base_check(prepared.version, prepared.base_version)
        assert self._sink is not None
        tensors = self._sink.tensors
        prepared.check_live(tensors)  # before the first write: a delta lands whole or not at all
        basis = self._seq
        spare = self._spare
        if spare is not None and spare.lock.acquire(blocking=False):  # busy: write in place instead
            try:
                new = spare.take(prepared, basis)
                if new is not None:
                    self._swap_in(new, prepared)
                    return
            finally:
                spare.lock.release()
        self._seq += 1
        try:  # FP8: every check before the first write, bf16 or FP8
            prepared.write(tensors) if self._fp8 is None else self._fp8.write(prepared, tensors)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self._seq += 1
        self._version = prepared.version
        if prepared.digest is not None and prepared.digest_basis == basis:
            self._digest = (self._seq, prepared.digest)
        if spare is not None:
            if spare.version is not None and spare.version >= prepared.version:
                # The spare was written for this version (or past it) from other weights than these:
                # a version number no longer says what it holds.
                spare.version, spare.ready = None, None
            spare.note_activated(prepared)

    def _spare_for(self, tensors: Mapping[str, torch.Tensor]) -> SpareWeights | None:
        """The spare copy when swap activation is on (``auto``: decided here, once, by free memory)."""
        if not self._swap_decided:
            self._swap_decided = True
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            if swap_fits(need, self.device):
                self._spare = SpareWeights()
            log.info("engine: activation auto: %s (weights %d MiB)", "swap" if self._spare else "in-place", need >> 20)
        return self._spare

    def _swap_in(self, new: dict[str, torch.Tensor], prepared: PreparedDelta) -> None:
        """Point the parameters at ``new`` (the spare, the held weights plus ``prepared``); the old weights become the spare."""
        model, plan = self._need()
        spare = self._spare
        assert spare is not None
        params = [(name, p) for name, p in model.named_parameters() if name in new]  # a tied head is the embedding's
        old = {name: p.data for name, p in params}
        self._seq += 1
        try:
            with torch.no_grad():
                try:
                    for name, p in params:
                        p.data = new[name]
                    weights = hf_weights(model)
                    sink = SplitWeights({n: weights[n] for p in plan for n in (b.source for b in p.blocks)}, plan)
                except BaseException:
                    for name, p in params:  # never half swapped: every parameter back on the old weights
                        p.data = old[name]
                    spare.forget()
                    raise
            self._weights, self._sink = weights, sink
        finally:
            self._seq += 1
        self._version = prepared.version
        if prepared.digest is not None:
            self._digest = (self._seq, prepared.digest)
        spare.give(old, prepared.base_version)
        spare.note_activated(prepared)

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
                        f"{p.name}: given {list(t.shape)} {t.dtype}, the engine holds {list(p.spec.shape)} {p.spec.dtype}"
                    )
                flat = t.reshape(-1)
                copies += [(b.source, flat[b.offset : b.offset + b.numel]) for b in p.blocks]
        elif sources.keys() <= tensors.keys():
            copies = []
            for name, b in sources.items():
                t = tensors[name]
                if spec_of(t, name) != b.spec:
                    raise ModelMismatchError(
                        f"{name}: given {list(t.shape)} {t.dtype}, the engine holds {list(b.spec.shape)} {b.spec.dtype}"
                    )
                copies.append((name, t.reshape(-1)))
        else:
            lack = sorted(fused - tensors.keys())
            raise ModelMismatchError(
                f"weights lack {len(lack)} of the engine's parameters (e.g. {lack[:3]}), under fused and under Hugging Face names"
            )
        if self._spare is not None:
            self._spare.forget()
        self._seq += 1
        try:
            with torch.no_grad():
                for name, src in copies:
                    self._weights[name].view(-1).copy_(src)
            if self._fp8 is not None:
                self._fp8.refresh(self._sink.tensors)  # type: ignore[union-attr]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self._seq += 1
        self._version = version

    def verify_predicted(self) -> bool | None:
        """Hash the held weights and compare them with the digest :meth:`prepare` predicted.

        The prediction is computed from the old weights and the delta, not
        from the weights the write produced: this closes the loop, off the
        safe point (the Actor's stager calls it after an activation). True
        when they agree; False when they do not, and then :meth:`digest`
        hashes the weights themselves from now on; None when there is
        nothing to check (no prediction held, or a write began meanwhile).
        """
        held, seq = self._digest, self._seq
        if held is None or held[0] != seq or seq % 2:
            return None
        _, plan = self._need()
        actual = weights_digest(self._weights, plan)
        if self._seq != seq:
            return None
        if actual == held[1]:
            return True
        with self._lock:
            if self._digest == held:
                self._digest = None
        return False

    def verify_digest(self, expected: str) -> str | None:
        """The digest of the held weights in the form ``expected`` names (FORMAT.md §4.1), to compare with it.

        Why without the engine's lock: the Actor verifies outside its safe
        point, while this engine generates (reads only). A weight write that
        begins meanwhile makes the result speak for no version: None then.
        """
        seq = self._seq
        if seq % 2:
            return None
        _, plan = self._need()
        got = digest_as(expected, self._weights, plan)
        return got if self._seq == seq else None

    def digest(self) -> str:
        """``weights_digest`` of the held weights; the one :meth:`prepare` predicted when it is theirs."""
        with self._lock:
            _, plan = self._need()
            if self._digest is not None and self._digest[0] == self._seq:
                return self._digest[1]
            return weights_digest(self._weights, plan)

    def serving_digest(self) -> str:
        """Digest of what generation reads: the FP8 copy's (:meth:`Fp8Serving.digest`), else :meth:`digest`."""
        with self._lock:
            return self.digest() if self._fp8 is None else self._fp8.digest()

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
            raise ValueError(f"group and max_new_tokens must be >= 1, got {group}, {max_new_tokens}")
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
        if self._fp8 is not None and self._fp8.stale:
            self._fp8.refresh(self._sink.tensors)  # type: ignore[union-attr]
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
                out.extend(sample_rows(model, self.tokenizer, self.device, rows[lo : lo + step], max_new_tokens, temperature, gen))
        seconds = time.perf_counter() - t0
        done = tuple(tuple(out[i * group : (i + 1) * group]) for i in range(len(prompts)))
        return Generation(done, sum(len(c.token_ids) for c in out), seconds)

    def close(self) -> None:
        """Nothing to end: the model lives in this process (the Engine protocol's ``close``)."""

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
            raise ModelMismatchError(f"delta {staged.version}: the model has no parameter {e.param!r}")
        if e.spec != spec:  # first: a delta cut for other E, I or H is named as such
            raise ModelMismatchError(mismatch(where, e.param, e.spec, spec))
        if not 0 <= e.start <= e.stop <= spec.numel:
            raise ModelMismatchError(f"{where} range [{e.start}, {e.stop}) does not fit its {spec.numel} elements")
        width = DTYPES[spec.dtype].bits.itemsize
        if e.bits.dtype.itemsize != width:
            raise ModelMismatchError(f"{where} carries {e.bits.dtype.itemsize}-byte values, the engine holds {spec.dtype}")
        if e.indices is None:
            if e.bits.size != e.stop - e.start:
                raise ModelMismatchError(f"{where} dense range of {e.stop - e.start} elements carries {e.bits.size} values")
        elif e.bits.size != e.indices.size or (e.indices.size and (int(e.indices.min()) < e.start or int(e.indices.max()) >= e.stop)):
            raise ModelMismatchError(
                f"{where} has {e.indices.size} indices and {e.bits.size} values, indices must lie in [{e.start}, {e.stop})"
            )
