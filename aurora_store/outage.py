"""Riding out a dependency that is away for a while: Redis, the object store.

Every worker (Trainer, Actor, Relay) talks to two dependencies it does not
own. Either may be unreachable for a while: a Redis restart or failover, an
S3 endpoint that times out, a network partition. The rule (docs/FAILURES.md):

- only *transient* failures are waited out (:func:`is_transient`): Redis
  refused, timed out or loading (:class:`~aurora_store.errors.RedisUnavailable`),
  a store that did not answer through its own retries
  (:class:`~aurora_store.errors.StoreUnavailable`), and the raw socket errors
  beneath them. Everything else (bad credentials, a missing bucket, a
  refused version, a bug) is an answer: it propagates at once;
- one log line when an outage starts and one when it ends, however many
  threads hit it and however many retries it takes;
- the wait between attempts backs off exponentially with jitter
  (tenacity's ``wait_exponential_jitter``), capped;
- after the *outage budget* (``--outage-budget-s``, env
  :data:`OUTAGE_BUDGET_ENV`, default :data:`DEFAULT_OUTAGE_BUDGET_S`) the
  outage is no longer "a while": :class:`~aurora_store.errors.OutageTooLong`,
  which a worker turns into a one-line error and a non-zero exit.

:class:`Dependency` holds the state of one dependency for one process and is
shared by its threads, so an outage seen by the heartbeat thread and the
main loop is one outage, with one budget.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

import tenacity

from aurora_store import metrics
from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.config import Switch
from aurora_store.errors import (
    AuroraError,
    ConfigError,
    OutageTooLong,
    RedisUnavailable,
    StoreUnavailable,
)

__all__ = [
    "DEFAULT_OUTAGE_BUDGET_S",
    "OUTAGE_BUDGET_ENV",
    "Dependency",
    "is_transient",
    "riding",
    "outage_budget_s",
]

T = TypeVar("T")

#: How long a worker waits for a dependency before it gives up (seconds).
DEFAULT_OUTAGE_BUDGET_S = 900.0
#: The environment variable every worker reads it from (``--outage-budget-s`` wins).
OUTAGE_BUDGET_ENV = "AURORA_OUTAGE_BUDGET_S"


#: The budget as read from the environment by the library's own entry points (``Publisher``,
#: ``Follower``); the workers declare it as an option of their configs (docs/OPTIONS.md).
OUTAGE_BUDGET = Switch(
    OUTAGE_BUDGET_ENV,
    float,
    DEFAULT_OUTAGE_BUDGET_S,
    "give up (exit 1, one line) once a dependency has been unreachable this long (seconds)",
)


def outage_budget_s(given: float | None = None, environ: Mapping[str, str] | None = None) -> float:
    """The outage budget: ``given``, else :data:`OUTAGE_BUDGET_ENV`, else the default."""
    if given is None:
        given = float(OUTAGE_BUDGET.get(environ))
    if given <= 0:
        raise ConfigError(f"the outage budget must be > 0 seconds, got {given}")
    return float(given)


def is_transient(e: BaseException) -> bool:
    """Whether ``e`` means "a dependency is away for now", worth waiting out.

    Aurora's own :class:`RedisUnavailable` and :class:`StoreUnavailable`;
    redis-py's connection and timeout errors and the builtin
    ``ConnectionError``/``TimeoutError`` when raised by code that called a
    client directly. Any other :class:`AuroraError` is an answer.
    """
    if isinstance(e, (RedisUnavailable, StoreUnavailable)):
        return True
    if isinstance(e, AuroraError):
        return False
    try:
        import redis.exceptions as rx
    except ImportError:  # pragma: no cover - redis is a dependency
        rx = None  # type: ignore[assignment]
    if rx is not None and isinstance(e, (rx.ConnectionError, rx.TimeoutError, rx.BusyLoadingError)):
        return not isinstance(e, getattr(rx, "AuthenticationError", ()))
    # Redis Cluster: no master for a slot yet (CLUSTERDOWN, TRYAGAIN), a failover under way.
    if rx is not None and isinstance(e, (rx.ClusterDownError, rx.TryAgainError, rx.SlotNotCoveredError)):
        return True
    return isinstance(e, (ConnectionError, TimeoutError))


def _describe(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class Dependency:
    """One dependency of one process, as its threads see it: up, or away since when.

    ``name`` ("Redis", "the store") goes into the log lines; ``log`` is the
    worker's logger. ``initial_s`` and ``max_s`` shape the back-off between
    attempts (exponential with jitter, capped). Thread-safe.
    """

    def __init__(
        self,
        name: str,
        log: logging.Logger,
        budget_s: float = DEFAULT_OUTAGE_BUDGET_S,
        clock: Clock = SYSTEM_CLOCK,
        initial_s: float = 0.2,
        max_s: float = 10.0,
    ) -> None:
        if budget_s <= 0 or initial_s <= 0 or max_s < initial_s:
            raise ConfigError(f"{name}: budget_s and initial_s must be > 0 and max_s >= initial_s")
        self.name = name
        self.log = log
        self.budget_s = budget_s
        self.clock = clock
        self.initial_s = initial_s
        self.max_s = max_s
        self._lock = threading.Lock()
        self._since: float | None = None
        self._outages = 0
        metrics.active().outage(name, False)  # the series exists (0) before any outage

    # -- state ------------------------------------------------------------------
    @property
    def away(self) -> bool:
        """Whether an outage is in progress."""
        return self._since is not None

    @property
    def outages(self) -> int:
        """Outages seen so far (each counted once, at its start)."""
        return self._outages

    def away_for_s(self) -> float:
        """Seconds since the current outage began (0 when up)."""
        since = self._since
        return 0.0 if since is None else max(0.0, self.clock.monotonic() - since)

    def failed(self, e: BaseException, what: str = "") -> None:
        """Record a transient failure; logs the start of an outage once.

        Raises :class:`OutageTooLong` once the outage has lasted longer than the budget.
        """
        with self._lock:
            now = self.clock.monotonic()
            if self._since is None:
                self._since = now
                self._outages += 1
                self.log.warning(
                    "%s unreachable%s: %s; waiting for it (up to %.0fs)",
                    self.name,
                    f" ({what})" if what else "",
                    _describe(e),
                    self.budget_s,
                )
                metrics.active().outage(self.name, True, started=True)
            away = now - self._since
        if away > self.budget_s:
            raise OutageTooLong(self.name, away, self.budget_s, _describe(e)) from e

    def ok(self) -> None:
        """Record a success; logs the end of an outage once."""
        if self._since is None:  # the common case: no lock taken
            return
        with self._lock:
            if self._since is None:
                return
            away = self.clock.monotonic() - self._since
            self._since = None
            metrics.active().outage(self.name, False)  # under the lock: never after a new outage's 1
        self.log.warning("%s reachable again after %.1fs", self.name, away)

    # -- calling through it -------------------------------------------------------
    def call(self, fn: Callable[[], T], what: str = "", stop: threading.Event | None = None) -> T:
        """``fn()``, retried while it fails transiently, until the budget is spent.

        A permanent error propagates at once. If ``stop`` is set during a wait,
        the last transient error is raised (the caller is shutting down).
        """
        stop = stop if stop is not None else threading.Event()
        wait = tenacity.wait_exponential_jitter(multiplier=self.initial_s, max=self.max_s, jitter=self.initial_s)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_transient),
            stop=lambda rs: stop.is_set(),
            wait=wait,
            sleep=lambda s: None if self.clock.wait(stop, s) else None,
            before_sleep=lambda rs: self.failed(rs.outcome.exception(), what),  # type: ignore[union-attr,arg-type]
            reraise=True,
        )
        out = retrying(fn)
        self.ok()
        return out

    def guard(self, what: str = "") -> _Guard:
        """``with dep.guard("heartbeat"):`` run a body once: a transient failure is
        recorded (and swallowed), a success ends an outage; a permanent error propagates.

        For periodic work that is simply tried again next period (heartbeats,
        announcements that are hints). ``OutageTooLong`` propagates.
        """
        return _Guard(self, what)


class _Guard:
    __slots__ = ("dep", "what", "failed")

    def __init__(self, dep: Dependency, what: str) -> None:
        self.dep = dep
        self.what = what
        self.failed = False

    def __enter__(self) -> _Guard:
        return self

    def __exit__(self, tp: type[BaseException] | None, e: BaseException | None, tb: object) -> bool:
        if e is None:
            self.dep.ok()
            return False
        if not is_transient(e):
            return False
        self.failed = True
        self.dep.failed(e, self.what)
        return True


class _Riding:
    """A proxy whose method calls go through :meth:`Dependency.call` (see :func:`riding`)."""

    __slots__ = ("_target", "_dep", "_stop")
    _target: object
    _dep: Dependency
    _stop: threading.Event | None

    def __init__(self, target: object, dep: Dependency, stop: threading.Event | None) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_dep", dep)
        object.__setattr__(self, "_stop", stop)

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._target, name)
        if not callable(attr) or name.startswith("_"):
            return attr
        dep, stop, what = self._dep, self._stop, f"{type(self._target).__name__}.{name}"

        def call(*args: object, **kwargs: object) -> object:
            return dep.call(lambda: attr(*args, **kwargs), what, stop)

        return call

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._target, name, value)

    def __repr__(self) -> str:
        return f"riding({self._target!r}, {self._dep.name})"


def riding(target: T, dep: Dependency, stop: threading.Event | None = None) -> T:
    """``target`` (a store, a ledger, a Redis client) whose public method calls ride out ``dep``'s outages.

    Each call is retried whole while it fails transiently, so it must be safe
    to repeat: true of Aurora's create-only store writes (a repeat reads back
    equal bytes), the ledger's scripts (idempotent by design) and plain Redis
    reads and sets. Attributes that are not methods pass through; so do
    private methods.
    """
    return _Riding(target, dep, stop)  # type: ignore[return-value]
