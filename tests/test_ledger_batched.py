"""The ledger's batched scripts: one CLAIM answers the step's metadata, one SETTLE_MANY per step settles a
batch, each result judged as its own SETTLE would judge it, and a step created while an Actor leaves
strands nothing."""

from __future__ import annotations

from typing import Any

import pytest
from ledger_fixtures import jobs, register_on

from aurora_store.coordination.ledger import Ledger
from aurora_store.testing.clock import ManualClock
from aurora_store.testing.servers import RedisServer
from aurora_tools.bench.ledger import CallCounter, counting_client

pytestmark = pytest.mark.server

V = 5
H = "sha256:" + "5" * 64
LEASE = 1_000


def join(ledger: Ledger, actor: str, v: int = V) -> None:
    register_on(ledger, actor, v, v, H)


def test_claim_is_one_round_trip_and_carries_the_step(redis_server: RedisServer, run_name: str, clock: ManualClock) -> None:
    counter = CallCounter()
    led = Ledger(counting_client(redis_server.url, counter), run_name, clock=clock)
    join(led, "a")
    led.create_step(V, H, jobs(6), {"a": 2}, group=3, lease_ms=LEASE, version=V - 1)
    led.heartbeat("a", active=V - 1)
    led.claim("a", V, 1)  # loads the script
    counter.reset()
    status, leases = led.claim("a", V, 4)
    assert counter.snapshot()[0] == 1
    assert status == "ok" and [le.prompt for le in leases] == ["p001", "p002", "p003", "p004"]
    assert {(le.version, le.state, le.group, le.step_id) for le in leases} == {(V - 1, H, 3, V)}
    assert [le.token for le in leases] == sorted({le.token for le in leases})  # distinct, increasing
    assert all(le.expiry_ms == clock() + LEASE for le in leases)


def test_claim_drops_duplicates_in_the_lists_and_fills_up(ledger: Ledger, redis_client: Any) -> None:
    """A prompt repeated in the lists (a write repeated after a partial loss) is leased once; the claim
    pops further to fill up."""
    join(ledger, "a")
    ledger.create_step(V, H, jobs(5), {"a": 2}, group=1, lease_ms=LEASE)
    redis_client.lpush(ledger.k_assigned(V, "a"), "p000", "p000", "ghost")  # ghost p000 p000 p000 p001
    _, leases = ledger.claim("a", V, 4)
    assert [le.prompt for le in leases] == ["p000", "p001", "p002", "p003"]
    assert int(redis_client.hget(ledger.k_step(V), "duplicates")) == 3  # ghost (no such prompt), p000 twice


def test_claim_returns_every_expired_lease_to_the_pool(ledger: Ledger, clock: ManualClock) -> None:
    join(ledger, "a")
    join(ledger, "b")
    ledger.create_step(V, H, jobs(30), {}, group=1, lease_ms=LEASE)
    _, held = ledger.claim("a", V, 30)
    clock.advance_ms(LEASE + 1)
    _, again = ledger.claim("b", V, 30)
    assert sorted(le.prompt for le in again) == sorted(le.prompt for le in held)
    assert ledger.step_status(V).expired == 30
    assert all(s.reason == "stale_token" for s in ledger.settle_many("a", [(le, V, H, b"x") for le in held]))


def test_settle_many_is_one_script_per_step(redis_server: RedisServer, redis_client: Any, run_name: str, clock: ManualClock) -> None:
    counter = CallCounter()
    led = Ledger(counting_client(redis_server.url, counter), run_name, clock=clock)
    join(led, "a")
    led.create_step(V, H, jobs(8), {}, group=1, lease_ms=LEASE)
    led.create_step(V + 1, H, jobs(8, "q"), {}, group=1, lease_ms=LEASE, version=V)
    _, a = led.claim("a", V, 4)
    _, b = led.claim("a", V + 1, 4)
    mixed = [a[0], b[0], a[1], b[1], a[2], b[2], a[3], b[3]]
    before = int(redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    counter.reset()
    out = led.settle_many("a", [(le, V, H, b"r" + le.prompt.encode()) for le in mixed])
    assert counter.snapshot()[0] == 1
    assert int(redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]) - before == 2  # one per step
    assert [s.prompt for s in out] == [le.prompt for le in mixed] and all(s.accepted for s in out)
    for v, want in ((V, a), (V + 1, b)):
        got = led.collect(v)
        assert [r.prompt for r in got] == [le.prompt for le in want]
        assert [r.seq for r in got] == [1, 2, 3, 4]
        assert [r.payload for r in got] == [b"r" + le.prompt.encode() for le in want]
        assert {(r.actor, r.version, r.state) for r in got} == {("a", V, H)}
    rec = led.actor("a")
    assert rec is not None and rec.settled == 8


def test_settle_many_judges_each_result_as_settle_would(ledger: Ledger, redis_client: Any, clock: ManualClock) -> None:
    """The same mix of results settled one by one on one step and as one batch on a twin step: same answers,
    same ledger afterwards."""
    join(ledger, "a")
    join(ledger, "b")
    answers: list[list[str]] = []
    for v in (V, V + 1):
        ledger.create_step(v, H, jobs(9), {}, group=1, lease_ms=LEASE, version=V)
        _, mine = ledger.claim("a", v, 7)
        _, theirs = ledger.claim("b", v, 1)
        clock.advance_ms(10)
        short = ledger.claim("a", v, 1)[1][0]
        batch = [
            (mine[0], V, H, b"0"),
            (mine[1], V - 1, H, b"1"),  # wrong version: back to the pool
            (mine[2], V, "sha256:bad", b"2"),  # wrong digest
            (mine[0], V, H, b"0 again"),  # duplicate of the first
            (theirs[0], V, H, b"not mine"),  # stale token (another Actor's lease)
            (mine[1], V, H, b"1 again"),  # its lease went back to the pool: not leased
            (mine[3], V, H, b"3"),
            (mine[3], V, H, b"3"),
        ]
        if v == V:
            answers.append([ledger.settle("a", le, ver, st, body).reason for le, ver, st, body in batch])
        else:
            answers.append([s.reason for s in ledger.settle_many("a", batch)])
        clock.advance_ms(LEASE - 5)  # `short` (leased 10 ms later) is still valid, the others are past expiry
        late = (
            [ledger.settle("a", mine[4], V, H, b"late").reason]
            if v == V
            else [ledger.settle_many("a", [(mine[4], V, H, b"late")])[0].reason]
        )
        ok = [ledger.settle("a", short, V, H, b"s").reason] if v == V else [ledger.settle_many("a", [(short, V, H, b"s")])[0].reason]
        answers[-1] += late + ok
        clock.advance_ms(-(LEASE - 5))
    assert answers[0] == answers[1]
    assert answers[0] == [
        "accepted",
        "wrong_version",
        "wrong_digest",
        "duplicate",
        "stale_token",
        "not_leased",
        "accepted",
        "duplicate",
        "expired",
        "accepted",
    ]
    s1, s2 = ledger.step_status(V), ledger.step_status(V + 1)
    assert (s1.settled, s1.rejected, s1.expired, s1.leased, s1.pending) == (
        s2.settled,
        s2.rejected,
        s2.expired,
        s2.leased,
        s2.pending,
    )
    assert [(r.prompt, r.seq, r.payload) for r in ledger.collect(V)] == [(r.prompt, r.seq, r.payload) for r in ledger.collect(V + 1)]
    assert redis_client.lrange(ledger.k_step(V, "pool"), 0, -1) == redis_client.lrange(ledger.k_step(V + 1, "pool"), 0, -1)


def test_settle_many_on_a_closed_or_missing_step(ledger: Ledger) -> None:
    join(ledger, "a")
    ledger.create_step(V, H, jobs(3), {}, group=1, lease_ms=LEASE)
    _, leases = ledger.claim("a", V, 3)
    ledger.seal_step(V)
    assert [s.reason for s in ledger.settle_many("a", [(le, V, H, b"r") for le in leases])] == ["closed"] * 3
    gone = [le.__class__(le.prompt, le.token, V, H, 1, le.expiry_ms, b"", step=V + 9) for le in leases[:2]]
    assert [s.reason for s in ledger.settle_many("a", [(le, V, H, b"r") for le in gone])] == ["no_step"] * 2


def test_a_large_batch_settles_in_one_script(ledger: Ledger) -> None:
    """Batches past Lua's unpack limit are written in chunks."""
    join(ledger, "a")
    ledger.create_step(V, H, jobs(1200), {}, group=1, lease_ms=LEASE)
    _, leases = ledger.claim("a", V, 1200)
    assert len(leases) == 1200
    out = ledger.settle_many("a", [(le, V, H, b"r") for le in leases])
    assert all(s.accepted for s in out)
    assert len(ledger.collect(V)) == 1200 and ledger.step_status(V).leased == 0


def test_a_quota_of_an_actor_that_left_before_the_step_was_written_goes_to_the_pool(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """create_step reads the registry, then writes the step: an Actor that leaves in between (its release
    finds no such step yet) must not be assigned prompts nobody else could claim."""
    join(ledger, "a")
    join(ledger, "b")
    read = ledger._liveness

    def read_then_b_leaves() -> Any:
        out = read()
        ledger.leave("b")
        return out

    monkeypatch.setattr(ledger, "_liveness", read_then_b_leaves)
    ledger.create_step(V, H, jobs(6), {"a": 2, "b": 3}, group=1, lease_ms=LEASE)
    monkeypatch.undo()
    st_ = ledger.step_status(V)
    assert st_.pending == 6
    _, leases = ledger.claim("a", V, 10)
    assert len(leases) == 6  # its own two, then b's three and the last from the pool
