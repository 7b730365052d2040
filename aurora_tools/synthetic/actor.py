"""The synthetic workload's Actor: the real Actor with the synthetic engine; full and none transfer."""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from aurora_store.format.checkpoint import StagedDelta
from aurora_tools.synthetic.engine import StagedAnnouncement, StagedSnapshot, SyntheticEngine
from aurora_tools.synthetic.workload import SyntheticSpec, wan_key
from workers.actor import Actor, ActorConfig, config_from_args
from workers.trainer import unshipped_state

__all__ = ["SyntheticActorOptions", "SyntheticActor", "actor_main"]

log = logging.getLogger("aurora.synthetic")


class _CountingStore:
    """A store that counts the bytes it read (what crossed from origin into the Actor's region)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self.bytes_read = 0

    def get(self, key: str) -> bytes:
        data = self._inner.get(key)
        with self._lock:
            self.bytes_read += len(data)
        return cast(bytes, data)

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        data = self._inner.get_range(key, start, stop)
        with self._lock:
            self.bytes_read += len(data)
        return cast(bytes, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass(frozen=True, slots=True)
class SyntheticActorOptions:
    transfer: str = "delta"
    hold: bool = True
    digests: bool = False


class SyntheticActor(Actor):
    """An Actor with the synthetic engine; ``full`` and ``none`` transfer stage snapshots or announcements."""

    def __init__(self, ep: Any, cfg: ActorConfig, opts: SyntheticActorOptions | None = None) -> None:
        super().__init__(ep, cfg)
        self.opts = opts or SyntheticActorOptions()
        self.counter = _CountingStore(self.origin)
        self.origin = cast(Any, self.counter)

    def prepare(self) -> None:
        from aurora_store.errors import ObjectNotFound
        from workers.common import MODEL_CONFIG_KEY

        # Started alongside the Trainer: wait for the description it writes before version 0.
        while True:
            try:
                raw = self.origin.get(MODEL_CONFIG_KEY)
                break
            except ObjectNotFound:
                if self.stop.wait(0.2):
                    raise SystemExit(0) from None
        self.spec = SyntheticSpec.from_json(raw)
        self.synthetic = SyntheticEngine(self.spec, hold=self.opts.hold, digests=self.opts.digests)
        self.engine = cast(Any, self.synthetic)

    def bootstrap(self) -> None:
        from workers.common import record_digest

        if not hasattr(self, "engine"):
            self.prepare()
        from aurora_store.codec.kernels import warm_up

        t0 = time.perf_counter()
        warm_up()  # compile or load the codec kernels now, not inside the first activation
        self.synthetic.load_base()
        self.active = self.staged_version = 0
        self.active_state = self.staged_state = self.spec.base_state
        record_digest(self.redis, self.keys, self.cfg.actor_id, 0, self.engine.digest())
        log.info("%s: base loaded in %.2fs (hold=%s)", self.cfg.actor_id, time.perf_counter() - t0, self.opts.hold)
        self.ledger.register(self.cfg.actor_id, self.cfg.region, self.cfg.engine)
        self._heartbeat()

    def _stage_available(self, polled: tuple[str | None, int | None] | None = None) -> None:
        if self.opts.transfer == "delta":
            super()._stage_available(polled)
        elif self.opts.transfer == "none":
            head = self.redis.hget(self.keys.trainer, "head")
            for v in range(self.staged_version + 1, (int(head) if head is not None else -1) + 1):
                state = unshipped_state(v)
                self._push(StagedAnnouncement(v, v - 1), state, 0.0, v)
                self._on_staged(v, 0, 0.0, False)
        else:
            self._stage_snapshots()

    def _push(self, staged: Any, state: str, seconds: float, v: int) -> None:
        with self.lock:
            self.staged.append((cast(StagedDelta, staged), state, seconds))
            self.staged_version, self.staged_state = v, state

    def _stage_snapshots(self) -> None:
        """``full`` transfer: fetch, verify and decode every newer snapshot, oldest first."""
        from safetensors.torch import load

        from aurora_store.errors import AuroraError
        from aurora_store.lineage.fetch import fetch_objects, fetch_snapshot, read_manifest
        from aurora_store.lineage.plan import scan_versions

        for v in sorted(s for s in scan_versions(self.origin).snapshots if s > self.staged_version):
            if self.stop.is_set():
                return
            # Never stage far ahead of what runs: each staged full version is a model's worth of memory.
            while self.staged_version > self.active + 1 and not self.stop.is_set():
                self.stop.wait(0.05)
            t0 = time.perf_counter()
            before = self.counter.bytes_read
            try:
                if self.opts.hold:
                    m, tensors = fetch_snapshot(self.origin, v, self.cfg.streams)
                    staged = StagedSnapshot(v, self.staged_version, tensors)
                else:
                    m = read_manifest(self.origin, "snapshot", v)
                    fetch_objects(self.origin, m, self.cfg.streams, lambda where, data: len(load(data)))
                    staged = StagedSnapshot(v, self.staged_version, None)
            except AuroraError as e:
                # Deleted by retention while we were behind: the next listing finds a newer one.
                log.warning("stage snapshot v%d failed: %s", v, e)
                return
            self._push(staged, m.state, time.perf_counter() - t0, v)
            self._on_staged(v, self.counter.bytes_read - before, time.perf_counter() - t0, False)

    def _on_staged(self, version: int, nbytes: int, seconds: float, from_mirror: bool) -> None:
        self.redis.hset(
            wan_key(self.ep.run, "staged"), f"{self.cfg.actor_id}|{version}",
            json.dumps({"t_ms": time.time() * 1000, "stage_s": seconds, "bytes": nbytes, "mirror": from_mirror, "origin_bytes": self.counter.bytes_read}),
        )


def actor_main(args: argparse.Namespace, storage_options: Mapping[str, Any]) -> int:
    from workers.actor import run_until_stopped
    from workers.common import Endpoints, limit_torch_threads, setup_logging

    setup_logging(f"actor[{args.actor_id or ''}]")
    limit_torch_threads()
    cfg = config_from_args(args, engine="synthetic")
    opts = SyntheticActorOptions(args.transfer, args.hold_weights == "yes", args.digests)
    return run_until_stopped(SyntheticActor(Endpoints(args.store, args.redis, args.run, storage_options), cfg, opts), args.join_at_version)

