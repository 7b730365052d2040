"""Riding out a dependency (aurora_store.outage): transient vs permanent, one log line per
outage start and end, the budget, and the stop event. Pure logic: no server."""

from __future__ import annotations

import logging
import threading

import pytest

from aurora_store.errors import (
    ConfigError,
    OutageTooLong,
    RedisUnavailable,
    StoreError,
    StoreUnavailable,
    VersionConflict,
)
from aurora_store.outage import (
    DEFAULT_OUTAGE_BUDGET_S,
    OUTAGE_BUDGET_ENV,
    Dependency,
    is_transient,
    outage_budget_s,
)
from aurora_store.testing.clock import ManualClock


def _flaky(failures: int, exc: BaseException) -> tuple[list[int], object]:
    calls = [0]

    def fn() -> str:
        calls[0] += 1
        if calls[0] <= failures:
            raise exc
        return "ok"

    return calls, fn


def test_transient_is_only_unavailability() -> None:
    import redis.exceptions as rx

    assert is_transient(RedisUnavailable("x", "refused"))
    assert is_transient(StoreUnavailable("put: timed out"))
    assert is_transient(rx.ConnectionError("reset"))
    assert is_transient(rx.TimeoutError())
    assert is_transient(ConnectionRefusedError())
    assert not is_transient(rx.AuthenticationError("WRONGPASS"))
    assert not is_transient(StoreError("AccessDenied"))
    assert not is_transient(VersionConflict("taken"))
    assert not is_transient(ValueError("bug"))


def test_an_outage_is_logged_once_at_start_and_once_at_end(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock(start=0.0, instant=True)
    dep = Dependency("Redis", logging.getLogger("t.outage"), budget_s=600, clock=clock, initial_s=0.5, max_s=4)
    calls, fn = _flaky(6, RedisUnavailable("claim", "Connection refused"))
    with caplog.at_level(logging.WARNING, logger="t.outage"):
        assert dep.call(fn, "claim") == "ok"  # type: ignore[arg-type]
    assert calls[0] == 7
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "Redis unreachable (claim)" in lines[0] and "Connection refused" in lines[0]
    assert "Redis reachable again after" in lines[1]
    assert not dep.away and dep.outages == 1
    # Exponential, capped, jittered.
    assert all(0 < w <= 4 + 0.5 for w in clock.waited) and max(clock.waited) > 2


def test_a_permanent_error_propagates_at_once() -> None:
    dep = Dependency("the store", logging.getLogger("t.outage"), clock=ManualClock(start=0.0, instant=True))
    calls, fn = _flaky(1, StoreError("s3://b/run: AccessDenied"))
    with pytest.raises(StoreError, match="AccessDenied"):
        dep.call(fn)  # type: ignore[arg-type]
    assert calls[0] == 1 and not dep.away


def test_past_the_budget_the_outage_is_too_long() -> None:
    clock = ManualClock(start=0.0, instant=True)
    dep = Dependency("Redis", logging.getLogger("t.outage"), budget_s=30, clock=clock, initial_s=1, max_s=5)
    calls, fn = _flaky(10_000, RedisUnavailable("x", "timed out"))
    with pytest.raises(OutageTooLong, match=r"Redis unreachable for \d+s \(outage budget 30s\)") as ei:
        dep.call(fn)  # type: ignore[arg-type]
    assert ei.value.seconds > 30 and 30 < clock.monotonic() < 40
    assert 5 < calls[0] < 40


def test_threads_share_one_outage(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock(start=0.0, instant=True)
    dep = Dependency("Redis", logging.getLogger("t.outage"), clock=clock)
    with caplog.at_level(logging.WARNING, logger="t.outage"):
        for what in ("heartbeat", "claim", "heartbeat"):
            with dep.guard(what) as g:
                raise RedisUnavailable(what, "refused")
            assert g.failed
        with dep.guard("heartbeat"):
            pass
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["Redis unreachable (heartbeat)", "Redis reachable again after 0.0s"]
    with pytest.raises(ValueError), dep.guard("x"):
        raise ValueError("a bug is not an outage")


def test_stop_ends_the_wait_with_the_last_error() -> None:
    stop = threading.Event()
    stop.set()
    dep = Dependency("Redis", logging.getLogger("t.outage"), clock=ManualClock(start=0.0, instant=True))
    _, fn = _flaky(100, RedisUnavailable("x", "refused"))
    with pytest.raises(RedisUnavailable):
        dep.call(fn, stop=stop)  # type: ignore[arg-type]


def test_budget_from_argument_environment_or_default() -> None:
    assert outage_budget_s(None, {}) == DEFAULT_OUTAGE_BUDGET_S >= 600
    assert outage_budget_s(None, {OUTAGE_BUDGET_ENV: "42"}) == 42
    assert outage_budget_s(5, {OUTAGE_BUDGET_ENV: "42"}) == 5
    with pytest.raises(ConfigError, match=OUTAGE_BUDGET_ENV):
        outage_budget_s(None, {OUTAGE_BUDGET_ENV: "soon"})
    with pytest.raises(ConfigError):
        outage_budget_s(0)


def test_backoff_never_overflows_and_stays_capped() -> None:
    from aurora_store.config import Backoff

    idle = Backoff(initial_s=0.05, max_s=0.25, factor=1.5, jitter=0.0)  # the Actor's idle back-off
    assert idle.delay(0) == 0.05 and idle.delay(2) == pytest.approx(0.1125)
    # An Actor idle for hours makes millions of waits: factor ** attempt would overflow a float.
    assert idle.delay(10**7) == 0.25
    assert Backoff(initial_s=0.0, max_s=5.0).delay(10**9) == 0.0
