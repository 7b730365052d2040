"""Checkpoints written while training goes on: every rank its own part, the record once all are in.

Why: a checkpoint of a large model is gigabytes per rank, and waiting for its
upload would stop the step. A staging copy in memory would cost as much as
the shard itself, and on a machine without separate device memory there is
none to spare; so the bytes are read from the *live* tensors (master weights,
optimizer state) by a background thread while the next batch is collected and
its forward and backward passes run, and ``optimizer.step()`` (the first
thing that changes those tensors) is held until they have been read
(:meth:`Checkpointer.attach` registers the hold as a step pre-hook).

Read into what: a store takes as long as it takes (about 50 MB/s into
``rclone serve s3`` on a loaded machine, a minute for a 200 M model's 2.4 GB),
longer than a forward and backward pass. So each rank first copies its
tensors into a local :class:`~workers.trainer.spool.Spool`, at memory speed
once the file's pages are cached, and the hold waits for that copy only; the
upload then reads the spool, one part at a time, in the background, while
training goes on. The spool takes as much disk (and page cache, which is not
the process's memory) as the rank's part of a checkpoint, 12 bytes per
parameter with AdamW; without room for it, or when it cannot be written, the
checkpoint is uploaded from the live tensors and the hold waits for the
upload instead.

A checkpoint goes in three moves, each at the same point on every rank:

1. :meth:`Checkpointer.begin` (the Trainer's checkpoint call, every rank after
   the version's gather): DCP plans the save (which rank writes which chunk;
   a few small collectives) and each rank starts its thread (spool, upload);
2. the hold before each ``optimizer.step()`` (:meth:`Checkpointer.hold`): each
   rank waits until its tensors are read; when every rank's upload is done
   (one small collective to ask), rank 0 gathers every rank's objects (sizes,
   SHA-256) and commits the record, which lists them all. One process commits
   from its thread as soon as its upload is done (nothing to gather), and the
   hold only passes on an error of that commit;
3. :meth:`Checkpointer.finish` (the next checkpoint, or the end of the run):
   the same, waiting for the uploads.

:attr:`Checkpointer.wait_s` accumulates the time the training loop waited
for checkpoints (planning, the hold, committing the record).
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
from workers.trainer.spool import Spool

__all__ = ["Checkpointer", "Commit"]

log = logging.getLogger("aurora.trainer")

Commit = Callable[[list[ObjectEntry], Mapping[str, Any]], None]
"""Rank 0's last move: commit the record over every rank's objects and the chunks' layout."""


@dataclass(slots=True)
class _Pending:
    step: int
    writer: StoreWriter
    commit: Commit | None
    read: threading.Event = field(default_factory=threading.Event)
    """Set once the live tensors have been read (spooled, or uploaded): they may change."""
    thread: threading.Thread | None = None
    objects: list[ObjectEntry] = field(default_factory=list)
    error: str | None = None
    """Why this rank's part was not written (the checkpoint is then not committed)."""
    failure: Exception | None = None
    """What the commit raised on the thread (one process): raised again on the training loop's thread."""
    spooled: bool = False

    @property
    def uploaded(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()


class Checkpointer:
    """One rank's checkpoint writer (see the module's docstring).

    ``folder_of(step)``: the checkpoint's folder in ``store``; ``sharded``:
    whether a process group spans the ranks (then every call is collective).
    ``spool_dir``: the spool's folder (``""``: the temporary folder; None: no spool).
    """

    def __init__(
        self,
        store: Store,
        folder_of: Callable[[int], str],
        rank: int = 0,
        sharded: bool = False,
        spool_dir: str | None = "",
    ) -> None:
        self.store = store
        self.folder_of = folder_of
        self.rank = rank
        self.sharded = sharded
        self.part_bytes = PART_BYTES
        self.spool = Spool(spool_dir, "checkpoint")
        self.wait_s = 0.0
        """Seconds the training loop waited for checkpoints so far (``aurora bench trainer``'s ``checkpoint_wait_s``)."""
        self.pending: _Pending | None = None
        self._hooked: set[int] = set()

    def attach(self, opt: torch.optim.Optimizer) -> None:
        """Hold ``opt.step()`` until a checkpoint being written has read the tensors (once per optimizer)."""
        if id(opt) not in self._hooked:
            self._hooked.add(id(opt))
            opt.register_step_pre_hook(lambda *_: self.hold())

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
        pending = _Pending(step, writer, commit)
        spool = self.spool.fd(writer.nbytes)
        pending.thread = threading.Thread(target=self._write, args=(pending, spool), name=f"checkpoint-{step}", daemon=True)
        pending.thread.start()
        self.pending = pending
        self.wait_s += time.perf_counter() - t0

    def _write(self, pending: _Pending, spool: int | None) -> None:
        """The checkpoint's thread: spool the tensors (then they may change), upload the parts."""
        try:
            if spool is not None:
                try:
                    pending.writer.spool(spool)
                    pending.spooled = True
                except OSError as e:
                    log.warning("checkpoint before step %d: the spool failed (%s); uploading from the live tensors", pending.step, e)
                    spool = None
                else:
                    pending.read.set()
            pending.objects = pending.writer.upload(spool=spool)
        except Exception as e:  # noqa: BLE001 - reported by the commit, on rank 0 for every rank
            pending.error = f"rank {self.rank}: {type(e).__name__}: {str(e)[:300]}"
        finally:
            pending.read.set()
        if not self.sharded:
            # Nothing to gather: committed now, off the training loop (the record is the checkpoint's last write).
            try:
                self._commit(pending, [(pending.objects, pending.error)])
            except Exception as e:  # noqa: BLE001 - raised again by _settle on the training loop's thread
                pending.failure = e

    def hold(self) -> None:
        """Before ``optimizer.step()``: wait until the checkpoint being written has read the tensors;
        commit it if every rank's upload is done (else a later hold, or :meth:`finish`, does)."""
        pending = self.pending
        if pending is None:
            return
        t0 = time.perf_counter()
        try:
            pending.read.wait()
            if self._everywhere(pending.uploaded):
                self._settle(pending)
        finally:
            self.wait_s += time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for the checkpoint being written, then (rank 0) commit its record; nothing when none is."""
        pending = self.pending
        if pending is None:
            return
        t0 = time.perf_counter()
        try:
            self._settle(pending)
        finally:
            self.wait_s += time.perf_counter() - t0

    def _everywhere(self, mine: bool) -> bool:
        """Whether ``mine`` holds on every rank (a collective when sharded)."""
        if not self.sharded:
            return mine
        import torch.distributed as dist

        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return all(every)

    def _settle(self, pending: _Pending) -> None:
        """Wait for this rank's thread; rank 0 commits the record over every rank's objects (one
        process: its thread did; what that commit raised is raised here)."""
        self.pending = None
        assert pending.thread is not None
        pending.thread.join()
        if not self.sharded:
            if pending.failure is not None:
                raise pending.failure
            return
        import torch.distributed as dist

        mine = (pending.objects, pending.error)
        every: list[Any] = [None] * dist.get_world_size() if self.rank == 0 else []
        dist.gather_object(mine, every if self.rank == 0 else None, dst=0)
        self._commit(pending, every)

    def _commit(self, pending: _Pending, every: list[Any]) -> None:
        """Rank 0: commit the record over every rank's ``(objects, error)``, or say why not."""
        if self.rank != 0 or pending.commit is None:
            return
        errors = [e for _, e in every if e]
        if errors:
            log.warning("checkpoint before step %d not written (the run goes on without it): %s", pending.step, "; ".join(errors))
            return
        layout = pending.writer.layout
        assert layout is not None
        pending.commit([o for objs, _ in every for o in objs], layout)

    @property
    def spool_bytes(self) -> int:
        """Disk the spool takes (0: none): the largest of this rank's checkpoints so far."""
        return self.spool.nbytes

    def close(self) -> None:
        """Finish the checkpoint being written; drop the spool (its disk is freed)."""
        self.finish()
        self.spool.close()
