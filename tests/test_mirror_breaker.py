"""Mirrors can fail without taking Actors with them (issue 24, hole 7).

- a mirror whose S3 server is stopped: the Actor stages every version from
  origin and is still alive well past origin's outage budget (the mirror's
  faults never spend it);
- a mirror that answers slowly (an S3 server behind a proxy that holds every
  byte for far longer than the timeout), and one that answers every read
  with a 5xx-like error after a pause: each version arrives from origin within
  about ``--mirror-timeout-s`` once, not the store's timeouts times its
  retries for every version;
- the breaker itself (cool-down, re-try, the shared deadline) without servers.

Real redis-server and S3 servers (moto); the local proxy is
:mod:`aurora_tools.wan.proxy`.
"""

from __future__ import annotations

import argparse
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from aurora_store.clock import SYSTEM_CLOCK, Clock
from aurora_store.coordination.keys import RunKeys, mirror_token
from aurora_store.coordination.records import RunRecords
from aurora_store.errors import ConfigError, StoreUnavailable
from aurora_store.storage import LocalStore, Store, StoreConfig, open_store
from aurora_store.storage.base import CallBudget
from aurora_store.testing.clock import ManualClock
from aurora_store.testing.servers import S3Server
from aurora_store.testing.wait import wait_until
from aurora_tools.bench.hostile.workers import VERSIONS, SourceRecorder, publish_mirror_run
from aurora_tools.synthetic.engine import SyntheticEngine
from aurora_tools.wan.profile import LinkProfile
from aurora_tools.wan.proxy import ProxyThread
from workers.actor import Actor, ActorConfig, add_arguments, config_from_args
from workers.actor.breaker import COOL_DOWN_MAX_S, MirrorBreaker, mirror_store_config
from workers.common import Endpoints

REGION = "r1"


# -- the breaker, without servers ----------------------------------------------------------------


def test_the_breaker_opens_cools_down_with_back_off_and_closes_on_a_delivery() -> None:
    clock = ManualClock()
    b = MirrorBreaker(2.0, clock)
    assert not b.open
    b.failed(StoreUnavailable("down"), "v1")
    assert b.open and b.cool_down_s() == 2.0
    clock.advance(1.9)
    assert b.open
    clock.advance(0.2)
    assert not b.open  # tried again after the cool-down
    b.failed(StoreUnavailable("down"), "v2")
    assert b.cool_down_s() == 4.0 and b.open
    for _ in range(20):
        b.failed(StoreUnavailable("down"), "v2")
    assert b.cool_down_s() == COOL_DOWN_MAX_S
    b.succeeded()
    assert not b.open and b.failures == 0 and b.openings == 22


def test_an_armed_budget_ends_the_calls_of_a_store_once_spent(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/m")
    store.put("k", b"v")
    b = MirrorBreaker(30.0, ManualClock())
    b.attach(store)
    with b.attempt(store):
        assert store.get_capped("k", 10) == b"v"
    b.budget.arm(0.0)  # spent
    with pytest.raises(StoreUnavailable, match="no answer within"):
        store.get("k")
    with pytest.raises(StoreUnavailable):
        store.list()
    b.budget.disarm()
    assert store.get("k") == b"v"
    other = open_store(f"file://{tmp_path}/o")
    with b.attempt(other):  # not the mirror: unbounded
        assert other.budget is None


def test_a_spent_budget_cuts_an_s3_request_short(s3_server: S3Server) -> None:
    store = open_store(f"s3://{s3_server.new_bucket()}/m", s3_server.storage_options())
    budget = CallBudget()
    store.budget = budget
    with budget.armed(5.0):
        assert 0 < store._deadline["timeout"] <= 5.0
    assert store._deadline["timeout"] == store.config.op_timeout_s


def test_the_mirror_store_retries_once_with_short_timeouts() -> None:
    base = StoreConfig(retries=5, connect_timeout_s=10, read_timeout_s=60, op_timeout_s=600)
    cfg = mirror_store_config(2.0, base)
    assert (cfg.retries, cfg.connect_timeout_s, cfg.read_timeout_s, cfg.op_timeout_s) == (1, 2.0, 2.0, 600)


def test_the_mirror_timeout_is_an_option_with_its_variable() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--store", "file:///tmp/x", "--redis", "redis://localhost", "--run", "r"]
    assert config_from_args(p.parse_args(base), environ={}).mirror_timeout_s == 10.0
    assert config_from_args(p.parse_args(base), environ={"AURORA_ACTOR_MIRROR_TIMEOUT_S": "3"}).mirror_timeout_s == 3.0
    assert config_from_args(p.parse_args([*base, "--mirror-timeout-s", "4"]), environ={}).mirror_timeout_s == 4.0
    with pytest.raises(ConfigError, match="mirror_timeout_s"):
        ActorConfig(mirror_timeout_s=0)


# -- Actors with a failing mirror ----------------------------------------------------------------


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, redis_client: Any, redis_server: Any) -> dict[str, Any]:
    """Deltas 1..VERSIONS at ``tmp/origin`` and a true copy in ``tmp/mirror``."""
    monkeypatch.setenv("AURORA_SYNTHETIC_CACHE", str(tmp_path / "cache"))
    res = publish_mirror_run(tmp_path)
    res.update(redis=redis_server.url, client=redis_client)
    return res


def _fill(mirror: Store, run: dict[str, Any]) -> None:
    """The true copy, as a Relay would have written it."""
    src = open_store(f"file://{run['tmp']}/origin")
    for key in src.list():
        mirror.put(key, src.get(key))


def _actor(run: dict[str, Any], mirror_url: str, clock: Clock, open_mirror: Any = None, **cfg: Any) -> tuple[Actor, SourceRecorder]:
    """A fresh Actor at v0 whose region's Relay heartbeats with ``mirror_url``; the Trainer's head at VERSIONS."""
    name = f"breaker{time.monotonic_ns()}"
    eng: Any = SyntheticEngine(run["spec"], hold=True, digests=True)
    eng.load_base()
    rec = SourceRecorder()
    a = Actor.from_endpoints(
        Endpoints(f"file://{run['tmp']}/origin", run["redis"], name),
        ActorConfig(actor_id="a", region=REGION, mirror=mirror_url, **cfg),
        clock,
        engine=eng,
        open_mirror=open_mirror,
        observers=[rec],
    )
    a.holding.start_at(0, run["spec"].base_state)
    records = RunRecords(run["client"], name)
    for v, st in run["states"].items():
        records.record_expected_state(v, st)
    records.record_head(VERSIONS)
    run["client"].set(RunKeys(name).relay(REGION), mirror_token(mirror_url))
    return a, rec


class _Staging:
    """``stage_once`` (or the stager's whole loop) in a daemon thread: a stuck one cannot hang the test."""

    def __init__(self, a: Actor, loop: bool = False) -> None:
        self.a, self.error, self.done = a, None, threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._body, args=(loop,), daemon=True, name="test-stager")
        self.thread.start()

    def _body(self, loop: bool) -> None:
        try:
            if loop:
                self.a.stager.run()
            else:
                self.a.stager.stage_once()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.done.set()

    def stop(self) -> None:
        self.a.stop.set()
        self.thread.join(15)


def test_a_stopped_mirror_never_spends_origins_outage_budget(run: dict[str, Any]) -> None:
    budget_s = 1.0
    with S3Server(process=True) as server:
        url = f"s3://{server.new_bucket()}/run"
        _fill(open_store(url, server.storage_options()), run)
    # The mirror's server is gone: every call to it is refused.
    a, rec = _actor(run, url, SYSTEM_CLOCK, outage_budget_s=budget_s, mirror_timeout_s=0.5, mirror_options=server.storage_options())
    a.fetcher.full_bytes = 1  # far behind: the stager lists the mirror to plan a catch-up first
    stager = _Staging(a, loop=True)
    try:
        wait_until(lambda: a.holding.staged_version == VERSIONS or stager.done.is_set(), "every version staged", timeout=60)
        assert stager.error is None, stager.error
        assert rec.sources == [(v, False) for v in range(1, VERSIONS + 1)]  # all from origin
        # Alive (and still looking at the run) well past origin's outage budget.
        wait_until(lambda: time.monotonic() - stager.t0 > 3 * budget_s or stager.done.is_set(), "three outage budgets", timeout=30)
        assert not stager.done.is_set() and stager.error is None, stager.error
        assert a.sources.breaker.openings >= 1
        assert a.ctx.store_dep.outages == 0  # origin never looked away: nothing was charged to it
    finally:
        stager.stop()
    assert stager.error is None, stager.error


def test_a_slow_mirror_costs_about_the_timeout_once(run: dict[str, Any], s3_server: S3Server) -> None:
    timeout_s = 2.0
    url = f"s3://{s3_server.new_bucket()}/run"
    _fill(open_store(url, s3_server.storage_options()), run)
    host, port = s3_server.endpoint.rsplit("/", 1)[1].split(":")
    # Every byte either way held for 30 s: a mirror that answers, far too slowly.
    with ProxyThread((host, int(port)), LinkProfile(delay_ms=30_000)) as proxy:
        opts = s3_server.storage_options()
        opts["client_kwargs"] = dict(opts["client_kwargs"], endpoint_url=f"http://{proxy.address[0]}:{proxy.address[1]}")
        a, rec = _actor(run, url, ManualClock(), mirror_timeout_s=timeout_s, mirror_options=opts)
        stager = _Staging(a)
        try:
            wait_until(stager.done.is_set, "staging from origin", timeout=4 * timeout_s)
            elapsed = time.monotonic() - stager.t0
        finally:
            stager.stop()
    assert stager.error is None, stager.error
    assert rec.sources == [(v, False) for v in range(1, VERSIONS + 1)]
    assert elapsed < 2 * timeout_s, f"{elapsed:.1f}s for {VERSIONS} versions with a {timeout_s}s mirror timeout"
    assert a.sources.breaker.openings == 1  # one bounded wait, then origin until the cool-down


class _Failing(LocalStore):
    """A mirror whose every read pauses, then fails like a 503 (retried by the store, then given up)."""

    pause_s = 0.4
    reads = 0

    def _call(self, what: str, fn: Any) -> Any:
        if not what.startswith("get "):
            return fn()
        type(self).reads += 1
        time.sleep(self.pause_s)
        raise ConnectionError("503 Slow Down")


def test_a_mirror_answering_errors_costs_about_the_timeout_once(run: dict[str, Any]) -> None:
    timeout_s = 1.0
    shutil.copytree(run["tmp"] / "origin", run["tmp"] / "failing")
    url = f"file://{run['tmp']}/failing"
    # Five retries, as origin has: the budget, not the retries, bounds the wait.
    mirror = _Failing(url, config=StoreConfig(retries=5, backoff_s=0.05))
    clock = ManualClock()
    a, rec = _actor(run, url, clock, open_mirror=lambda: mirror, mirror_timeout_s=timeout_s)
    t0 = time.monotonic()
    a.stager.stage_once()
    elapsed = time.monotonic() - t0
    assert rec.sources == [(v, False) for v in range(1, VERSIONS + 1)]
    assert elapsed < timeout_s + 1.0, f"{elapsed:.1f}s"
    assert a.sources.breaker.openings == 1 and a.sources.breaker.open
    # After the cool-down the mirror is tried again (and, still failing, costs one bounded wait more).
    clock.advance(a.sources.breaker.cool_down_s() + 0.1)
    assert not a.sources.breaker.open
    assert a.sources.source(mirror_token(url))[0] is mirror
