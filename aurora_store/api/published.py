"""What :class:`~aurora_store.api.publisher.Publisher` returns, and its small helpers."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from aurora_store.coordination.bus import SEGMENT, Bus
from aurora_store.lineage.publish import SegmentEvent

__all__ = ["Published", "WaitedFor", "announce_segments", "run_name_of", "same_weights"]


@dataclass(frozen=True, slots=True)
class Published:
    """What one :meth:`Publisher.publish` wrote."""

    version: int
    state: str
    """The version's ``state`` digest (FORMAT.md §4): names its exact weights."""
    kind: str
    """``snapshot`` (version 0, or a full version on request) or ``delta``."""
    bytes: int
    """Bytes written to the store (a delta and its snapshot, when both)."""
    changed: int
    """Elements that changed (deltas; every element for version 0)."""
    density: float
    """``changed`` over all elements."""
    seconds: float
    weights_digest: str | None
    """The tree digest (FORMAT.md §4.1) of the weights, at the versions hashed: version 0,
    snapshots, those asked for; None elsewhere (the manifest carries none)."""
    snapshot: bool = False
    """A snapshot was written at this version (besides the delta); with background
    snapshots: one was started (``on_snapshot`` tells how it ended)."""
    snapshot_bytes: int = 0
    """Of ``bytes``, those of that snapshot (0 while it is written in the background)."""
    digest_s: float = 0.0
    """Seconds :meth:`Publisher.publish` waited for the weights digest (0 where none was computed)."""


def announce_segments(bus: Bus) -> Callable[[SegmentEvent], None]:
    """An ``on_segment`` callback announcing each durable segment on the run's stream (a Relay copies it at once)."""

    def announce(ev: SegmentEvent) -> None:
        bus.announce(SEGMENT, ev.version, index=ev.index, key=ev.key, bytes=ev.bytes, sha256=ev.sha256)

    return announce


def run_name_of(store_url: str) -> str:
    """A run name from a run root URL: its last path component (``s3://b/runs/r1`` -> ``r1``)."""
    name = store_url.rstrip("/").rsplit("/", 1)[-1]
    return name.split("://", 1)[-1] or "run"


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two sets of bf16 weights are equal (the same tensors, or equal bytes)."""
    if a is b:
        return True
    return a.keys() == b.keys() and all(a[n] is b[n] or (a[n].shape == b[n].shape and torch.equal(a[n], b[n])) for n in a)


class WaitedFor:
    """A future's result as a call, counting the seconds callers waited for it (``waited``).

    Why: a digest hashed on its own thread overlaps the delta's upload; what the
    step pays is only the wait once the manifest needs it.
    """

    def __init__(self, fut: Future[str]) -> None:
        self.fut = fut
        self.waited = 0.0

    def __call__(self) -> str:
        t = time.perf_counter()
        try:
            return self.fut.result()
        finally:
            self.waited += time.perf_counter() - t
