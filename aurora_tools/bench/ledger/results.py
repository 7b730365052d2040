"""Results through the store in ``aurora bench ledger``: the Actors' writes and the Trainer's reads, as the workers do them.

A payload larger than ``--inline-max-bytes`` (the Actor's
``--result-inline-max-bytes``, 64 KiB by default) is written by the simulated
Actor with :func:`~aurora_store.lineage.results.write_result` under its own
``results/<actor id>/`` folder, and the ledger settles the reference; the
Trainer resolves each step's references when it closes the step with the
Trainer's own :class:`~workers.trainer.results.ResultReader` (parallel ranged
reads capped at the recorded size, sha256 checked, objects deleted), so the
bench measures the real code on both sides.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aurora_store.clock import SYSTEM_CLOCK
from aurora_store.coordination.ledger import AcceptedResult
from aurora_store.lineage.results import write_result
from aurora_store.storage import Store, open_store
from workers.trainer.results import ResultReader

__all__ = ["ActorWrites", "TrainerReads", "through_store"]


def through_store(payload_bytes: int, inline_max_bytes: int) -> bool:
    """Whether a payload of this size goes through the store (larger than the threshold)."""
    return payload_bytes > max(0, inline_max_bytes)


class ActorWrites:
    """One worker process's writes: each settled result is written and settled as a reference.

    The payload is random bytes, drawn once per process (hashing real data,
    not a run of one byte that compresses to nothing anywhere on the way).
    """

    def __init__(self, url: str, payload_bytes: int) -> None:
        self.store: Store = open_store(url)
        self.data = os.urandom(payload_bytes)
        self.write_ms: list[float] = []
        self.bytes = 0

    def payload(self, actor: str, step: int, token: int) -> bytes:
        t0 = time.perf_counter()
        ref = write_result(self.store, actor, step, token, self.data)
        self.write_ms.append((time.perf_counter() - t0) * 1e3)
        self.bytes += len(self.data)
        return ref


@dataclass(slots=True)
class TrainerReads:
    """The Trainer's reads of every closed step's references (the Trainer's :class:`ResultReader`)."""

    url: str
    payload_bytes: int
    streams: int = 16
    seconds: float = 0.0
    reader: ResultReader | None = field(default=None)

    def __post_init__(self) -> None:
        self.reader = ResultReader(open_store(self.url), max(self.payload_bytes, 1), SYSTEM_CLOCK, streams=self.streams)

    def resolve(self, step: int, results: Sequence[AcceptedResult]) -> bool:
        """Read and check one closed step's results; True when every one came back whole."""
        assert self.reader is not None
        collected = {r.prompt: r for r in results}
        t0 = time.perf_counter()
        refused = self.reader.resolve(step, collected)
        self.seconds += time.perf_counter() - t0
        return refused == 0 and all(len(r.payload) == self.payload_bytes for r in collected.values())

    def close(self) -> dict[str, Any]:
        """Stop (the deletes in flight finish) and report."""
        assert self.reader is not None
        self.reader.close()
        n, b = self.reader.through_store, self.reader.bytes_through_store
        return {
            "trainer_read_s": self.seconds,
            "trainer_read_mb_per_s": b / 1e6 / self.seconds if self.seconds > 0 else float("inf"),
            "results_read": n,
            "results_refused": sum(self.reader.refused.values()),
        }


def write_summary(write_ms: Sequence[float]) -> dict[str, float]:
    """p50/p99 of the Actors' result writes (ms)."""
    if not write_ms:
        return {"p50_result_write_ms": 0.0, "p99_result_write_ms": 0.0}
    s = sorted(write_ms)
    return {
        "p50_result_write_ms": statistics.median(s),
        "p99_result_write_ms": s[min(len(s) - 1, round(0.99 * (len(s) - 1)))],
    }
