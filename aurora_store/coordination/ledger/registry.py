"""The Actor registry: join, heartbeat, leave, and reaping the silent.

Records are bounded (:class:`~aurora_store.coordination.ledger.core.LedgerConfig`):
an ``alive`` record expires ``actor_ttl_s`` after its last register or
heartbeat, a ``left`` or ``gone`` one ``departed_ttl_s`` after it was marked.
The ``actors`` set keeps an id until the Trainer's :meth:`ActorRegistry.reap`
finds its record gone; it then releases whatever the id still held and
removes it. Every loop over Actors reads the records, so it touches the live
ones (and the recently departed) only, however many joined over the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aurora_store.coordination.decode import as_int, as_str
from aurora_store.coordination.ledger.core import LedgerCore, _ms
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
        args = [actor, self._now(), _ms(self.config.actor_ttl_s), *fields]
        return int(self._scripts.register(keys=[self.k_actor(actor), self.k_actors], args=args))

    @translate_redis_errors("Ledger.heartbeat")
    def heartbeat(self, actor: str, active: int | None = None, staged: int | None = None, active_state: str | None = None) -> bool:
        """Refresh liveness (and the record's TTL) and report versions.

        False: the ledger considers this Actor gone or left, or its record
        expired (Redis lost it, or the Actor was away past ``actor_ttl_s``):
        register again.
        """
        fields: list[Any] = []
        if active is not None:
            fields += ["active", str(active)]
        if staged is not None:
            fields += ["staged", str(staged)]
        if active_state is not None:
            fields += ["active_state", active_state]
        args = [self._now(), _ms(self.config.actor_ttl_s), *fields]
        return int(self._scripts.heartbeat(keys=[self.k_actor(actor)], args=args)) >= 0

    def _mark(self, actor: str, ttl_ms: int | None, require: str = "", **fields: Any) -> bool:
        """Write ``fields`` into an existing record (never creating one); optionally set its TTL."""
        args: list[Any] = ["" if ttl_ms is None else ttl_ms, require]
        for k, v in fields.items():
            args += [k, v]
        return bool(int(self._scripts.mark_actor(keys=[self.k_actor(actor)], args=args)))

    @translate_redis_errors("Ledger.report")
    def report(self, actor: str, field: str, value: str) -> bool:
        """Write one field of ``actor``'s record (``quarantined``, ...); False when the record is gone.

        Never creates a record (:data:`~aurora_store.coordination.ledger.actor_scripts.MARK_ACTOR`):
        an Actor reaped or expired registers again and then reports everything anew.
        """
        return bool(int(self._scripts.mark_actor(keys=[self.k_actor(actor)], args=["", "", field, value])))

    @translate_redis_errors("Ledger.lease_counts")
    def lease_counts(self) -> dict[str, int]:
        """Leases held per Actor across open steps, counted from the lease hashes.

        Counted rather than stored: a counter would drift when CLAIM returns
        someone else's expired lease to the pool.
        """
        out: dict[str, int] = {}
        steps = self.open_steps()
        if not steps:
            return out
        pipe = self.r.pipeline(transaction=False)
        for v in steps:
            pipe.hvals(self.k_step(v, "lease"))
        for vals in pipe.execute():
            for raw in vals:
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

    def _records(self) -> tuple[list[str], list[dict[Any, Any]]]:
        """Every id of the ``actors`` set and its record (empty when the record is gone), in one round trip."""
        ids = sorted(as_str(x) for x in self.r.smembers(self.k_actors))
        if not ids:
            return [], []
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(self.k_actor(i))
        return ids, list(pipe.execute())

    def _liveness(self) -> tuple[list[str], list[tuple[str | None, int]]]:
        """Every id of the ``actors`` set with its record's (status, heartbeat_ms), in one round trip.

        Status None: the record is gone. Lighter than :meth:`_records` (two fields, no parsing of
        the rest), for what only asks who is alive.
        """
        ids = sorted(as_str(x) for x in self.r.smembers(self.k_actors))
        if not ids:
            return [], []
        pipe = self.r.pipeline(transaction=False)
        for i in ids:
            pipe.hmget(self.k_actor(i), "status", "heartbeat_ms")
        out = [(None if st is None else as_str(st), as_int(hb, 0) or 0) for st, hb in pipe.execute()]
        return ids, out

    @translate_redis_errors("Ledger.actors")
    def actors(self) -> list[ActorRecord]:
        """Every Actor with a record (alive, or departed within ``departed_ttl_s``), by id. Reads only."""
        ids, records = self._records()
        if not ids:
            return []
        counts = self.lease_counts()
        return [actor_from_hash(i, h, counts.get(i, 0)) for i, h in zip(ids, records, strict=True) if h]

    @translate_redis_errors("Ledger.set_tau")
    def set_tau(self, actor: str, tau: float) -> None:
        """The Trainer's throughput estimate of ``actor`` (ignored once its record expired)."""
        self._mark(actor, None, tau=repr(float(tau)))

    @translate_redis_errors("Ledger.leave")
    def leave(self, actor: str) -> int:
        """Graceful leave: release every lease and assignment at once; returns prompts released."""
        # Status first: a claim racing this leave then answers not_alive
        # instead of handing a lease to an Actor that is going away.
        self._mark(actor, _ms(self.config.departed_ttl_s), status="left")
        return self.release_actor(actor)

    @translate_redis_errors("Ledger.release_actor")
    def release_actor(self, actor: str) -> int:
        """Put every lease and unclaimed assignment of ``actor`` back in the pools; returns how many."""
        n = 0
        for v in self.open_steps():
            n += int(
                self._scripts.release(
                    keys=[
                        self.k_step(v, "lease"),
                        self.k_step(v, "exp"),
                        self.k_step(v, "pool"),
                        self.k_assigned(v, actor),
                        self.k_step(v),
                    ],
                    args=[actor],
                )
            )
        return n

    @translate_redis_errors("Ledger.reap")
    def reap(self, heartbeat_timeout_ms: int) -> list[str]:
        """Mark Actors silent for longer than the timeout ``gone`` and release their work.

        Returns the ids marked gone. Also trims the ``actors`` set of ids
        whose record expired, releasing what they still held (an Actor that
        died while no Trainer was reaping), and forgets open steps whose keys
        expired.
        """
        now = self.server_time_ms()
        ids, live = self._liveness()
        gone = []
        for a, (status, heartbeat_ms) in zip(ids, live, strict=True):
            if status is None:
                if int(self._scripts.trim_actor(keys=[self.k_actor(a), self.k_actors], args=[a])):
                    self.release_actor(a)
                continue
            if status == "alive" and now - heartbeat_ms > heartbeat_timeout_ms:
                if self._mark(a, _ms(self.config.departed_ttl_s), "alive", status="gone"):
                    gone.append(a)
                self.release_actor(a)
        self._forget_expired_steps()
        return gone

    def _forget_expired_steps(self) -> None:
        """Drop ids from the ``steps`` zset whose step hash is gone (expired: a crashed Trainer's)."""
        steps = self.open_steps()
        if not steps:
            return
        pipe = self.r.pipeline(transaction=False)
        for v in steps:
            pipe.exists(self.k_step(v))
        stale = [str(v) for v, ok in zip(steps, pipe.execute(), strict=True) if not ok]
        if stale:
            self.r.zrem(self.k_steps, *stale)
