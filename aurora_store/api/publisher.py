"""``Publisher``: Aurora's weight path for any trainer (a plain PyTorch loop, TRL, verl ...).

Each :meth:`Publisher.publish` makes the next version of a run: the first
on a fresh run root is version 0 (a snapshot); every later one is a sparse
delta against the version published before it (the changed bf16 elements
only), and a snapshot too every ``snapshot_every`` versions or on request.
Weights are hashed (the tree digest of FORMAT.md §4.1, a tensor per thread)
only where something binds to them: version 0, each snapshot and the delta of
its version, and the versions asked for (``digest=True``, ``digest_every``);
with ``background_snapshots`` a snapshot is uploaded on a thread of its own
after the delta of its version is committed, and :meth:`Publisher.publish`
returns without waiting for it.
With Redis, every segment and version is announced and the chain's state
recorded as the Trainer does (docs/WORKERS.md), so Relays and Actors follow
a Publisher's run like any other. Opened on a run root that already holds
versions, it continues the chain: the newest committed version is
materialized from the store, checked against its state, and the next
publish is a delta against it.

Every detail has a default: segment sizes, streams, encodings, signing
(``sign_key``), the commit mode (create-only manifests, or ``commit_via=
"redis"`` for S3 servers that ignore conditional writes), riding out
outages of Redis and the store (``outage_budget_s``). A publish that fails
may be called again with the same weights: it writes the same bytes (or
finds them committed) and returns what it published.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch

from aurora_store.api.published import Published, WaitedFor, announce_segments, run_name_of, same_weights
from aurora_store.api.snapshots import SnapshotResult, SnapshotWriter
from aurora_store.api.weights import (
    Tensors,
    family_of,
    gather_bf16,
    is_distributed_rank,
    named_tensors,
    tied_head,
)
from aurora_store.apply.sink import tree_weights_digest
from aurora_store.codec.entries import EncodeOptions
from aurora_store.codec.extract import extract, plan_of, unfuse_weights
from aurora_store.codec.fusion import TIED_HEAD, FusionPlan
from aurora_store.coordination.bus import COMMIT, VERSION, Bus
from aurora_store.coordination.commit import prepare_commit
from aurora_store.coordination.records import RunRecords
from aurora_store.coordination.redisconn import connect
from aurora_store.errors import ConfigError
from aurora_store.format.manifest import Manifest, new_attempt_id
from aurora_store.format.signing import Signer, signer_from_option
from aurora_store.lineage.binding import ModelFile
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.plan import scan_versions
from aurora_store.lineage.publish import (
    PublishConfig,
    SegmentEvent,
    _utc_now,
    encode_options_from_env,
    publish_delta,
    publish_snapshot,
)
from aurora_store.lineage.shards import ReadGate
from aurora_store.outage import Dependency, outage_budget_s, riding
from aurora_store.storage import Store, open_store

__all__ = ["Published", "Publisher", "SnapshotResult", "announce_segments", "run_name_of"]

log = logging.getLogger("aurora.publisher")


class Publisher:
    """Publishes successive versions of one run; see the module's docstring.

    Parameters: ``store`` (run root URL), ``redis`` (URL; None: no
    announcements, readers poll the store), ``run`` (Redis namespace and
    manifests' ``run``; default: the root's last path component),
    ``storage_options`` (fsspec, e.g. an endpoint), ``snapshot_every``
    (a snapshot too every N versions; 0: only version 0), ``sign_key``
    (FORMAT.md §4.1), ``model_files`` (the description version 0 lists,
    from ``workers.common.write_model_description``; None: none),
    ``commit_via`` (``store`` or ``redis``), ``outage_budget_s``,
    ``options`` (encodings; default: the ``AURORA_*`` encoder variables), ``format``
    (segment format: 2, or 1 for readers that know only format 1; default
    ``AURORA_FORMAT``, else 2),
    ``digest_every`` (also hash every N-th version; 0: only where something
    binds to the digest), ``background_snapshots`` (a snapshot after version 0
    is uploaded on a thread while later versions go on; ``on_snapshot`` is told,
    on that thread, how each ended; :meth:`wait_snapshots` and :meth:`close`
    wait for it).

    Under torch.distributed every rank calls :meth:`publish` with its shard
    of the model; the gather is collective, only rank 0 opens the store and
    Redis and writes, the others return None.
    """

    def __init__(
        self,
        store: str | Store,
        *,
        redis: str | Any | None = None,
        run: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        snapshot_every: int = 0,
        sign_key: str | None = None,
        signer: Signer | None = None,
        model_files: list[ModelFile] | None = None,
        commit_via: str = "store",
        outage_budget: float | None = None,
        streams: int | None = None,
        options: EncodeOptions | None = None,
        format: int | None = None,
        bus: Bus | None = None,
        commit: Callable[[str, int, bytes], None] | None = None,
        prepared: bool = False,
        plan: FusionPlan | None = None,
        on_segment: Callable[[SegmentEvent], None] | None = None,
        config: PublishConfig | None = None,
        digest_every: int = 0,
        background_snapshots: bool = False,
        on_snapshot: Callable[[SnapshotResult], None] | None = None,
    ) -> None:
        if snapshot_every < 0:
            raise ConfigError(f"snapshot_every must be >= 0, got {snapshot_every}")
        if digest_every < 0:
            raise ConfigError(f"digest_every must be >= 0, got {digest_every}")
        self.digest_every = digest_every
        self._snapshots = SnapshotWriter(on_snapshot) if background_snapshots else None
        self._snapshot_gate = ReadGate()
        """Uploads snapshots after version 0 off the publishing step (None: in it)."""
        self._hash_pool: ThreadPoolExecutor | None = None
        self.stop = threading.Event()
        self.snapshot_every = snapshot_every
        self.model_files = model_files
        self._leader = not is_distributed_rank()[0] or is_distributed_rank()[1] == 0
        url = store if isinstance(store, str) else store.url
        self.run = run or run_name_of(url)
        self.version: int | None = None
        """The newest version this Publisher published or continued from."""
        self.state: str | None = None
        self._base: dict[str, torch.Tensor] | None = None
        self._plan: FusionPlan | None = plan
        self._chain_read = False
        """Whether the store's newest version was looked for (once, before the first publish)."""
        self._on_segment = on_segment
        self._plan_tied: bool | None = None
        self._given: dict[str, torch.Tensor] = {}
        self._pending: tuple[int, str, str, dict[str, torch.Tensor]] | None = None
        """(version, attempt, created_at, weights) of a publish that failed: a retry of the same weights writes the same bytes."""
        if options is None and config is None:
            options = encode_options_from_env()  # AURORA_FORMAT and the encoder's other variables, as the Trainer reads them
        over: dict[str, Any] = {k: v for k, v in (("streams", streams), ("options", options)) if v is not None}
        self._pub_cfg = config if config is not None else PublishConfig.from_env(**over)
        if format is not None:  # 1: for readers that know only format 1
            self._pub_cfg = replace(self._pub_cfg, options=replace(self._pub_cfg.options, format=format))
        """Defaults, then ``AURORA_STREAMS`` / ``AURORA_SEGMENT_MIB``, then the arguments."""
        self._last_delta_bytes: int | None = None
        """Bytes of the last delta published: with an adaptive segment size, the next is cut by it."""
        if not self._leader:
            return
        budget = outage_budget_s(outage_budget)
        self.store_dep = Dependency("the store", log, budget)
        raw_store = store if not isinstance(store, str) else open_store(store, dict(storage_options or {}))
        self._raw_store = raw_store
        self.store = riding(raw_store, self.store_dep, self.stop)
        self.signer = signer if signer is not None else signer_from_option(sign_key)
        self._raw_redis: Any = None
        self.bus: Bus | None = bus
        self._records: RunRecords | None = None
        """The run's records (head, expected states, digests), written fenced by this Publisher's epoch."""
        if redis is not None:
            self.redis_dep = Dependency("Redis", log, budget)
            self._raw_redis = connect(redis) if isinstance(redis, str) else redis
            if self.bus is None:
                self.bus = riding(Bus(self._raw_redis, self.run), self.redis_dep, self.stop)
            self._records = RunRecords(self._raw_redis, self.run)
        self._commit = commit
        if not prepared:
            self._commit = prepare_commit(raw_store, self._raw_redis, self.run, commit_via)

    # -- context manager ------------------------------------------------------------
    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for a snapshot being uploaded, then stop riding outages and drop the held version
        (the store and Redis need no closing)."""
        self.wait_snapshots()
        self.stop.set()
        self._base = None
        if self._hash_pool is not None:
            self._hash_pool.shutdown(wait=True)
            self._hash_pool = None

    def wait_snapshots(self, timeout: float | None = None) -> bool:
        """Wait for a snapshot uploaded in the background; False when one still runs after ``timeout`` seconds."""
        return self._snapshots is None or self._snapshots.wait(timeout)

    @property
    def snapshot_in_flight(self) -> int | None:
        """The version of the snapshot being uploaded in the background (None: none)."""
        return None if self._snapshots is None else self._snapshots.in_flight

    def snapshot_reads_paused(self) -> AbstractContextManager[None]:
        """Inside: no snapshot reads the weights it was handed (a shard being built is finished first, the
        next waits), so their owner may take their memory away for a while (``workers/trainer/park.py``)."""
        return self._snapshot_gate.paused()

    def spares(self, key: str) -> bool:
        """Whether ``key`` may belong to the snapshot in flight (retention must not take it for an orphan)."""
        return self._snapshots is not None and self._snapshots.spares(key)

    # -- publishing -------------------------------------------------------------------
    def publish(
        self,
        weights: Tensors,
        *,
        snapshot: bool = False,
        step: int | None = None,
        producer: Mapping[str, Any] | None = None,
        owned: bool = False,
        digest: bool = False,
    ) -> Published | None:
        """The next version: ``weights`` rounded to bf16, as a delta against the previous one (or version 0).

        ``snapshot``: also write a full snapshot at this version (late joiners
        start there). ``step`` / ``producer`` go into the manifest's
        ``producer`` (FORMAT.md §4). ``owned``: the weights are bf16 tensors
        the caller hands over and never writes again (the Publisher keeps them
        as the next delta's base instead of a copy; a background snapshot reads
        them after this returns). ``digest``: the delta carries the weights
        digest although no snapshot is due (something else binds to this
        version, e.g. a checkpoint). Returns None on ranks other than 0.
        """
        t0 = time.perf_counter()
        new = self._gather(weights, owned)
        if new is None:
            return None
        if self._plan is None:
            self._plan_tied = tied_head(weights, new)
            self._plan = plan_of(new, tied=self._plan_tied, family=family_of(weights))
        if not self._chain_read:
            self._given = new
            self._continue_chain()
            self._given, self._chain_read = {}, True
        plan = self._plan
        if set(new) != set(self._base or new):
            raise ConfigError(
                f"the weights name {sorted(set(new) ^ set(self._base or new))[:3]} unlike the version before: the model of a run is fixed"
            )
        prod = {**({"step": step} if step is not None else {}), **(producer or {})}
        if self._base is None:
            return self._publish_v0(new, plan, prod, t0)
        return self._publish_next(new, plan, prod, snapshot, digest, t0)

    def _gather(self, weights: Tensors, owned: bool = False) -> dict[str, torch.Tensor] | None:
        """bf16 copies of every parameter on rank 0 (one gathered at a time); None elsewhere."""
        out = gather_bf16(named_tensors(weights), self._leader, owned=owned)
        return out if self._leader else None

    def continue_from(self, version: int, state: str, weights: Tensors, owned: bool = False) -> None:
        """Continue the chain after ``version`` (its ``state``), whose weights the caller holds (a resumed trainer).

        Nothing is read from the store; the next :meth:`publish` is a delta
        against ``weights`` (rounded to bf16).
        """
        base = self._gather(weights, owned)
        if base is None:
            return
        if self._plan is None:
            self._plan = plan_of(base, tied=tied_head(weights, base), family=family_of(weights))
        self._base, self.version, self.state, self._chain_read = base, int(version), state, True

    def _continue_chain(self) -> None:
        """On a run root that holds versions: the newest committed one becomes the base."""
        index = scan_versions(self.store)
        head = index.latest
        if head is None:
            return
        assert self._plan is not None
        fused, state = materialize(self._raw_store, head, self._pub_cfg.streams, commits=self._commit_records())
        names = {p.name for p in self._plan}
        if TIED_HEAD in names and TIED_HEAD not in fused and self._plan_tied is False:
            # The run ties the head to the embedding; these weights name both (a copied state dict).
            self._plan = plan_of(self._given, tied=True, family=self._plan.family)
            names = {p.name for p in self._plan}
        if set(fused) != names:
            raise ConfigError(
                f"{self.store.url}: version {head} names {sorted(set(fused) ^ names)[:3]} unlike these weights: the model of a run is fixed (another model's run?)"
            )
        self._base = {n: t.to(torch.bfloat16) for n, t in unfuse_weights(fused, self._plan).items()}
        self.version, self.state = head, state
        log.info("%s: continuing the chain after v%d (state %s…)", self.store.url, head, state[:19])

    def _commit_records(self) -> Any:
        if self._raw_redis is None:
            return None
        from aurora_store.coordination.commit import commit_records_for

        return commit_records_for(self._raw_redis, self.run)

    def _attempt(self, v: int, new: dict[str, torch.Tensor]) -> tuple[str, str]:
        """The attempt id and time of version ``v``: a retry of the same weights reuses those of the failed try.

        Why compare the weights themselves: no digest is computed at most versions, and the
        comparison costs only on a retry (usually the very tensors handed over again).
        """
        p = self._pending
        if p is not None and p[0] == v and same_weights(p[3], new):
            self._pending = (v, p[1], p[2], new)
            return p[1], p[2]
        self._pending = (v, new_attempt_id(), _utc_now(), new)
        return self._pending[1], self._pending[2]

    def _hasher(self) -> ThreadPoolExecutor:
        """The thread a delta's digest is computed on (its leaves on threads of their own), made at first use."""
        if self._hash_pool is None:
            self._hash_pool = ThreadPoolExecutor(1, thread_name_prefix="aurora-digest-root")
        return self._hash_pool

    def _snapshot(
        self,
        v: int,
        new: dict[str, torch.Tensor],
        plan: FusionPlan,
        state: str | None,
        prod: dict[str, Any],
        attempt: tuple[str, str],
        digest: str,
    ) -> Manifest:
        """The snapshot at ``v``: shards, then its manifest, carrying ``digest`` (already computed: not hashed again)."""
        return publish_snapshot(
            self.store,
            self.run,
            v,
            new,  # fused as the shards are written: no fused copy of the version beside it
            state,
            self._pub_cfg,
            producer=prod or None,
            model=self.model_files,
            signer=self.signer,
            commit=self._commit,
            attempt=attempt[0],
            created_at=attempt[1],
            weights_digest=digest,
            plan=plan,
            gate=self._snapshot_gate,
        )

    def _publish_v0(self, new: dict[str, torch.Tensor], plan: FusionPlan, prod: dict[str, Any], t0: float) -> Published:
        attempt = self._attempt(0, new)
        t = time.perf_counter()
        digest = tree_weights_digest(new, plan)
        digest_s = time.perf_counter() - t
        m = self._snapshot(0, new, plan, None, prod, attempt, digest)
        n = sum(p.spec.numel for p in plan)
        return self._done(
            0, m, new, "snapshot", m.total_bytes, n, n, digest, t0, snapshot=True, snapshot_bytes=m.total_bytes, digest_s=digest_s
        )

    def _publish_next(
        self, new: dict[str, torch.Tensor], plan: FusionPlan, prod: dict[str, Any], snapshot: bool, want_digest: bool, t0: float
    ) -> Published:
        assert self._base is not None and self.version is not None and self.state is not None
        v = self.version + 1
        attempt, created = self._attempt(v, new)
        snap = snapshot or bool(self.snapshot_every and v % self.snapshot_every == 0)
        hashing: Future[str] | None = None
        if snap or want_digest or (self.digest_every and v % self.digest_every == 0):
            # The delta carries the digest (it binds the snapshot at v, FORMAT.md §4.1): hashed a tensor per thread
            # while the delta is extracted, encoded and uploaded; only its manifest waits for it.
            hashing = self._hasher().submit(tree_weights_digest, new, plan)
        digest_now = WaitedFor(hashing) if hashing is not None else None
        announce = announce_segments(self.bus) if self.bus is not None else None
        hook = self._on_segment

        def on_segment(ev: SegmentEvent) -> None:
            if announce is not None:
                announce(ev)
            if hook is not None:
                hook(ev)

        m = publish_delta(
            self.store,
            self.run,
            v,
            extract(plan, self._base, new),
            self.state,
            self._delta_cfg(),
            on_segment=on_segment,
            producer=prod or None,
            attempt=attempt,
            created_at=created,
            signer=self.signer,
            weights_digest=digest_now,
            commit=self._commit,
        )
        digest, digest_s = (digest_now(), digest_now.waited) if digest_now is not None else (None, 0.0)
        self._last_delta_bytes = m.total_bytes
        snap_bytes = 0
        if snap:
            assert digest is not None
            state, d = m.state, digest
            if self._snapshots is None:
                snap_bytes = self._snapshot(v, new, plan, state, prod, (attempt, created), d).total_bytes
            else:
                # The delta at v is committed: the snapshot follows on its own thread, manifest last.
                self._snapshots.submit(v, lambda: self._snapshot(v, new, plan, state, prod, (attempt, created), d).total_bytes)
        total, nbytes = sum(p.spec.numel for p in plan), m.total_bytes + snap_bytes
        return self._done(v, m, new, "delta", nbytes, m.nnz, total, digest, t0, snapshot=snap, snapshot_bytes=snap_bytes, digest_s=digest_s)

    def _delta_cfg(self) -> PublishConfig:
        """How the next delta is cut. An adaptive size must see a whole delta before its first
        segment; from the second delta on it is taken from the last one (RL steps change about as
        many elements each), so extraction, encoding and uploads overlap from the first parameter."""
        cfg = self._pub_cfg
        if cfg.segment_bytes is None and self._last_delta_bytes:
            return replace(cfg, segment_bytes=cfg.segment_bytes_for(self._last_delta_bytes))
        return cfg

    def _done(
        self,
        v: int,
        m: Manifest,
        new: dict[str, torch.Tensor],
        kind: str,
        nbytes: int,
        changed: int,
        total: int,
        digest: str | None,
        t0: float,
        snapshot: bool = False,
        snapshot_bytes: int = 0,
        digest_s: float = 0.0,
    ) -> Published:
        self._pending = None
        self._base, self.version, self.state = new, v, m.state
        self._announce(v, m.state, kind, nbytes, digest)
        return Published(
            v,
            m.state,
            kind,
            nbytes,
            changed,
            changed / max(1, total),
            time.perf_counter() - t0,
            digest,
            snapshot,
            snapshot_bytes,
            digest_s,
        )

    def _announce(self, v: int, state: str, kind: str, nbytes: int, digest: str | None) -> None:
        """Redis: the digest and state readers check, the head, the version and its commit (docs/WORKERS.md).

        The records go through :class:`~aurora_store.coordination.records.RunRecords`, fenced by
        an epoch this Publisher takes at its first record (one above any stored): a newer writer
        of the run (a Trainer, another Publisher) fences this one out.
        """
        records = self._records
        if records is None or self.bus is None:
            return

        def record() -> None:
            if records.epoch is None:
                records.enter_epoch((records.stored_epoch() or 0) + 1)
            records.record_version(v, state, digest, commit=True)

        self.redis_dep.call(record, "record the version", self.stop)
        self.bus.announce(VERSION, v, kind=kind, state=state, bytes=nbytes)
        self.bus.announce(COMMIT, v)

    # -- introspection ------------------------------------------------------------------
    @property
    def plan(self) -> FusionPlan | None:
        """The fusion plan of the run's weights (known after the first publish)."""
        return self._plan

    def manifest(self, kind: str, version: int) -> Manifest:
        """A committed manifest of this run (for inspection)."""
        return read_manifest(self._raw_store, kind, version)
