"""How versions become staged: the Protocols a stager takes, and the real strategy, by deltas.

- :class:`StagingStrategy`: what the stager calls when the run may have
  moved (``stage_available``); :class:`DeltaStaging` is the Actor's own,
  and a benchmark plugs in another (whole snapshots, or nothing fetched);
- :class:`StagedObserver`: told of each version staged (benchmarks record
  where it came from and what it cost).

:class:`DeltaStaging` stages every committed delta in order, by its manifest
key (no listing: on a far link every request is a round trip), from the
region's mirror when a Relay heartbeats, else from origin (:mod:`~workers.actor.sources`).
Far behind, it plans first (:meth:`DeltaStaging.catch_up`): replay, or a
whole version from a snapshot, by the bytes each fetches.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from aurora_store import metrics
from aurora_store.errors import AuroraError, ChainError, VersionNotFound
from aurora_store.lineage.fetch import ManifestReader
from aurora_store.lineage.plan import plan_chain, scan_versions
from aurora_store.storage import Store
from workers.actor.breaker import is_mirror_fault
from workers.actor.context import ActorContext
from workers.actor.fetch import INVALID, Fetcher, Refused
from workers.actor.holding import Staged
from workers.actor.polled import Polled
from workers.actor.quarantine import StagedFull
from workers.actor.sources import Sources
from workers.actor.verify import record_digest_of

__all__ = ["DeltaStaging", "StagedObserver", "StagingStrategy"]

log = logging.getLogger("aurora.actor")


@runtime_checkable
class StagingStrategy(Protocol):
    """What the stager runs whenever the run may have moved: stage what is available, in order.

    Why a Protocol: how a version becomes staged is what benchmarks vary
    (deltas, whole snapshots, nothing fetched at all); the stager's loop,
    its outages and its stream reading stay the Actor's own.
    """

    def stage_available(self, polled: Polled) -> None:
        """Stage every version after the newest staged one that ``polled`` (a poll just made) allows."""
        ...


@runtime_checkable
class StagedObserver(Protocol):
    """Told, in the stager thread, of each version staged."""

    def staged(self, version: int, nbytes: int, seconds: float, from_mirror: bool) -> None: ...


class DeltaStaging:
    """The Actor's staging strategy: deltas in order, a whole version when that is cheaper or the only way."""

    def __init__(self, ctx: ActorContext, fetcher: Fetcher, sources: Sources, observers: Sequence[StagedObserver] = ()) -> None:
        self.ctx = ctx
        self.fetcher = fetcher
        self.sources = sources
        self.observers = tuple(observers)
        self._delta_bytes: deque[int] = deque(maxlen=8)
        """Bytes of the last deltas staged."""
        self._replay_until = -1
        """A catch-up plan chose replay up to here: no new plan before it is reached."""
        self._manifests: ManifestReader | None = None
        """Manifests read by the last plan, reused by the replay that follows it."""
        self._replan_at = 0.0
        self._replan_failures = 0
        self._stuck_at: int | None = None
        """The version no plan could reach: not looked for again before ``_replan_at``."""
        self._full_said = False

    def _told(self, version: int, nbytes: int, seconds: float, from_mirror: bool) -> None:
        for o in self.observers:
            o.staged(version, nbytes, seconds, from_mirror)

    def room(self) -> bool:
        """Whether the stager may fetch another version (``max_staged_bytes``; one always fits)."""
        held = self.ctx.holding.staged_bytes()
        if held < self.ctx.cfg.max_staged_bytes:
            self._full_said = False
            return True
        if not self._full_said:
            log.info("%s: %d MiB staged (the limit); fetching more once activation frees room", self.ctx.cfg.actor_id, held >> 20)
            self._full_said = True
        return False

    def stage_available(self, polled: Polled) -> None:
        """Stage every delta after ``staged_version`` that is committed, in order.

        The mirror serves while it has each version; one it lacks is waited
        for within the grace (:meth:`Sources.mirror_missing`), then read from
        origin. A mirror that errs or does not deliver within ``mirror_timeout_s``
        opens its breaker (:mod:`workers.actor.breaker`): that version and the
        next ones come from origin until the cool-down has passed, and the
        fault never counts against origin's outage budget. A delta that is gone though the run's head is past it
        (``aurora gc``) breaks the chain: the Actor re-bootstraps from a
        snapshot. A delta that fails validation at origin is quarantined,
        and a snapshot past it is looked for. A store outage at origin
        propagates (:class:`~aurora_store.errors.StoreUnavailable`): the
        stager loop waits it out.
        """
        c, h = self.ctx, self.ctx.holding
        head = polled.head
        mirror, region = self.sources.source(polled.relay_url)
        v = h.staged_version + 1
        store = mirror
        while not c.stop.is_set() and (head is None or v <= head):
            if self._stuck_at == v and c.clock.monotonic() < self._replan_at:
                return  # no way through yet: not a request until the back-off passes
            if not self.room():
                return
            if not c.quarantine.allowed("delta", v):
                self.catch_up(c.origin, head, broken=True)
                return
            if store is mirror and self._behind(head):
                try:
                    caught = self.catch_up(mirror, head)
                except Exception as e:  # noqa: BLE001 - a mirror's fault is the breaker's; anything else propagates
                    if mirror is c.origin or not is_mirror_fault(e):
                        raise
                    self.sources.mirror_failed(e, f"the catch-up to v{head}")
                    mirror = store = c.origin  # the breaker is open: origin for the rest of this round
                    continue
                if caught:
                    v, store = h.staged_version + 1, mirror
                    continue
            t0 = time.perf_counter()
            try:
                with self.sources.breaker.attempt(store):  # the mirror's time for this version, in all
                    m, staged = self.fetcher.fetch_delta(store, v, h.staged_state, self._manifests)
                self.fetcher.check_expected(v, m.state, store)
                staged = self.fetcher.prepared(staged)
            except VersionNotFound:
                if store is c.origin:
                    if head is not None and v <= head:
                        # Committed (the head is past it) yet gone: retention removed it, or
                        # it was never there. Replay cannot go on; a snapshot past it can.
                        self.catch_up(c.origin, head, broken=True)
                    return  # else not committed (yet)
                if not self.sources.mirror_missing(v, region):
                    return
                store = c.origin
                continue
            except (AuroraError, OSError) as e:
                if store is not c.origin:
                    if is_mirror_fault(e):
                        # Away, stalled or broken: never origin's outage budget, and origin until the cool-down.
                        self.sources.mirror_failed(e, f"v{v}")
                        mirror = c.origin
                    else:
                        log.warning("stage v%d from mirror failed (%s); trying origin", v, e)
                    store = c.origin
                    continue
                if isinstance(e, INVALID):
                    c.quarantine.failed("delta", v, e)
                    self.catch_up(c.origin, head, broken=True)
                    return
                raise  # the store is away (waited out by the caller), or a permanent error
            from_mirror = store is not c.origin
            if not from_mirror:
                c.store_dep.ok()
            c.quarantine.cleared("delta", v)
            self.sources.staged(v, from_mirror, region)
            h.stage(Staged(staged, m.state, time.perf_counter() - t0, record_digest_of(m)))
            self._delta_bytes.append(m.total_bytes)
            if v >= self._replay_until:
                self._manifests = None  # the planned replay is done
            metrics.active().staged(
                c.cfg.actor_id, c.cfg.region, v, "delta", m.total_bytes, "mirror" if from_mirror else "origin", time.perf_counter() - t0
            )
            self._told(v, m.total_bytes, time.perf_counter() - t0, from_mirror)
            v += 1
            store = mirror  # the next version: the region's copy first, again

    def _behind(self, head: int | None) -> bool:
        """Whether replaying to ``head`` might cost about as much as a whole version: then plan.

        Planning lists the store and reads manifests, round trips a delta or
        two behind never needs: a delta is a small fraction of a snapshot.
        Without a snapshot's size to compare with (no bootstrap from one),
        there is nothing to weigh.
        """
        staged, full = self.ctx.holding.staged_version, self.fetcher.full_bytes
        if head is None or full is None or staged < self._replay_until:
            return False
        lag = head - staged
        if lag < 2:
            return False
        per_delta = max(self._delta_bytes) if self._delta_bytes else None
        return per_delta is None or 2 * lag * per_delta >= full

    def catch_up(self, store: Store, head: int | None, broken: bool = False) -> bool:
        """Plan the way from ``staged_version`` to the run by bytes; stage a whole version when that wins.

        Returns True when a whole version was staged. ``broken``: replay
        cannot go on (a delta gone or quarantined); with no way through
        either, the plan is tried again after a back-off, logged once.
        """
        c, h = self.ctx, self.ctx.holding
        now = c.clock.monotonic()
        if head is None or now < self._replan_at:
            return False
        # A mirror's listing and manifests within its time for one attempt; its shards, if a
        # snapshot is chosen, within its per-request timeouts (a snapshot may take longer).
        with self.sources.breaker.attempt(store):
            index = scan_versions(store).without(c.quarantine.blocked())
            # The version the run needs next when this Actor is behind it, else the head.
            goal = h.want if h.staged_version < h.want < head else head
            reachable = [v for v in index.deltas | index.snapshots if h.staged_version < v <= goal]
            if not reachable:
                return self._no_way(broken, f"no version after v{h.staged_version} up to v{goal} at {store.url}")
            target = max(reachable)
            reader = self.fetcher.reader(store)
            try:
                plan = plan_chain(index, target, held=h.staged_version, cost=reader.cost)
            except (ChainError, VersionNotFound) as e:
                return self._no_way(broken, str(e))
        self._replan_failures, self._stuck_at = 0, None
        if plan.snapshot is None:
            self._replay_until, self._manifests = target, reader
            return False
        if not self.room():
            return False
        log.info(
            "%s: catching up from v%d to v%d through snapshot %d (%d bytes%s)",
            c.cfg.actor_id,
            h.staged_version,
            target,
            plan.snapshot,
            plan.bytes or 0,
            "; the chain is broken" if broken else ", fewer than replaying the deltas",
        )
        t0 = time.perf_counter()
        try:
            full = self.fetcher.stage_full(store, plan, reader)
        except Refused as r:
            if store is not c.origin:
                # The region's copy is bad, not necessarily origin's: replay, which
                # falls back to origin version by version.
                log.warning("%s: catch-up from the mirror failed (%s); replaying deltas instead", c.cfg.actor_id, r)
                self._replay_until = target
                return False
            c.quarantine.failed(r.kind, r.version, r.error)
            return False
        except VersionNotFound:
            return False  # removed while we read it: plan again next time
        if store is c.origin:
            c.store_dep.ok()
        h.stage_whole(Staged(full, full.state, time.perf_counter() - t0, _whole_digest(full, reader)))
        c.quarantine.forget_below(full.version + 1)
        from_mirror = store is not c.origin
        metrics.active().staged(
            c.cfg.actor_id,
            c.cfg.region,
            full.version,
            "snapshot",
            full.nbytes,
            "mirror" if from_mirror else "origin",
            time.perf_counter() - t0,
        )
        self._told(full.version, full.nbytes, time.perf_counter() - t0, from_mirror)
        return True

    def _no_way(self, broken: bool, why: str) -> bool:
        if not broken:
            return False  # replay goes on as before
        c = self.ctx
        self._replan_failures += 1
        delay = c.cfg.quarantine.delay(self._replan_failures - 1)
        self._replan_at = c.clock.monotonic() + delay
        self._stuck_at = c.holding.staged_version + 1
        if self._replan_failures == 1:
            log.error(
                "%s: stuck at v%d: %s; looking again in %.0fs, then less and less often",
                c.cfg.actor_id,
                c.holding.staged_version,
                why,
                delay,
            )
        return False


def _whole_digest(full: StagedFull, reader: ManifestReader) -> str | None:
    """The ``weights_digest`` of a whole version's record: its chain's last manifest (read for the
    plan already); None when it carries none or cannot be read now (the Trainer's record is tried then)."""
    if full.manifests:
        return record_digest_of(full.manifests[-1])
    try:
        return record_digest_of(reader.get("delta" if full.version > full.snapshot else "snapshot", full.version))
    except (AuroraError, OSError):
        return None
