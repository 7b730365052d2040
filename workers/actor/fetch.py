"""The Actor's two fetch paths, and the checks every fetched version passes.

- :meth:`Fetcher.fetch_delta`: one delta on top of the newest staged state,
  decoded here (``fetch_delta``, with the announced segments when
  ``--fetch announced``), or staged by an engine that reads the store
  itself (:class:`~workers.engine.StoreStaging`);
- :meth:`Fetcher.stage_full`: a whole version (a snapshot and the deltas
  after it), for bootstrap and for catch-up; :meth:`Fetcher.load_full`
  swaps one into the engine.

Each version is checked against the state the Trainer recorded for it
(:meth:`Fetcher.check_expected`), and in a run that commits through Redis,
each manifest against its commit record. A version that fails validation
raises one of :data:`INVALID` (wrapped in :class:`Refused` on the whole-version
path, to say which version of the chain it was).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from aurora_store.errors import (
    ChainError,
    FormatError,
    IntegrityError,
    ModelMismatchError,
    ObjectNotFound,
    VersionNotFound,
)
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.format.signing import TrustKeys
from aurora_store.lineage.fetch import ManifestReader, fetch_delta, fetch_snapshot
from aurora_store.lineage.interfaces import CommitRecords
from aurora_store.lineage.plan import ChainPlan
from aurora_store.storage import Store
from workers.actor.announced import AnnouncedFetch
from workers.actor.context import ActorContext
from workers.actor.held import chain_error, check_chain, check_reached, check_staged
from workers.actor.holding import StagedItem
from workers.actor.quarantine import StagedFull
from workers.commits import RidingRecords, resolve_commit_records
from workers.engine import PreparingEngine, StoreStaging

__all__ = ["INVALID", "Fetcher", "Refused"]

log = logging.getLogger("aurora.actor")

T = TypeVar("T")

#: Errors that say "these bytes are not a valid version" (as opposed to "the store is away"
#: or "not committed"): the version is quarantined.
INVALID = (FormatError, IntegrityError, ChainError, ObjectNotFound)


class Refused(Exception):
    """A version on a whole-version path failed validation (which one, and why)."""

    def __init__(self, kind: str, version: int, error: BaseException) -> None:
        super().__init__(f"{kind} {version}: {error}")
        self.kind, self.version, self.error = kind, version, error


def _attributed(kind: str, version: int, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except INVALID as e:
        raise Refused(kind, version, e) from e


class Fetcher:
    """Fetches and checks versions for one Actor (see the module docstring)."""

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        cfg = ctx.cfg
        self.announced = AnnouncedFetch(cfg.streams, cfg.max_prefetch_bytes, ctx.records) if cfg.fetch == "announced" else None
        """Reads started by announcements (``cfg.fetch``: segments before their manifest); None: manifest first."""
        self.commits: CommitRecords | None = None
        """The run's Redis commit records (FORMAT.md §1) when it commits through Redis; None: the store commits."""
        self._commits_known = False
        self.full_bytes: int | None = None
        """Bytes of a whole version (the last snapshot staged from): what replay is weighed against."""

    @property
    def trust(self) -> TrustKeys | None:
        return self.ctx.cfg.trust

    def resolve_commits(self) -> None:
        """Whether the run commits through Redis: asked once, when its first version is seen (workers.commits)."""
        if self._commits_known:
            return
        c = self.ctx
        found = resolve_commit_records(c.redis, c.ep.run, c.origin, c.redis_call, c.store_call, log, c.cfg.actor_id)
        self.commits = None if found is None else RidingRecords(found, c.redis_dep, c.stop)
        self._commits_known = True

    def reader(self, store: Store) -> ManifestReader:
        return ManifestReader(store, self.trust, self.commits)

    def close(self) -> None:
        if self.announced is not None:
            self.announced.close()

    # -- the Trainer's expected states ------------------------------------------------
    def check_expected(self, version: int, state: str, store: Store | None) -> None:
        """Refuse (:class:`~aurora_store.errors.ChainError`) a version whose state is not the one the Trainer recorded.

        A chain can be self-consistent and still not the Trainer's (a mirror
        that forged a delta on the true base, and everything after it); the
        record in Redis (``state:trainer``) names the state the Trainer
        published. No record (an older Trainer, a Redis that lost its data):
        nothing to compare with, and the chain's own checks stand alone.
        """
        read, want = self.announced.expected_state(version) if self.announced is not None else (False, None)
        if not read:
            want = self.ctx.redis_call(lambda: self.ctx.records.expected_state(version), "read an expected state")
        if want is not None and want != state:
            src = f" from {store.url}" if store is not None else ""
            raise ChainError(f"v{version}{src}: state {state[:19]}… is not the state the Trainer recorded ({want[:19]}…)")

    # -- a whole version ----------------------------------------------------------------
    def _checked(self, store: Store, reader: ManifestReader, kind: str, version: int) -> Any:
        """The manifest ``reader`` accepted; in a Redis-commit run, read again (and refused, naming why) when it did not.

        Without records, None lets the fetch read it (and raise what names it), as before.
        """
        m = reader.get(kind, version)
        if m is None and self.commits is not None:
            m = _manifest(store, None, kind, version, self.trust, self.commits)
        return m

    def stage_full(self, store: Store, plan: ChainPlan, reader: ManifestReader | None = None) -> StagedFull:
        """Fetch a whole version: ``plan``'s snapshot, then its deltas, each checked against the state it lands on.

        Raises :class:`Refused` naming the version that failed validation.
        An engine that reads the store itself (vLLM) fetches nothing here:
        it reaches the version when the result is activated.
        """
        from aurora_store.apply.sink import FusedWeights, apply_delta
        from aurora_store.codec.extract import spec_of

        assert plan.snapshot is not None
        reader = reader or self.reader(store)
        self.full_bytes = reader.cost("snapshot", plan.snapshot) or self.full_bytes
        engine, trust, streams = self.ctx.engine, self.trust, self.ctx.cfg.streams
        if isinstance(engine, StoreStaging):
            # The chain is checked here, manifest by manifest, and handed to the engine,
            # which reads none of them again (see workers.actor.held).
            sn = plan.snapshot
            chain = [_attributed("snapshot", sn, lambda: _manifest(store, reader, "snapshot", sn, trust, self.commits))]
            chain += [_attributed("delta", v, lambda v=v: _manifest(store, reader, "delta", v, trust, self.commits)) for v in plan.deltas]  # type: ignore[misc]
            broken = check_chain(chain)
            if broken is not None:
                raise Refused("delta", broken, chain_error(broken, chain))
            _attributed(
                "delta" if plan.deltas else "snapshot", plan.target, lambda: self.check_expected(plan.target, chain[-1].state, store)
            )
            return StagedFull(plan.target, chain[-1].state, None, sn, plan.bytes or 0, manifests=tuple(chain))
        s = plan.snapshot
        sm, tensors = _attributed(
            "snapshot", s, lambda: fetch_snapshot(store, s, streams, self._checked(store, reader, "snapshot", s), trust=trust)
        )
        specs = engine.param_specs()

        def fits() -> None:
            if set(tensors) != set(specs):
                raise ModelMismatchError(f"snapshot {s} names {sorted(set(tensors) ^ set(specs))[:3]} that the model lacks or misses")
            for name, t in tensors.items():
                if spec_of(t, name) != specs[name]:
                    raise ModelMismatchError(f"snapshot {s}: {name} does not fit the model")

        _attributed("snapshot", s, fits)
        sink, state = FusedWeights(tensors), sm.state
        for v in plan.deltas:
            m, staged = _attributed(
                "delta",
                v,
                lambda v=v, st=state: fetch_delta(
                    store, v, specs, streams, expect_base_state=st, manifest=self._checked(store, reader, "delta", v), trust=trust
                ),  # type: ignore[misc]
            )
            apply_delta(staged, sink)
            state = m.state
        _attributed("delta" if plan.deltas else "snapshot", plan.target, lambda: self.check_expected(plan.target, state, store))
        return StagedFull(plan.target, state, tensors, s, plan.bytes or 0)

    def load_full(self, full: StagedFull) -> None:
        """Swap a whole version into the engine (bootstrap, or a safe point)."""
        engine, c = self.ctx.engine, self.ctx
        if full.tensors is None:
            assert isinstance(engine, StoreStaging)
            reach = partial(engine.bootstrap_from_store, c.origin, c.ep.storage_options, full.version, c.cfg.streams)
            if full.manifests:
                reach = partial(reach, manifests=full.manifests)
            check_reached(full.version, full.state, c.store_call(reach, f"reach v{full.version}"))
        else:
            engine.load_weights(full.tensors, version=full.version)

    # -- one delta --------------------------------------------------------------------
    def fetch_delta(self, store: Store, version: int, base_state: str, planned: ManifestReader | None = None) -> tuple[Any, StagedItem]:
        """Delta ``version`` on ``base_state`` from ``store``: (its manifest, what is staged).

        ``planned``: the manifests a catch-up plan read (used when they are
        ``store``'s). Raises what the fetch raises: one of :data:`INVALID`,
        :class:`~aurora_store.errors.VersionNotFound` (not committed there yet),
        :class:`~aurora_store.errors.StoreUnavailable`.
        """
        known = planned.get("delta", version) if planned is not None and planned.store is store else None
        if isinstance(self.ctx.engine, StoreStaging):
            return self._stage_in_engine(self.ctx.engine, store, version, base_state, known)
        if known is None and self.commits is not None:  # checked against its record: never re-read unchecked
            known = _manifest(store, None, "delta", version, self.trust, self.commits)
        early, cfg, engine = self.announced, self.ctx.cfg, self.ctx.engine
        each = engine.prepare_segment if isinstance(engine, PreparingEngine) else None
        if early is None:
            return fetch_delta(
                store,
                version,
                engine.param_specs(),
                cfg.streams,
                expect_base_state=base_state,
                manifest=known,
                trust=self.trust,
                prepare=each,
            )
        t0 = time.perf_counter()
        early.expect(version)  # the state check after the fetch: read beside it, not after it
        if known is None:
            known = early.manifest(store, version)  # read when the version was announced, with the same checks
        t1 = time.perf_counter()
        taken, waited = early.prefetch.stats.taken, early.prefetch.stats.waited_s
        try:
            # Held segments are taken only once the manifest is read and trusted, each checked against it.
            fetched = fetch_delta(
                store,
                version,
                engine.param_specs(),
                cfg.streams,
                expect_base_state=base_state,
                manifest=known,
                trust=self.trust,
                held=early.held(version),
                prepare=each,
            )
        except VersionNotFound:
            raise  # not committed yet (here): what is held waits for its manifest
        except BaseException:
            early.done(version)  # refused: nothing held for it is of use
            raise
        early.done(version)  # and keys its manifest did not list are let go
        log.debug(
            "%s: delta %d: %d of %d segments prefetched; %.3fs for the manifest read when announced, then %.3fs to fetch and decode "
            "(%.3fs waited for downloads under way, summed over threads)",
            cfg.actor_id,
            version,
            early.prefetch.stats.taken - taken,
            len(fetched[0].segments),
            t1 - t0,
            time.perf_counter() - t1,
            early.prefetch.stats.waited_s - waited,
        )
        return fetched

    def _stage_in_engine(self, engine: StoreStaging, store: Store, version: int, base_state: str, known: Any) -> tuple[Any, StagedItem]:
        """The engine's workers stage the delta; its manifest is read (and checked) here once, handed over, and compared."""
        c = self.ctx
        opts = c.ep.storage_options if store is c.origin else c.cfg.mirror_options
        early = self.announced
        if early is not None:
            early.expect(version)  # the state check after staging: read beside the fetch
        if known is None and early is not None and self.commits is None:
            known = early.manifest(store, version)  # read when the version was announced, with the same checks
        m = known if known is not None else _manifest(store, None, "delta", version, self.trust, self.commits)
        src = store
        try:
            # Segments held from their announcements, checked against the manifest, in a local
            # folder the workers stage from (they check each object against it again).
            spilled = early.spill(store, m, c.cfg.streams) if early is not None else None
            if spilled is not None:
                src, opts = spilled, {}
                c.stats.spilled += 1
            got, staged = engine.stage_from_store(src, opts, version, base_state, c.cfg.streams, manifest=m)
        finally:
            if early is not None:
                early.done(version)
                early.unspill(version)
        check_staged(version, m, got, staged)
        return m, staged

    def prepared(self, staged: StagedItem) -> StagedItem:
        """``staged`` made ready for the safe point by an engine that can (``prepare``: checks,
        grouping, the digest after it; see aurora_store.apply.prepare), else as it is."""
        engine = self.ctx.engine
        if isinstance(engine, PreparingEngine) and isinstance(staged, StagedDelta):
            prepared: StagedItem = engine.prepare(staged)
            return prepared
        return staged


def _manifest(
    store: Store,
    reader: ManifestReader | None,
    kind: str,
    version: int,
    trust: TrustKeys | None = None,
    commits: CommitRecords | None = None,
) -> Any:
    """The manifest ``reader`` holds, else read now; either way accepted by ``trust`` (FORMAT.md §4.1)
    and, in a run that commits through Redis, by its record (``commits``, FORMAT.md §1)."""
    from aurora_store.lineage.fetch import check_trusted, read_manifest

    m = reader.get(kind, version) if reader is not None else None
    if m is not None:
        check_trusted(store, m, trust)  # the reader may have been made without it
        return m
    return read_manifest(store, kind, version, trust, commits)
