"""The ledger against a holder of the Actors' Redis credential (issue 24, hole 8).

Every Actor logs in as one Redis user, which can read every lease and, since
Redis checks a script's commands against its caller's permissions, write
every key the settle script writes. So: a lease is settled only with the
secret its claimer chose (its hash rides in the lease, the secret never
leaves the claimer but in the SETTLE call); the Trainer takes a result only
when it is consistent with what the settle script writes (a witness of that
secret matching the lease's hash, the ``done`` entry, the batch's prompts,
version and state) and ignores and counts anything else, and nothing
malformed stops it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
from ledger_fixtures import jobs, register_on

from aurora_store.coordination.ledger import Lease, Ledger
from aurora_store.testing.clock import ManualClock
from workers.trainer.scheduling import Collected, collect_batch

pytestmark = pytest.mark.server

V = 4
H = "sha256:" + "4" * 64
LEASE = 10_000


class ScriptedClock:
    """A clock whose every wait runs the next step of a script (as in test_ledger_robust)."""

    def __init__(self, on_wait: Callable[[int], None], limit: int = 50) -> None:
        self.now = 0.0
        self.waits = 0
        self.on_wait = on_wait
        self.limit = limit

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        self.now += timeout_s
        self.waits += 1
        assert self.waits < self.limit, "collect_batch kept waiting"
        self.on_wait(self.waits)
        return event.is_set()


def _forged_lease(redis_client: Any, ledger: Ledger, prompt: str) -> Lease:
    """What anyone holding the Actor credential can build by reading another Actor's lease."""
    raw = redis_client.hget(ledger.k_step(V, "lease"), prompt).decode()
    actor, token, expiry = raw.split("|")[:3]
    return Lease(prompt, int(token), V, H, 1, int(expiry), b"", step=V)


def _forge_result(redis_client: Any, ledger: Ledger, prompt: str, head: str | bytes, actor: str = "x", token: int = 7) -> None:
    """A result written with plain HSETs, as the Actor credential may (the issue's attack)."""
    redis_client.hset(ledger.k_step(V, "done"), prompt, f"{actor}|{token}")
    redis_client.hset(ledger.k_step(V, "results"), prompt, head)
    redis_client.hset(ledger.k_step(V, "results:payload"), prompt, b'{"completions": [[1]], "texts": ["forged"]}')


def _head(prompt: str, actor: str = "x", token: int = 7, proven: bool = False) -> str:
    """A result record; ``proven``: with a witness and claim hash the forger made up consistently."""
    if not proven:
        return json.dumps([prompt, actor, token, V, 1, 0, 1, H])
    witness = hashlib.sha1(b"made-up").hexdigest()  # noqa: S324
    return json.dumps([prompt, actor, token, V, 1, 0, 1, H, witness, hashlib.sha1(witness.encode()).hexdigest()])  # noqa: S324


def _collect(ledger: Ledger, n: int, play: Callable[[int], None], **kw: Any) -> tuple[Any, dict[str, Any], Collected]:
    collected: dict[str, Any] = {}
    counts = Collected()
    done = collect_batch(
        ledger,
        V,
        V,
        n,
        collected,
        [],
        counts,
        60_000,
        30.0,
        1.0,
        threading.Event(),
        ScriptedClock(play),
        lambda: pytest.fail("the step was not lost"),
        prompts={p for p, _ in jobs(n)},
        state=H,
        **kw,
    )
    return done, collected, counts


def test_settling_another_actors_lease_is_refused(ledger: Ledger, redis_client: Any, clock: ManualClock) -> None:
    register_on(ledger, "a", V, V, H)
    register_on(ledger, "b", V, V, H)
    ledger.create_step(V, H, jobs(2), {}, group=1, lease_ms=LEASE)
    _, (mine,) = ledger.claim("a", V, 1)
    # b reads a's lease (every Actor can) and settles it in a's name, and in its own.
    forged = _forged_lease(redis_client, ledger, mine.prompt)
    assert forged.token == mine.token
    assert ledger.settle("a", forged, V, H, b"stolen").reason == "stale_token"
    assert ledger.settle("b", forged, V, H, b"stolen").reason == "stale_token"
    assert [s.reason for s in ledger.settle_many("a", [(forged, V, H, b"stolen")])] == ["stale_token"]
    # The lease is still a's, and a's settle (and its retry) go through.
    assert ledger.settle("a", mine, V, H, b"honest").reason == "accepted"
    assert ledger.settle("a", mine, V, H, b"honest").reason == "duplicate"
    (got,) = ledger.collect(V)
    assert got.actor == "a" and got.payload == b"honest"


def test_the_claim_secret_is_not_in_redis_nor_in_the_lease_repr(ledger: Ledger, redis_client: Any) -> None:
    register_on(ledger, "a", V, V, H)
    ledger.create_step(V, H, jobs(1), {}, group=1, lease_ms=LEASE)
    _, (mine,) = ledger.claim("a", V, 1)
    assert mine.secret and mine.secret not in repr(mine)
    assert ledger.settle("a", mine, V, H, b"r").accepted
    dump = b"".join(
        b"".join(k + v for k, v in redis_client.hgetall(key).items())
        for key in redis_client.scan_iter(f"{ledger.p}*")
        if redis_client.type(key) == b"hash"
    )
    assert mine.secret.encode() not in dump


def test_a_result_written_directly_is_not_absorbed(ledger: Ledger, redis_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    register_on(ledger, "a", V, V, H)
    ledger.create_step(V, H, jobs(3), {}, group=1, lease_ms=LEASE)
    _, leases = ledger.claim("a", V, 3)

    def play(n: int) -> None:
        if n == 1:
            # The credential holder injects a result for p001 (leased to a) and for p002, with a
            # made-up witness, before a settles.
            _forge_result(redis_client, ledger, "p001", _head("p001"))
            _forge_result(redis_client, ledger, "p002", json.dumps(["p002", "x", 7, V, 1, 0, 1, H, "0" * 40, "1" * 40]))
        if n == 2:
            assert ledger.settle("a", leases[0], V, H, b"honest").accepted
        if n == 3:
            # The Trainer took the forged entries out of the ledger and offered p001 and p002
            # again (their leases dropped: a forged done entry answers the holder already_settled).
            assert [ledger.settle("a", x, V, H, b"honest").reason for x in leases[1:]] == ["not_leased", "not_leased"]
            _, again = ledger.claim("a", V, 3)
            assert sorted(x.prompt for x in again) == ["p001", "p002"]
            for x in again:
                assert ledger.settle("a", x, V, H, b"honest").accepted

    with caplog.at_level(logging.WARNING, logger="aurora.trainer"):
        done, collected, counts = _collect(ledger, 3, play)
    assert done.reason == "complete"
    assert {p: r.actor for p, r in collected.items()} == {"p000": "a", "p001": "a", "p002": "a"}
    assert all(r.payload == b"honest" for r in collected.values())
    assert counts.ignored.get("unproven", 0) == 2
    assert sum("ignored" in r.getMessage() for r in caplog.records) >= 1


def test_malformed_and_unknown_results_are_counted_and_the_trainer_carries_on(
    ledger: Ledger, redis_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    register_on(ledger, "a", V, V, H)
    ledger.create_step(V, H, jobs(3), {}, group=1, lease_ms=LEASE)
    _, leases = ledger.claim("a", V, 1)
    for prompt, head in (
        ("zzz-unknown", _head("zzz-unknown", proven=True)),
        ("p001", b"{not json"),
        ("p002", json.dumps({"a": 1})),
        ("p001x", json.dumps(["p001x", ["x"], "seven", None, 1, 0, 1, H])),
    ):
        _forge_result(redis_client, ledger, prompt, head)

    def play(n: int) -> None:
        if n == 1:
            assert ledger.settle("a", leases[0], V, H, b"honest").accepted
        if n == 2:
            _, again = ledger.claim("a", V, 3)
            for x in again:
                assert ledger.settle("a", x, V, H, b"honest").accepted

    with caplog.at_level(logging.WARNING, logger="aurora.trainer"):
        done, collected, counts = _collect(ledger, 3, play)
    assert done.reason == "complete" and sorted(collected) == ["p000", "p001", "p002"]
    assert all(r.actor == "a" for r in collected.values())
    assert sum(counts.ignored.values()) == 4, counts.ignored
    assert counts.ignored.get("malformed", 0) == 3 and counts.ignored.get("unknown_prompt", 0) == 1
    # Logged, but not once per poll: the same bad entry is counted and named once.
    said = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert 1 <= len(said) <= 4, said


def test_a_result_on_another_state_or_version_is_ignored(ledger: Ledger, redis_client: Any) -> None:
    register_on(ledger, "a", V, V, H)
    ledger.create_step(V, H, jobs(2), {}, group=1, lease_ms=LEASE)
    _, leases = ledger.claim("a", V, 2)
    assert ledger.settle("a", leases[0], V, H, b"honest").accepted
    # Rewrite the accepted record of p000 to claim another state (the witness stays valid).
    head = json.loads(redis_client.hget(ledger.k_step(V, "results"), "p000"))
    head[7] = "sha256:" + "e" * 64
    redis_client.hset(ledger.k_step(V, "results"), "p000", json.dumps(head))

    def play(n: int) -> None:
        if n == 1:
            assert ledger.settle("a", leases[1], V, H, b"honest").accepted
        if n == 2:
            _, again = ledger.claim("a", V, 2)
            assert [x.prompt for x in again] == ["p000"]
            assert ledger.settle("a", again[0], V, H, b"honest").accepted

    done, collected, counts = _collect(ledger, 2, play)
    assert done.reason == "complete" and sorted(collected) == ["p000", "p001"]
    assert collected["p000"].state == H
    assert counts.ignored.get("wrong_state", 0) == 1


# ---------------------------------------------------------------------------
# What is read back from Redis, parsed without a server


@pytest.mark.parametrize(
    "head",
    [
        b"{not json",
        b"\xff\xfe",
        b'{"a": 1}',
        b"[1, 2]",
        b"[" * 100_000,
        json.dumps(["p", "a", "seven", "4", "1", "0", 1, H]).encode(),
        json.dumps(["p", "a", 1, "4", "1", "0", 1, H, 5, "x"]).encode(),
        json.dumps(["other", "a", 1, "4", "1", "0", 1, H]).encode(),
        json.dumps(["p", "a", True, "4", "1", "0", 1, H]).encode(),
        b"[" + b" " * 70_000 + b"]",
    ],
)
def test_a_malformed_result_record_parses_to_none(head: bytes) -> None:
    from aurora_store.coordination.ledger.records import accepted_from_redis

    assert accepted_from_redis(head, b"payload", "p") is None


def test_lease_values_old_and_new() -> None:
    from aurora_store.coordination.ledger.records import claim_hash, lease_holder, proves_claim

    assert lease_holder(b"a-1|5|100|50") == "a-1"
    assert lease_holder(b"a-1|5|100|50|" + claim_hash("s").encode()) == "a-1"
    assert lease_holder(b"a-1|5|100|50|") == "a-1"
    witness = hashlib.sha1(b"s").hexdigest()  # noqa: S324
    assert proves_claim(witness, claim_hash("s")) and not proves_claim(witness, claim_hash("t")) and not proves_claim("", "")


@pytest.mark.parametrize(
    "payload, ok",
    [
        (b'{"id": "p", "ids": [1, 2, 3], "max_new_tokens": 8}', True),
        (b"{not json", False),
        (b"[1, 2]", False),
        (b'{"ids": []}', False),
        (b'{"ids": [1, -2]}', False),
        (b'{"ids": [1, true]}', False),
        (b'{"ids": "abc"}', False),
        (b'{"ids": [1e300]}', False),
    ],
)
def test_the_actor_takes_only_prompts_as_the_trainer_writes_them(payload: bytes, ok: bool) -> None:
    from workers.actor.work import prompt_body

    assert (prompt_body(payload) is not None) is ok


def test_the_trainer_drops_payloads_it_cannot_use_and_carries_on() -> None:
    """What a hostile Actor settles through the front door (its own lease): bad payloads are failed rollouts."""
    from aurora_store.coordination.ledger import AcceptedResult
    from workers.task.base import Problem
    from workers.tokenizer import CharTokenizer
    from workers.trainer.grpo import read_rollouts

    class Scores:
        def score(self, items: list[Any]) -> list[float]:
            return [0.0] * len(items)

    def result(p: str, payload: bytes) -> AcceptedResult:
        return AcceptedResult(p, "a", 1, V, 2, 1, payload, 1, H)

    good = json.dumps({"completions": [[5, 6], [7]], "gen_s": 0.5}).encode()
    collected = {
        "p0": result("p0", good),
        "p1": result("p1", b"{not json"),
        "p2": result("p2", json.dumps({"completions": [[5], [6]], "gen_s": "soon"}).encode()),
        "p3": result("p3", json.dumps({"completions": [[5], [6]], "gen_s": "inf"}).encode()),
        "p4": result("p4", json.dumps([1, 2]).encode()),
        "stray": result("stray", good),
    }
    problems = {p: Problem(p, "Q: 1+1=? A:", 2) for p in ("p0", "p1", "p2", "p3", "p4")}
    out = read_rollouts(collected, problems, CharTokenizer(), 2, 16, Scores())  # type: ignore[arg-type]
    assert out.bad == 5 and out.by_actor == {"a": 1} and out.gen_s == {"a": 0.5}
