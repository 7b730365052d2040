"""What the Trainer's loop asks of a workload: version 0, and each step's prompts, rollouts and update.

The Trainer owns the run (epochs, batches over the ledger, publishing and
recording versions, checkpoints); a workload plugs in through two narrow
Protocols, :class:`StepSource` and :class:`WeightsSource`. The real one is :class:`~workers.trainer.policy.GrpoPolicy`
(a model trained with GRPO on a task); ``aurora bench wan``'s synthetic
workload (:mod:`aurora_tools.synthetic.trainer`) makes sparse updates of
real bf16 weights instead, and everything else runs the Trainer's own code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from aurora_store.codec.fusion import FusionPlan
from aurora_store.coordination.ledger import AcceptedResult
from aurora_store.lineage.binding import ModelFile
from aurora_store.storage import Store
from workers.trainer.grpo import Rollouts
from workers.trainer.scheduling import Prompts

__all__ = ["FirstVersion", "Rollouts", "StepSource", "WeightsSource"]


@dataclass(frozen=True, slots=True)
class FirstVersion:
    """Version 0 of a fresh run, as a weights source makes it."""

    weights: dict[str, torch.Tensor]
    """bf16 weights under Hugging Face names, held by the Trainer as version 0's."""
    plan: FusionPlan
    """How the weights are shipped (fused names, the tied head)."""
    model_files: list[ModelFile] | None
    """The description written under ``model/`` (every snapshot lists it)."""
    base_state: str | None = None
    """None: version 0 is published as a snapshot. Else the ``state`` of a base every Actor
    builds itself (the synthetic model): nothing is written, the chain continues from it."""


class WeightsSource(Protocol):
    """The weights each version is made of: version 0 of a fresh run, then the newest after each step.

    Why a Protocol: the real model warm-starts, writes its config and
    tokenizer and gathers its bf16 rounding from fp32 shards; a synthetic one
    builds a seeded base every Actor can rebuild and updates it in place.
    """

    def first_version(self, store: Store) -> FirstVersion:
        """The model's description in ``store`` and version 0's weights."""
        ...

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights the last :meth:`StepSource.train` made, in bf16 (not written again while they
        are the newest version: the Publisher diffs the version after against them)."""
        ...


class StepSource(Protocol):
    """Each step's work: the prompts of a batch, what its results are worth, the update.

    Why a Protocol: the Trainer's loop (wait for a batch, train, publish,
    issue the next batch, commit) is the same for GRPO and for a benchmark's
    simulated training.
    """

    def prompts(self, step: int) -> Prompts:
        """(prompt id, payload) of batch ``step``, in order."""
        ...

    def rollouts(self, results: Mapping[str, AcceptedResult]) -> Rollouts:
        """The batch's accepted results parsed and rewarded; malformed payloads counted in ``bad``."""
        ...

    def train(self, rollouts: Rollouts, behaviour: Mapping[str, torch.Tensor]) -> None:
        """Take the step on ``rollouts``; ``behaviour``: the bf16 weights of the version the batch was generated on."""
        ...
