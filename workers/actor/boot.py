"""How an Actor gets its engine and its first version: the :class:`Boot` Protocol and the real one.

:class:`StoreBoot` builds the engine from the run's model description in the
store (waiting for a run that has not appeared yet), then loads the version
the run needs: the oldest an open step still needs, else the newest usable
one, through a snapshot and the deltas after it. A version that fails
validation is quarantined and the next plan routes around it.

Which versions it aims at comes from trusted facts (issue 24): at or below
the head of the Trainer's fenced record, never the newest names the store
lists (anyone who can write the bucket can list ``v9999999999`` sixteen
times); with no record yet, the chain that counts
(:mod:`aurora_store.lineage.trusted`). Whether the run holds deltas (which
decides whether an unbound snapshot may be used) is origin's listing. A benchmark
plugs in another boot (a synthetic model and its base, for instance); the
Actor's registration, release of a previous incarnation's work and outage
riding stay the same whatever boot it has.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, TypeVar

from aurora_store import metrics
from aurora_store.errors import ChainError, StoreError, VersionNotFound
from aurora_store.format.manifest import manifest_key
from aurora_store.lineage.fetch import ManifestReader
from aurora_store.lineage.plan import ChainPlan, VersionIndex, plan_chain, scan_versions
from aurora_store.lineage.trusted import committed_versions
from aurora_store.storage import Store
from workers.actor.context import ActorContext
from workers.actor.fetch import INVALID, Fetcher, Refused
from workers.common import MODEL_CONFIG_KEY, check_model_files, read_model_description
from workers.engine import make_engine

__all__ = ["Boot", "StoreBoot"]

log = logging.getLogger("aurora.actor")

T = TypeVar("T")


class Boot(Protocol):
    """How an Actor's engine is built and its first version reached.

    Why a Protocol: the model and its first weights are what a benchmark
    replaces (a synthetic model, a base held in memory); the Actor keeps
    registering, releasing and riding outages around it.
    """

    @property
    def waited_for_run(self) -> bool:
        """Whether it had to wait for the run to appear (said in the bootstrap line)."""
        ...

    def prepare(self) -> None:
        """Build the engine (``ActorContext.set_engine``), no weights yet; returns early once ``stop`` is set."""
        ...

    def reach(self) -> tuple[int, str] | None:
        """Weights of the version to start at into the engine: (version, state); None once ``stop`` is set.

        Also how the safe point reloads an engine left holding weights nobody checked.
        """
        ...


class StoreBoot:
    """The Actor's boot from the run's store (see the module docstring)."""

    def __init__(self, ctx: ActorContext, fetcher: Fetcher) -> None:
        self.ctx = ctx
        self.fetcher = fetcher
        self._waiting_said = False
        self._model_unchecked: dict[str, str] | None = None
        """The model files read before any snapshot listed them (key -> sha256): checked once one does."""

    @property
    def waited_for_run(self) -> bool:
        return self._waiting_said

    def wait_for_run(self, what: str, probe: Callable[[], T | None]) -> T | None:
        """``probe()`` (a store read) until it finds something, or None if stopped first.

        The Trainer may start after the Actors: that is a wait, not an
        error, said once in the log (the bootstrap line says when it ended).
        An S3 bucket that does not exist is never going to hold a run: that
        ends the Actor (:class:`~aurora_store.errors.StoreError`).
        """
        c = self.ctx
        while not c.stop.is_set():
            got = c.store_call(probe, f"look for {what}")
            if got is not None:
                return got
            if not self._waiting_said:
                bucket = _missing_bucket(c.origin)
                if bucket is not None:
                    raise StoreError(f"{c.origin.url}: bucket {bucket!r} does not exist (or these credentials cannot see it)")
                log.info("%s: waiting for the run to appear at %s (no %s yet)", c.cfg.actor_id, c.origin.url, what)
                self._waiting_said = True
            c.clock.wait(c.stop, c.cfg.run_poll_s)
        return None

    def prepare(self) -> None:
        """Build the engine from the run's model description (no weights yet); waits for the run."""
        c = self.ctx

        def described() -> bool | None:
            return True if c.origin.exists(MODEL_CONFIG_KEY) else None  # written last (write_model_description)

        if self.wait_for_run("model description", described) is None:
            return
        # Version 0's manifest lists the files (FORMAT.md §1), written right after them: one
        # read before it exists (the Trainer still setting up) is checked once it does (reach).
        listed = c.store_call(
            lambda: c.origin.exists(manifest_key("snapshot", 0)) or bool(scan_versions(c.origin).snapshots), "look for version 0"
        )
        used: dict[str, str] = {}
        model, tokenizer = c.store_call(
            lambda: read_model_description(c.origin, used, unlisted_ok=not listed), "read the model description"
        )
        self._model_unchecked = None if listed else used
        engine = make_engine(c.cfg.engine, tokenizer, c.cfg.device, c.cfg.serve_dtype)
        engine.load(model)
        c.set_engine(engine)

    def reach(self) -> tuple[int, str] | None:
        """Weights of the newest usable version into the engine: (version, state), or None if stopped.

        A version that fails validation is quarantined and the next plan
        routes around it (an older version, another snapshot); with no
        usable version yet, this waits like a run that has not appeared.
        """
        got = self._reach_newest()
        if got is not None and self._model_unchecked is not None:
            used, c = self._model_unchecked, self.ctx
            c.store_call(lambda: check_model_files(c.origin, used), "check the model files")
            self._model_unchecked = None
        return got

    def _reach_newest(self) -> tuple[int, str] | None:
        c = self.ctx
        said = False
        while not c.stop.is_set():
            index = self.wait_for_run("version", lambda: _nonempty(scan_versions(c.origin)))
            if index is None:
                return None
            usable = index.without(c.quarantine.blocked())
            self.fetcher.resolve_commits()
            reader = self.fetcher.reader(c.origin)
            reader.snapshot_only = not index.deltas  # origin's listing: a mirror never decides it
            needed = c.redis_call(self._oldest_needed, "read open steps")
            head = c.redis_call(c.records.head, "read the run's head")
            plan = c.store_call(partial(_bootstrap_plan, usable, reader, needed, head), "plan the bootstrap")
            if plan is None:
                if not said:
                    log.warning("%s: no usable version at %s yet; waiting", c.cfg.actor_id, c.origin.url)
                    said = True
                # Quarantined versions come back after their back-off, not sooner.
                c.clock.wait(c.stop, c.cfg.quarantine.initial_s if c.quarantine.versions() else c.cfg.run_poll_s)
                continue
            try:
                full = c.store_call(partial(self.fetcher.stage_full, c.origin, plan, reader), "bootstrap")
            except Refused as r:
                c.quarantine.failed(r.kind, r.version, r.error)
                continue
            except VersionNotFound:
                continue  # removed while we read it (retention): plan again
            try:
                self.fetcher.load_full(full)
            except INVALID as e:  # the engine reached other weights than the chain checked here
                c.quarantine.failed("delta" if full.version > full.snapshot else "snapshot", full.version, e)
                continue
            c.quarantine.forget_below(full.version)
            metrics.active().bootstrapped(c.cfg.actor_id, c.cfg.region, full.version, full.nbytes)
            return full.version, full.state
        return None

    def _oldest_needed(self) -> int | None:
        """The oldest version an open step generated on still has prompts to settle on, or None.

        A fresh Actor starts there, not at the newest version: an Actor never
        goes back, so one that started past such a step could never serve it,
        and a step whose only Actor died would wait for ever.
        """
        left = [sv for _, sv, n in self.ctx.ledger.open_step_info() if n > 0]
        return min(left) if left else None


def _nonempty(index: VersionIndex) -> VersionIndex | None:
    return index if index.latest is not None else None


def _bootstrap_plan(index: VersionIndex, reader: ManifestReader, needed: int | None, head: int | None = None) -> ChainPlan | None:
    """The plan to version ``needed`` (an open step's, when the store can reach it), else to the newest.

    ``head``: the Trainer's record's; no version above it is aimed at.
    """
    if needed is not None and (head is None or needed <= head) and needed in index.deltas | index.snapshots:
        try:
            return plan_chain(index, needed, cost=reader.cost)
        except ChainError:
            pass  # gone or broken: the newest version it is (the step waits for another Actor)
    return _newest_plan(index, reader, head)


def _newest_plan(index: VersionIndex, reader: ManifestReader, head: int | None = None, tries: int = 16) -> ChainPlan | None:
    """The plan to the newest version that counts and ``index`` can reach (trying the ``tries`` newest), or None.

    With the Trainer's ``head``: versions at or below it, newest first. Without
    one (no record yet, or a Redis that lost it): the versions that count
    (:func:`~aurora_store.lineage.trusted.committed_versions`: the chain from
    the root), each manifest read once through ``reader``, which the plan reuses.
    """
    for target in _targets(index, reader, head)[:tries]:
        try:
            return plan_chain(index, target, cost=reader.cost)
        except (ChainError, VersionNotFound):
            continue
    return None


def _targets(index: VersionIndex, reader: ManifestReader, head: int | None) -> list[int]:
    """Versions to aim at, newest first (see :func:`_newest_plan`)."""
    if head is not None:
        return sorted((v for v in index.deltas | index.snapshots if v <= head), reverse=True)

    def read(kind: str, version: int) -> Any:
        m = reader.get(kind, version)
        if m is None:
            raise VersionNotFound(reader.why(kind, version) or f"{kind} {version} is not readable")
        return m

    counted = committed_versions(reader.store, listed=index, read=read, snapshot_only=reader.snapshot_only or None).index
    return sorted(counted.deltas | counted.snapshots, reverse=True)


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
