"""``AuroraCallback``: every optimizer step of a Hugging Face or TRL trainer, published as an Aurora version.

A ``transformers.TrainerCallback``, so it serves any ``transformers.Trainer``
subclass: TRL's ``GRPOTrainer``, ``RLOOTrainer``, ``SFTTrainer`` … Version 0
(a snapshot) is the model as training begins, then one delta per optimizer
step; any inference process follows the run with
:class:`aurora_store.Follower` (docs/INTEGRATIONS.md)::

    from trl import GRPOConfig, GRPOTrainer
    from aurora_store.integrations.trl import AuroraCallback

    trainer = GRPOTrainer(
        model="/models/Qwen3-0.6B",
        reward_funcs=my_reward,
        train_dataset=dataset,
        args=GRPOConfig(output_dir="out", max_steps=500, use_vllm=False),
        callbacks=[AuroraCallback("s3://bucket/runs/r1", redis="redis://host:6379/0")],
    )
    trainer.train()  # v0 before step 1, then v1, v2 … one per optimizer step

Choices, and why:

- The weights are read from ``kwargs["model"]``, the Trainer's ``self.model``:
  the bare model under DDP, the ``fully_shard``-ed one under FSDP2, whose
  DTensor parameters the Publisher gathers one at a time. That gather is
  collective, so every rank publishes; only rank 0 writes and logs. FSDP
  version 1 (flat parameters), DeepSpeed ZeRO-3 (partitioned parameters)
  and PEFT adapters (another model's names) are refused at
  ``on_train_begin`` with a :class:`ConfigError`, before anything is written.
- Given a URL, the Publisher is opened at ``on_train_begin``, not in the
  constructor: it learns its rank when it is made, and the process group
  may not exist yet when the callback is. It is closed at ``on_train_end``.
  A Publisher passed in is the caller's to close (``with Publisher(…)``).
- A publish failure stops training; it is never skipped. The Publisher
  rides out outages of the store and Redis for its outage budget, so an
  :class:`AuroraError` reaching the callback is one retrying did not fix,
  and training on would make steps no Actor ever sees. At ``on_step_end``
  the callback logs one error line, asks the Trainer to save a checkpoint
  of that step and stop, and re-raises the error from ``on_train_end``, so
  ``trainer.train()`` does not return as a success; resuming from the
  checkpoint continues the chain (the Publisher picks up the newest
  committed version, and the first publish carries the missed step). The
  ranks agree on the stop with one all-reduce of a flag per step. Other
  exceptions (bugs) propagate at once.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from aurora_store.api import Published, Publisher
from aurora_store.errors import AuroraError, ConfigError

__all__ = ["AuroraCallback"]

log = logging.getLogger("aurora.integrations.trl")


class AuroraCallback(TrainerCallback):
    """Publishes the model at ``on_train_begin`` and after every optimizer step; see the module's docstring.

    ``publisher``: a :class:`Publisher`, or a run root URL opened as
    ``Publisher(publisher, **publisher_kwargs)`` (``redis``, ``run``,
    ``snapshot_every``, ``sign_key`` …) when training begins.
    """

    def __init__(self, publisher: Publisher | str, **publisher_kwargs: Any) -> None:
        if isinstance(publisher, str):
            try:  # a misspelt option fails here, not after the model has loaded
                inspect.signature(Publisher).bind(publisher, **publisher_kwargs)
            except TypeError as e:
                raise ConfigError(f"AuroraCallback({publisher!r}, …): {e}") from None
        elif not isinstance(publisher, Publisher):
            raise ConfigError(f"AuroraCallback: expected a Publisher or a run root URL, got {type(publisher).__name__}")
        elif publisher_kwargs:
            raise ConfigError(f"AuroraCallback: options {sorted(publisher_kwargs)} go to Publisher(…), not beside a Publisher")
        self._given = publisher if isinstance(publisher, Publisher) else None
        self._url = publisher if isinstance(publisher, str) else None
        self._kwargs = publisher_kwargs
        self._pub: Publisher | None = self._given
        self._error: AuroraError | None = None
        self.last: Published | None = None
        """What rank 0 published last (None before the first version, and on other ranks)."""

    @property
    def publisher(self) -> Publisher | None:
        """The Publisher in use (None before ``on_train_begin`` when given a URL)."""
        return self._pub

    # -- the Trainer's events -----------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        model = kwargs["model"]
        _check_model(model)
        self._error = None
        # Nothing is trained yet: a failure here is raised at once, on every rank. Opening is agreed on
        # before the first publish, whose gathers (FSDP2) every rank must join.
        opened = True
        if self._pub is None:
            assert self._url is not None
            try:
                self._pub = Publisher(self._url, **self._kwargs)
            except AuroraError as e:
                self._error, opened = e, False
                log.error("aurora: opening %s failed: %s: %s; training does not start", self._url, type(e).__name__, e)
        if _agree(args, not opened) or self._publish(args, state, model, then="training does not start") is not None:
            self.close()
            raise self._error or AuroraError(
                "aurora: rank 0 could not open the run root or publish the first version; training does not start (see its log)"
            )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> TrainerControl:
        then = "stopping training with a checkpoint of this step: resume from it and the chain continues"
        if self._error is None and self._publish(args, state, kwargs["model"], then=then) is not None:
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.close()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Close a Publisher this callback opened (one passed in stays open)."""
        if self._pub is not None and self._given is None:
            self._pub.close()
            self._pub = None

    # -- publishing -----------------------------------------------------------------------
    def _publish(self, args: TrainingArguments, state: TrainerState, model: torch.nn.Module, then: str) -> int | None:
        """Publish on every rank; the step that failed (on any rank), else None. ``then``: what the error line tells the user."""
        assert self._pub is not None
        step = int(state.global_step)
        failed = False
        try:
            p = self._pub.publish(model, step=step)
        except AuroraError as e:
            failed = True
            self._error = e
            where = self._url or getattr(getattr(self._pub, "store", None), "url", "the run root")
            log.error("aurora: publishing step %d to %s failed: %s: %s; %s", step, where, type(e).__name__, e, then)
        else:
            if p is not None:
                self.last = p
                if state.is_world_process_zero:
                    log.info(
                        "aurora: v%d (%s%s) step %d: %s, %.2f%% changed, %.2f s",
                        p.version,
                        p.kind,
                        " + snapshot" if p.snapshot and p.kind == "delta" else "",
                        step,
                        _size(p.bytes),
                        100 * p.density,
                        p.seconds,
                    )
        if _agree(args, failed):
            if self._error is None:
                self._error = AuroraError(f"aurora: rank 0 could not publish step {step}; stopping training (see its log)")
            return step
        return None


def _agree(args: TrainingArguments, failed: bool) -> bool:
    """Whether any rank failed: one all-reduce of a flag, so every rank stops at the same step (saving is collective)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return failed
    flag = torch.tensor([1 if failed else 0], device=args.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _check_model(model: Any) -> None:
    """Refuse the wrappings whose parameters are not the model's own names and whole tensors."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"AuroraCallback: the Trainer's model is a {type(model).__name__}, not a torch.nn.Module")
    if hasattr(model, "peft_config"):
        raise ConfigError("AuroraCallback: PEFT (LoRA) models are not supported: their parameters are adapters, not the model's weights")
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch without distributed support
        FullyShardedDataParallel = ()  # type: ignore[assignment,misc]
    if isinstance(model, FullyShardedDataParallel):
        raise ConfigError("AuroraCallback: FSDP version 1 (flat parameters) is not supported: use FSDP2 (fsdp_config={'fsdp_version': 2})")
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ConfigError("AuroraCallback: DeepSpeed ZeRO-3 (partitioned parameters) is not supported: use ZeRO-1/2 or FSDP2")


def _size(n: int) -> str:
    """Bytes for a log line: ``812 B``, ``1.3 MB``."""
    x, unit = float(n), "B"
    for bigger in ("kB", "MB", "GB"):
        if x < 1000:
            break
        x, unit = x / 1000, bigger
    return f"{n} B" if unit == "B" else f"{x:.1f} {unit}"
