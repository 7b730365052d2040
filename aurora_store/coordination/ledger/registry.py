"""The Actor registry: join, heartbeat, leave, and reaping the silent."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aurora_store.coordination.decode import as_str
from aurora_store.coordination.ledger.core import LedgerCore
from aurora_store.coordination.ledger.records import ActorRecord, actor_from_hash, lease_holder
from aurora_store.coordination.redisconn import translate_redis_errors
from aurora_store.errors import ConfigError

__all__ = ["ActorRegistry", "check_actor_id"]


def check_actor_id(actor: str) -> str:
    """``actor`` itself if it can be a ledger id (lease values are ``actor|token|…``)."""
    if not actor or "|" in actor or len(actor) > 200:
        raise ConfigError(f"actor id {actor!r} must be 1-200 characters without '|'")
    return actor


class ActorRegistry(LedgerCore):
    """Actors of the run, their versions and liveness (``actor:{id}`` hashes, the ``actors`` set)."""

    _check_id = staticmethod(check_actor_id)

    @translate_redis_errors("Ledger.register")
    def register(self, actor: str, region: str = "default", engine: str = "torch", tau: float | None = None) -> int:
        """Join (or rejoin) the run. Returns the server time (ms)."""
        check_actor_id(actor)
        fields: list[Any] = ["region", region, "engine", engine, "active", "", "staged", "", "active_state", ""]
        if tau is not None:
            fields += ["tau", repr(float(tau))]
        return int(self._scripts.register(keys=[self.k_actor(actor), self.k_actors], args=[actor, self._now(), *fields]))

    @translate_redis_errors("Ledger.heartbeat")
    def heartbeat(self, actor: str, active: int | None = None, staged: int | None = None, active_state: str | None = None) -> bool:
        """Refresh liveness and report versions. False: the ledger considers this Actor gone or left."""
        fields: list[Any] = []
        if active is not None:
            fields += ["active", str(active)]
        if staged is not None:
            fields += ["staged", str(staged)]
        if active_state is not None:
            fields += ["active_state", active_state]
        return int(self._scripts.heartbeat(keys=[self.k_actor(actor)], args=[self._now(), *fields])) >= 0

    @translate_redis_errors("Ledger.lease_counts")
    def lease_counts(self) -> dict[str, int]:
        """Leases held per Actor across open steps, counted from the lease hashes.

        Counted rather than stored: a counter would drift when CLAIM returns
        someone else's expired lease to the pool.
        """
        out: dict[str, int] = {}
        for v in self.open_steps():
            for raw in self.r.hvals(self.k_step(v, "lease")):
                a = lease_holder(raw)
                out[a] = out.get(a, 0) + 1
        return out

    @translate_redis_errors("Ledger.actor")
    def actor(self, actor: str, lease_counts: Mapping[str, int] | None = None) -> ActorRecord | None:
        h = self.r.hgetall(self.k_actor(actor))
        if not h:
            return None
        counts = self.lease_counts() if lease_counts is None else lease_counts
        return actor_from_hash(actor, h, counts.get(actor, 0))

    @translate_redis_errors("Ledger.actors")
    def actors(self) -> list[ActorRecord]:
        ids = sorted(as_str(x) for x in self.r.smembers(self.k_actors))
        counts = self.lease_counts()
        return [a for a in (self.actor(i, counts) for i in ids) if a is not None]

    @translate_redis_errors("Ledger.set_tau")
    def set_tau(self, actor: str, tau: float) -> None:
        self.r.hset(self.k_actor(actor), "tau", repr(float(tau)))

    @translate_redis_errors("Ledger.leave")
    def leave(self, actor: str) -> int:
        """Graceful leave: release every lease and assignment at once; returns prompts released."""
        # Status first: a claim racing this leave then answers not_alive
        # instead of handing a lease to an Actor that is going away.
        self.r.hset(self.k_actor(actor), "status", "left")
        return self.release_actor(actor)

    @translate_redis_errors("Ledger.release_actor")
    def release_actor(self, actor: str) -> int:
        """Put every lease and unclaimed assignment of ``actor`` back in the pools; returns how many."""
        n = 0
        for v in self.open_steps():
            n += int(
                self._scripts.release(
                    keys=[self.k_step(v, "lease"), self.k_step(v, "exp"), self.k_step(v, "pool"), self.k_assigned(v, actor)],
                    args=[actor],
                )
            )
        return n

    @translate_redis_errors("Ledger.reap")
    def reap(self, heartbeat_timeout_ms: int) -> list[str]:
        """Mark Actors silent for longer than the timeout ``gone`` and release their work."""
        now = self.server_time_ms()
        gone = []
        for a in self.actors():
            if a.status == "alive" and now - a.heartbeat_ms > heartbeat_timeout_ms:
                self.r.hset(self.k_actor(a.actor), "status", "gone")
                self.release_actor(a.actor)
                gone.append(a.actor)
        return gone
