"""The Trainer's versions: ship each one, then record it in the run's records and announce it.

A version goes through :class:`VersionPublisher` in three moves: the fence
is checked (only the Trainer of the current epoch publishes), the weights are
shipped (a delta through the public API's :class:`~aurora_store.Publisher`,
or a baseline of ``aurora bench wan``: a full snapshot, or nothing), then
:meth:`VersionPublisher.record` writes the digest, the expected state and the
head through :class:`~aurora_store.coordination.records.RunRecords` (fenced
by the epoch) and announces VERSION. Commit comes later, from the Trainer,
once the batch generated on the version exists.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from aurora_store import metrics
from aurora_store.api import Publisher
from aurora_store.api.snapshots import SnapshotResult
from aurora_store.apply.sink import tree_weights_digest, weights_digest
from aurora_store.codec.fusion import FusionPlan
from aurora_store.coordination.bus import VERSION, Bus
from aurora_store.coordination.records import RunRecords
from aurora_store.errors import FencedOut, VersionConflict
from aurora_store.format.manifest import manifest_key
from aurora_store.format.signing import Signer
from aurora_store.lineage.binding import ModelFile
from aurora_store.lineage.gc import retain
from aurora_store.lineage.interfaces import HeldVersions
from aurora_store.lineage.publish import DEFAULT_SHARD_BYTES, PublishConfig
from aurora_store.outage import is_transient
from aurora_store.storage import Store
from workers.trainer.config import TrainerConfig
from workers.trainer.crash import crash_point
from workers.trainer.held import HeldWeights
from workers.trainer.publishing import Published, publish_version

__all__ = ["SNAPSHOT_SHARD_FLOOR", "VersionEvent", "VersionObserver", "VersionPublisher", "snapshot_shard_bytes"]

log = logging.getLogger("aurora.trainer")


@dataclass(frozen=True, slots=True)
class VersionEvent:
    """One version shipped and recorded (what a benchmark times)."""

    version: int
    kind: str
    """``snapshot``, ``delta``, ``base`` (built by every Actor, nothing written) or ``none``."""
    nbytes: int
    """Bytes written to the store."""
    started_ms: float
    """When shipping began (wall clock, ms)."""
    recorded_ms: float
    """When the head named it (wall clock, ms)."""


VersionObserver = Callable[[VersionEvent], None]
"""Told of every version once it is recorded (``aurora bench wan`` keeps the times)."""


SNAPSHOT_SHARD_FLOOR = 8 << 20
"""The smallest snapshot shard :func:`snapshot_shard_bytes` picks (small models: a few objects, 64 MiB in flight)."""


def snapshot_shard_bytes(version_bytes: int, streams: int) -> int:
    """Shard size for the Trainer's snapshots: the upload keeps up to ``streams`` shards in memory beside
    the version (built while the next step runs), so they are sized to hold about an eighth of the version
    between them (:data:`SNAPSHOT_SHARD_FLOOR` to the library's default). Measured with ``aurora bench
    trainer --params 2e8 --nproc 2``: the default (1 GiB: the whole 0.4 GB version in one shard) put
    rank 0's peak at the snapshot's start, about 0.3 GB above the update's."""
    return max(SNAPSHOT_SHARD_FLOOR, min(DEFAULT_SHARD_BYTES, version_bytes // (8 * max(1, streams))))


class VersionPublisher:
    """Ships and records the versions of one Trainer; holds the versions batches may still be generated on.

    ``store`` rides outages (the Publisher writes through it); ``raw_store``
    does not (retention runs best effort on it). ``records`` rides Redis outages.
    """

    def __init__(
        self,
        store: Store,
        raw_store: Store,
        records: RunRecords,
        bus: Bus,
        cfg: TrainerConfig,
        publish_config: PublishConfig,
        signer: Signer | None,
        stop: threading.Event,
        held_versions: Callable[[], HeldVersions],
        on_version: VersionObserver | None = None,
    ) -> None:
        self.store = store
        self.raw_store = raw_store
        self.records = records
        self.bus = bus
        self.cfg = cfg
        self.publish_config = publish_config
        self.signer = signer
        self.stop = stop
        self.held_versions = held_versions
        """What live Actors and Relays hold or stage (read before a retention round)."""
        self.on_version = on_version
        self.commit: Callable[[str, int, bytes], None] | None = None
        """Redis-commit mode's callback (FORMAT.md §1); None: the store commits."""
        self.plan: FusionPlan | None = None
        self.publisher: Publisher | None = None
        self.states: dict[int, str] = {}
        """version -> its ``state``, for every version this Trainer published or continued from."""
        self.held = HeldWeights()
        """bf16 weights of the versions a batch may still be generated on: the newest in full, the
        older ones (``max_lag`` of them) as what rebuilds them from it (:mod:`workers.trainer.held`)."""
        self.place: Callable[[], torch.device | None] = lambda: None
        """Where held versions go (the Trainer's ``versions_on``); None: where they are given."""
        self.full_bytes = 0
        """Bytes of a whole version (version 0's snapshot)."""
        self.digests: dict[int, str] = {}
        """version -> the tree digest (FORMAT.md §4.1) of its weights, for the versions hashed:
        version 0, snapshots and checkpoint versions (see :meth:`digest_of`)."""
        self.publish_s = 0.0
        """Seconds the last :meth:`publish` kept its step waiting, hashing excluded (``aurora bench trainer``)."""
        self.digest_s = 0.0
        """Seconds the last :meth:`publish` spent hashing weights (0 at most versions)."""
        self._snapshots_ended: deque[SnapshotResult] = deque()
        """Snapshots written in the background that ended since the last step looked (appended on their thread)."""

    @property
    def published(self) -> dict[str, torch.Tensor]:
        """The newest version's bf16 weights."""
        return self.held.weights

    @property
    def newest(self) -> int:
        """The newest version published or continued from (-1: none yet)."""
        return max(self.states, default=-1)

    def start(self, plan: FusionPlan, model_files: list[ModelFile] | None) -> None:
        """The Publisher over this Trainer's store, stream, signer and commit mode (once the plan is known).

        It extracts, encodes, uploads and announces each segment; the
        records and the VERSION announcement are :meth:`record`'s.
        """
        self.plan = plan
        config = self.publish_config
        if config.shard_bytes == DEFAULT_SHARD_BYTES:  # not chosen by the caller: sized for this model
            version_bytes = 2 * sum(p.spec.numel for p in plan.params.values())
            config = dataclasses.replace(config, shard_bytes=snapshot_shard_bytes(version_bytes, config.streams))
        snap = self.cfg.snapshot_every if self.cfg.transfer == "delta" else 0
        self.publisher = Publisher(
            self.store,
            run=self.records.run,
            bus=self.bus,
            signer=self.signer,
            model_files=model_files,
            commit=self.commit,
            prepared=True,
            plan=plan,
            snapshot_every=snap,
            digest_every=self.cfg.digest_every,
            config=config,
            on_segment=lambda ev: crash_point("segment", ev.version),
            background_snapshots=True,
            on_snapshot=self._snapshots_ended.append,
        )

    def _publisher(self) -> tuple[Publisher, FusionPlan]:
        if self.publisher is None or self.plan is None:
            raise RuntimeError("VersionPublisher.start() has not run")
        return self.publisher, self.plan

    def publish_first(self, weights: dict[str, torch.Tensor], producer: dict[str, Any]) -> int:
        """Version 0 as a snapshot; returns its bytes."""
        pub, _ = self._publisher()
        t0 = time.time() * 1000
        p = pub.publish(weights, producer=producer, owned=True)
        assert p is not None and p.version == 0
        self._hold(0, p.state, weights)
        self.full_bytes = p.bytes
        if p.weights_digest is not None:
            self.digests[0] = p.weights_digest
        self.record(0, "snapshot", p.bytes, p.weights_digest, t0)
        metrics.active().published(0, "snapshot", p.bytes)
        return p.bytes

    def continue_from(self, version: int, state: str, weights: Mapping[str, torch.Tensor], kind: str, digest: str | None = None) -> None:
        """Continue the chain after ``version`` (its ``state``), whose weights this Trainer holds.

        A resumed run's newest version, or a synthetic base every Actor builds
        (``kind="base"``); it is recorded again (the head, its expected state).
        """
        pub, _ = self._publisher()
        self._hold(version, state, weights)
        if digest is not None:
            self.digests[version] = digest
        pub.continue_from(version, state, self.published, owned=True)
        self.record(version, kind, 0, digest, time.time() * 1000)

    def hold(self, version: int, state: str, weights: Mapping[str, torch.Tensor]) -> None:
        """Keep ``version`` (already in the store) as one a batch may be generated on."""
        self.states[version] = state
        self.held.hold(version, _placed(weights, self.place()))

    def _hold(self, version: int, state: str, weights: Mapping[str, torch.Tensor]) -> None:
        self.hold(version, state, weights)

    def behaviour(self, version: int, oldest_needed: int) -> Mapping[str, torch.Tensor]:
        """Version ``version``'s weights for one batch's behaviour log-probabilities; then what rebuilds
        versions older than ``oldest_needed`` (no batch to come is generated on them) is let go, so
        it is freed as soon as the returned view is (:meth:`~workers.trainer.held.VersionView.release`)."""
        w = self.held[version]
        self.held.forget_before(min(oldest_needed, self.held.newest if self.held.newest is not None else version))
        self.held.compact()  # what must outlive this batch (max_lag > 1) shrinks to the elements that changed
        return w

    def publish(self, v: int, new: dict[str, torch.Tensor], producer: dict[str, Any]) -> tuple[int, int]:
        """Ship version ``v`` as ``cfg.transfer`` says; returns (bytes written, changed elements).

        Only the Trainer of the current epoch publishes: the fence is checked
        first, and a manifest already at ``v`` with other bytes (a newer
        Trainer got there first) fences this one out too.
        """
        t0 = time.time() * 1000
        started = time.perf_counter()
        pub, plan = self._publisher()
        self.records.check_epoch()
        digest: str | None = None
        digest_s = 0.0
        try:
            if self.cfg.transfer == "delta":
                # Weights are hashed only where something binds to them (FORMAT.md §4.1): the delta at a
                # snapshot's version (the Publisher decides) and at a checkpoint's; the snapshot is
                # uploaded after the delta, in the background (retention waits for its commit).
                p = pub.publish(new, producer=producer, owned=True, digest=self.binds(v))
                assert p is not None and p.version == v, (p, v)
                out = Published(p.state, "delta", p.bytes - p.snapshot_bytes, p.changed)
                digest, digest_s = p.weights_digest, p.digest_s
            else:  # the broadcast baselines of `aurora bench wan`
                if self.binds(v):  # in the form the baseline's snapshots carry (they hash themselves)
                    digest = (weights_digest if self.cfg.transfer == "full" else tree_weights_digest)(new, plan)
                    digest_s = time.perf_counter() - started
                out = publish_version(
                    self.store,
                    self.records.run,
                    v,
                    int(producer.get("step", v - 1)),
                    self.cfg.transfer,
                    plan,
                    self.published,
                    new,
                    self.states[v - 1],
                    self.publish_config,
                    self.bus,
                    producer=producer,
                    weights_digest=digest,
                    signer=self.signer,
                    commit=self.commit,
                )
        except VersionConflict as e:
            raise self._conflict(v, e) from e
        crash_point("manifest", v)
        self._hold(v, out.state, new)
        self.held.forget_before(v - self.cfg.max_lag)
        if digest is not None:
            self.digests[v] = digest
        self.record(v, out.kind, out.nbytes, digest, t0)
        metrics.active().published(v, out.kind, out.nbytes)
        self.snapshots_ended()
        self.digest_s = digest_s
        self.publish_s = max(0.0, time.perf_counter() - started - digest_s)
        return out.nbytes, out.changed

    def binds(self, v: int) -> bool:
        """Whether a checkpoint binds to version ``v`` (the Trainer saves one before step ``v`` every
        ``checkpoint_every``): its delta then carries the weights digest, as at a snapshot's version."""
        every = self.cfg.checkpoint_every
        return every > 0 and v % every == 0

    def digest_of(self, v: int) -> str | None:
        """The tree digest (FORMAT.md §4.1) of version ``v``'s weights: the one its delta carries and the
        records hold when ``v`` was hashed at publishing (snapshot and checkpoint versions, version 0),
        else computed now from the held weights; None when this Trainer no longer holds them.
        What a checkpoint of ``v`` records as ``weights_digest``."""
        if v not in self.digests:
            weights, plan = self.held.get(v), self.plan
            if weights is None or plan is None:
                return None
            self.digests[v] = tree_weights_digest(weights, plan)
        return self.digests[v]

    def snapshots_ended(self) -> None:
        """Account for snapshots the background finished since: count those committed, then run
        retention (only now: nothing is deleted before a snapshot is committed). A failed one was
        logged on its thread; the next snapshot is written as usual."""
        committed = False
        while self._snapshots_ended:
            res = self._snapshots_ended.popleft()
            if res.ok:
                metrics.active().published(res.version, "snapshot", res.bytes)
                committed = True
        if committed:
            self.retain()

    def drain(self) -> None:
        """Wait for a snapshot still being uploaded, then account for it (the end of a run)."""
        if self.publisher is not None:
            self.publisher.wait_snapshots()
        self.snapshots_ended()

    def _conflict(self, v: int, e: VersionConflict) -> Exception:
        """What a conflict at version ``v`` means: a newer Trainer (the epoch in Redis moved on:
        :class:`~aurora_store.errors.FencedOut`), or an object nobody in this run published.

        Why: anyone who can write the bucket can put bytes at ``deltas/v{H+1}/manifest.json``;
        calling that "fenced out" would send an operator looking for a second Trainer
        that does not exist. The epoch is asked again (a fence check restores a lost one).
        """
        try:
            self.records.check_epoch()
        except FencedOut as fenced:
            return FencedOut(f"version {v} was published by another Trainer; this one (epoch {self.records.epoch}) stops: {fenced}")
        where = self.store.where(manifest_key("delta", v))
        return VersionConflict(
            f"{where} (or the snapshot beside it) already holds an object this Trainer did not write, and no newer "
            f"Trainer holds the run (epoch {self.records.epoch} is current): it was planted or left by another writer; "
            f"inspect it (aurora lineage {self.store.url}), delete it if nobody should have published version {v}, "
            f"then restart the Trainer ({str(e).splitlines()[0][:300]})"
        )

    def record(self, v: int, kind: str, nbytes: int, digest: str | None, started_ms: float) -> None:
        """Record version ``v`` (digest, expected state, head) and announce it.

        The state Actors must reach at ``v`` is recorded before the head names
        ``v``: an Actor refuses to activate a version whose manifest says
        otherwise (a forged chain).
        """
        state = self.states[v]
        self.records.record_version(v, state, digest)
        recorded_ms = time.time() * 1000
        self.bus.announce(VERSION, v, kind=kind, state=state, bytes=nbytes)
        if self.on_version is not None:
            self.on_version(VersionEvent(v, kind, nbytes, started_ms, recorded_ms))

    def retain(self) -> None:
        """Retention after a snapshot: keep the newest ``keep_snapshots`` and everything after the
        oldest of them, and whatever live Actors and Relays hold or stage (read from Redis first).

        Best effort: with Redis or the store away the round is skipped (never a partial
        view of who holds what), and the next snapshot tries again.
        """
        if self.cfg.keep_snapshots <= 0:
            return
        held = self.held_versions()
        try:
            # Nothing above this Trainer's own head counts: a planted snapshot at v9999999999 must
            # not move the floor above every real version (issue 24).
            spares = self.publisher.spares if self.publisher is not None else None
            plan = retain(self.raw_store, self.cfg.keep_snapshots, held, ceiling=self.newest, spare_orphan=spares)
        except Exception as e:  # noqa: BLE001 - sorted right below
            if not is_transient(e):
                raise
            log.warning("retention skipped this round: %s", e)
            return
        if plan.versions or plan.orphans:
            log.info("retention: %s", plan.summary())


def _placed(weights: Mapping[str, torch.Tensor], device: torch.device | None) -> dict[str, torch.Tensor]:
    """``weights`` on ``device`` (as they are when None or already there); tied names stay one tensor."""
    if device is None:
        return dict(weights)
    moved: dict[int, torch.Tensor] = {}
    out = {}
    for n, t in weights.items():
        if t.device == device:
            out[n] = t
            continue
        key = id(t)
        if key not in moved:
            moved[key] = t.to(device)
        out[n] = moved[key]
    return out
