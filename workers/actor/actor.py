"""An Actor: bootstrap, stage in the background, activate at safe points, generate, settle.

Three threads (docs/WORKERS.md):

- main: at each safe point (between batches) activate staged versions that
  an open step or a Commit asks for; claim leases of steps on the active
  version; generate; settle with (active version, its state digest);
- stager: follow announcements (the region's Relay mirror while its
  heartbeat key exists, else origin), fetch + verify + decode the next delta
  on top of the newest staged state, keep it staged; when far behind, or
  when the chain is broken, stage a whole version (snapshot + deltas)
  instead, whichever fetches fewer bytes;
- heartbeat: report active and staged versions (and quarantined ones) every
  ``heartbeat_s``.

A delta is accepted only on top of the base it declares
(``expect_base_state``); a version that fails validation is never staged,
so it can never be applied: it is quarantined with back-off instead. SIGTERM
is a graceful leave.

Faults are normal (docs/FAILURES.md). The Actor and the Trainer start in any
order: an Actor that finds no run yet waits for it. Redis and the store may
be away for a while: every thread rides out an outage through one
:class:`~aurora_store.outage.Dependency` per dependency (one log line when
it starts, one when it ends, one budget, ``outage_budget_s``); the Actor
keeps generating on the version it holds while only the store is away. A
Redis that comes back without its data finds the Actor registering again.
Past the budget, or on a permanent error (bad credentials, a missing
bucket), :meth:`Actor.run` raises and the CLI prints one line.

Every wait of these loops (polls, back-off, the mirror's grace, the Relay
wait) is timed on the Actor's ``clock``, so tests step through them with a
:class:`~aurora_store.testing.clock.ManualClock` instead of sleeping.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

from aurora_store import metrics
from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.config import Backoff
from aurora_store.coordination.bus import COMMIT, SEGMENT, VERSION, Bus, BusGap, Event
from aurora_store.coordination.ledger import Lease, Ledger
from aurora_store.coordination.redisconn import connect
from aurora_store.errors import (
    AuroraError,
    ChainError,
    FormatError,
    IntegrityError,
    ModelMismatchError,
    ObjectNotFound,
    StoreError,
    StoreUnavailable,
    VersionNotFound,
)
from aurora_store.format.checkpoint import StagedDelta
from aurora_store.format.manifest import manifest_key
from aurora_store.format.signing import TrustKeys
from aurora_store.lineage.fetch import ManifestReader, fetch_delta, fetch_snapshot
from aurora_store.lineage.interfaces import CommitRecords
from aurora_store.lineage.plan import ChainPlan, VersionIndex, plan_chain, scan_versions
from aurora_store.outage import Dependency, is_transient, riding
from aurora_store.storage import Store, open_store
from workers.actor.announced import AnnouncedFetch
from workers.actor.config import ActorConfig, ActorStats
from workers.actor.held import chain_error, check_chain, check_reached, check_staged
from workers.actor.quarantine import Quarantine, StagedFull, staged_nbytes
from workers.commits import RidingRecords, resolve_commit_records
from workers.common import (
    MODEL_CONFIG_KEY,
    Endpoints,
    RunKeys,
    check_model_files,
    read_expected_state,
    read_model_description,
    record_activation,
    record_digest,
)
from workers.engine import RemoteStaged, StoreStaging, make_engine

__all__ = ["Actor", "StagedFull"]

log = logging.getLogger("aurora.actor")

T = TypeVar("T")

#: Errors that say "these bytes are not a valid version" (as opposed to "the store is away"
#: or "not committed"): the version is quarantined.
INVALID = (FormatError, IntegrityError, ChainError, ObjectNotFound)

# KEYS[1] actor hash; ARGV field, value. Writes only into a record that exists: a report
# must never create a record the ledger does not know (it would have no status and no TTL).
_REPORT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class _Refused(Exception):
    """A version on a catch-up path failed validation (which one, and why)."""

    def __init__(self, kind: str, version: int, error: BaseException) -> None:
        super().__init__(f"{kind} {version}: {error}")
        self.kind, self.version, self.error = kind, version, error


def _attributed(kind: str, version: int, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except INVALID as e:
        raise _Refused(kind, version, e) from e


class Actor:
    """One Actor of a run; :meth:`run` until ``stop`` is set. ``clock`` times every wait of its loops."""

    def __init__(self, ep: Endpoints, cfg: ActorConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.ep = ep
        self.cfg = cfg
        self.clock = clock
        self.origin: Store = open_store(ep.store, dict(ep.storage_options))
        self.redis = connect(ep.redis)
        # Room for the stager's longest blocking read, and as much again for the reply.
        self.bus_redis = connect(ep.redis, block_s=2 * cfg.stage_block_ms / 1000)
        self.ledger = Ledger(self.redis, ep.run)
        self.bus = Bus(self.bus_redis, ep.run)
        self.keys = RunKeys(ep.run)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self._weights = threading.Lock()
        """Held while the engine's weights change, and while (version, digest) is read as a pair:
        the heartbeat thread must never label one version's digest with another's number."""
        self.staged: deque[tuple[StagedDelta | RemoteStaged | StagedFull, str, float]] = deque()
        """(delta or whole version, its state, seconds it took to stage) in version order."""
        self.staged_version = -1
        self.staged_state = ""
        self.commit_seen = -1
        self.stats = ActorStats()
        # One outage per dependency, however many threads hit it (and one budget).
        ob = cfg.outage_backoff
        self.redis_dep = Dependency("Redis", log, cfg.outage_budget_s, clock, ob.initial_s, ob.max_s)
        self.store_dep = Dependency("the store", log, cfg.outage_budget_s, clock, ob.initial_s, ob.max_s)
        self.quarantine = Quarantine(cfg.quarantine, clock, log)
        self._report = self.redis.register_script(_REPORT)
        self._reported: str | None = None
        """The ``quarantined`` field as last written into the actor record."""
        self._fatal: BaseException | None = None
        self._verified: int | None = None  # the active version whose predicted digest was checked
        """What ended a background thread (an outage past the budget, a permanent error)."""
        self._want = -1
        """The version the main loop last wanted: the stager's catch-up target when behind it."""
        self._full_bytes: int | None = None
        """Bytes of a whole version (the last snapshot staged from): what replay is weighed against."""
        self._delta_bytes: deque[int] = deque(maxlen=8)
        """Bytes of the last deltas staged."""
        self._replay_until = -1
        """A catch-up plan chose replay up to here: no new plan before it is reached."""
        self._manifests: ManifestReader | None = None
        """Manifests read by the last plan, reused by the replay that follows it."""
        self._replan_at = 0.0
        self._replan_failures = 0
        self._waiting_said = False
        self._stuck_at: int | None = None
        """The version no plan could reach: not looked for again before ``_replan_at``."""
        self._full_said = False
        self._mirror: tuple[str, Store] | None = None
        """The configured mirror (``cfg.mirror``), opened at its first use."""
        self._ignored_mirrors: set[str] = set()
        """Mirror URLs read from Redis that are not the configured one (each logged once)."""
        self._missing_since: dict[int, float] = {}
        """version -> when the stager first found it missing from the region's mirror."""
        self._relay_progress: dict[int, float] = {}
        """version -> when the region's Relay last announced a segment of it."""
        self._mirror_behind = False
        self._state_refused: tuple[int, int] | None = None
        self.commits: CommitRecords | None = None
        """The run's Redis commit records (FORMAT.md §1) when it commits through Redis; None: the store commits."""
        self._commits_known = False
        self._announced = AnnouncedFetch(cfg.streams, cfg.max_prefetch_bytes, self.redis, self.keys) if cfg.fetch == "announced" else None
        """Reads started by announcements (``cfg.fetch``: segments before their manifest); None: manifest first."""
        self._model_unchecked: dict[str, str] | None = None
        """The model files read before any snapshot listed them (key -> sha256): checked at bootstrap."""
        """(step, active version) last refused for its state: logged once."""

    # -- riding out outages ---------------------------------------------------------
    def _redis(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` (a Redis call), retried through a Redis outage until the budget is spent."""
        return self.redis_dep.call(fn, what, self.stop)

    def _store(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` (a store call), retried through a store outage until the budget is spent."""
        return self.store_dep.call(fn, what, self.stop)

    def _pauses(self) -> Iterator[float]:
        ob = self.cfg.outage_backoff
        return Backoff(initial_s=ob.initial_s, max_s=ob.max_s, factor=ob.factor, jitter=ob.jitter).delays()

    def _trouble(self, e: BaseException, what: str) -> bool:
        """A background loop's error: True if it is to be waited out (recorded on its dependency).

        Raises :class:`~aurora_store.errors.OutageTooLong` past the budget. False
        for a permanent error (the caller re-raises it: the Actor ends).
        """
        if is_transient(e):
            (self.store_dep if isinstance(e, StoreUnavailable) else self.redis_dep).failed(e, what)
            return True
        if isinstance(e, AuroraError):
            return False
        # Not ours, not an outage (a bug, an untranslated library error): keep the
        # Actor generating on what it holds, and say so.
        log.warning("%s: %s: %s", what, type(e).__name__, e, exc_info=e)
        return True

    def _background(self, fn: Callable[[], None], name: str) -> threading.Thread:
        def go() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
                if not (self.stop.is_set() and is_transient(e)):
                    self._fatal = self._fatal or e
                self.stop.set()

        return threading.Thread(target=go, daemon=True, name=name)

    # -- waiting for the run ----------------------------------------------------------
    def _wait_for_run(self, what: str, probe: Callable[[], T | None]) -> T | None:
        """``probe()`` (a store read) until it finds something, or None if stopped first.

        The Trainer may start after the Actors: that is a wait, not an
        error, said once in the log (the bootstrap line says when it ended).
        An S3 bucket that does not exist is never going to hold a run: that
        ends the Actor (:class:`~aurora_store.errors.StoreError`).
        """
        while not self.stop.is_set():
            got = self._store(probe, f"look for {what}")
            if got is not None:
                return got
            if not self._waiting_said:
                bucket = _missing_bucket(self.origin)
                if bucket is not None:
                    raise StoreError(f"{self.origin.url}: bucket {bucket!r} does not exist (or these credentials cannot see it)")
                log.info("%s: waiting for the run to appear at %s (no %s yet)", self.cfg.actor_id, self.origin.url, what)
                self._waiting_said = True
            self.clock.wait(self.stop, self.cfg.run_poll_s)
        return None

    def wait_for_version(self, version: int) -> None:
        """Join only once the run's head reaches ``version`` (a node that becomes available later)."""
        while not self.stop.is_set():
            try:
                head = self._redis(lambda: self.redis.hget(self.keys.trainer, "head"), "read the run's head")
            except Exception as e:
                if self.stop.is_set() and is_transient(e):
                    return  # stopped during an outage
                raise
            if head is not None and int(head) >= version:
                return
            self.clock.wait(self.stop, self.cfg.join_poll_s)

    # -- bootstrap ----------------------------------------------------------------
    def prepare(self) -> None:
        """Build the engine from the run's model description (no weights yet); waits for the run."""

        def described() -> bool | None:
            return True if self.origin.exists(MODEL_CONFIG_KEY) else None  # written last (write_model_description)

        if self._wait_for_run("model description", described) is None:
            return
        # Version 0's manifest lists the files (FORMAT.md §1), written right after them: one
        # read before it exists (the Trainer still setting up) is checked once it does (bootstrap).
        listed = self._store(lambda: self.origin.exists(manifest_key("snapshot", 0)) or bool(scan_versions(self.origin).snapshots), "look for version 0")
        used: dict[str, str] = {}
        model, self.tokenizer = self._store(lambda: read_model_description(self.origin, used, unlisted_ok=not listed), "read the model description")
        self._model_unchecked = None if listed else used
        self.engine = make_engine(self.cfg.engine, self.tokenizer, self.cfg.device)
        self.engine.load(model)

    def bootstrap(self) -> None:
        """Load the version the run needs (the oldest an open step still needs, else the newest), register, heartbeat."""
        if not hasattr(self, "engine"):
            self.prepare()
        if self.stop.is_set():
            return
        t0 = time.perf_counter()
        got = self._reach_newest()
        if got is None:
            return
        if self._model_unchecked is not None:
            used = self._model_unchecked
            self._store(lambda: check_model_files(self.origin, used), "check the model files")
            self._model_unchecked = None
        version, state = got
        self.active, self.active_state = version, state
        self.staged_version, self.staged_state = version, state
        self._redis(lambda: record_digest(self.redis, self.keys, self.cfg.actor_id, self.active, self.engine.digest()), "record a digest")
        log.info("%s bootstrapped at v%d in %.2fs%s", self.cfg.actor_id, self.active, time.perf_counter() - t0, " (the run appeared)" if self._waiting_said else "")
        self._redis(self._register, "register")
        # A process that reuses the id of one that died (restarted before the Trainer
        # reaped it): the dead one's leases and unclaimed assignments go back to the
        # pool now, not when their leases expire (its tokens are not ours to settle).
        released = self._redis(lambda: self.ledger.release_actor(self.cfg.actor_id), "release a previous incarnation's work")
        if released:
            log.info("%s: released %d prompt(s) held by a previous process with this id", self.cfg.actor_id, released)
        self._redis(self._heartbeat, "heartbeat")

    def _reach_newest(self) -> tuple[int, str] | None:
        """Weights of the newest usable version into the engine: (version, state), or None if stopped.

        A version that fails validation is quarantined and the next plan
        routes around it (an older version, another snapshot); with no
        usable version yet, this waits like a run that has not appeared.
        """
        said = False
        while not self.stop.is_set():
            index = self._wait_for_run("version", lambda: _nonempty(scan_versions(self.origin)))
            if index is None:
                return None
            usable = index.without(self.quarantine.blocked())
            self._resolve_commits()
            reader = ManifestReader(self.origin, self.cfg.trust, self.commits)
            needed = self._redis(self._oldest_needed, "read open steps")
            plan = self._store(partial(_bootstrap_plan, usable, reader, needed), "plan the bootstrap")
            if plan is None:
                if not said:
                    log.warning("%s: no usable version at %s yet; waiting", self.cfg.actor_id, self.origin.url)
                    said = True
                # Quarantined versions come back after their back-off, not sooner.
                self.clock.wait(self.stop, self.cfg.quarantine.initial_s if self.quarantine.versions() else self.cfg.run_poll_s)
                continue
            try:
                full = self._store(partial(self._stage_full, self.origin, plan, reader), "bootstrap")
            except _Refused as r:
                self.quarantine.failed(r.kind, r.version, r.error)
                continue
            except VersionNotFound:
                continue  # removed while we read it (retention): plan again
            try:
                self._load_full(full)
            except INVALID as e:  # the engine reached other weights than the chain checked here
                self.quarantine.failed("delta" if full.version > full.snapshot else "snapshot", full.version, e)
                continue
            self.quarantine.forget_below(full.version)
            metrics.active().bootstrapped(self.cfg.actor_id, self.cfg.region, full.version, full.nbytes)
            return full.version, full.state
        return None

    def _oldest_needed(self) -> int | None:
        """The oldest version an open step generated on still has prompts to settle on, or None.

        A fresh Actor starts there, not at the newest version: an Actor never
        goes back, so one that started past such a step could never serve it,
        and a step whose only Actor died would wait for ever.
        """
        left = [sv for _, sv, n in self.ledger.open_step_info() if n > 0]
        return min(left) if left else None

    def _resolve_commits(self) -> None:
        """Whether the run commits through Redis: asked once, when its first version is seen (workers.commits)."""
        if self._commits_known:
            return
        found = resolve_commit_records(self.redis, self.ep.run, self.origin, self._redis, self._store, log, self.cfg.actor_id)
        self.commits = None if found is None else RidingRecords(found, self.redis_dep, self.stop)
        self._commits_known = True

    def _checked(self, store: Store, reader: ManifestReader, kind: str, version: int) -> Any:
        """The manifest ``reader`` accepted; in a Redis-commit run, read again (and refused, naming why) when it did not.

        Without records, None lets the fetch read it (and raise what names it), as before.
        """
        m = reader.get(kind, version)
        if m is None and self.commits is not None:
            m = _manifest(store, None, kind, version, self.cfg.trust, self.commits)
        return m

    def _stage_full(self, store: Store, plan: ChainPlan, reader: ManifestReader | None = None) -> StagedFull:
        """Fetch a whole version: ``plan``'s snapshot, then its deltas, each checked against the state it lands on.

        Raises :class:`_Refused` naming the version that failed validation.
        An engine that reads the store itself (vLLM) fetches nothing here:
        it reaches the version when the result is activated.
        """
        from aurora_store.apply.sink import FusedWeights, apply_delta
        from aurora_store.codec.extract import spec_of

        assert plan.snapshot is not None
        reader = reader or ManifestReader(store, self.cfg.trust, self.commits)
        self._full_bytes = reader.cost("snapshot", plan.snapshot) or self._full_bytes
        if isinstance(self.engine, StoreStaging):
            # The chain is checked here, manifest by manifest, and handed to the engine,
            # which reads none of them again (see workers.actor.held).
            sn = plan.snapshot
            chain = [_attributed("snapshot", sn, lambda: _manifest(store, reader, "snapshot", sn, self.cfg.trust, self.commits))]
            chain += [_attributed("delta", v, lambda v=v: _manifest(store, reader, "delta", v, self.cfg.trust, self.commits)) for v in plan.deltas]  # type: ignore[misc]
            broken = check_chain(chain)
            if broken is not None:
                raise _Refused("delta", broken, chain_error(broken, chain))
            _attributed("delta" if plan.deltas else "snapshot", plan.target, lambda: self._check_expected(plan.target, chain[-1].state, store))
            return StagedFull(plan.target, chain[-1].state, None, sn, plan.bytes or 0, manifests=tuple(chain))
        s = plan.snapshot
        sm, tensors = _attributed("snapshot", s, lambda: fetch_snapshot(store, s, self.cfg.streams, self._checked(store, reader, "snapshot", s), trust=self.cfg.trust))
        specs = self.engine.param_specs()

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
                "delta", v, lambda v=v, st=state: fetch_delta(store, v, specs, self.cfg.streams, expect_base_state=st, manifest=self._checked(store, reader, "delta", v), trust=self.cfg.trust)  # type: ignore[misc]
            )
            apply_delta(staged, sink)
            state = m.state
        _attributed("delta" if plan.deltas else "snapshot", plan.target, lambda: self._check_expected(plan.target, state, store))
        return StagedFull(plan.target, state, tensors, s, plan.bytes or 0)

    def _load_full(self, full: StagedFull) -> None:
        """Swap a whole version into the engine (bootstrap, or a safe point)."""
        if full.tensors is None:
            engine = self.engine
            assert isinstance(engine, StoreStaging)
            reach = partial(engine.bootstrap_from_store, self.origin, self.ep.storage_options, full.version, self.cfg.streams)
            if full.manifests:
                reach = partial(reach, manifests=full.manifests)
            check_reached(full.version, full.state, self._store(reach, f"reach v{full.version}"))
        else:
            self.engine.load_weights(full.tensors, version=full.version)

    # -- the ledger record ----------------------------------------------------------
    def _register(self) -> None:
        self.ledger.register(self.cfg.actor_id, self.cfg.region, self.cfg.engine)
        self._reported = None  # a new record: report everything again

    def _heartbeat(self) -> None:
        ok = self.ledger.heartbeat(self.cfg.actor_id, active=self.active, staged=self.staged_version, active_state=self.active_state)
        if not ok and not self.stop.is_set():
            # Reaped (we were silent too long), or Redis lost its state: join again.
            log.warning("%s: heartbeat refused (the ledger lost or reaped this Actor); registering again", self.cfg.actor_id)
            self._register()
            self.ledger.heartbeat(self.cfg.actor_id, active=self.active, staged=self.staged_version, active_state=self.active_state)
            with self._weights:
                active, digest = self.active, self.engine.digest()
            record_digest(self.redis, self.keys, self.cfg.actor_id, active, digest)
        q = json.dumps(self.quarantine.versions())
        if q != self._reported and self._report(keys=[self.keys.actor(self.cfg.actor_id)], args=["quarantined", q]):
            self._reported = q

    def _heartbeat_loop(self) -> None:
        while not self.clock.wait(self.stop, self.cfg.heartbeat_s):
            with self.redis_dep.guard("heartbeat"):
                self._heartbeat()

    # -- staging --------------------------------------------------------------------
    def _poll(self) -> tuple[str | None, int | None, int | None]:
        """The region's Relay mirror URL (None while no Relay heartbeats), the run's head and commit: one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.keys.relay(self.cfg.region))
        pipe.hmget(self.keys.trainer, "head", "commit")
        url, (head, commit) = pipe.execute()
        self.redis_dep.ok()
        metrics.active().head_seen(self.cfg.actor_id, self.cfg.region, _int_or_none(head))
        return (url.decode() if url else None), _int_or_none(head), _int_or_none(commit)

    def _source(self, relay_url: str | None) -> tuple[Store, str | None]:
        """The configured mirror while the region's Relay heartbeats with its URL, else origin.

        The key says whether the Relay is alive, never where to read: a URL
        that is not the configured one (``--mirror``) is logged once and ignored.
        """
        if not self._trusted_mirror(relay_url):
            return self.origin, None
        if self._mirror is None:
            assert self.cfg.mirror is not None
            self._mirror = (self.cfg.mirror, open_store(self.cfg.mirror, dict(self.cfg.mirror_options)))
        return self._mirror[1], self.cfg.region

    def _trusted_mirror(self, relay_url: str | None) -> bool:
        """Whether the region's Relay heartbeats (``relay_url`` set) with the configured mirror."""
        if not relay_url:
            return False
        if self.cfg.mirror is not None and _same_root(relay_url, self.cfg.mirror):
            return True
        if relay_url not in self._ignored_mirrors and len(self._ignored_mirrors) < 64:
            self._ignored_mirrors.add(relay_url)
            why = "it is not this Actor's --mirror" if self.cfg.mirror is not None else "this Actor has no --mirror"
            log.warning(
                "%s: the Relay key of region %s names mirror %s; ignored (%s): reading origin",
                self.cfg.actor_id, self.cfg.region, _shown_url(relay_url), why,
            )
        return False

    def _fetch_delta(self, store: Store, version: int) -> tuple[Any, StagedDelta | RemoteStaged]:
        known = self._manifests.get("delta", version) if self._manifests is not None and self._manifests.store is store else None
        if isinstance(self.engine, StoreStaging):
            # Read (and checked) here once, handed to the engine, and compared with what it staged.
            opts = self.ep.storage_options if store is self.origin else self.cfg.mirror_options
            early = self._announced
            if early is not None:
                early.expect(version)  # the state check after staging: read beside the fetch
            if known is None and early is not None and self.commits is None:
                known = early.manifest(store, version)  # read when the version was announced, with the same checks
            m = known if known is not None else _manifest(store, None, "delta", version, self.cfg.trust, self.commits)
            src = store
            try:
                # Segments held from their announcements, checked against the manifest, in a local
                # folder the workers stage from (they check each object against it again).
                spilled = early.spill(store, m, self.cfg.streams) if early is not None else None
                if spilled is not None:
                    src, opts = spilled, {}
                    self.stats.spilled += 1
                got, staged = self.engine.stage_from_store(src, opts, version, self.staged_state, self.cfg.streams, manifest=m)
            finally:
                if early is not None:
                    early.done(version)
                    early.unspill(version)
            check_staged(version, m, got, staged)
            return m, staged
        if known is None and self.commits is not None:  # checked against its record: never re-read unchecked
            known = _manifest(store, None, "delta", version, self.cfg.trust, self.commits)
        early = self._announced
        each = self._segment_prep()
        if early is None:
            return fetch_delta(
                store, version, self.engine.param_specs(), self.cfg.streams, expect_base_state=self.staged_state, manifest=known,
                trust=self.cfg.trust, prepare=each,
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
                store, version, self.engine.param_specs(), self.cfg.streams, expect_base_state=self.staged_state, manifest=known,
                trust=self.cfg.trust, held=early.held(version), prepare=each,
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
            self.cfg.actor_id, version, early.prefetch.stats.taken - taken, len(fetched[0].segments), t1 - t0,
            time.perf_counter() - t1, early.prefetch.stats.waited_s - waited,
        )
        return fetched

    def _announcement(self, ev: Event, region: str | None, url: str | None) -> None:
        """``--fetch announced``: start the reads an announcement names, from where it says they are (mirror or origin)."""
        early = self._announced
        if early is None:
            return
        store = self._source(url)[0] if region is not None else self.origin
        if ev.type == SEGMENT:
            early.segment(store, ev, self.staged_version)
        elif ev.type == VERSION:
            early.version(store, ev, self.staged_version, self.cfg.trust, self.commits)

    def _segment_prep(self) -> Any:
        """The engine's ``prepare_segment``, when it has one: each segment is prepared in its
        download thread as it is decoded, so the last one's arrival leaves little for ``prepare``."""
        each = getattr(self.engine, "prepare_segment", None)
        return each if callable(each) else None

    def _prepared(self, staged: Any) -> Any:
        """``staged`` made ready for the safe point by an engine that can (``prepare``: checks,
        grouping, the digest after it; see aurora_store.apply.prepared), else as it is."""
        prepare = getattr(self.engine, "prepare", None)
        return prepare(staged) if callable(prepare) and isinstance(staged, StagedDelta) else staged

    def _staged_bytes(self) -> int:
        with self.lock:
            return sum(staged_nbytes(e[0]) for e in self.staged)

    def _room(self) -> bool:
        """Whether the stager may fetch another version (``max_staged_bytes``; one always fits)."""
        held = self._staged_bytes()
        if held < self.cfg.max_staged_bytes:
            self._full_said = False
            return True
        if not self._full_said:
            log.info("%s: %d MiB staged (the limit); fetching more once activation frees room", self.cfg.actor_id, held >> 20)
            self._full_said = True
        return False

    def _stage_available(self, polled: tuple[str | None, int | None] | None = None) -> None:
        """Stage every delta after ``staged_version`` that is committed, in order.

        ``polled`` is (Relay mirror URL, head) from a :meth:`_poll` just made.
        Each version is read by its manifest key directly (no listing: on a
        far link every request is a round trip), from the region's mirror
        when a Relay heartbeats, else from origin.

        The mirror may lag: origin is the truth, once the Relay had its chance.
        A version the mirror lacks is read from origin after it has been
        missing ``mirror_grace_s`` with no sign of the Relay copying it (each
        segment the Relay announces for it restarts the wait). A mirror that
        missed the grace once (a Relay that died and whose key has not expired
        yet, or one slower than the run) is skipped without waiting until it
        has a version first again: a grace per version would keep this Actor
        one grace behind the run for as long as the key lives.

        Far behind, the stager plans first (:meth:`_catch_up`): replay, or
        a whole version from a snapshot, by the bytes each fetches. A delta
        that is gone though the run's head is past it (``aurora gc``) breaks
        the chain: the Actor re-bootstraps from a snapshot. A delta that
        fails validation at origin is quarantined, and a snapshot past it
        is looked for. A store outage at origin propagates
        (:class:`~aurora_store.errors.StoreUnavailable`): the stager loop
        waits it out.
        """
        relay_url, head = polled if polled is not None else self._poll()[:2]
        mirror, region = self._source(relay_url)
        v = self.staged_version + 1
        store = mirror
        while not self.stop.is_set() and (head is None or v <= head):
            if self._stuck_at == v and self.clock.monotonic() < self._replan_at:
                return  # no way through yet: not a request until the back-off passes
            if not self._room():
                return
            if not self.quarantine.allowed("delta", v):
                self._catch_up(self.origin, head, broken=True)
                return
            if store is mirror and self._behind(head) and self._catch_up(mirror, head):
                v, store = self.staged_version + 1, mirror
                continue
            t0 = time.perf_counter()
            try:
                m, staged = self._fetch_delta(store, v)
                self._check_expected(v, m.state, store)
                staged = self._prepared(staged)
            except VersionNotFound:
                if store is self.origin:
                    if head is not None and v <= head:
                        # Committed (the head is past it) yet gone: retention removed it, or
                        # it was never there. Replay cannot go on; a snapshot past it can.
                        self._catch_up(self.origin, head, broken=True)
                    return  # else not committed (yet)
                if not self._mirror_behind:
                    now = self.clock.monotonic()
                    since = max(self._missing_since.setdefault(v, now), self._relay_progress.get(v, 0.0))
                    if now - since < self.cfg.mirror_grace_s:
                        return
                    log.warning("mirror of region %s lacks v%d after %.1fs; reading from origin until it catches up", region, v, self.cfg.mirror_grace_s)
                    self._mirror_behind = True
                store = self.origin
                continue
            except AuroraError as e:
                if store is not self.origin:
                    log.warning("stage v%d from mirror failed (%s); trying origin", v, e)
                    store = self.origin
                    continue
                if isinstance(e, INVALID):
                    self.quarantine.failed("delta", v, e)
                    self._catch_up(self.origin, head, broken=True)
                    return
                raise  # the store is away (waited out by the caller), or a permanent error
            from_mirror = store is not self.origin
            if not from_mirror:
                self.store_dep.ok()
            self.quarantine.cleared("delta", v)
            if from_mirror and self._mirror_behind:
                log.info("mirror of region %s caught up (v%d); reading from it again", region, v)
                self._mirror_behind = False
            with self.lock:
                self.staged.append((staged, m.state, time.perf_counter() - t0))
                self.staged_version, self.staged_state = v, m.state
            self._delta_bytes.append(m.total_bytes)
            if v >= self._replay_until:
                self._manifests = None  # the planned replay is done
            for d in (self._missing_since, self._relay_progress):
                for old in [k for k in d if k <= v]:
                    del d[old]
            metrics.active().staged(self.cfg.actor_id, self.cfg.region, v, "delta", m.total_bytes, "mirror" if from_mirror else "origin", time.perf_counter() - t0)
            self._on_staged(v, m.total_bytes, time.perf_counter() - t0, from_mirror)
            v += 1
            store = mirror  # the next version: the region's copy first, again

    def _behind(self, head: int | None) -> bool:
        """Whether replaying to ``head`` might cost about as much as a whole version: then plan.

        Planning lists the store and reads manifests, round trips a delta or
        two behind never needs: a delta is a small fraction of a snapshot.
        Without a snapshot's size to compare with (no bootstrap from one),
        there is nothing to weigh.
        """
        if head is None or self._full_bytes is None or self.staged_version < self._replay_until:
            return False
        lag = head - self.staged_version
        if lag < 2:
            return False
        per_delta = max(self._delta_bytes) if self._delta_bytes else None
        return per_delta is None or 2 * lag * per_delta >= self._full_bytes

    def _catch_up(self, store: Store, head: int | None, broken: bool = False) -> bool:
        """Plan the way from ``staged_version`` to the run by bytes; stage a whole version when that wins.

        Returns True when a whole version was staged. ``broken``: replay
        cannot go on (a delta gone or quarantined); with no way through
        either, the plan is tried again after a back-off, logged once.
        """
        now = self.clock.monotonic()
        if head is None or now < self._replan_at:
            return False
        index = scan_versions(store).without(self.quarantine.blocked())
        # The version the run needs next when this Actor is behind it, else the head.
        goal = self._want if self.staged_version < self._want < head else head
        reachable = [v for v in index.deltas | index.snapshots if self.staged_version < v <= goal]
        if not reachable:
            return self._no_way(broken, f"no version after v{self.staged_version} up to v{goal} at {store.url}")
        target = max(reachable)
        reader = ManifestReader(store, self.cfg.trust, self.commits)
        try:
            plan = plan_chain(index, target, held=self.staged_version, cost=reader.cost)
        except (ChainError, VersionNotFound) as e:
            return self._no_way(broken, str(e))
        self._replan_failures, self._stuck_at = 0, None
        if plan.snapshot is None:
            self._replay_until, self._manifests = target, reader
            return False
        if not self._room():
            return False
        log.info(
            "%s: catching up from v%d to v%d through snapshot %d (%d bytes%s)", self.cfg.actor_id, self.staged_version, target,
            plan.snapshot, plan.bytes or 0, "; the chain is broken" if broken else ", fewer than replaying the deltas",
        )
        t0 = time.perf_counter()
        try:
            full = self._stage_full(store, plan, reader)
        except _Refused as r:
            if store is not self.origin:
                # The region's copy is bad, not necessarily origin's: replay, which
                # falls back to origin version by version.
                log.warning("%s: catch-up from the mirror failed (%s); replaying deltas instead", self.cfg.actor_id, r)
                self._replay_until = target
                return False
            self.quarantine.failed(r.kind, r.version, r.error)
            return False
        except VersionNotFound:
            return False  # removed while we read it: plan again next time
        if store is self.origin:
            self.store_dep.ok()
        with self.lock:
            # The whole version replaces every staged delta up to it.
            kept = [e for e in self.staged if e[0].version > full.version]
            self.staged.clear()
            self.staged.append((full, full.state, time.perf_counter() - t0))
            self.staged.extend(kept)
            self.staged_version, self.staged_state = full.version, full.state
        self.quarantine.forget_below(full.version + 1)
        metrics.active().staged(self.cfg.actor_id, self.cfg.region, full.version, "snapshot", full.nbytes, "origin" if store is self.origin else "mirror", time.perf_counter() - t0)
        self._on_staged(full.version, full.nbytes, time.perf_counter() - t0, store is not self.origin)
        return True

    def _no_way(self, broken: bool, why: str) -> bool:
        if not broken:
            return False  # replay goes on as before
        self._replan_failures += 1
        delay = self.cfg.quarantine.delay(self._replan_failures - 1)
        self._replan_at = self.clock.monotonic() + delay
        self._stuck_at = self.staged_version + 1
        if self._replan_failures == 1:
            log.error("%s: stuck at v%d: %s; looking again in %.0fs, then less and less often", self.cfg.actor_id, self.staged_version, why, delay)
        return False

    def _on_staged(self, version: int, nbytes: int, seconds: float, from_mirror: bool) -> None:
        """Called in the stager thread after each version is staged (benchmarks record it)."""

    def _wait_for_relay(self) -> None:
        """``relay_wait_s``: give the region's Relay that long to appear before staging from origin."""
        if self.cfg.relay_wait_s <= 0 or self.cfg.mirror is None:
            return  # no mirror of our own: origin it is
        deadline = self.clock.monotonic() + self.cfg.relay_wait_s
        while not self.stop.is_set() and self.clock.monotonic() < deadline:
            with self.redis_dep.guard("look for the region's Relay"):
                if self.redis.exists(self.keys.relay(self.cfg.region)):
                    return
            self.clock.wait(self.stop, self.cfg.join_poll_s)
        if not self.stop.is_set():
            log.warning("no Relay for region %s after %.0fs; staging from origin", self.cfg.region, self.cfg.relay_wait_s)

    def _verify_active(self) -> None:
        """Check, once per activation, the weights an engine's predicted digest speaks for.

        An engine that predicted the digest of a delta's result before the
        safe point (:meth:`TorchEngine.prepare`) hashes its real weights here,
        in the stager, off the critical path. Weights that are not what was
        predicted are a broken write: no rollout may come from them, so the
        Actor records their real digest and stops with the error (its leases
        expire, and the Trainer sees the mismatch).
        """
        check = getattr(self.engine, "verify_predicted", None)
        v = self.active
        if check is None or v is None or self._verified == v:
            return
        ok = check()
        if ok is None:
            return  # nothing predicted (or a write raced): nothing to check for this version
        self._verified = v
        if not ok:
            digest = self.engine.digest()
            self._redis(partial(record_digest, self.redis, self.keys, self.cfg.actor_id, v, digest), "record a digest")
            raise ModelMismatchError(f"the weights of v{v} after activation are not the ones predicted (digest {digest[:12]}); stopping")

    def _stager_loop(self) -> None:
        self._wait_for_relay()
        last = "$"
        region = None
        polled: tuple[str | None, int | None, int | None] | None = None
        polled_at = float("-inf")
        pauses = self._pauses()
        while not self.stop.is_set():
            try:
                self._verify_active()
                if polled is None:
                    polled, polled_at = self._poll(), self.clock.monotonic()
                url, head, commit = polled
                new_region = self.cfg.region if self._trusted_mirror(url) else None
                if new_region != region or last == "$":
                    # Source changed (Relay up or down): start from the newest entry.
                    last = self.bus.tail_id(new_region)
                    region = new_region
                    self._stage_available((url, head))
                events = self.bus.read(last, block_ms=self.cfg.stage_block_ms, region=region)
                now = self.clock.monotonic()
                for ev in events:
                    last = ev.id
                    if ev.type == COMMIT:
                        self.commit_seen = max(self.commit_seen, ev.version)
                    elif ev.type == SEGMENT and region is not None:
                        self._relay_progress[ev.version] = now  # the Relay is copying it
                    self._announcement(ev, region, url)
                if (
                    self._announced is not None and events and all(ev.type == SEGMENT for ev in events)
                    and now - polled_at < self.cfg.stage_block_ms / 1000
                ):
                    # Only segments of a version still being published, and the run's head read
                    # moments ago: back to the stream at once, so the next announcement starts its
                    # download one round trip sooner (on a far link a poll is one more round trip,
                    # queued behind the segments on the wire). The version's own announcement, a
                    # quiet stream, or a poll older than one block still poll as before.
                    polled = url, head, commit
                    continue
                polled = url, head, commit = self._poll()
                polled_at = self.clock.monotonic()
                # Announcements are hints: a silent stream (a Relay that just died,
                # before its key expires) must not stop us from staging what exists,
                # nor from activating what the Trainer committed.
                if commit is not None:
                    self.commit_seen = max(self.commit_seen, commit)
                if events or (head is not None and head > self.staged_version):
                    self._stage_available((url, head))
                pauses = self._pauses()
            except BusGap:
                last = "$"
            except Exception as e:  # noqa: BLE001 - sorted by _trouble: outages are waited out, the rest ends the Actor
                if not self._trouble(e, "staging"):
                    raise
                self.clock.wait(self.stop, next(pauses))
                last, polled = "$", None

    # -- safe point -------------------------------------------------------------------
    def _wanted_version(self) -> int:
        """The version to run next.

        Stay on the active version while an open step generated on it has
        prompts not yet accepted (a lease that expires comes back to the pool
        and needs someone on this version); then move to the newest version
        that a step or a Commit asks for. With one-step asynchrony this is
        exactly: finish batch b+1 on v_b, then activate v_b+1 for batch b+2.
        """
        needed: list[int] = []
        for _, sv, left in self._redis(self.ledger.open_step_info, "read open steps"):
            if not left:
                continue
            if sv == self.active:
                self._want = self.active
                return self.active
            if sv > self.active:
                needed.append(sv)
        # The oldest version an open step still needs comes first: skipping it
        # would strand that step's prompts on a version nobody holds.
        self._want = min(needed) if needed else max(self.active, self.commit_seen)
        return self._want

    def _next_staged(self, wanted: int) -> tuple[Any, str, float] | None:
        """Under the lock: the staged item that moves the active version towards ``wanted``."""
        while self.staged and self.staged[0][0].version <= self.active:
            self.staged.popleft()  # behind the active version: of no use any more
        fulls = [i for i, e in enumerate(self.staged) if isinstance(e[0], StagedFull) and e[0].version <= wanted]
        if fulls:
            # A whole version the run needs: jump to it (what it supersedes is dropped).
            for _ in range(fulls[-1]):
                self.staged.popleft()
            return self.staged.popleft()
        if self.staged and not isinstance(self.staged[0][0], StagedFull) and self.staged[0][0].base_version == self.active:
            return self.staged.popleft()
        return None

    def _activate(self) -> None:
        """Between batches: apply staged deltas (or swap in a whole version) up to the version the run needs."""
        while self.active < self._wanted_version():
            with self.lock:
                item = self._next_staged(self._want)
            if item is None:
                return
            staged, state, stage_s = item
            t0 = time.perf_counter()
            try:
                self._check_expected(staged.version, state, None)
            except ChainError as e:
                self._refused_state(staged.version, e)
                return
            with self._weights:
                try:
                    if isinstance(staged, StagedFull):
                        self._load_full(staged)
                        self.stats.rebootstraps += 1
                        log.info("%s swapped in v%d (snapshot %d and %d delta(s))", self.cfg.actor_id, staged.version, staged.snapshot, staged.version - staged.snapshot)
                    else:
                        self.engine.apply(staged)
                except INVALID as e:
                    self._refused_at_activation(staged, e)
                    return
                self.active, self.active_state = staged.version, state
                act_s = time.perf_counter() - t0
                me, v, digest = self.cfg.actor_id, self.active, self.engine.digest()
            self.stats.activations.append((v, stage_s, act_s))
            metrics.active().activated(me, self.cfg.region, v, act_s)
            self._redis(partial(record_digest, self.redis, self.keys, me, v, digest), "record a digest")
            self._redis(partial(record_activation, self.redis, self.keys, me, v, stage_s, act_s), "record an activation")
            self._redis(self._heartbeat, "heartbeat")
            log.info("%s activated v%d (staged in %.3fs, applied in %.4fs)", self.cfg.actor_id, self.active, stage_s, act_s)

    def _refused_at_activation(self, staged: Any, e: BaseException) -> None:
        """The engine refused (or misreported) a staged version: quarantine it, drop what was staged on it.

        The stager then stages again from the active version, at origin. An
        engine left holding unchecked weights (it reports another version
        than the active one) is loaded again from origin before it generates.
        """
        kind = "snapshot" if isinstance(staged, StagedFull) and staged.version == staged.snapshot else "delta"
        log.error("%s: refused to activate v%d: %s", self.cfg.actor_id, staged.version, e)
        self.quarantine.failed(kind, staged.version, e)
        with self.lock:
            self.staged.clear()
            self.staged_version, self.staged_state = self.active, self.active_state
        if getattr(self.engine, "version", self.active) != self.active:
            got = self._reach_newest()
            if got is not None:
                with self.lock:
                    self.staged.clear()
                    self.active, self.active_state = got
                    self.staged_version, self.staged_state = got
                self._redis(partial(record_digest, self.redis, self.keys, self.cfg.actor_id, self.active, self.engine.digest()), "record a digest")

    # -- the Trainer's expected states ------------------------------------------------
    def _check_expected(self, version: int, state: str, store: Store | None) -> None:
        """Refuse (:class:`~aurora_store.errors.ChainError`) a version whose state is not the one the Trainer recorded.

        A chain can be self-consistent and still not the Trainer's (a mirror
        that forged a delta on the true base, and everything after it); the
        record in Redis (``state:trainer``) names the state the Trainer
        published. No record (an older Trainer, a Redis that lost its data):
        nothing to compare with, and the chain's own checks stand alone.
        """
        read, want = self._announced.expected_state(version) if self._announced is not None else (False, None)
        if not read:
            want = self._redis(lambda: read_expected_state(self.redis, self.keys, version), "read an expected state")
        if want is not None and want != state:
            src = f" from {store.url}" if store is not None else ""
            raise ChainError(f"v{version}{src}: state {state[:19]}… is not the state the Trainer recorded ({want[:19]}…)")

    def _refused_state(self, version: int, e: BaseException) -> None:
        """A staged version is not the Trainer's (its record came after it was staged): drop what was staged.

        Nothing is quarantined: the bytes may be fine at origin. The stager
        stages again from the active version, and now checks each version
        against the record before staging it, so a mirror that forged it
        loses to origin.
        """
        log.error("%s: refused to activate v%d: %s", self.cfg.actor_id, version, e)
        with self.lock:
            self.staged.clear()
            self.staged_version, self.staged_state = self.active, self.active_state

    def _step_state_held(self, step: int) -> bool:
        """Whether step ``step`` asks for the state this Actor holds: never claim a lease for another one."""
        raw = self._redis(lambda: self.redis.hget(self.keys.step(step), "state"), "read a step's state")
        want = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
        if want is None or want == self.active_state:
            return True
        if self._state_refused != (step, self.active):
            self._state_refused = (step, self.active)
            log.error(
                "%s: step %d asks for state %s… on v%d, this Actor holds %s…: not claiming",
                self.cfg.actor_id, step, str(want)[:19], self.active, self.active_state[:19],
            )
        return False

    # -- work -------------------------------------------------------------------------
    def _work_once(self) -> bool:
        ledger = riding(self.ledger, self.redis_dep, self.stop)
        for s, sv, _ in ledger.open_step_info():
            if sv != self.active or not self._step_state_held(s):
                continue
            status, leases = ledger.claim(self.cfg.actor_id, s, self.cfg.claim)
            metrics.active().claimed(self.cfg.actor_id, self.cfg.region, len(leases))
            if status == "not_alive":
                self._redis(self._heartbeat, "heartbeat")
                return False
            if leases:
                self._generate_and_settle(leases)
                return True
        return False

    def _generate_and_settle(self, leases: list[Lease]) -> None:
        bodies = [json.loads(le.payload) for le in leases]
        prompts = [b["ids"] for b in bodies]
        group = leases[0].group
        t0 = time.perf_counter()
        gen = self.engine.generate(prompts, group, _max_new_tokens(bodies, self.cfg.max_new_tokens), seed=self.cfg.seed ^ leases[0].token, temperature=self.cfg.temperature)
        if self.cfg.slowdown > 1:
            self.clock.wait(self.stop, gen.seconds * (self.cfg.slowdown - 1))
        gen_s = time.perf_counter() - t0
        items = []
        for le, comps in zip(leases, gen.completions, strict=True):
            body = {
                "completions": [list(c.token_ids) for c in comps],
                "texts": [c.text for c in comps],
                "new_tokens": sum(len(c.token_ids) for c in comps),
                "gen_s": gen_s / len(leases),
            }
            items.append((le, self.active, self.active_state, json.dumps(body).encode()))
        # Settling is idempotent per (Actor, lease token): a retry after a lost answer
        # reads ``duplicate`` for what the first attempt already settled.
        for st in self._redis(lambda: self.ledger.settle_many(self.cfg.actor_id, items), "settle"):
            metrics.active().settled(self.cfg.actor_id, self.cfg.region, st.reason)
            if st.accepted or st.reason == "duplicate":
                self.stats.settled += 1
            else:
                self.stats.rejected[st.reason] = self.stats.rejected.get(st.reason, 0) + 1
        self.stats.tokens += gen.new_tokens
        metrics.active().generated(self.cfg.actor_id, self.cfg.region, len(leases), gen.new_tokens, gen_s)

    def run(self) -> ActorStats:
        """Bootstrap, then work until ``stop``; raises what ended it otherwise (an outage past
        the budget, a permanent error), after leaving the ledger as well as it can."""
        threads: list[threading.Thread] = []
        try:
            self.bootstrap()
            if not self.stop.is_set():
                threads = [self._background(self._heartbeat_loop, "heartbeat"), self._background(self._stager_loop, "stager")]
                for t in threads:
                    t.start()
            idle = self.cfg.idle.delays()
            while not self.stop.is_set():
                self._activate()
                if self._work_once():
                    idle = self.cfg.idle.delays()
                else:
                    # Back off while there is nothing to do: idle Actors polling
                    # Redis steal CPU from whoever shares the machine.
                    self.clock.wait(self.stop, next(idle))
        except Exception as e:
            if not (self.stop.is_set() and is_transient(e)):  # a stop during an outage is a stop
                raise
        finally:
            self.stop.set()
            # Leave first: the work loop is done, so nothing claims or settles any
            # more, and a stager still finishing a fetch must not hold the leases
            # (nor the status) hostage until it ends or the process is killed.
            # The heartbeat script refuses a record that is no longer alive.
            self._leave()
            for t in threads:
                t.join(timeout=30)
            if self._announced is not None:
                self._announced.close()
            if hasattr(self, "engine") and hasattr(self.engine, "close"):  # an engine with processes of its own (vLLM)
                self.engine.close()
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    def _leave(self) -> None:
        """Release every lease at once; with Redis away they expire instead (one attempt, no wait)."""
        if not hasattr(self, "active"):
            return  # never bootstrapped, never registered
        try:
            released = self.ledger.leave(self.cfg.actor_id)
        except Exception as e:  # noqa: BLE001 - leaving is best effort: leases expire by themselves
            log.warning("%s could not leave the ledger (%s); its leases expire instead", self.cfg.actor_id, e)
            return
        spilled = f", {self.stats.spilled} delta(s) staged from held segments" if self.stats.spilled else ""
        log.info("%s left: %d settled, %d prompt(s) released, rejections %s%s", self.cfg.actor_id, self.stats.settled, released, self.stats.rejected, spilled)


def _int_or_none(x: Any) -> int | None:
    return None if x is None else int(x)


def _bootstrap_plan(index: VersionIndex, reader: ManifestReader, needed: int | None) -> ChainPlan | None:
    """The plan to version ``needed`` (an open step's, when the store can reach it), else to the newest."""
    if needed is not None and needed in index.deltas | index.snapshots:
        try:
            return plan_chain(index, needed, cost=reader.cost)
        except ChainError:
            pass  # gone or broken: the newest version it is (the step waits for another Actor)
    return _newest_plan(index, reader)


def _newest_plan(index: VersionIndex, reader: ManifestReader, tries: int = 16) -> ChainPlan | None:
    """The plan to the newest version ``index`` can reach (trying the ``tries`` newest), or None."""
    for target in sorted(index.deltas | index.snapshots, reverse=True)[:tries]:
        try:
            return plan_chain(index, target, cost=reader.cost)
        except ChainError:
            continue
    return None


def _missing_bucket(store: Store) -> str | None:
    """The bucket of an S3 run root when it does not exist; None when it does or nobody can tell.

    A run root that does not exist yet is normal (the Trainer creates it); a
    bucket is created by whoever runs the cluster, never by the Trainer, and
    S3 answers a read in a missing bucket exactly as one of a missing key.
    """
    if store.protocol not in ("s3", "s3a"):
        return None
    bucket = store.root.split("/", 1)[0]
    try:
        return None if store.fs.exists(bucket) else bucket
    except Exception:  # noqa: BLE001 - cannot tell: wait for the run as usual
        return None


def _same_root(a: str, b: str) -> bool:
    """Whether two run-root URLs name the same place (a trailing ``/`` aside)."""
    return a.rstrip("/") == b.rstrip("/")


def _shown_url(url: str) -> str:
    """``url`` fit for a log line: no user or password, no query, at most 200 characters.

    It came from Redis: untrusted, and possibly carrying credentials.
    """
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        host = u.hostname or ""
        port = f":{u.port}" if u.port else ""
        shown = f"{u.scheme}://{host}{port}{u.path}" if u.scheme else "(not a URL)"
    except ValueError:
        shown = "(not a URL)"
    return repr(shown[:200])


def _nonempty(index: VersionIndex) -> VersionIndex | None:
    return index if index.latest is not None else None


def _manifest(
    store: Store, reader: ManifestReader | None, kind: str, version: int, trust: TrustKeys | None = None,
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


MAX_NEW_TOKENS_LIMIT = 32768
"""Most tokens per completion an Actor generates, whatever a prompt's payload asks (Redis is not trusted)."""


def _max_new_tokens(bodies: list[Any], default: int) -> int:
    """The completion length the Trainer accepts, as its payloads say (the smallest, bounded); ``default`` when they say none."""
    asked = [b.get("max_new_tokens") for b in bodies if isinstance(b, dict)]
    ok = [int(n) for n in asked if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_NEW_TOKENS_LIMIT]
    return min(ok) if ok and len(ok) == len(bodies) else default
