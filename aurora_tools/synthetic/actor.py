"""The synthetic workload's Actor: the real Actor with the synthetic engine; full and none transfer.

The real :class:`~workers.actor.Actor`, with parts plugged in through its
Protocols (nothing of it overridden):

- :class:`SyntheticBoot` (a :class:`~workers.actor.boot.Boot`): the engine
  from the run's :class:`SyntheticSpec`, and its base as version 0; the
  Actor still registers, releases a previous incarnation's work and rides
  out outages as always;
- ``transfer``: ``delta`` is the Actor's own staging; ``full`` stages every
  newer snapshot (:class:`SnapshotStaging`), ``none`` stages versions that
  move no bytes (:class:`AnnouncedStaging`);
- :class:`WanRecorder` (a :class:`~workers.actor.staging.StagedObserver`):
  when each version was staged, from where, and what crossed from origin.

:func:`run_synthetic_actor` is the entry point (``aurora bench synthetic-actor``).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from aurora_store.storage import Store
from aurora_tools.synthetic.engine import StagedAnnouncement, StagedSnapshot, SyntheticEngine
from aurora_tools.synthetic.workload import SyntheticSpec, wan_key
from workers.actor import Actor, ActorConfig, config_from_args
from workers.actor.context import ActorContext
from workers.actor.holding import Staged
from workers.actor.polled import Polled
from workers.actor.staging import StagingStrategy
from workers.common import Endpoints
from workers.trainer import unshipped_state

__all__ = [
    "AnnouncedStaging",
    "SnapshotStaging",
    "SyntheticActorOptions",
    "SyntheticBoot",
    "WanRecorder",
    "actor_main",
    "run_synthetic_actor",
    "synthetic_actor",
]

log = logging.getLogger("aurora.synthetic")


class _CountingStore:
    """A store that counts the bytes it read (what crossed from origin into the Actor's region)."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.bytes_read = 0

    def get(self, key: str) -> bytes:
        data = self._inner.get(key)
        with self._lock:
            self.bytes_read += len(data)
        return data

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        data = self._inner.get_range(key, start, stop)
        with self._lock:
            self.bytes_read += len(data)
        return data

    def get_capped(self, key: str, limit: int, what: str = "") -> bytes:
        data = self._inner.get_capped(key, limit, what)
        with self._lock:
            self.bytes_read += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass(frozen=True, slots=True)
class SyntheticActorOptions:
    """The synthetic workload's options of an Actor."""

    transfer: str = "delta"
    """``delta`` (the Actor's own staging), ``full`` (every newer snapshot) or ``none`` (no bytes)."""
    hold: bool = True
    """Hold real weights and write every version into them."""
    digests: bool = False
    """Hash the held weights for every digest (else a placeholder)."""


class SyntheticBoot:
    """The engine from the run's synthetic spec, and its base weights as version 0."""

    def __init__(self, ctx: ActorContext, opts: SyntheticActorOptions) -> None:
        self.ctx = ctx
        self.opts = opts
        self.spec: SyntheticSpec | None = None
        self.engine: SyntheticEngine | None = None

    @property
    def waited_for_run(self) -> bool:
        return False

    def prepare(self) -> None:
        from aurora_store.errors import ObjectNotFound
        from workers.common import MODEL_CONFIG_KEY

        # Started alongside the Trainer: wait for the description it writes before version 0.
        c = self.ctx
        while True:
            try:
                raw = c.store_call(lambda: c.origin.get(MODEL_CONFIG_KEY), "read the synthetic spec")
                break
            except ObjectNotFound:
                if c.stop.wait(0.2):
                    return
        self.spec = SyntheticSpec.from_json(raw)
        self.engine = SyntheticEngine(self.spec, hold=self.opts.hold, digests=self.opts.digests)
        c.set_engine(self.engine)

    def reach(self) -> tuple[int, str] | None:
        from aurora_store.codec.kernels import warm_up

        assert self.spec is not None and self.engine is not None, "prepare() first"
        t0 = time.perf_counter()
        warm_up()  # compile or load the codec kernels now, not inside the first activation
        self.engine.load_base()
        log.info("%s: base loaded in %.2fs (hold=%s)", self.ctx.cfg.actor_id, time.perf_counter() - t0, self.opts.hold)
        return 0, self.spec.base_state


class WanRecorder:
    """Records when each version was staged, its bytes and source, and what crossed from origin (``aurora bench wan``)."""

    def __init__(self, ctx: ActorContext, counter: _CountingStore) -> None:
        self.ctx = ctx
        self.counter = counter

    def staged(self, version: int, nbytes: int, seconds: float, from_mirror: bool) -> None:
        c = self.ctx
        record = {
            "t_ms": time.time() * 1000,
            "stage_s": seconds,
            "bytes": nbytes,
            "mirror": from_mirror,
            "origin_bytes": self.counter.bytes_read,
        }
        c.redis_call(
            lambda: c.redis.hset(wan_key(c.ep.run, "staged"), f"{c.cfg.actor_id}|{version}", json.dumps(record)), "record a staged version"
        )


class AnnouncedStaging:
    """``none`` transfer: every version up to the head is staged at once, moving no bytes."""

    def __init__(self, ctx: ActorContext, recorder: WanRecorder) -> None:
        self.ctx = ctx
        self.recorder = recorder

    def stage_available(self, polled: Polled) -> None:
        h = self.ctx.holding
        for v in range(h.staged_version + 1, (polled.head if polled.head is not None else -1) + 1):
            h.stage(Staged(StagedAnnouncement(v, v - 1), unshipped_state(v), 0.0))
            self.recorder.staged(v, 0, 0.0, False)


class SnapshotStaging:
    """``full`` transfer: fetch, verify and decode every newer snapshot, oldest first."""

    def __init__(self, ctx: ActorContext, opts: SyntheticActorOptions, counter: _CountingStore, recorder: WanRecorder) -> None:
        self.ctx = ctx
        self.opts = opts
        self.counter = counter
        self.recorder = recorder

    def stage_available(self, polled: Polled) -> None:
        from safetensors.torch import load

        from aurora_store.errors import AuroraError
        from aurora_store.lineage.fetch import fetch_objects, fetch_snapshot, read_manifest
        from aurora_store.lineage.plan import scan_versions
        from aurora_store.outage import is_transient

        c, h = self.ctx, self.ctx.holding
        for v in sorted(s for s in scan_versions(c.origin).snapshots if s > h.staged_version):
            if c.stop.is_set():
                return
            # Never stage far ahead of what runs: each staged full version is a model's worth of memory.
            while h.staged_version > h.active + 1 and not c.stop.is_set():
                c.stop.wait(0.05)
            t0 = time.perf_counter()
            before = self.counter.bytes_read
            try:
                if self.opts.hold:
                    m, tensors = fetch_snapshot(c.origin, v, c.cfg.streams)
                    staged = StagedSnapshot(v, h.staged_version, tensors)
                else:
                    m = read_manifest(c.origin, "snapshot", v)
                    fetch_objects(c.origin, m, c.cfg.streams, lambda where, data: len(load(data)))
                    staged = StagedSnapshot(v, h.staged_version, None)
            except AuroraError as e:
                if is_transient(e):
                    raise  # the stager loop waits it out
                # Deleted by retention while we were behind: the next listing finds a newer one.
                log.warning("stage snapshot v%d failed: %s", v, e)
                return
            h.stage(Staged(staged, m.state, time.perf_counter() - t0))
            self.recorder.staged(v, self.counter.bytes_read - before, time.perf_counter() - t0, False)


def synthetic_actor(ep: Endpoints, cfg: ActorConfig, opts: SyntheticActorOptions | None = None) -> Actor:
    """The real Actor with the synthetic workload's parts (see the module docstring)."""
    from aurora_store.storage import open_store

    opts = opts or SyntheticActorOptions()
    counter = _CountingStore(open_store(ep.store, dict(ep.storage_options)))
    ctx = ActorContext.connect(ep, cfg, origin=cast(Store, counter))
    recorder = WanRecorder(ctx, counter)
    staging: StagingStrategy | None = None  # delta: the Actor's own, which tells the recorder
    if opts.transfer == "none":
        staging = AnnouncedStaging(ctx, recorder)
    elif opts.transfer != "delta":
        staging = SnapshotStaging(ctx, opts, counter, recorder)
    return Actor(ctx, boot=SyntheticBoot(ctx, opts), staging=staging, observers=[recorder])


def run_synthetic_actor(ep: Endpoints, cfg: ActorConfig, opts: SyntheticActorOptions, join_at_version: int | None = None) -> int:
    """Run a synthetic Actor in this process until SIGTERM/SIGINT (as ``aurora actor`` runs the real one)."""
    from workers.actor import run_until_stopped

    return run_until_stopped(synthetic_actor(ep, cfg, opts), join_at_version)


def actor_main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    """``aurora bench synthetic-actor``: logging, then :func:`run_synthetic_actor` from the parsed options."""
    from workers.process import limit_torch_threads, setup_logging

    setup_logging(f"actor[{args.actor_id or ''}]")
    limit_torch_threads()
    cfg = config_from_args(args, engine="synthetic")
    opts = SyntheticActorOptions(args.transfer, args.hold_weights == "yes", args.digests)
    return run_synthetic_actor(Endpoints(args.store, args.redis, args.run, storage_options), cfg, opts, args.join_at_version)
