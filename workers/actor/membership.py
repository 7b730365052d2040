"""The Actor's record in the ledger: register, heartbeat, report quarantined versions, leave.

The heartbeat thread (:meth:`Membership.run`) reports the active and staged
versions every ``heartbeat_s``; a heartbeat the ledger refuses (this Actor
was reaped, or Redis lost its data) registers it again. A graceful stop
releases every lease at once (:meth:`Membership.leave`).
"""

from __future__ import annotations

import json
import logging

from workers.actor.context import ActorContext

__all__ = ["Membership"]

log = logging.getLogger("aurora.actor")


class Membership:
    """One Actor's ledger record. Its methods make raw Redis calls: callers ride outages."""

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        self._reported: str | None = None
        """The ``quarantined`` field as last written into the actor record."""

    def register(self) -> None:
        c = self.ctx
        c.ledger.register(c.cfg.actor_id, c.cfg.region, c.cfg.engine)
        self._reported = None  # a new record: report everything again

    def release_previous(self) -> int:
        """Release what a previous process with this id held; returns how many prompts went back.

        A process that reuses the id of one that died (restarted before the
        Trainer reaped it): the dead one's leases and unclaimed assignments go
        back to the pool now, not when their leases expire (its tokens are
        not ours to settle).
        """
        return int(self.ctx.ledger.release_actor(self.ctx.cfg.actor_id))

    def heartbeat(self) -> None:
        """Report the active and staged versions (and the quarantined ones); register again if refused."""
        c, h = self.ctx, self.ctx.holding
        me = c.cfg.actor_id
        ok = c.ledger.heartbeat(me, active=h.active, staged=h.staged_version, active_state=h.active_state)
        if not ok and not c.stop.is_set():
            # Reaped (we were silent too long), or Redis lost its state: join again.
            log.warning("%s: heartbeat refused (the ledger lost or reaped this Actor); registering again", me)
            self.register()
            c.ledger.heartbeat(me, active=h.active, staged=h.staged_version, active_state=h.active_state)
            verified = h.verified  # the last digest verified, when it is the active version's (never a hash here)
            if verified is not None and verified[0] == h.active:
                c.records.record_digest(me, *verified)
        q = json.dumps(c.quarantine.versions())
        if q != self._reported and c.ledger.report(me, "quarantined", q):  # never creates a record
            self._reported = q

    def run(self) -> None:
        """The heartbeat thread: one heartbeat every ``heartbeat_s`` until ``stop``; outages are waited out."""
        c = self.ctx
        while not c.clock.wait(c.stop, c.cfg.heartbeat_s):
            with c.redis_dep.guard("heartbeat"):
                self.heartbeat()

    def leave(self) -> None:
        """Release every lease at once; with Redis away they expire instead (one attempt, no wait)."""
        c = self.ctx
        if not c.holding.bootstrapped:
            return  # never bootstrapped, never registered
        try:
            released = c.ledger.leave(c.cfg.actor_id)
        except Exception as e:  # noqa: BLE001 - leaving is best effort: leases expire by themselves
            log.warning("%s could not leave the ledger (%s); its leases expire instead", c.cfg.actor_id, e)
            return
        s = c.stats
        spilled = f", {s.spilled} delta(s) staged from held segments" if s.spilled else ""
        log.info("%s left: %d settled, %d prompt(s) released, rejections %s%s", c.cfg.actor_id, s.settled, released, s.rejected, spilled)
