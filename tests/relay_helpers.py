"""What the Relay tests share: a Relay in a thread, the run's model description, and what the Relay has mirrored.

The Trainer is :class:`trainer_fixtures.FakeTrainer` given the origin stream's
:class:`~aurora_store.coordination.bus.Bus`; waits are :func:`aurora_store.testing.wait.wait_until`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.coordination.bus import Bus, Event
from aurora_store.storage import Store
from workers.relay import Relay, RelayConfig

REPO = Path(__file__).resolve().parents[1]
REGION = "eu"
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
