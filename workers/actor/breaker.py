"""The per-mirror breaker: a mirror that fails or stalls costs a bounded wait, never the Actor.

The region's mirror is a convenience: origin is the truth, and always there
to read from. So a mirror's faults are kept apart from origin's:

- an error from the mirror (refused, timed out, 5xx through its one retry,
  any store error) opens the breaker, and never touches the store's outage
  budget (that budget is origin's: spending it on the mirror would end the
  Actor while origin answers);
- every attempt at the mirror (one delta; the listing and manifests of a
  catch-up) runs under a deadline of ``mirror_timeout_s``, shared by all the
  requests it makes (:class:`~aurora_store.storage.base.CallBudget`): a slow
  mirror costs at most about that once, not its timeouts times its retries
  for every version;
- while the breaker is open, versions are read from origin; after a
  cool-down (``mirror_timeout_s``, doubling at each failure in a row, up to
  :data:`COOL_DOWN_MAX_S`) the mirror is tried again, and one version it
  delivers closes the breaker.

The mirror's store itself is opened with one retry and connect and read
timeouts of at most ``mirror_timeout_s`` (:func:`mirror_store_config`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.errors import StoreError
from aurora_store.storage import Store, StoreConfig
from aurora_store.storage.base import CallBudget

__all__ = ["COOL_DOWN_MAX_S", "MirrorBreaker", "is_mirror_fault", "mirror_store_config"]

log = logging.getLogger("aurora.actor")

COOL_DOWN_MAX_S = 300.0
"""Longest wait before a mirror that keeps failing is tried again."""


def mirror_store_config(timeout_s: float, base: StoreConfig | None = None) -> StoreConfig:
    """``base`` (default: the environment's) with one retry and connect/read timeouts of at most ``timeout_s``.

    Why: origin's store retries long because there is nowhere else to go; a
    mirror's failure has origin behind it, so it should be found out fast.
    The whole-request deadline (``op_timeout_s``) stays: a snapshot shard read
    from the mirror in a catch-up may take longer than ``timeout_s``.
    """
    base = base or StoreConfig.from_env()
    return dataclasses.replace(
        base,
        retries=min(base.retries, 1),
        backoff_s=min(base.backoff_s, 0.1),
        backoff_max_s=min(base.backoff_max_s, 1.0),
        connect_timeout_s=min(base.connect_timeout_s, timeout_s),
        read_timeout_s=min(base.read_timeout_s, timeout_s),
    )


def is_mirror_fault(e: BaseException) -> bool:
    """Whether ``e``, raised by a read of the mirror, says the mirror is away or broken (rather than
    that the version's bytes are bad, or not there yet)."""
    if isinstance(e, StoreError):
        from aurora_store.errors import ObjectNotFound

        return not isinstance(e, ObjectNotFound)
    return isinstance(e, (OSError, TimeoutError))


class MirrorBreaker:
    """Whether to read the mirror now, and the deadline of each attempt at it (see the module docstring).

    Used by the stager thread; the deadline is read by the store's download threads too.
    """

    def __init__(self, timeout_s: float, clock: Clock = SYSTEM_CLOCK, name: str = "the mirror") -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self.name = name
        self.budget = CallBudget()
        """The deadline of the attempt under way, on the real clock: requests take real time."""
        self.failures = 0
        """Failures in a row (0: closed)."""
        self.openings = 0
        """Times the breaker opened, in all."""
        self._retry_at = float("-inf")

    def attach(self, store: Store) -> Store:
        """Bound ``store`` (the mirror's) by this breaker's attempts; returns it."""
        store.budget = self.budget
        return store

    @property
    def open(self) -> bool:
        """True while the mirror is not to be read (cooling down after a failure)."""
        return self.clock.monotonic() < self._retry_at

    def cool_down_s(self) -> float:
        """The wait after the latest failure: ``timeout_s``, doubling with each failure in a row, capped."""
        return float(min(COOL_DOWN_MAX_S, self.timeout_s * 2 ** max(0, self.failures - 1)))

    @contextlib.contextmanager
    def attempt(self, store: Store) -> Iterator[None]:
        """Bound the reads of ``store`` in the block by ``timeout_s`` in all (nothing for another store)."""
        if store.budget is not self.budget:
            yield
            return
        with self.budget.armed(self.timeout_s):
            yield

    def failed(self, e: BaseException, what: str) -> None:
        """The mirror failed ``what``: read origin until the cool-down has passed.

        Reads of the mirror still under way (prefetches, a second attempt) end at their
        next request: the deadline stays spent until the next attempt.
        """
        self.budget.arm(0.0)
        self.failures += 1
        self.openings += 1
        wait = self.cool_down_s()
        self._retry_at = self.clock.monotonic() + wait
        log.log(
            logging.WARNING if self.failures == 1 else logging.INFO,
            "%s failed %s (%s); reading origin, trying the mirror again in %.0fs",
            self.name,
            what,
            _one_line(e),
            wait,
        )

    def succeeded(self) -> None:
        """The mirror delivered a version: it is read first again."""
        if self.failures:
            log.info("%s delivers again; reading it first", self.name)
        self.failures = 0
        self._retry_at = float("-inf")


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:300]
