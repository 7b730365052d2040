"""What every part of an Actor is given: its dependencies, its outages, what it holds.

:class:`ActorContext` is built once per Actor (:meth:`ActorContext.connect`
from URLs, or by hand with fakes) and handed to each part's constructor: the
origin store and the mirror's opener, Redis with the ledger and the bus, the
engine (None until the model description is read), the clock, the stop event,
one :class:`~aurora_store.outage.Dependency` per dependency, the run's records,
the quarantine,
the statistics and the shared :class:`~workers.actor.holding.Holding`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.config import Backoff
from aurora_store.coordination.bus import Bus
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.records import RunRecords
from aurora_store.coordination.redisconn import connect
from aurora_store.errors import StoreUnavailable
from aurora_store.outage import Dependency, is_transient
from aurora_store.storage import Store, open_store
from workers.actor.config import ActorConfig, ActorStats
from workers.actor.holding import Holding
from workers.actor.quarantine import Quarantine
from workers.actor.vouched import VouchedLedger
from workers.common import Endpoints
from workers.engine import Engine

__all__ = ["ActorContext", "MirrorOpener"]

log = logging.getLogger("aurora.actor")

T = TypeVar("T")

MirrorOpener = Callable[[], Store]
"""Opens the region's mirror store (``cfg.mirror``) at its first use."""


class ActorContext:
    """One Actor's dependencies and shared state (see the module docstring)."""

    def __init__(
        self,
        ep: Endpoints,
        cfg: ActorConfig,
        origin: Store,
        redis: Any,
        bus_redis: Any,
        clock: Clock = SYSTEM_CLOCK,
        open_mirror: MirrorOpener | None = None,
        engine: Engine | None = None,
    ) -> None:
        self.ep = ep
        if cfg.trust is not None:  # a key may sign several runs: accept this run's versions only
            cfg = dataclasses.replace(cfg, trust=cfg.trust.for_run(ep.run))
        self.cfg = cfg
        self.clock = clock
        self.origin = origin
        """The run's store (every read of it rides out outages through ``store_dep``)."""
        self.redis = redis
        self.bus_redis = bus_redis
        """A second client for the stager's blocking stream reads."""
        self.ledger = VouchedLedger(redis, ep.run)
        """The run's ledger; its settlements wait for the weights to be vouched for (workers.actor.verify)."""
        self.bus = Bus(bus_redis, ep.run)
        self.keys = RunKeys(ep.run)
        self.records = RunRecords(redis, ep.run, self.ledger)
        """The run's records (the Trainer's head, commit and expected states; digests): read, never fenced."""
        self.stop = threading.Event()
        self.stats = ActorStats()
        self.holding = Holding()
        self.open_mirror = open_mirror or _mirror_opener(cfg)
        self._engine = engine
        # One outage per dependency, however many threads hit it (and one budget).
        ob = cfg.outage_backoff
        self.redis_dep = Dependency("Redis", log, cfg.outage_budget_s, clock, ob.initial_s, ob.max_s)
        self.store_dep = Dependency("the store", log, cfg.outage_budget_s, clock, ob.initial_s, ob.max_s)
        self.quarantine = Quarantine(cfg.quarantine, clock, log)

    @classmethod
    def connect(
        cls,
        ep: Endpoints,
        cfg: ActorConfig,
        clock: Clock = SYSTEM_CLOCK,
        *,
        origin: Store | None = None,
        open_mirror: MirrorOpener | None = None,
        engine: Engine | None = None,
    ) -> ActorContext:
        """Open the run's store and Redis from ``ep``'s URLs; ``origin``/``open_mirror``/``engine`` replace what would be built."""
        store = origin if origin is not None else open_store(ep.store, dict(ep.storage_options))
        # Room for the stager's longest blocking read, and as much again for the reply.
        bus_redis = connect(ep.redis, block_s=2 * cfg.stage_block_ms / 1000)
        return cls(ep, cfg, store, connect(ep.redis), bus_redis, clock, open_mirror, engine)

    # -- the engine -------------------------------------------------------------------
    @property
    def has_engine(self) -> bool:
        return self._engine is not None

    @property
    def engine(self) -> Engine:
        """The engine; built by the Actor's boot from the model description (or given)."""
        if self._engine is None:
            raise RuntimeError(f"{self.cfg.actor_id}: no engine yet (prepare() builds it from the model description)")
        return self._engine

    def set_engine(self, engine: Engine) -> None:
        self._engine = engine

    def close_engine(self) -> None:
        """Close the engine, if there is one (an engine with processes of its own ends them)."""
        if self._engine is not None:
            self._engine.close()

    # -- riding out outages -------------------------------------------------------------
    def redis_call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` (a Redis call), retried through a Redis outage until the budget is spent."""
        return self.redis_dep.call(fn, what, self.stop)

    def store_call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` (a store call), retried through a store outage until the budget is spent."""
        return self.store_dep.call(fn, what, self.stop)

    def pauses(self) -> Iterator[float]:
        """Back-off between attempts of a loop that met an outage."""
        ob = self.cfg.outage_backoff
        return Backoff(initial_s=ob.initial_s, max_s=ob.max_s, factor=ob.factor, jitter=ob.jitter).delays()

    def outage(self, e: BaseException, what: str) -> bool:
        """Whether a loop's error is a dependency away for now (recorded on it, to be waited out).

        Raises :class:`~aurora_store.errors.OutageTooLong` past the budget.
        Anything else (a permanent error, a bug) is False: the caller
        re-raises it and the Actor ends.
        """
        if not is_transient(e):
            return False
        (self.store_dep if isinstance(e, StoreUnavailable) else self.redis_dep).failed(e, what)
        return True

    def close(self) -> None:
        """Close the Redis clients."""
        for client in (self.redis, self.bus_redis):
            try:
                client.close()
            except Exception as e:  # noqa: BLE001 - closing is best effort
                log.debug("closing a Redis client: %s", e)


def _mirror_opener(cfg: ActorConfig) -> MirrorOpener:
    def open_configured() -> Store:
        if cfg.mirror is None:
            raise RuntimeError(f"{cfg.actor_id}: no mirror configured")
        from workers.actor.breaker import mirror_store_config  # one retry, short timeouts: origin is behind it

        return open_store(cfg.mirror, dict(cfg.mirror_options), mirror_store_config(cfg.mirror_timeout_s))

    return open_configured
