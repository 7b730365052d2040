"""What every part of the ledger shares: the client, the run's keys, the clock, the scripts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aurora_store.coordination.ledger.scripts as lua
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger.scripts import LedgerScripts
from aurora_store.coordination.redisconn import translate_redis_errors

__all__ = ["LedgerCore"]


class LedgerCore:
    """The ledger of one run: connection, keys and time. Thread-safe as far as the redis-py client is."""

    REGISTER = lua.REGISTER
    HEARTBEAT = lua.HEARTBEAT
    CLAIM = lua.CLAIM
    SETTLE = lua.SETTLE
    """The settlement predicate (see :mod:`aurora_store.coordination.ledger.scripts`)."""
    RELEASE = lua.RELEASE

    def __init__(self, redis: Any, run: str, clock: Callable[[], int] | None = None) -> None:
        """``redis``: a redis-py client; ``clock``: milliseconds, for tests (default: Redis TIME)."""
        self.r = redis
        self.run = run
        self.keys = RunKeys(run)
        self.p = self.keys.prefix
        self.clock = clock
        self._scripts = LedgerScripts.on(redis)

    # -- keys (docs/PROTOCOL.md; formatted by RunKeys) ----------------------------
    def k_actor(self, actor: str) -> str:
        return self.keys.actor(actor)

    def k_step(self, v: int, part: str = "") -> str:
        return self.keys.step(v, part)

    def k_assigned(self, v: int, actor: str) -> str:
        return self.keys.assigned(v, actor)

    @property
    def k_actors(self) -> str:
        return self.keys.actors

    @property
    def k_steps(self) -> str:
        return self.keys.steps

    @property
    def k_fence(self) -> str:
        return self.keys.fence

    # -- time -------------------------------------------------------------------
    def _now(self) -> str:
        """The ``now`` argument of the scripts: ``""`` lets the server's TIME decide."""
        return "" if self.clock is None else str(int(self.clock()))

    @translate_redis_errors("Ledger.server_time_ms")
    def server_time_ms(self) -> int:
        if self.clock is not None:
            return int(self.clock())
        s, us = self.r.time()
        return int(s) * 1000 + int(us) // 1000

    # -- what both the registry and the steps read ------------------------------
    @translate_redis_errors("Ledger.open_steps")
    def open_steps(self) -> list[int]:
        return sorted(int(x) for x in self.r.zrange(self.k_steps, 0, -1))
