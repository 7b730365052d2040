"""An Actor: bootstrap, stage in the background, activate at safe points, generate, settle.

Three threads (docs/WORKERS.md):

- main: at each safe point (between batches) activate staged versions that
  an open step or a Commit asks for (:class:`~workers.actor.safepoint.SafePoint`);
  claim leases of steps on the active version, generate, settle with (active
  version, its state digest) (:class:`~workers.actor.work.WorkLoop`);
- stager (:class:`~workers.actor.stager.Stager`): follow announcements and
  the run's head, and stage what it publishes through a
  :class:`~workers.actor.staging.StagingStrategy` (by default
  :class:`~workers.actor.staging.DeltaStaging`: deltas from the region's
  mirror or origin, a whole version when cheaper or the only way);
- heartbeat (:class:`~workers.actor.membership.Membership`): report active
  and staged versions (and quarantined ones) every ``heartbeat_s``;
- verify (:class:`~workers.actor.verify.Verifier`): check the engine's
  weights against the digest a version's record carries, outside the safe
  point; the ledger settles nothing generated on a version before it passed.

What the threads share is one :class:`~workers.actor.holding.Holding`; what
every part depends on (stores, Redis, engine, clock, outages) is one
:class:`~workers.actor.context.ActorContext`, handed to each part's
constructor. :class:`Actor` wires the parts and owns the threads.

Faults are normal (docs/FAILURES.md). The Actor and the Trainer start in any
order: an Actor that finds no run yet waits for it. Redis and the store may
be away for a while: every thread rides out an outage through one
:class:`~aurora_store.outage.Dependency` per dependency (one log line when
it starts, one when it ends, one budget, ``outage_budget_s``); the Actor
keeps generating on the version it holds while only the store is away.
Past the budget, on a permanent error (bad credentials, a missing bucket),
or on any error that is not an outage (a bug), :meth:`Actor.run` raises it.

Every wait of these loops is timed on the context's ``clock``, so tests
step through them with a :class:`~aurora_store.testing.clock.ManualClock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.outage import is_transient
from aurora_store.storage import Store
from workers.actor.boot import Boot, StoreBoot
from workers.actor.config import ActorConfig, ActorStats
from workers.actor.context import ActorContext, MirrorOpener
from workers.actor.fetch import INVALID, Fetcher
from workers.actor.holding import Holding, Staged
from workers.actor.membership import Membership
from workers.actor.quarantine import StagedFull
from workers.actor.safepoint import SafePoint
from workers.actor.sources import Sources
from workers.actor.stager import Stager
from workers.actor.staging import DeltaStaging, StagedObserver, StagingStrategy
from workers.actor.verify import Verifier
from workers.actor.work import WorkLoop
from workers.common import Endpoints
from workers.engine import Engine

__all__ = ["INVALID", "Actor", "StagedFull"]

log = logging.getLogger("aurora.actor")


class Actor:
    """One Actor of a run, wired from its parts; :meth:`run` until ``stop`` is set.

    ``boot`` builds the engine and reaches the first version (default:
    :class:`~workers.actor.boot.StoreBoot`, from the run's store);
    ``staging`` stages versions in the stager thread (default:
    :attr:`deltas`, a :class:`~workers.actor.staging.DeltaStaging`);
    ``observers`` are told of each version the default strategy stages.
    """

    def __init__(
        self,
        ctx: ActorContext,
        *,
        boot: Boot | None = None,
        staging: StagingStrategy | None = None,
        observers: Sequence[StagedObserver] = (),
    ) -> None:
        self.ctx = ctx
        self.fetcher = Fetcher(ctx)
        self.sources = Sources(ctx)
        self.membership = Membership(ctx)
        self.boot: Boot = boot if boot is not None else StoreBoot(ctx, self.fetcher)
        self.deltas = DeltaStaging(ctx, self.fetcher, self.sources, observers)
        self.verifier = Verifier(ctx)
        ctx.ledger.vouch = self.verifier.vouch
        self.safepoint = SafePoint(ctx, self.fetcher, self.boot.reach, self.membership.heartbeat, self.verifier)
        self.stager = Stager(ctx, self.fetcher, self.sources, staging or self.deltas)
        self.work = WorkLoop(ctx, self.membership.heartbeat)
        self._threads: list[threading.Thread] = []
        self._fatal: BaseException | None = None
        """What ended a background thread (an outage past the budget, a permanent error, a bug)."""
        self._closed = False

    @classmethod
    def from_endpoints(
        cls,
        ep: Endpoints,
        cfg: ActorConfig,
        clock: Clock = SYSTEM_CLOCK,
        *,
        origin: Store | None = None,
        open_mirror: MirrorOpener | None = None,
        engine: Engine | None = None,
        boot: Callable[[ActorContext], Boot] | None = None,
        staging: Callable[[ActorContext], StagingStrategy] | None = None,
        observers: Sequence[StagedObserver] = (),
    ) -> Actor:
        """An Actor of the run at ``ep``'s URLs. ``origin``, ``open_mirror`` and ``engine`` replace the
        store, the mirror's opener and the engine it would build; ``boot``/``staging`` build other parts."""
        ctx = ActorContext.connect(ep, cfg, clock, origin=origin, open_mirror=open_mirror, engine=engine)
        return cls(ctx, boot=boot(ctx) if boot else None, staging=staging(ctx) if staging else None, observers=observers)

    # -- views ------------------------------------------------------------------------
    @property
    def cfg(self) -> ActorConfig:
        return self.ctx.cfg

    @property
    def stop(self) -> threading.Event:
        """Set to end :meth:`run` (SIGTERM sets it: a graceful leave)."""
        return self.ctx.stop

    @property
    def origin(self) -> Store:
        return self.ctx.origin

    @property
    def engine(self) -> Engine:
        return self.ctx.engine

    @property
    def holding(self) -> Holding:
        return self.ctx.holding

    @property
    def stats(self) -> ActorStats:
        return self.ctx.stats

    @property
    def active(self) -> int:
        return self.ctx.holding.active

    @property
    def active_state(self) -> str:
        return self.ctx.holding.active_state

    @property
    def staged_version(self) -> int:
        return self.ctx.holding.staged_version

    @property
    def staged_state(self) -> str:
        return self.ctx.holding.staged_state

    @property
    def staged(self) -> list[Staged]:
        """What is staged now, oldest first."""
        return self.ctx.holding.entries()

    # -- joining ------------------------------------------------------------------------
    def wait_for_version(self, version: int) -> None:
        """Join only once the run's head reaches ``version`` (a node that becomes available later)."""
        c = self.ctx
        while not c.stop.is_set():
            try:
                head = c.redis_call(c.records.head, "read the run's head")
            except Exception as e:
                if c.stop.is_set() and is_transient(e):
                    return  # stopped during an outage
                raise
            if head is not None and head >= version:
                return
            c.clock.wait(c.stop, c.cfg.join_poll_s)

    def prepare(self) -> None:
        """Build the engine (no weights yet) unless there is one; waits for the run."""
        if not self.ctx.has_engine:
            self.boot.prepare()

    def bootstrap(self) -> None:
        """Load the version the run needs (the oldest an open step still needs, else the newest), register, heartbeat."""
        c, h = self.ctx, self.ctx.holding
        self.prepare()
        if c.stop.is_set():
            return
        t0 = time.perf_counter()
        got = self.boot.reach()
        if got is None:
            return
        h.start_at(*got)
        me = c.cfg.actor_id
        self.verifier.activated(h.active, h.active_state, None)  # verified by the verify thread, if due
        log.info(
            "%s bootstrapped at v%d in %.2fs%s",
            me,
            h.active,
            time.perf_counter() - t0,
            " (the run appeared)" if self.boot.waited_for_run else "",
        )
        c.redis_call(self.membership.register, "register")
        released = c.redis_call(self.membership.release_previous, "release a previous incarnation's work")
        if released:
            log.info("%s: released %d prompt(s) held by a previous process with this id", me, released)
        c.redis_call(self.membership.heartbeat, "heartbeat")

    # -- the threads --------------------------------------------------------------------
    def _background(self, fn: Callable[[], None], name: str) -> threading.Thread:
        def go() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                if not (self.ctx.stop.is_set() and is_transient(e)):
                    self._fatal = self._fatal or e
                self.ctx.stop.set()

        return threading.Thread(target=go, daemon=True, name=f"{name}-{self.cfg.actor_id}")

    def start(self) -> None:
        """Bootstrap, then start the heartbeat and stager threads (unless stopped first); once."""
        if self._threads:
            return
        self.bootstrap()
        if self.ctx.stop.is_set():
            return
        self.verifier.begin()
        self._threads = [
            self._background(self.membership.run, "heartbeat"),
            self._background(self.stager.run, "stager"),
            self._background(self.verifier.run, "verify"),
        ]
        for t in self._threads:
            t.start()

    def step(self) -> bool:
        """One round of the main thread: activate at the safe point, then work; whether there was work."""
        self.safepoint.activate()
        return self.work.work_once()

    def run(self) -> ActorStats:
        """Start, then work until ``stop``; raises what ended it otherwise (an outage past the
        budget, a permanent error, a bug in any thread), after leaving the ledger as well as it can."""
        c = self.ctx
        try:
            self.start()
            idle = c.cfg.idle.delays()
            while not c.stop.is_set():
                if self.step():
                    idle = c.cfg.idle.delays()
                else:
                    # Back off while there is nothing to do: idle Actors polling
                    # Redis steal CPU from whoever shares the machine.
                    c.clock.wait(c.stop, next(idle))
        except Exception as e:
            if not (c.stop.is_set() and is_transient(e)):  # a stop during an outage is a stop
                raise
        finally:
            self.close()
        if self._fatal is not None:
            raise self._fatal
        return c.stats

    def join(self, timeout: float | None = 30.0) -> None:
        """Wait for the background threads to end (each up to ``timeout``)."""
        for t in self._threads:
            t.join(timeout=timeout)

    def close(self) -> None:
        """Stop, leave the ledger, join the threads, close the engine and the clients; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.ctx.stop.set()
        # Leave first: the work loop is done, so nothing claims or settles any
        # more, and a stager still finishing a fetch must not hold the leases
        # (nor the status) hostage until it ends or the process is killed.
        # The heartbeat script refuses a record that is no longer alive.
        self.membership.leave()
        self.join()
        self.fetcher.close()
        self.ctx.close_engine()
        self.ctx.close()

    def __enter__(self) -> Actor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
