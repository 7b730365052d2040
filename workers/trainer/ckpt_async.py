"""Checkpoints written while training goes on: every rank its own part, the record once all are in.

Why: a checkpoint of a large model is gigabytes per rank, and waiting for its
upload would stop the step. A staging copy would cost as much memory as the
shard itself, and on a machine without separate device memory there is none
to spare; so the objects are written from the *live* tensors (master weights,
optimizer state) by a background thread while the next batch is collected and
its forward and backward passes run, and ``optimizer.step()`` (the first
thing that changes those tensors) is held until the write is done
(:meth:`Checkpointer.attach` registers the hold as a step pre-hook).

A checkpoint goes in three moves, each at the same point on every rank:

1. :meth:`Checkpointer.begin` (the Trainer's checkpoint call, every rank after
   the version's gather): DCP plans the save (which rank writes which chunk;
   a few small collectives) and each rank starts its upload thread;
2. the uploads run (no collective: each rank writes only its own objects);
3. :meth:`Checkpointer.finish` (the hold before the next ``optimizer.step()``,
   the next checkpoint, or the end of the run): each rank waits for its
   thread, rank 0 gathers every rank's objects (sizes, SHA-256) and commits
   the record, which lists them all.

:attr:`Checkpointer.wait_s` accumulates the time the training loop waited
for checkpoints (planning, and any upload not done by the hold).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from aurora_store.storage import Store
from workers.trainer.ckpt_store import PART_BYTES, ObjectEntry, StoreWriter

__all__ = ["Checkpointer", "Commit"]

log = logging.getLogger("aurora.trainer")

Commit = Callable[[list[ObjectEntry], Mapping[str, Any]], None]
"""Rank 0's last move: commit the record over every rank's objects and the chunks' layout."""


@dataclass(slots=True)
class _Pending:
    step: int
    writer: StoreWriter
    commit: Commit | None
    thread: threading.Thread
    objects: list[ObjectEntry] = field(default_factory=list)
    error: str | None = None


class Checkpointer:
    """One rank's checkpoint writer (see the module's docstring).

    ``folder_of(step)``: the checkpoint's folder in ``store``; ``sharded``:
    whether a process group spans the ranks (then every call is collective).
    """

    def __init__(self, store: Store, folder_of: Callable[[int], str], rank: int = 0, sharded: bool = False) -> None:
        self.store = store
        self.folder_of = folder_of
        self.rank = rank
        self.sharded = sharded
        self.part_bytes = PART_BYTES
        self.wait_s = 0.0
        """Seconds the training loop waited for checkpoints so far (``aurora bench trainer``'s ``checkpoint_wait_s``)."""
        self.pending: _Pending | None = None
        self._hooked: set[int] = set()

    def attach(self, opt: torch.optim.Optimizer) -> None:
        """Hold ``opt.step()`` until a checkpoint being written is complete (once per optimizer)."""
        if id(opt) not in self._hooked:
            self._hooked.add(id(opt))
            opt.register_step_pre_hook(lambda *_: self.finish())

    def begin(self, step: int, attempt: str, state: Mapping[str, torch.Tensor], commit: Commit | None) -> None:
        """Start the checkpoint before ``step`` from ``state`` (name -> live tensor or DTensor shard).

        ``attempt``: the same on every rank; ``commit``: rank 0's. A checkpoint
        still being written is finished first.
        """
        self.finish()
        t0 = time.perf_counter()
        import torch.distributed.checkpoint as dcp

        writer = StoreWriter(self.store, self.folder_of(step), attempt, self.rank, self.part_bytes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
            dcp.save(dict(state), storage_writer=writer, no_dist=not self.sharded)
        pending = _Pending(step, writer, commit, threading.Thread(target=lambda: None))

        def upload() -> None:
            try:
                pending.objects = writer.upload()
            except Exception as e:  # noqa: BLE001 - reported by finish(), on rank 0 for every rank
                pending.error = f"rank {self.rank}: {type(e).__name__}: {str(e)[:300]}"

        pending.thread = threading.Thread(target=upload, name=f"checkpoint-{step}", daemon=True)
        pending.thread.start()
        self.pending = pending
        self.wait_s += time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for the checkpoint being written, then (rank 0) commit its record; nothing when none is."""
        pending = self.pending
        if pending is None:
            return
        t0 = time.perf_counter()
        self.pending = None
        pending.thread.join()
        mine = (pending.objects, pending.error)
        every: list[Any] = [mine]
        if self.sharded:
            import torch.distributed as dist

            every = [None] * dist.get_world_size() if self.rank == 0 else []
            dist.gather_object(mine, every if self.rank == 0 else None, dst=0)
        try:
            if self.rank != 0 or pending.commit is None:
                return
            errors = [e for _, e in every if e]
            if errors:
                log.warning("checkpoint before step %d not written (the run goes on without it): %s", pending.step, "; ".join(errors))
                return
            layout = pending.writer.layout
            assert layout is not None
            pending.commit([o for objs, _ in every for o in objs], layout)
        finally:
            self.wait_s += time.perf_counter() - t0
