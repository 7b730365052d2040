"""The job ledger against a real redis-server: leases, the settlement predicate, recovery.

Most tests pass a manual clock (milliseconds) so that expiry is exact and
nothing sleeps; the process tests use the server clock, as real Actors do,
because an Actor in another process cannot share a Python clock.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis.exceptions
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from ledger_fixtures import jobs, register_on

from aurora_store.coordination.ledger import SETTLE_REASONS, Lease, Ledger, LedgerLost, StepExists
from aurora_store.coordination.redisconn import RedisConfig, connect
from aurora_store.coordination.retention import LedgerHeldVersions
from aurora_store.errors import ConfigError, CoordinationError, RedisUnavailable
from aurora_store.lineage.interfaces import HeldVersions
from aurora_store.testing.clock import ManualClock
from aurora_store.testing.servers import RedisServer
from aurora_tools.bench.ledger import CallCounter, counting_client

pytestmark = pytest.mark.server

V = 7
H = "sha256:" + "7" * 64
LEASE = 1_000
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def join(ledger: Ledger, actor: str, v: int | None = V, staged: int | None = V, state: str = H) -> None:
    register_on(ledger, actor, v, staged, state)


def conserved(ledger: Ledger, v: int = V) -> Any:
    st_ = ledger.step_status(v)
    assert st_.settled + st_.leased + st_.pending == st_.total, st_
    return st_


# ---------------------------------------------------------------------------
# claims


def test_claim_takes_own_assignments_first_then_the_pool(ledger: Ledger, clock: ManualClock) -> None:
    join(ledger, "a")
    join(ledger, "b")
    ledger.create_step(V, H, jobs(6), {"a": 2, "b": 1}, group=4, lease_ms=LEASE)
    assert conserved(ledger).pending == 6
    status, leases = ledger.claim("a", V, 4)
    assert status == "ok"
    assert [x.prompt for x in leases] == ["p000", "p001", "p003", "p004"]
    tokens = [x.token for x in leases]
    assert tokens == sorted(tokens) and len(set(tokens)) == 4
    for x in leases:
        assert (x.version, x.state, x.group, x.expiry_ms) == (V, H, 4, clock() + LEASE)
        assert x.payload == f"prompt {int(x.prompt[1:])}".encode()
    status, leases_b = ledger.claim("b", V, 10)
    assert status == "ok" and [x.prompt for x in leases_b] == ["p002", "p005"]
    assert min(x.token for x in leases_b) > max(tokens)
    st_ = conserved(ledger)
    assert (st_.total, st_.leased, st_.pending, st_.settled) == (6, 6, 0, 0)
    assert ledger.claim("a", V, 3) == ("ok", [])
    assert ledger.claim("a", V, 0) == ("ok", [])


def test_claim_refusals(ledger: Ledger) -> None:
    assert ledger.claim("a", V, 1) == ("no_step", [])
    join(ledger, "on_v")
    join(ledger, "behind", v=V - 1, staged=V)  # eligible after Commit(v), but must activate first
    join(ledger, "boot", v=None, staged=None)  # still bootstrapping
    ledger.create_step(V, H, jobs(3), {}, group=1, lease_ms=LEASE)
    assert ledger.claim("stranger", V, 1) == ("not_alive", [])
    assert ledger.claim("behind", V, 1) == ("not_on_version", [])
    assert ledger.claim("boot", V, 1) == ("not_on_version", [])
    assert conserved(ledger).pending == 3  # nothing moved
    assert ledger.heartbeat("behind", active=V)  # Commit(v) applied
    status, leases = ledger.claim("behind", V, 1)
    assert status == "ok" and len(leases) == 1
    assert ledger.claim("on_v", V + 1, 1) == ("no_step", [])


def test_create_step_validation(ledger: Ledger) -> None:
    with pytest.raises(ConfigError):
        ledger.create_step(V, H, jobs(2), {}, group=1, lease_ms=0)
    with pytest.raises(ConfigError):
        ledger.create_step(V, H, [("x", b""), ("x", b"")], {}, group=1, lease_ms=LEASE)
    with pytest.raises(ConfigError):
        ledger.create_step(V, H, [("a|b", b"")], {}, group=1, lease_ms=LEASE)
    with pytest.raises(ConfigError):
        ledger.create_step(V, H, jobs(2), {"a": 3}, group=1, lease_ms=LEASE)
    with pytest.raises(ConfigError):
        ledger.register("bad|id")
    assert ledger.create_step(V, H, jobs(2), {}, group=1, lease_ms=LEASE) == "created"
    # a repeat (a retry after a lost answer) is a no-op; other jobs under the same id are refused
    assert ledger.create_step(V, H, jobs(2), {}, group=1, lease_ms=LEASE) == "exists"
    with pytest.raises(StepExists):
        ledger.create_step(V, H, jobs(3), {}, group=1, lease_ms=LEASE)
    assert ledger.open_steps() == [V]
    ledger.close_step(V)
    assert ledger.open_steps() == []
    with pytest.raises(LedgerLost):
        ledger.step_status(V)


# ---------------------------------------------------------------------------
# expiry


def test_expired_lease_goes_back_to_the_pool_on_the_next_claim(ledger: Ledger, clock: ManualClock) -> None:
    join(ledger, "a")
    join(ledger, "b")
    ledger.create_step(V, H, jobs(3), {}, group=1, lease_ms=LEASE)
    _, held = ledger.claim("a", V, 3)
    assert len(held) == 3
    clock.advance_ms(LEASE)  # exactly at expiry: still a's
    assert ledger.claim("b", V, 3) == ("ok", [])
    assert conserved(ledger).expired == 0
    clock.advance_ms(1)  # now past it
    st_ = conserved(ledger)
    assert (st_.leased, st_.expired) == (3, 0)  # nobody has looked yet
    status, again = ledger.claim("b", V, 3)
    assert status == "ok"
    assert sorted(x.prompt for x in again) == sorted(x.prompt for x in held)
    assert min(x.token for x in again) > max(x.token for x in held)
    st_ = conserved(ledger)
    assert (st_.leased, st_.pending, st_.expired, st_.settled) == (3, 0, 3, 0)
    # the old holder is fenced out, the new one settles
    assert ledger.settle("a", held[0], V, H, b"late").reason == "stale_token"
    assert all(ledger.settle("b", x, V, H, b"r").accepted for x in again)
    assert [r.actor for r in ledger.collect(V)] == ["b"] * 3


@pytest.mark.parametrize("offset, reason", [(-1, "accepted"), (0, "accepted"), (1, "expired")])
def test_result_at_the_expiry_boundary(ledger: Ledger, clock: ManualClock, offset: int, reason: str) -> None:
    join(ledger, "a")
    join(ledger, "b")
    ledger.create_step(V, H, jobs(1), {}, group=1, lease_ms=LEASE)
    _, (lease,) = ledger.claim("a", V, 1)
    clock.now_ms = lease.expiry_ms + offset
    s = ledger.settle("a", lease, V, H, b"result")
    assert s.reason == reason and s.now_ms == clock()
    st_ = conserved(ledger)
    if reason == "accepted":
        assert (st_.settled, st_.leased, st_.pending, st_.expired) == (1, 0, 0, 0)
        (r,) = ledger.collect(V)
        assert r.settled_ms <= lease.expiry_ms
    else:
        assert (st_.settled, st_.leased, st_.pending, st_.expired) == (0, 0, 1, 1)
        assert ledger.collect(V) == []
        _, (again,) = ledger.claim("b", V, 1)  # back in the pool at once
        assert again.prompt == lease.prompt and again.token > lease.token
        assert ledger.settle("b", again, V, H, b"r").accepted


# ---------------------------------------------------------------------------
# the rest of the predicate


@pytest.mark.parametrize(
    "version, state, reason", [(V - 1, H, "wrong_version"), (V + 1, H, "wrong_version"), (V, "sha256:other", "wrong_digest")]
)
def test_wrong_version_or_digest_is_rejected_and_released(ledger: Ledger, version: int, state: str, reason: str) -> None:
    join(ledger, "a")
    join(ledger, "b")
    ledger.create_step(V, H, jobs(2), {}, group=1, lease_ms=LEASE)
    _, (lease, other) = ledger.claim("a", V, 2)
    assert ledger.settle("a", lease, version, state, b"bad").reason == reason
    st_ = conserved(ledger)
    assert (st_.rejected, st_.pending, st_.leased, st_.settled) == (1, 1, 1, 0)
    assert ledger.settle("a", lease, V, H, b"good now").reason == "not_leased"  # the lease is gone
    _, (again,) = ledger.claim("b", V, 5)
    assert again.prompt == lease.prompt
    assert ledger.settle("b", again, V, H, b"good").accepted
    assert ledger.settle("a", other, V, H, b"good").accepted
    results = ledger.collect(V)
    assert sorted(r.prompt for r in results) == ["p000", "p001"]
    assert all(r.version == V for r in results)
    assert b"bad" not in [r.payload for r in results]


def test_stale_token_after_the_same_actor_was_re_leased(ledger: Ledger, clock: ManualClock) -> None:
    join(ledger, "a")
    ledger.create_step(V, H, jobs(1), {}, group=1, lease_ms=LEASE)
    _, (old,) = ledger.claim("a", V, 1)
    clock.advance_ms(LEASE + 1)
    _, (new,) = ledger.claim("a", V, 1)
    assert new.prompt == old.prompt and new.token > old.token
    assert ledger.settle("a", old, V, H, b"old").reason == "stale_token"
    assert ledger.settle("a", new, V, H, b"new").reason == "accepted"
    assert ledger.settle("a", old, V, H, b"old").reason == "already_settled"
    (r,) = ledger.collect(V)
    assert (r.token, r.payload) == (new.token, b"new")


def test_duplicate_settle_is_counted_once(ledger: Ledger, clock: ManualClock) -> None:
    join(ledger, "a")
    join(ledger, "b")
    ledger.create_step(V, H, jobs(2), {}, group=1, lease_ms=LEASE)
    t_claim = clock()
    _, (lease, _) = ledger.claim("a", V, 2)
    clock.advance_ms(10)
    assert ledger.settle("a", lease, V, H, b"once").reason == "accepted"
    assert ledger.settle("a", lease, V, H, b"once").reason == "duplicate"
    assert ledger.settle("a", lease, V, H, b"twice?").reason == "duplicate"
    assert ledger.settle("b", lease, V, H, b"me too").reason == "already_settled"
    (r,) = ledger.collect(V)
    assert (r.prompt, r.actor, r.token, r.version, r.payload) == (lease.prompt, "a", lease.token, V, b"once")
    assert (r.leased_ms, r.settled_ms) == (t_claim, t_claim + 10)
    assert conserved(ledger).settled == 1
    rec = ledger.actor("a")
    assert rec is not None and rec.settled == 1


def test_collect_skips_what_the_trainer_has(ledger: Ledger) -> None:
    join(ledger, "a")
    ledger.create_step(V, H, jobs(5), {}, group=1, lease_ms=LEASE)
    _, leases = ledger.claim("a", V, 5)
    for x in leases[:2]:
        ledger.settle("a", x, V, H, x.prompt.encode())
    first = ledger.collect(V)
    for x in leases[2:]:
        ledger.settle("a", x, V, H, x.prompt.encode())
    rest = ledger.collect(V, have={r.prompt for r in first})
    assert [r.prompt for r in first + rest] == [x.prompt for x in leases]
    assert all(r.payload == r.prompt.encode() for r in first + rest)


def test_settle_on_a_closed_step_answers_closed(ledger: Ledger) -> None:
    join(ledger, "a")
    ledger.create_step(V, H, jobs(1), {}, group=1, lease_ms=LEASE)
    _, (lease,) = ledger.claim("a", V, 1)
    ledger.close_step(V)
    assert ledger.settle("a", lease, V, H, b"r").reason == "closed"  # the tombstone answers
    assert ledger.settle("a", Lease("x", 1, V, H, 1, 0, b"", step=V + 1), V, H, b"r").reason == "no_step"
    assert set(SETTLE_REASONS) >= {"accepted", "closed", "no_step"}


# ---------------------------------------------------------------------------
# leave, reap


def test_graceful_leave_releases_leases_and_assignments_at_once(ledger: Ledger) -> None:
    join(ledger, "a")
    join(ledger, "b")
    ledger.create_step(V, H, jobs(6), {"a": 3, "b": 1}, group=1, lease_ms=LEASE)
    _, held = ledger.claim("a", V, 2)
    assert [x.prompt for x in held] == ["p000", "p001"]
    assert ledger.leave("a") == 3  # two leases, one unclaimed assignment
    rec = ledger.actor("a")
    assert rec is not None and rec.status == "left"
    st_ = conserved(ledger)
    assert (st_.leased, st_.pending) == (0, 6)
    assert ledger.heartbeat("a") is False
    assert ledger.claim("a", V, 1) == ("not_alive", [])
    # no clock movement: everything is claimable at once
    status, got = ledger.claim("b", V, 10)
    assert status == "ok" and sorted(x.prompt for x in got) == [p for p, _ in jobs(6)]
    assert ledger.settle("a", held[0], V, H, b"after leaving").reason == "stale_token"
    # rejoin
    join(ledger, "a")
    rec = ledger.actor("a")
    assert rec is not None and rec.status == "alive" and rec.active == V


def test_reap_marks_silent_actors_gone_and_releases_their_work(ledger: Ledger, clock: ManualClock) -> None:
    join(ledger, "a")
    join(ledger, "b")
    join(ledger, "c")
    ledger.create_step(V, H, jobs(6), {"a": 3}, group=1, lease_ms=60_000)
    _, held = ledger.claim("a", V, 2)
    ledger.leave("c")
    clock.advance_ms(5_000)
    assert ledger.heartbeat("b")
    assert ledger.reap(heartbeat_timeout_ms=5_000) == []  # exactly at the timeout: not yet
    clock.advance_ms(1)
    assert ledger.reap(heartbeat_timeout_ms=5_000) == ["a"]  # c left, b is fresh
    status = {r.actor: r.status for r in ledger.actors()}
    assert status == {"a": "gone", "b": "alive", "c": "left"}
    st_ = conserved(ledger)
    assert (st_.leased, st_.pending) == (0, 6)
    assert ledger.heartbeat("a") is False  # must register again
    assert ledger.claim("a", V, 1) == ("not_alive", [])
    _, got = ledger.claim("b", V, 10)
    assert len(got) == 6
    assert ledger.settle("a", held[0], V, H, b"zombie").reason == "stale_token"
    join(ledger, "a")
    assert ledger.reap(heartbeat_timeout_ms=5_000) == []


# ---------------------------------------------------------------------------
# settle_many and round trips


def test_settle_many_answers_each_item_in_order(ledger: Ledger) -> None:
    join(ledger, "a")
    ledger.create_step(V, H, jobs(4), {}, group=1, lease_ms=LEASE)
    _, (l0, l1, l2, l3) = ledger.claim("a", V, 4)
    out = ledger.settle_many(
        "a",
        [(l0, V, H, b"0"), (l1, V - 1, H, b"1"), (l2, V, "sha256:bad", b"2"), (l0, V, H, b"0 again"), (l3, V, H, b"3")],
    )
    assert [s.reason for s in out] == ["accepted", "wrong_version", "wrong_digest", "duplicate", "accepted"]
    assert [s.prompt for s in out] == ["p000", "p001", "p002", "p000", "p003"]
    assert ledger.settle_many("a", []) == []
    assert [r.prompt for r in ledger.collect(V)] == ["p000", "p003"]
    st_ = conserved(ledger)
    assert (st_.settled, st_.rejected, st_.pending) == (2, 2, 2)


def _counted_ledger(url: str, run: str, clock: ManualClock) -> tuple[Ledger, CallCounter]:
    counter = CallCounter()
    led = Ledger(counting_client(url, counter), run, clock=clock)
    join(led, "a")
    led.create_step(V, H, jobs(12), {}, group=1, lease_ms=LEASE)
    # load every script once (what a long-running Actor has long done)
    _, (warm,) = led.claim("a", V, 1)
    led.settle_many("a", [(warm, V, H, b"w")])
    return led, counter


def test_claim_and_settle_round_trips(redis_client: Any, redis_server: RedisServer, run_name: str, clock: ManualClock) -> None:
    led, counter = _counted_ledger(redis_server.url, run_name, clock)
    counter.reset()
    _, leases = led.claim("a", V, 5)
    assert counter.snapshot()[0] <= 2  # the script, then the step's state and group
    counter.reset()
    assert led.settle("a", leases[0], V, H, b"r").accepted
    assert counter.snapshot() == (1, 1)


def test_settle_many_is_one_round_trip(redis_client: Any, redis_server: RedisServer, run_name: str, clock: ManualClock) -> None:
    led, counter = _counted_ledger(redis_server.url, run_name, clock)
    _, leases = led.claim("a", V, 5)
    counter.reset()
    out = led.settle_many("a", [(x, V, H, b"r") for x in leases])
    assert all(s.accepted for s in out)
    assert counter.snapshot()[0] == 1


def test_settle_many_survives_a_lost_script_cache(redis_client: Any, redis_server: RedisServer, run_name: str, clock: ManualClock) -> None:
    """A Redis that lost its scripts (restart, SCRIPT FLUSH) answers NOSCRIPT: the batch is sent again, each result once."""
    led, counter = _counted_ledger(redis_server.url, run_name, clock)
    _, leases = led.claim("a", V, 3)
    redis_client.script_flush()
    out = led.settle_many("a", [(x, V, H, b"r") for x in leases] + [(leases[0], V, H, b"r")])
    assert [s.reason for s in out] == ["accepted", "accepted", "accepted", "duplicate"]
    assert len(led.collect(V)) == 4  # the warm-up prompt and these three, each once


# ---------------------------------------------------------------------------
# redis-py's errors stop at the ledger


def test_redis_away_is_redis_unavailable(dead_redis_url: str, run_name: str, clock: ManualClock) -> None:
    led = Ledger(connect(dead_redis_url, RedisConfig(connect_timeout_s=1.0)), run_name, clock=clock)
    lease = Lease("p000", 1, V, H, 1, clock() + LEASE, b"", step=V)
    calls: dict[str, Callable[[], Any]] = {
        "Ledger.register": lambda: led.register("a"),
        "Ledger.heartbeat": lambda: led.heartbeat("a", active=V),
        "Ledger.create_step": lambda: led.create_step(V, H, jobs(2), {}, group=1, lease_ms=LEASE),
        "Ledger.claim": lambda: led.claim("a", V, 1),
        "Ledger.settle": lambda: led.settle("a", lease, V, H, b"r"),
        "Ledger.settle_many": lambda: led.settle_many("a", [(lease, V, H, b"r")]),
        "Ledger.open_steps": led.open_steps,
        "Ledger.lease_counts": led.lease_counts,
        "Ledger.step_status": lambda: led.step_status(V),
        "Ledger.collect": lambda: led.collect(V),
    }
    for op, call in calls.items():
        with pytest.raises(RedisUnavailable) as e:
            call()
        # the innermost public method names the operation (create_step sets the fence first)
        assert e.value.op in (op, "Ledger.open_steps", "Ledger.ensure_fence"), (op, e.value.op)
        assert isinstance(e.value, ConnectionError)  # what callers that know nothing of Aurora catch
        assert isinstance(e.value.__cause__, redis.exceptions.ConnectionError)


def test_redis_answering_an_error_is_a_coordination_error(ledger: Ledger, redis_client: Any) -> None:
    redis_client.set(ledger.k_actor("a"), "not a hash")  # bad data where the ledger keeps an Actor
    with pytest.raises(CoordinationError) as e:
        ledger.register("a")
    assert not isinstance(e.value, RedisUnavailable)
    assert isinstance(e.value.__cause__, redis.exceptions.ResponseError)
    redis_client.delete(ledger.k_actor("a"))
    redis_client.srem(ledger.k_actors, "a")  # Lua does not roll back: the SADD before the failed HSET stayed
    join(ledger, "b")
    ledger.create_step(V, H, jobs(2), {}, group=1, lease_ms=LEASE)
    _, (x,) = ledger.claim("b", V, 1)
    redis_client.delete(ledger.k_step(V, "done"))
    redis_client.set(ledger.k_step(V, "done"), "not a hash")
    with pytest.raises(CoordinationError):  # inside a pipeline: the script's error result is raised translated
        ledger.settle_many("b", [(x, V, H, b"r")])


# ---------------------------------------------------------------------------
# versions live Actors hold (retention asks through lineage's HeldVersions)


def test_held_versions_of_live_actors(ledger: Ledger, clock: ManualClock) -> None:
    held = LedgerHeldVersions(ledger)
    assert held.held_versions() == frozenset()
    ledger.register("boot")  # registered, nothing active or staged yet
    assert ledger.heartbeat("boot", staged=-1)
    assert held.held_versions() == frozenset()
    join(ledger, "a", v=3, staged=5)  # on 3, with 4 and 5 staged
    join(ledger, "b", v=5, staged=5)
    ledger.register("c")
    assert ledger.heartbeat("c", staged=1)  # bootstrapping: staging its first version
    assert held.held_versions() == frozenset({1, 3, 4, 5})
    join(ledger, "left", v=0, staged=0)
    ledger.leave("left")
    assert 0 not in held.held_versions()
    join(ledger, "old", v=2, staged=2)
    clock.advance_ms(10_000)
    assert ledger.heartbeat("a") and ledger.heartbeat("b") and ledger.heartbeat("c")
    assert 2 in held.held_versions()  # alive until reaped, without a timeout
    recent = LedgerHeldVersions(ledger, heartbeat_timeout_ms=5_000)
    assert recent.held_versions() == frozenset({1, 3, 4, 5})  # "old" went silent
    ledger.reap(heartbeat_timeout_ms=5_000)
    assert held.held_versions() == frozenset({1, 3, 4, 5})
    with pytest.raises(ConfigError):
        LedgerHeldVersions(ledger, heartbeat_timeout_ms=0)


def test_held_versions_is_the_lineage_interface(ledger: Ledger) -> None:
    held: HeldVersions = LedgerHeldVersions(ledger)  # mypy checks the signature, isinstance the method
    assert isinstance(held, HeldVersions)


# ---------------------------------------------------------------------------
# known defects (strict xfails: they start passing when fixed)


def test_actor_lease_count_after_an_expired_lease_is_re_leased(ledger: Ledger, clock: ManualClock) -> None:
    join(ledger, "a")
    join(ledger, "b")
    ledger.create_step(V, H, jobs(1), {}, group=1, lease_ms=LEASE)
    _, (old,) = ledger.claim("a", V, 1)
    clock.advance_ms(LEASE + 1)
    _, (new,) = ledger.claim("b", V, 1)
    assert ledger.settle("b", new, V, H, b"r").accepted
    assert ledger.settle("a", old, V, H, b"r").reason == "already_settled"
    a, b = ledger.actor("a"), ledger.actor("b")
    assert a is not None and b is not None
    assert b.leases == 0
    assert a.leases == 0  # a holds nothing any more


def test_leave_racing_a_claim_leaves_nothing_leased(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    join(ledger, "a")
    ledger.create_step(V, H, jobs(4), {}, group=1, lease_ms=LEASE)
    ledger.claim("a", V, 1)
    release = ledger.release_actor

    def release_then_claim(actor: str) -> int:
        n = release(actor)
        ledger.claim(actor, V, 1)  # the Actor's loop, between the two steps of leave
        return n

    monkeypatch.setattr(ledger, "release_actor", release_then_claim)
    ledger.leave("a")
    rec = ledger.actor("a")
    assert rec is not None and rec.status == "left"
    assert ledger.step_status(V).leased == 0


def test_quota_for_an_unregistered_actor_loses_no_prompt(ledger: Ledger, clock: ManualClock) -> None:
    join(ledger, "b")
    try:
        ledger.create_step(V, H, jobs(4), {"ghost": 2, "b": 1}, group=1, lease_ms=LEASE)
    except ConfigError:
        return  # refusing such quotas is a fix too
    conserved(ledger)  # settled + leased + pending == total
    clock.advance_ms(60_000)
    assert ledger.heartbeat("b")
    ledger.reap(heartbeat_timeout_ms=30_000)
    _, got = ledger.claim("b", V, 10)
    assert len(got) == 4


# ---------------------------------------------------------------------------
# Redis losing its state


def test_fencing_tokens_stay_above_old_ones_after_redis_restart(own_redis_server: RedisServer, run_name: str) -> None:
    client = connect(own_redis_server.url)
    led = Ledger(client, run_name)  # server clock, as in production
    join(led, "a")
    led.create_step(V, H, jobs(50), {}, group=1, lease_ms=60_000)
    _, old = led.claim("a", V, 50)
    fence_before = int(client.get(led.k_fence))
    led.ensure_fence()  # idempotent: never lowers the counter
    assert int(client.get(led.k_fence)) == fence_before
    own_redis_server.restart()
    with pytest.raises(LedgerLost):
        led.step_status(V)
    assert led.heartbeat("a") is False
    join(led, "a")
    led.create_step(V, H, jobs(50), {}, group=1, lease_ms=60_000)
    _, new = led.claim("a", V, 50)
    assert min(x.token for x in new) > max(x.token for x in old)
    # a lease from before the loss never settles on the new ledger
    assert all(led.settle("a", x, V, H, b"old").reason == "stale_token" for x in old)
    assert led.collect(V) == []
    client.close()


# ---------------------------------------------------------------------------
# processes: Actors killed, frozen, and Redis losing its data mid-run

ACTOR_SCRIPT = r"""
import json, sys
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.redisconn import connect

url, run, actor, v, state, n = sys.argv[1:7]
v, n = int(v), int(n)
led = Ledger(connect(url), run)  # server clock
led.register(actor)
led.heartbeat(actor, active=v, staged=v, active_state=state)
status, leases = led.claim(actor, v, n)
print(json.dumps({"status": status, "claimed": [[x.prompt, x.token, x.expiry_ms] for x in leases]}), flush=True)
sys.stdin.readline()  # "generating": a killed or stopped Actor never gets past this
out = {x.prompt: led.settle(actor, x, v, state, b"late " + x.prompt.encode()).reason for x in leases}
print(json.dumps({"reasons": out}), flush=True)
"""


def _spawn_actor(url: str, run: str, actor: str, n: int, tmp_path: Any) -> subprocess.Popen[str]:
    script = tmp_path / "actor.py"
    script.write_text(ACTOR_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(
        [sys.executable, str(script), url, run, actor, str(V), H, str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _read_json_line(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> dict[str, Any]:
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout_s):
            raise AssertionError(f"actor process said nothing within {timeout_s}s")
        line = proc.stdout.readline()
    finally:
        sel.close()
    if not line:
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"actor process exited ({proc.poll()}): {err}")
    return json.loads(line)


def _claim_until(led: Ledger, actor: str, want: set[str], keep: Callable[[Lease], bool], timeout_s: float = 20.0) -> dict[str, Lease]:
    """Claim (server clock) until every prompt in ``want`` was leased to ``actor``.

    Each lease is settled at once unless ``keep(lease)``; the kept ones are
    returned (by prompt). Settling at once matters: a lease held while we
    wait for another Actor's to expire would expire too.
    """
    seen: set[str] = set()
    kept: dict[str, Lease] = {}
    deadline = time.monotonic() + timeout_s
    while not want <= seen:
        assert time.monotonic() < deadline, f"{want - seen} never came back to the pool"
        status, leases = led.claim(actor, V, 100)
        assert status == "ok"
        for x in leases:
            seen.add(x.prompt)
            if keep(x):
                kept[x.prompt] = x
            else:
                assert led.settle(actor, x, V, H, actor.encode()).accepted
        if not leases:
            time.sleep(0.05)  # the server clock has to pass the expiry; nothing to wait on
    return kept


def _finish(led: Ledger, actor: str, kept: dict[str, Lease], timeout_s: float = 20.0) -> None:
    """Settle the kept leases; anything that expired meanwhile is claimed again and settled."""
    for x in kept.values():
        led.settle(actor, x, V, H, actor.encode())
    deadline = time.monotonic() + timeout_s
    while (st_ := led.step_status(V)).settled < st_.total:
        assert time.monotonic() < deadline, st_
        _, leases = led.claim(actor, V, 100)
        for x in leases:
            led.settle(actor, x, V, H, actor.encode())
        if not leases:
            time.sleep(0.05)


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()


@pytest.mark.slow
def test_actor_killed_mid_lease_loses_no_prompt(redis_client: Any, redis_server: RedisServer, run_name: str, tmp_path: Any) -> None:
    trainer = Ledger(connect(redis_server.url), run_name)
    trainer.create_step(V, H, jobs(10), {}, group=1, lease_ms=1_500)
    proc = _spawn_actor(redis_server.url, run_name, "spot", 4, tmp_path)
    try:
        line = _read_json_line(proc)
        assert line["status"] == "ok"
        dead = {p: (tok, exp) for p, tok, exp in line["claimed"]}
        assert len(dead) == 4
        os.kill(proc.pid, signal.SIGKILL)  # spot preemption: no goodbye
    finally:
        _kill(proc)
    b = Ledger(connect(redis_server.url), run_name)
    join(b, "b")
    got: list[Lease] = []

    def note(x: Lease) -> bool:
        got.append(x)
        return False  # settle every lease at once

    _claim_until(b, "b", {p for p, _ in jobs(10)}, keep=note)
    for x in got:
        if x.prompt in dead:
            assert x.token > dead[x.prompt][0]
    results = trainer.collect(V)
    assert sorted(r.prompt for r in results) == [p for p, _ in jobs(10)]  # each once, none lost
    for r in results:
        if r.prompt in dead:
            assert r.leased_ms > dead[r.prompt][1]  # re-leased only after the old lease expired
    st_ = conserved(trainer)
    assert (st_.settled, st_.leased, st_.pending, st_.expired) == (10, 0, 0, 4)


@pytest.mark.slow
def test_frozen_actor_late_settles_are_refused(redis_client: Any, redis_server: RedisServer, run_name: str, tmp_path: Any) -> None:
    trainer = Ledger(connect(redis_server.url), run_name)
    trainer.create_step(V, H, jobs(8), {}, group=1, lease_ms=1_500)
    proc = _spawn_actor(redis_server.url, run_name, "frozen", 4, tmp_path)
    try:
        line = _read_json_line(proc)
        frozen = [p for p, _, _ in line["claimed"]]
        assert len(frozen) == 4
        os.kill(proc.pid, signal.SIGSTOP)  # a stalled VM, a GC pause, a partition
        b = Ledger(connect(redis_server.url), run_name)
        join(b, "b")
        held = _claim_until(b, "b", set(frozen), keep=lambda x: x.prompt in frozen[2:])
        assert sorted(held) == sorted(frozen[2:])
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        os.kill(proc.pid, signal.SIGCONT)
        reasons = _read_json_line(proc)["reasons"]
        assert proc.wait(timeout=30) == 0
    finally:
        _kill(proc)
    assert set(reasons) == set(frozen)
    assert "accepted" not in reasons.values()
    assert set(reasons.values()) <= {"stale_token", "not_leased", "already_settled", "expired"}
    assert [reasons[p] for p in frozen[:2]] == ["already_settled"] * 2  # b settled these first
    assert [reasons[p] for p in frozen[2:]] == ["stale_token"] * 2  # b holds the newer lease
    _finish(b, "b", held)
    results = trainer.collect(V)
    assert sorted(r.prompt for r in results) == [p for p, _ in jobs(8)]
    assert {r.actor for r in results} == {"b"}
    assert not any(r.payload.startswith(b"late") for r in results)
    assert trainer.step_status(V).rejected == 0


@pytest.mark.slow
def test_redis_losing_its_data_mid_run(own_redis_server: RedisServer, run_name: str) -> None:
    url = own_redis_server.url
    trainer, a, b = (Ledger(connect(url), run_name) for _ in range(3))
    prompts = jobs(12)
    join(a, "a")
    join(b, "b")
    trainer.create_step(V, H, prompts, {"a": 4, "b": 4}, group=1, lease_ms=60_000)
    collected: dict[str, bytes] = {}  # the Trainer's own record: the source of truth
    _, la = a.claim("a", V, 4)
    _, lb = b.claim("b", V, 4)
    assert all(a.settle("a", x, V, H, b"a1").accepted for x in la[:3])
    assert all(b.settle("b", x, V, H, b"b1").accepted for x in lb)
    for r in trainer.collect(V):
        collected[r.prompt] = r.payload
    assert len(collected) == 7
    _, la2 = a.claim("a", V, 2)
    assert a.settle("a", la2[0], V, H, b"a2").accepted  # accepted, but the Trainer never collects it
    before = la + lb + la2
    held = [la[3], la2[1]]  # leases alive when Redis goes

    own_redis_server.restart()  # ... and comes back empty

    with pytest.raises(LedgerLost):
        trainer.step_status(V)
    with pytest.raises(LedgerLost):
        trainer.collect(V)
    remaining = [(p, body) for p, body in prompts if p not in collected]
    assert len(remaining) == 5
    quotas: dict[str, int] = {}  # nobody is registered yet: everything goes to the pool
    assert trainer.actors() == []
    trainer.create_step(V, H, remaining, quotas, group=1, lease_ms=60_000)
    for led, name in ((a, "a"), (b, "b")):
        assert led.heartbeat(name, active=V, staged=V, active_state=H) is False
        join(led, name)
    assert a.settle("a", held[0], V, H, b"pre-restart").reason == "not_leased"
    _, new_a = a.claim("a", V, 3)
    _, new_b = b.claim("b", V, 10)
    assert min(x.token for x in new_a + new_b) > max(x.token for x in before)
    assert {x.prompt for x in new_a + new_b} == {p for p, _ in remaining}
    for x in held:  # whoever holds the prompt now, the old lease is fenced out
        assert a.settle("a", x, V, H, b"pre-restart").reason == "stale_token"
    assert all(a.settle("a", x, V, H, b"a3").accepted for x in new_a)
    assert all(b.settle("b", x, V, H, b"b3").accepted for x in new_b)
    after = trainer.collect(V)
    assert not {r.prompt for r in after} & set(collected)
    for r in after:
        collected[r.prompt] = r.payload
    assert sorted(collected) == [p for p, _ in prompts]  # every prompt exactly once overall
    assert len(after) == len(remaining)
    assert b"pre-restart" not in collected.values()
    assert conserved(trainer).settled == 5


# ---------------------------------------------------------------------------
# the ledger against a plain-Python model of the predicate

SM_ACTORS = ("a0", "a1", "a2")
SM_PROMPTS = 6
SM_LEASE = 100


class LedgerMachine(RuleBasedStateMachine):
    """One step, three Actors, a manual clock; every answer predicted by the model.

    The model keeps the same lists as the ledger (per-Actor assignments and
    the pool, in order) so claims are predicted exactly; only the order in
    which a leave or reap puts leases back (hash order) is read from Redis.
    """

    client: Any = None

    @initialize(quota=st.integers(0, 3))
    def setup(self, quota: int) -> None:
        self.clock = ManualClock(wall=1_000.0)
        self.run = f"sm-{uuid.uuid4().hex[:10]}"
        self.ledger = Ledger(self.client, self.run, clock=self.clock)
        self.active = {"a0": V, "a1": V, "a2": V - 1}  # a2 must activate v before it may claim
        self.alive = dict.fromkeys(SM_ACTORS, True)
        self.hb = {}
        for a in SM_ACTORS:
            join(self.ledger, a, v=self.active[a])
            self.hb[a] = self.clock()
        ids = [f"p{i}" for i in range(SM_PROMPTS)]
        quotas = {"a0": quota, "a2": 1}
        self.ledger.create_step(V, H, [(p, p.encode()) for p in ids], quotas, group=1, lease_ms=SM_LEASE)
        self.assigned = {"a0": ids[:quota], "a1": [], "a2": ids[quota : quota + 1]}
        self.pool = ids[quota + 1 :]
        self.leases: dict[str, tuple[str, int, int]] = {}  # prompt -> (actor, token, expiry)
        self.done: dict[str, tuple[str, int]] = {}
        self.accepted: list[tuple[str, str, int, int]] = []  # (prompt, actor, token, now)
        self.handed: list[tuple[str, Lease]] = []  # every lease ever handed out, with its holder
        self.last_token = 0
        self.expired = 0
        self.rejected = 0

    # -- model helpers ---------------------------------------------------------
    def _release(self, actor: str, got: int) -> None:
        """Apply RELEASE to the model; hash order of the leases is read from Redis."""
        mine = sorted(p for p, (a, _, _) in self.leases.items() if a == actor)
        assigned = self.assigned[actor]
        assert got == len(mine) + len(assigned)
        redis_pool = [x.decode() for x in self.client.lrange(self.ledger.k_step(V, "pool"), 0, -1)]
        n0 = len(self.pool)
        assert redis_pool[:n0] == self.pool
        assert sorted(redis_pool[n0 : n0 + len(mine)]) == mine
        assert redis_pool[n0 + len(mine) :] == assigned
        for p in mine:
            del self.leases[p]
        self.assigned[actor] = []
        self.pool = redis_pool

    # -- rules -----------------------------------------------------------------
    @rule(actor=st.sampled_from(SM_ACTORS), n=st.integers(1, 4))
    def claim(self, actor: str, n: int) -> None:
        status, leases = self.ledger.claim(actor, V, n)
        now = self.clock()
        if not self.alive[actor]:
            assert (status, leases) == ("not_alive", [])
            return
        if self.active[actor] != V:
            assert (status, leases) == ("not_on_version", [])
            return
        assert status == "ok"
        back = sorted((exp, p) for p, (_, _, exp) in self.leases.items() if exp < now)
        for _, p in back:
            del self.leases[p]
            self.pool.append(p)
        self.expired += len(back)
        want: list[str] = []
        while len(want) < n and (self.assigned[actor] or self.pool):
            want.append((self.assigned[actor] or self.pool).pop(0))
        assert [x.prompt for x in leases] == want
        for x in leases:
            assert x.token > self.last_token
            assert (x.version, x.state, x.expiry_ms, x.payload) == (V, H, now + SM_LEASE, x.prompt.encode())
            self.last_token = x.token
            self.leases[x.prompt] = (actor, x.token, x.expiry_ms)
            self.handed.append((actor, x))

    @rule(
        i=st.integers(0, 10_000),
        kind=st.sampled_from(["ok", "ok", "ok", "wrong_version", "wrong_digest", "impostor"]),
    )
    def settle(self, i: int, kind: str) -> None:
        if not self.handed:
            return
        holder, lease = self.handed[i % len(self.handed)]
        actor = holder
        version, state = V, H
        if kind == "wrong_version":
            version = V - 1
        elif kind == "wrong_digest":
            state = "sha256:wrong"
        elif kind == "impostor":
            actor = SM_ACTORS[(SM_ACTORS.index(holder) + 1) % len(SM_ACTORS)]
        s = self.ledger.settle(actor, lease, version, state, b"result")
        now = self.clock()
        p = lease.prompt
        if p in self.done:
            expect = "duplicate" if self.done[p] == (actor, lease.token) else "already_settled"
        elif p not in self.leases:
            expect = "not_leased"
        elif self.leases[p][:2] != (actor, lease.token):
            expect = "stale_token"
        else:
            if now > self.leases[p][2]:
                expect = "expired"
                self.expired += 1
            elif version != V:
                expect = "wrong_version"
                self.rejected += 1
            elif state != H:
                expect = "wrong_digest"
                self.rejected += 1
            else:
                expect = "accepted"
            if expect == "accepted":
                self.done[p] = (actor, lease.token)
                self.accepted.append((p, actor, lease.token, now))
                del self.leases[p]
            else:
                del self.leases[p]
                self.pool.append(p)
        assert s.reason == expect, (s, expect)

    @rule(ms=st.sampled_from([0, 1, 30, SM_LEASE - 1, SM_LEASE, SM_LEASE + 1, 150]))
    def advance(self, ms: int) -> None:
        self.clock.advance_ms(ms)

    @rule(actor=st.sampled_from(SM_ACTORS))
    def heartbeat(self, actor: str) -> None:
        assert self.ledger.heartbeat(actor) is self.alive[actor]
        if self.alive[actor]:
            self.hb[actor] = self.clock()

    @rule()
    def activate(self) -> None:
        if self.ledger.heartbeat("a2", active=V, active_state=H):
            self.active["a2"] = V
            self.hb["a2"] = self.clock()

    @rule(actor=st.sampled_from(SM_ACTORS))
    def leave(self, actor: str) -> None:
        self._release(actor, self.ledger.leave(actor))
        self.alive[actor] = False

    @rule(timeout=st.sampled_from([50, 150, 300]))
    def reap(self, timeout: int) -> None:
        now = self.clock()
        expect = [a for a in SM_ACTORS if self.alive[a] and now - self.hb[a] > timeout]
        # reap's answer comes after it released everyone's work, so replay the
        # releases one Actor at a time against a copy of what it did
        before_pool = list(self.pool)
        held = {a: sorted(p for p, (h, _, _) in self.leases.items() if h == a) for a in expect}
        assigned = {a: list(self.assigned[a]) for a in expect}
        assert self.ledger.reap(timeout) == expect
        redis_pool = [x.decode() for x in self.client.lrange(self.ledger.k_step(V, "pool"), 0, -1)]
        assert redis_pool[: len(before_pool)] == before_pool
        pos = len(before_pool)
        for a in expect:
            k = len(held[a])
            assert sorted(redis_pool[pos : pos + k]) == held[a]
            assert redis_pool[pos + k : pos + k + len(assigned[a])] == assigned[a]
            pos += k + len(assigned[a])
            for p in held[a]:
                del self.leases[p]
            self.assigned[a] = []
            self.alive[a] = False
        assert pos == len(redis_pool)
        self.pool = redis_pool

    @rule(actor=st.sampled_from(SM_ACTORS))
    def rejoin(self, actor: str) -> None:
        if self.alive[actor]:
            return
        join(self.ledger, actor, v=V)
        self.alive[actor] = True
        self.active[actor] = V
        self.hb[actor] = self.clock()

    # -- invariants --------------------------------------------------------------
    @invariant()
    def counts_match_the_model(self) -> None:
        if not hasattr(self, "ledger"):
            return
        st_ = self.ledger.step_status(V)
        pending = len(self.pool) + sum(len(x) for x in self.assigned.values())
        assert st_.settled + st_.leased + st_.pending == st_.total == SM_PROMPTS
        assert (st_.settled, st_.leased, st_.pending) == (len(self.done), len(self.leases), pending)
        assert (st_.expired, st_.rejected) == (self.expired, self.rejected)

    @invariant()
    def accepted_at_most_once_and_only_if_valid(self) -> None:
        if not hasattr(self, "ledger"):
            return
        results = self.ledger.collect(V)
        prompts = [r.prompt for r in results]
        assert len(prompts) == len(set(prompts))
        assert [(r.prompt, r.actor, r.token, r.settled_ms) for r in results] == self.accepted
        handed = {(x.prompt, x.token): (h, x) for h, x in self.handed}
        for r in results:
            holder, lease = handed[(r.prompt, r.token)]
            assert r.actor == holder and r.version == V
            assert r.settled_ms <= lease.expiry_ms  # on time
            assert r.payload == b"result"


def test_ledger_state_machine(redis_client: Any) -> None:
    LedgerMachine.client = redis_client
    run_state_machine_as_test(
        LedgerMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
