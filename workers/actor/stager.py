"""The Actor's stager thread: follow the run, and stage what it publishes.

:class:`Stager` follows announcements (the region's stream while its Relay
heartbeats with the configured mirror, else origin's), polls the run's head
and commit, and hands each chance to stage to its
:class:`~workers.actor.staging.StagingStrategy` (by default
:class:`~workers.actor.staging.DeltaStaging`). :meth:`Stager.stage_once` is
one such chance, without the thread: tests and benchmarks drive it directly.

Announcements are hints: a silent stream (a Relay that just died, before its
key expires) never stops the stager from staging what exists. An outage of
Redis or the store is waited out (:meth:`~workers.actor.context.ActorContext.outage`);
any other error ends the loop, and the Actor with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aurora_store import metrics
from aurora_store.coordination.bus import COMMIT, SEGMENT, VERSION, BusGap, Event
from workers.actor.context import ActorContext
from workers.actor.fetch import Fetcher
from workers.actor.polled import Polled
from workers.actor.sources import Sources
from workers.actor.staging import StagingStrategy

__all__ = ["Stager"]

log = logging.getLogger("aurora.actor")


class Stager:
    """Follows the run and stages through ``strategy``; :meth:`run` is the thread's body.

    ``between``: called at the top of every round of the loop (a hook for
    work that belongs off the critical path; the Actor passes none).
    """

    def __init__(
        self,
        ctx: ActorContext,
        fetcher: Fetcher,
        sources: Sources,
        strategy: StagingStrategy,
        between: Callable[[], None] | None = None,
    ) -> None:
        self.ctx = ctx
        self.fetcher = fetcher
        self.sources = sources
        self.strategy = strategy
        self.between = between

    def poll(self) -> Polled:
        """The region's Relay mirror URL, the run's head and commit (one round trip; not ridden)."""
        c = self.ctx
        polled = Polled.read(c.records, c.cfg.region)
        c.redis_dep.ok()
        metrics.active().head_seen(c.cfg.actor_id, c.cfg.region, polled.head)
        return polled

    def stage_once(self, polled: Polled | None = None) -> None:
        """Stage what the run has published after the newest staged version, through the strategy.

        ``polled``: a :meth:`poll` just made (else one is made now). Errors
        propagate: the loop sorts outages from the rest.
        """
        self.strategy.stage_available(polled if polled is not None else self.poll())

    def announcement(self, ev: Event, region: str | None, url: str | None) -> None:
        """``--fetch announced``: start the reads an announcement names, from where it says they are (mirror or origin)."""
        early = self.fetcher.announced
        if early is None:
            return
        store = self.sources.source(url)[0] if region is not None else self.ctx.origin
        if ev.type == SEGMENT:
            early.segment(store, ev, self.ctx.holding.staged_version)
        elif ev.type == VERSION:
            early.version(store, ev, self.ctx.holding.staged_version, self.ctx.cfg.trust, self.fetcher.commits)

    def run(self) -> None:
        """The stager thread: until ``stop``, read announcements and stage; outages are waited out."""
        c = self.ctx
        self.sources.wait_for_relay()
        last = "$"
        region = None
        polled: Polled | None = None
        polled_at = float("-inf")
        pauses = c.pauses()
        while not c.stop.is_set():
            try:
                if self.between is not None:
                    self.between()
                if polled is None:
                    polled, polled_at = self.poll(), c.clock.monotonic()
                new_region = c.cfg.region if self.sources.trusted(polled.relay_url) else None
                if new_region != region or last == "$":
                    # Source changed (Relay up or down): start from the newest entry.
                    last = c.bus.tail_id(new_region)
                    region = new_region
                    self.stage_once(polled)
                events = c.bus.read(last, block_ms=c.cfg.stage_block_ms, region=region)
                now = c.clock.monotonic()
                for ev in events:
                    last = ev.id
                    if ev.type == COMMIT:
                        c.holding.commit_seen = max(c.holding.commit_seen, ev.version)
                    elif ev.type == SEGMENT and region is not None:
                        self.sources.relay_progress(ev.version, now)  # the Relay is copying it
                    self.announcement(ev, region, polled.relay_url)
                if (
                    self.fetcher.announced is not None
                    and events
                    and all(ev.type == SEGMENT for ev in events)
                    and now - polled_at < c.cfg.stage_block_ms / 1000
                ):
                    # Only segments of a version still being published, and the run's head read
                    # moments ago: back to the stream at once, so the next announcement starts its
                    # download one round trip sooner (on a far link a poll is one more round trip,
                    # queued behind the segments on the wire). The version's own announcement, a
                    # quiet stream, or a poll older than one block still poll as before.
                    continue
                polled = self.poll()
                polled_at = c.clock.monotonic()
                # Announcements are hints: a silent stream (a Relay that just died,
                # before its key expires) must not stop us from staging what exists,
                # nor from activating what the Trainer committed.
                if polled.commit is not None:
                    c.holding.commit_seen = max(c.holding.commit_seen, polled.commit)
                if events or (polled.head is not None and polled.head > c.holding.staged_version):
                    self.stage_once(polled)
                pauses = c.pauses()
            except BusGap:
                last = "$"
            except Exception as e:  # noqa: BLE001 - sorted: outages are waited out, the rest ends the Actor
                if not c.outage(e, "staging"):
                    raise
                c.clock.wait(c.stop, next(pauses))
                last, polled = "$", None
