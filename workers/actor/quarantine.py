"""What the Actor's stager refuses to use for a while, and what it holds staged.

- :class:`Quarantine`: versions that failed validation (a damaged or
  truncated object, a manifest that does not parse, a delta on another
  base), each refused until its back-off passes. Fetching a bad version on
  every stager loop (twice a second, per Actor) is an egress storm that
  fixes nothing; a repair at origin is picked up at the next attempt.
- :class:`StagedFull`: a whole version staged for a swap at a safe point
  (the newest snapshot plus deltas), when that is cheaper than replaying
  deltas or the only way left (a delta removed by ``aurora gc``).
- :func:`staged_nbytes`: what a staged item holds in memory, for the bound
  ``max_staged_bytes``.
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aurora_store.clock import Clock
from aurora_store.config import Backoff
from aurora_store.format.checkpoint import StagedDelta

if TYPE_CHECKING:
    import torch

__all__ = ["Quarantine", "StagedFull", "staged_nbytes"]

VersionId = tuple[str, int]
"""(kind, version): ``("delta", 7)`` or ``("snapshot", 5)``."""


@dataclass(slots=True)
class _Entry:
    failures: int
    next_at: float
    reason: str


class Quarantine:
    """Versions that failed validation, with their back-off; thread-safe, timed on ``clock``.

    One log line when a version is quarantined and one when it is used after
    all; a failure of a version already quarantined only lengthens its wait.
    """

    def __init__(self, backoff: Backoff, clock: Clock, log: logging.Logger, rng: random.Random | None = None) -> None:
        self.backoff = backoff
        self.clock = clock
        self.log = log
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._entries: dict[VersionId, _Entry] = {}

    def allowed(self, kind: str, version: int) -> bool:
        """Whether the version may be fetched now (not quarantined, or its wait is over)."""
        with self._lock:
            e = self._entries.get((kind, version))
            return e is None or self.clock.monotonic() >= e.next_at

    def failed(self, kind: str, version: int, error: BaseException) -> float:
        """Record a failed validation; returns the seconds until the next attempt."""
        reason = str(error) or type(error).__name__
        with self._lock:
            e = self._entries.get((kind, version))
            n = 1 if e is None else e.failures + 1
            delay = self.backoff.delay(n - 1, self._rng)
            self._entries[(kind, version)] = _Entry(n, self.clock.monotonic() + delay, reason)
        if n == 1:
            self.log.error(
                "%s %d failed validation (%s: %s); quarantined: not fetched again for %.0fs, then less and less often",
                kind, version, type(error).__name__, _short(reason), delay,
            )
        else:
            self.log.debug("%s %d failed validation again (%d times); next attempt in %.0fs", kind, version, n, delay)
        return delay

    def cleared(self, kind: str, version: int) -> None:
        """The version was fetched and validated: forget it (one log line if it was quarantined)."""
        if not self._entries:  # the common case: no lock taken
            return
        with self._lock:
            e = self._entries.pop((kind, version), None)
        if e is not None:
            self.log.warning("%s %d is valid again after %d failed attempt(s); quarantine lifted", kind, version, e.failures)

    def forget_below(self, version: int) -> None:
        """Forget versions below ``version``: the Actor is past them and will never fetch them."""
        with self._lock:
            for vid in [vid for vid in self._entries if vid[1] < version]:
                del self._entries[vid]

    def blocked(self) -> frozenset[VersionId]:
        """Versions whose wait is not over: a planner routes around them."""
        now = self.clock.monotonic()
        with self._lock:
            return frozenset(vid for vid, e in self._entries.items() if now < e.next_at)

    def versions(self) -> list[int]:
        """Every quarantined version number, ascending (what the heartbeat reports)."""
        with self._lock:
            return sorted({v for _, v in self._entries})


@dataclass(frozen=True, slots=True)
class StagedFull:
    """A whole version staged for a swap at a safe point.

    ``tensors`` are the fused weights of ``version`` (the snapshot with the
    deltas after it applied, checked against each manifest's state); None
    for an engine that reaches a version from the store itself
    (:class:`~workers.engine.protocol.StoreStaging`), which does it at the
    safe point. It continues no particular version (``base_version`` -1):
    it replaces whatever is active.
    """

    version: int
    state: str
    tensors: dict[str, torch.Tensor] | None
    snapshot: int
    """The snapshot it was built from."""
    nbytes: int
    """Bytes fetched to build it."""
    base_version: int = -1
    manifests: tuple[Any, ...] = ()
    """For an engine that reaches the version itself: the chain this Actor checked (the
    snapshot's manifest, then each delta's), handed to the engine so it reads none again."""


def staged_nbytes(item: Any) -> int:
    """Memory a staged item holds (decoded arrays, whole tensors); 0 when it lives elsewhere."""
    if isinstance(item, StagedDelta):
        return sum(e.bits.nbytes + (e.indices.nbytes if e.indices is not None else 0) for e in item.entries)
    if isinstance(item, StagedFull):
        return sum(t.numel() * t.element_size() for t in item.tensors.values()) if item.tensors else 0
    return 0


def _short(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
