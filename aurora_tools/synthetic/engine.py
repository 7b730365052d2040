"""The synthetic workload's engine: simulated generation, real weights applied when held."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from aurora_store.codec.entries import ParamSpec
from aurora_store.codec.fusion import FusionPlan
from aurora_store.errors import ChainError
from aurora_store.format.checkpoint import StagedDelta
from aurora_tools.synthetic.shapes import qwen3_shapes
from aurora_tools.synthetic.workload import SyntheticSpec, base_weights

__all__ = ["StagedSnapshot", "StagedAnnouncement", "SyntheticEngine"]


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
    """The :class:`~workers.engine.protocol.Engine` of the synthetic workload.

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
        from workers.engine.protocol import Completion, Generation

        t0 = time.perf_counter()
        time.sleep(len(prompts) * self.spec.gen_s_per_prompt)
        ids = tuple(range(1, self.spec.tokens + 1))
        one = Completion(ids, "", False)
        comps = tuple(tuple(one for _ in range(group)) for _ in prompts)
        return Generation(comps, len(prompts) * group * len(ids), time.perf_counter() - t0)

    def prepare_segment(self, seg: Any) -> Any:
        """One decoded segment prepared while the others download (the torch engine's ``prepare_segment``)."""
        from aurora_store.apply.prepare import prepare_part
        from aurora_store.apply.prepared_delta import layout_of_plan

        if not self.hold:
            return None
        return prepare_part(seg.version, seg.entries, self._plan.specs(), layout_of_plan(self._plan), basis=self._plan)

    def prepare(self, staged: StagedDelta) -> Any:
        """What the torch engine's ``prepare`` does, for held weights (aurora_store.apply.prepare):
        checks and grouping in the stager, so the safe point only writes. Not held: ``staged`` as it is."""
        from aurora_store.apply.prepare import prepare_delta
        from aurora_store.apply.prepared_delta import layout_of_plan, parts_of

        if not self.hold:
            return staged
        return prepare_delta(staged, self._plan.specs(), layout_of_plan(self._plan), parts=parts_of(staged, self._plan))

    def apply(self, staged: Any) -> None:
        from aurora_store.apply.prepared_delta import PreparedDelta
        from aurora_store.apply.sink import apply_delta, check_fits

        with self._lock:
            if isinstance(staged, PreparedDelta):
                if self._version is not None and staged.base_version != self._version:
                    raise ChainError(f"delta {staged.version} is based on version {staged.base_version}, the engine holds {self._version}")
                staged.write(self._sink.tensors)  # every target checked before the first write
            elif isinstance(staged, StagedDelta):
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

    def close(self) -> None:
        """Nothing to end: everything lives in this process."""
