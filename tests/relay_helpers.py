"""What the Relay tests share: a test Trainer that publishes and announces as the real one does,
a Relay in a thread, and waiting on conditions (never on fixed sleeps)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from aurora_store.apply.sink import weights_digest
from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.codec.extract import extract, fuse_weights, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.coordination.bus import SEGMENT, VERSION, Bus, Event
from aurora_store.format.manifest import Manifest, manifest_key
from aurora_store.lineage.publish import (
    PublishConfig,
    SegmentEvent,
    publish_delta,
    publish_snapshot,
)
from aurora_store.storage import Store
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights
from workers.relay import Relay, RelayConfig

REPO = Path(__file__).resolve().parents[1]
# Small segments: every delta of the tiny model spans several objects.
CFG = PublishConfig(streams=4, segment_bytes=2048)
REGION = "eu"


def fused(plan: FusionPlan, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return fuse_weights(w, plan)


def wait_until(pred: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Trainer:
    """Publishes at origin and announces on the origin stream, as the Trainer does."""

    def __init__(self, store: Store, bus: Bus, run: str, repeat: int = 1) -> None:
        self.store, self.bus, self.run, self.repeat = store, bus, run, repeat
        self.weights = {0: make_weights(QWEN3_TINY, seed=0)}
        self.plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in self.weights[0].items()})
        self.master = MasterWeights(self.weights[0], seed=0)
        self.manifests: dict[tuple[str, int], Manifest] = {}
        m = publish_snapshot(store, run, 0, fused(self.plan, self.weights[0]), None, CFG)
        self._committed(m, announce=True)
        self.states = {0: m.state}

    def _committed(self, m: Manifest, announce: bool) -> None:
        self.manifests[(m.kind, m.version)] = m
        for _ in range(self.repeat if announce else 0):
            self.bus.announce(VERSION, m.version, kind=m.kind, state=m.state, bytes=m.total_bytes)

    def step(
        self,
        before: Callable[[SegmentEvent], None] | None = None,
        after: Callable[[SegmentEvent], None] | None = None,
        announce: bool = True,
    ) -> Manifest:
        """Publish the next delta; ``before``/``after`` run around each segment's announcement."""
        v = max(self.weights) + 1

        def on_segment(ev: SegmentEvent) -> None:
            if before is not None:
                before(ev)
            for _ in range(self.repeat if announce else 0):
                self.bus.announce(SEGMENT, ev.version, index=ev.index, key=ev.key, bytes=ev.bytes, sha256=ev.sha256)
            if after is not None:
                after(ev)

        new = self.master.step(lr=2.5e-7)
        m = publish_delta(self.store, self.run, v, extract(self.plan, self.weights[v - 1], new), self.states[v - 1], CFG, on_segment=on_segment, weights_digest=weights_digest(new, self.plan))
        self.weights[v], self.states[v] = new, m.state
        self._committed(m, announce)
        return m

    def snapshot(self, v: int) -> Manifest:
        m = publish_snapshot(self.store, self.run, v, fused(self.plan, self.weights[v]), self.states[v], CFG)
        self._committed(m, announce=True)
        return m

    def digest(self, v: int) -> str:
        return weights_digest(self.weights[v], self.plan)

    def version_bytes(self, kind: str, v: int) -> int:
        """Objects plus manifest: what one copy of the version weighs."""
        return self.manifests[(kind, v)].total_bytes + len(self.store.get(manifest_key(kind, v)))


MODEL_CONFIG = b'{"model_type": "qwen3"}'


def describe_model(origin: Store) -> None:
    """Write the run's model description, as a Trainer does before its first version."""
    origin.put("model/config.json", MODEL_CONFIG)


def make_relay(origin: Store, mirror: Store, redis_url: str, run: str, clock: Clock = SYSTEM_CLOCK, **kw: Any) -> Relay:
    opts: dict[str, Any] = {"block_ms": 100, "heartbeat_s": 0.2, "ttl_s": 1.0, "streams": 4, "resync_s": 0.0, "retry_s": 0.2}
    opts.update(kw)
    cfg = RelayConfig(origin=origin.url, mirror=mirror.url, redis=redis_url, run=run, region=REGION, **opts)
    return Relay(cfg, origin=origin, mirror=mirror, clock=clock)


@contextlib.contextmanager
def running(relay: Relay) -> Iterator[Relay]:
    """The Relay's loop in a thread; a graceful stop on exit (its errors fail the test)."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def body() -> None:
        try:
            relay.run(stop)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=body, name="test-relay")
    t.start()
    try:
        yield relay
    finally:
        stop.set()
        t.join(10)
        relay.close()
    assert not t.is_alive()
    assert not errors, errors


def region_events(redis: Any, run: str) -> list[Event]:
    return Bus(redis, run).read("0", region=REGION)


def mirrored(relay: Relay, *vids: tuple[str, int]) -> Callable[[], bool]:
    return lambda: set(vids) <= set(relay.stats().mirrored)
