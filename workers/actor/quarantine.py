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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aurora_store.clock import Clock
from aurora_store.config import Backoff
from aurora_store.format.checkpoint import StagedDelta
from workers.quarantine import QuarantineBook, VersionId

if TYPE_CHECKING:
    import torch

__all__ = ["Quarantine", "StagedFull", "VersionId", "staged_nbytes"]


class Quarantine(QuarantineBook):
    """Versions that failed validation, with their back-off; thread-safe, timed on ``clock``.

    One log line when a version is quarantined and one when it is used after
    all; a failure of a version already quarantined only lengthens its wait.
    """

    def __init__(self, backoff: Backoff, clock: Clock, log: logging.Logger, rng: random.Random | None = None) -> None:
        self.backoff = backoff
        self.log = log
        self._rng = rng or random.Random()
        super().__init__(lambda n: self.backoff.delay(n - 1, self._rng), clock)

    def allowed(self, kind: str, version: int) -> bool:  # type: ignore[override]
        """Whether the version may be fetched now (not quarantined, or its wait is over)."""
        return super().allowed((kind, version))

    def failed(self, kind: str, version: int, error: BaseException) -> float:
        """Record a failed validation; returns the seconds until the next attempt."""
        reason = str(error) or type(error).__name__
        n, delay = self.record((kind, version), reason)
        if n == 1:
            self.log.error(
                "%s %d failed validation (%s: %s); quarantined: not fetched again for %.0fs, then less and less often",
                kind,
                version,
                type(error).__name__,
                _short(reason),
                delay,
            )
        else:
            self.log.debug("%s %d failed validation again (%d times); next attempt in %.0fs", kind, version, n, delay)
        return delay

    def cleared(self, kind: str, version: int) -> None:
        """The version was fetched and validated: forget it (one log line if it was quarantined)."""
        e = self.pop((kind, version))
        if e is not None:
            self.log.warning("%s %d is valid again after %d failed attempt(s); quarantine lifted", kind, version, e.failures)

    def forget_below(self, version: int) -> None:
        """Forget versions below ``version``: the Actor is past them and will never fetch them."""
        self.forget(lambda vid: vid[1] < version)

    def versions(self) -> list[int]:
        """Every quarantined version number, ascending (what the heartbeat reports)."""
        return sorted({v for _, v in self.failures()})


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
    from aurora_store.apply.prepared_delta import PreparedDelta

    if isinstance(item, PreparedDelta):
        return item.nbytes
    if isinstance(item, StagedFull):
        return sum(t.numel() * t.element_size() for t in item.tensors.values()) if item.tensors else 0
    return 0


def _short(text: str, n: int = 300) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."
