"""The Actor's safe point: between batches, activate what the run needs, and nothing it does not.

:meth:`SafePoint.activate` moves the active version towards the one the run
needs next (:meth:`SafePoint.wanted_version`): staged deltas are applied in
place, a staged whole version is swapped in. Each is checked first against
the state the Trainer recorded for it; one the engine refuses is
quarantined, and what was staged on it dropped. Nothing is hashed here: the
weights are verified by digest afterwards, outside the safe point
(:mod:`workers.actor.verify`), and a version whose weights failed that is
handled at the next safe point (:meth:`SafePoint.wrong_weights`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

from aurora_store import metrics
from aurora_store.errors import ChainError, ModelMismatchError
from workers.actor.context import ActorContext
from workers.actor.fetch import INVALID, Fetcher
from workers.actor.holding import StagedItem
from workers.actor.quarantine import StagedFull
from workers.actor.verify import Job, Verifier

__all__ = ["SafePoint"]

log = logging.getLogger("aurora.actor")


class SafePoint:
    """Activation and its checks. ``reload`` loads the newest usable version again (the boot's
    way in), for an engine left holding weights nobody checked; ``heartbeat`` reports at once."""

    def __init__(
        self,
        ctx: ActorContext,
        fetcher: Fetcher,
        reload: Callable[[], tuple[int, str] | None],
        heartbeat: Callable[[], None],
        verifier: Verifier | None = None,
    ) -> None:
        self.ctx = ctx
        self.fetcher = fetcher
        self.reload = reload
        self.heartbeat = heartbeat
        self.verifier = verifier or Verifier(ctx)

    def wanted_version(self) -> int:
        """The version to run next.

        Stay on the active version while an open step generated on it has
        prompts not yet accepted (a lease that expires comes back to the pool
        and needs someone on this version); then move to the newest version
        that a step or a Commit asks for. With one-step asynchrony this is
        exactly: finish batch b+1 on v_b, then activate v_b+1 for batch b+2.
        """
        c, h = self.ctx, self.ctx.holding
        needed: list[int] = []
        for _, sv, left in c.redis_call(c.ledger.open_step_info, "read open steps"):
            if not left:
                continue
            if sv == h.active:
                h.want = h.active
                return h.active
            if sv > h.active:
                needed.append(sv)
        # The oldest version an open step still needs comes first: skipping it
        # would strand that step's prompts on a version nobody holds.
        h.want = min(needed) if needed else max(h.active, h.commit_seen)
        return h.want

    def activate(self) -> None:
        """Apply staged deltas (or swap in a whole version) up to the version the run needs."""
        c, h = self.ctx, self.ctx.holding
        failed = self.verifier.take_failure()
        if failed is not None:
            self.wrong_weights(failed)
        while h.active < self.wanted_version():
            entry = h.next_for(h.want)
            if entry is None:
                return
            staged = entry.item
            t0 = time.perf_counter()
            try:
                self.fetcher.check_expected(entry.version, entry.state, None)
            except ChainError as e:
                self._refused_state(entry.version, e)
                return
            with h.weights:
                try:
                    if isinstance(staged, StagedFull):
                        self.fetcher.load_full(staged)
                        c.stats.rebootstraps += 1
                        log.info(
                            "%s swapped in v%d (snapshot %d and %d delta(s))",
                            c.cfg.actor_id,
                            staged.version,
                            staged.snapshot,
                            staged.version - staged.snapshot,
                        )
                    else:
                        c.engine.apply(staged)
                except INVALID as e:
                    self._refused_at_activation(staged, e)
                    return
                h.activated(entry.version, entry.state)
                act_s = time.perf_counter() - t0  # the safe point: checks and writes, no digest
            me, v = c.cfg.actor_id, h.active
            self.verifier.activated(v, entry.state, entry.digest)
            c.stats.activations.append((v, entry.stage_s, act_s))
            metrics.active().activated(me, c.cfg.region, v, act_s)
            c.redis_call(partial(c.records.record_activation, me, v, entry.stage_s, act_s), "record an activation")
            c.redis_call(self.heartbeat, "heartbeat")
            log.info("%s activated v%d (staged in %.3fs, applied in %.4fs)", me, v, entry.stage_s, act_s)

    def _refused_at_activation(self, staged: StagedItem, e: BaseException) -> None:
        """The engine refused (or misreported) a staged version: quarantine it, drop what was staged on it.

        The stager then stages again from the active version, at origin. An
        engine left holding unchecked weights (it reports another version
        than the active one) is loaded again from origin before it generates.
        """
        c, h = self.ctx, self.ctx.holding
        kind = "snapshot" if isinstance(staged, StagedFull) and staged.version == staged.snapshot else "delta"
        log.error("%s: refused to activate v%d: %s", c.cfg.actor_id, staged.version, e)
        c.quarantine.failed(kind, staged.version, e)
        h.drop_staged()
        if c.engine.version != h.active:
            got = self.reload()
            if got is not None:
                h.start_at(*got)
                self.verifier.activated(h.active, h.active_state, None, forced=True)

    def wrong_weights(self, failed: Job) -> None:
        """The weights of an active version failed verification (outside the safe point): act on it now.

        Nothing generated on them was settled (the ledger's gate refused it);
        the leases this Actor holds go back to the pool at once, what was
        staged on those weights is dropped, and the engine reaches the run
        again from the store (the boot's way in), to be verified whatever the
        cadence. Wrong twice in a row: the Actor stops with the error.
        """
        c, h = self.ctx, self.ctx.holding
        me = c.cfg.actor_id
        released = c.redis_call(partial(c.ledger.release_actor, me), "release the leases of unverified weights")
        log.error("%s: v%d failed verification; %d prompt(s) released, reaching the run again from the store", me, failed.version, released)
        if self.verifier.failures_in_row >= 2:
            raise ModelMismatchError(
                f"{me}: the weights of v{failed.version} failed verification again right after being reached from the store "
                f"(digest {str(failed.actual)[:23]}…); stopping: check the engine (docs/WORKERS.md, Verification)"
            )
        h.drop_staged()
        got = self.reload()
        if got is not None:
            h.start_at(*got)
            self.verifier.activated(h.active, h.active_state, None, forced=True)
            c.redis_call(self.heartbeat, "heartbeat")

    def _refused_state(self, version: int, e: BaseException) -> None:
        """A staged version is not the Trainer's (its record came after it was staged): drop what was staged.

        Nothing is quarantined: the bytes may be fine at origin. The stager
        stages again from the active version, and now checks each version
        against the record before staging it, so a mirror that forged it
        loses to origin.
        """
        log.error("%s: refused to activate v%d: %s", self.ctx.cfg.actor_id, version, e)
        self.ctx.holding.drop_staged()
