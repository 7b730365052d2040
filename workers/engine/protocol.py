"""What an Actor needs of an inference engine, and the values engines hand back.

An Actor needs exactly these things from an engine: sample completions,
overwrite a full version (bootstrap from a snapshot), apply a staged delta
in place, say which parameters it holds (so a fetcher validates a delta
against *this* model before staging it), digest its weights (so it can
prove to the ledger what it generated with), say which version it holds,
and close. :class:`Engine` is that and no more, so the vLLM engine
(:mod:`workers.engine.vllm_engine`) fits behind it as well as the torch one
(:mod:`workers.engine.torch_engine`).

Capabilities beyond it are Protocols of their own, which the Actor tests with
``isinstance`` (all are runtime-checkable):

- :class:`LoadingEngine`: built empty, then given a model (``load``): what
  :func:`~workers.engine.factory.make_engine` returns;
- :class:`PreparingEngine`: prepares a staged delta before the safe point
  (per segment as it is decoded, then as a whole);
- :class:`PredictingEngine`: predicted the digest of a prepared delta's
  result, and checks the real weights against it afterwards;
- :class:`StoreStaging`: its workers read versions from the store themselves;
- :class:`VerifyingEngine`: computes the digest of its weights in either form of
  FORMAT.md §4.1 without holding up generation or activation.

This module imports no engine, and neither torch nor vLLM at run time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from aurora_store.config import DEFAULT_STREAMS
from workers.task import Problem, reward

if TYPE_CHECKING:
    import torch

    from aurora_store.codec.entries import ParamSpec
    from aurora_store.codec.fusion import FusionPlan
    from aurora_store.format.checkpoint import StagedDelta
    from aurora_store.format.manifest import Manifest
    from aurora_store.storage import Store

__all__ = [
    "Completion",
    "Engine",
    "EvalResult",
    "Generation",
    "LoadingEngine",
    "PredictingEngine",
    "PreparingEngine",
    "RemoteStaged",
    "StoreStaging",
    "TextCodec",
    "TokenCodec",
    "VerifyingEngine",
    "evaluate",
]


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: tuple[int, ...]
    """Generated ids, ending with ``eos`` when :attr:`finished`."""
    text: str
    """The ids decoded, special tokens dropped."""
    finished: bool
    """True when the model emitted ``eos``; False when ``max_new_tokens`` cut it."""


@dataclass(frozen=True, slots=True)
class Generation:
    """Completions of a batch of prompts, and what producing them cost."""

    completions: tuple[tuple[Completion, ...], ...]
    """``completions[i][j]``: sample ``j`` of the group of prompt ``i``."""
    new_tokens: int
    """Tokens generated, over all samples (``eos`` included, padding not)."""
    seconds: float
    """Wall time of the whole call."""

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class TokenCodec(Protocol):
    """What an engine needs of a tokenizer: the stop and padding ids, and decoding."""

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...


class TextCodec(TokenCodec, Protocol):
    """A :class:`TokenCodec` that also encodes prompts (for :func:`evaluate`)."""

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...


@runtime_checkable
class Engine(Protocol):
    """An Actor's inference engine, as narrow as the Actor's needs.

    Why each member is here: ``generate`` is the Actor's work; ``apply`` is
    the activation step (in place, at a safe point, checked before the first
    write); ``load_weights`` is bootstrap and snapshot catch-up;
    ``param_specs``/``fusion_plan`` let a fetcher validate a delta against
    this model while it is staged, before activation; ``digest`` lets the
    Actor prove which bits it generated with; ``version`` is what it reports
    with each rollout, and what the Actor checks after a refused activation;
    ``close`` ends what the engine runs of its own (vLLM's processes; a no-op
    for an engine in this process). How the model is built or held is left
    to each engine.
    """

    @property
    def version(self) -> int | None:
        """Policy version held, or ``None`` when the caller never said."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        group: int,
        max_new_tokens: int,
        seed: int,
        temperature: float = 1.0,
    ) -> Generation:
        """``group`` samples per prompt; the same seed and weights give the same samples."""
        ...

    def apply(self, staged: Any) -> None:
        """Overwrite the changed elements in place; a delta that does not fit changes nothing.

        ``staged``: a :class:`~aurora_store.format.checkpoint.StagedDelta`, or
        what this engine's ``prepare`` or ``stage_from_store`` returned for one.
        """
        ...

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Overwrite every weight in place from a full version (fused or Hugging Face names)."""
        ...

    def digest(self) -> str:
        """``weights_digest`` of the held weights under the fused plan."""
        ...

    def fusion_plan(self) -> FusionPlan:
        """The fused view of the held model (FORMAT.md §2)."""
        ...

    def param_specs(self) -> Mapping[str, ParamSpec]:
        """Fused name -> spec: what deltas for this engine must match."""
        ...

    def close(self) -> None:
        """End what the engine runs of its own (processes, threads); idempotent."""
        ...


@runtime_checkable
class LoadingEngine(Engine, Protocol):
    """An engine built empty and then given its model: what :func:`~workers.engine.factory.make_engine` returns.

    Why: an Actor reads the model description from the run's store and
    builds the model before any weights exist; the engine takes it over.
    """

    def load(self, model: Any, version: int | None = None) -> None:
        """Take ``model`` over (its weights are overwritten by the first version loaded)."""
        ...


@runtime_checkable
class PreparingEngine(Protocol):
    """An engine that does the work of ``apply`` but the write before the safe point.

    Why: the safe point is on the critical path of every Actor; checking,
    splitting and sorting a delta's writes can happen in the stager while
    the engine generates. ``prepare_segment`` runs in a download thread for
    each segment as it is decoded; ``prepare`` finishes the delta, and its
    result goes to ``apply`` in place of the delta.
    """

    def prepare_segment(self, seg: Any) -> Any:
        """The per-entry part of ``prepare`` for one decoded segment (``fetch_delta(prepare=...)``)."""
        ...

    def prepare(self, staged: StagedDelta) -> Any:
        """``staged`` made ready for ``apply``; raises what ``apply`` would have refused it with."""
        ...


@runtime_checkable
class PredictingEngine(Protocol):
    """An engine that predicted the digest its weights have after a prepared delta is applied.

    Why: the Actor records that digest at activation without hashing the
    weights on the critical path; it checks the real weights against it
    later, in the stager (a mismatch is a broken write: the Actor stops).
    """

    def verify_predicted(self) -> bool | None:
        """Whether the held weights have the digest predicted for them; None when nothing was predicted."""
        ...


@runtime_checkable
class VerifyingEngine(Protocol):
    """An engine that digests its weights off the critical path, in the form a record names.

    Why: an Actor verifies its weights against the ``weights_digest`` a
    version's record carries (FORMAT.md §4.1: ``sha256:`` or
    ``tree-sha256:``) while it generates, never inside its safe point; a
    tensor-parallel engine hashes each whole tensor once, not on every rank.
    """

    def verify_digest(self, expected: str) -> str | None:
        """The held weights' digest in ``expected``'s form; None when a weight write raced it."""
        ...


@dataclass(frozen=True, slots=True)
class RemoteStaged:
    """A delta staged inside an engine's own processes (see :class:`StoreStaging`)."""

    version: int
    base_version: int
    state: str
    """The version's ``state`` digest (its manifest's)."""
    nnz: int


@runtime_checkable
class StoreStaging(Protocol):
    """An engine whose workers read versions from the store themselves.

    Why: an engine that generates in other processes (vLLM) would otherwise
    receive every delta twice over a process boundary; with this, the
    workers fetch, verify and decode segments and only a handle comes back.
    An Actor uses it when its engine has it, and ``fetch_delta`` otherwise.
    """

    def bootstrap_from_store(
        self,
        store: Store,
        storage_options: Mapping[str, Any] | None = None,
        version: int | None = None,
        streams: int = DEFAULT_STREAMS,
        manifests: Sequence[Manifest] | None = None,
    ) -> tuple[int, str]:
        """Reach ``version`` (default: the newest) from the store; returns (version, state) as the workers hold it.

        ``manifests``: the chain the caller checked (snapshot, then deltas):
        followed exactly, no manifest read again.
        """
        ...

    def stage_from_store(
        self,
        store: Store,
        storage_options: Mapping[str, Any] | None,
        version: int,
        expect_base_state: str | None,
        streams: int = DEFAULT_STREAMS,
        manifest: Manifest | None = None,
    ) -> tuple[Manifest, RemoteStaged | StagedDelta]:
        """Stage delta ``version`` on top of ``expect_base_state``; ``apply`` takes the handle.

        ``manifest``: the one the caller checked, handed to the workers (never
        read twice); the handle's ``state`` is what the workers staged.
        """
        ...


# ---------------------------------------------------------------------------
# evaluation


@dataclass(frozen=True, slots=True)
class EvalResult:
    """Sampling accuracy on a problem set."""

    accuracy: float
    """Mean reward over all samples."""
    samples: int
    generation: Generation


def evaluate(
    engine: Engine,
    tokenizer: TextCodec,
    problems: Sequence[Problem],
    samples: int = 1,
    max_new_tokens: int = 24,
    seed: int = 0,
    temperature: float = 1.0,
) -> EvalResult:
    """Mean :func:`workers.task.reward` of ``samples`` completions per problem."""
    prompts = [tokenizer.encode(p.prompt_text, bos=True) for p in problems]
    g = engine.generate(prompts, samples, max_new_tokens, seed, temperature)
    scores = [reward(c.text, p.answer) for p, group in zip(problems, g.completions, strict=True) for c in group]
    return EvalResult(sum(scores) / max(1, len(scores)), len(scores), g)
