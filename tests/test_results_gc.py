"""Retention and the Trainer's reads of result objects (issue 25 leftovers), on a real redis-server and S3 server.

What must hold: retention never removes a result object that a step the
ledger still holds may read (a batch open longer than the grace, one a
resumed Trainer reopens, one closing right now), whatever Redis holds
otherwise, and removes nothing from ``results/`` when it cannot ask (Redis
away, or no Redis given); the Trainer reads each reference while its batch
is still open, and a bad object is still refused when the batch closes.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from ledger_fixtures import jobs, register_on

from aurora_store.clock import SYSTEM_CLOCK
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.redisconn import connect
from aurora_store.coordination.retention import LedgerOpenBatches, run_held_versions
from aurora_store.errors import RedisUnavailable
from aurora_store.lineage.gc import retain
from aurora_store.lineage.results import ResultsSweep, reference_payload, result_key, results_to_remove, write_result
from aurora_store.storage import Store
from aurora_store.testing.clock import ManualClock
from aurora_store.testing.wait import wait_until
from workers.trainer.results import ResultReader
from workers.trainer.scheduling import Collected, collect_batch

pytestmark = pytest.mark.server

H = "sha256:" + "4" * 64
LEASE = 60_000


def _write(store: Store, step: int, actor: str = "a0", token: int = 1) -> str:
    key = result_key(actor, step, token)
    store.put(key, b"x" * 100)
    return key


def _left(store: Store) -> set[str]:
    return set(store.list("results/"))


def test_gc_keeps_the_results_of_every_step_the_ledger_holds(s3_store: Store, redis_client: Any, run_name: str) -> None:
    ledger = Ledger(redis_client, run_name)
    ledger.create_step(3, H, jobs(2), {}, group=1, lease_ms=LEASE)  # open
    ledger.create_step(5, H, jobs(2), {}, group=1, lease_ms=LEASE)
    ledger.seal_step(5)  # closing: the Trainer reads its last results now
    ledger.create_step(6, H, jobs(2), {}, group=1, lease_ms=LEASE)
    ledger.close_step(6)  # closed a moment ago: only its tombstone is left
    keep = {_write(s3_store, 3), _write(s3_store, 5), _write(s3_store, 6)}
    gone = {_write(s3_store, 4), "results/a0/not-a-step/1-x.json"}  # a step the ledger never held; a name no batch reads
    s3_store.put("results/a0/not-a-step/1-x.json", b"y")
    plan = retain(s3_store, 1, run_held_versions(redis_client, run_name), grace_s=0)
    assert _left(s3_store) == keep and set(plan.results) == gone
    assert plan.results_for_open_batches == 3 and plan.results_unasked == 0
    # Younger than the grace, kept whatever the ledger says.
    young = retain(s3_store, 1, run_held_versions(redis_client, run_name), grace_s=3600, dry_run=True)
    assert young.results == [] and young.young_results == 3
    # Once the ledger holds none of them (the tombstone expired, the batches closed), they go.
    redis_client.delete(ledger.k_step(6))
    for b in (3, 5):
        ledger.close_step(b)
        redis_client.delete(ledger.k_step(b))
    retain(s3_store, 1, run_held_versions(redis_client, run_name), grace_s=0)
    assert _left(s3_store) == set()


def test_gc_removes_no_result_while_redis_is_away_or_not_given(s3_store: Store, dead_redis_url: str, run_name: str) -> None:
    keys = {_write(s3_store, 1), _write(s3_store, 2)}
    client = connect(dead_redis_url)
    try:
        with pytest.raises(RedisUnavailable):
            retain(s3_store, 1, run_held_versions(client, run_name), grace_s=0)
    finally:
        client.close()
    assert _left(s3_store) == keys
    # No ledger to ask at all (``aurora gc`` without --redis): kept and counted; --force removes them.
    plan = retain(s3_store, 1, grace_s=0)
    assert _left(s3_store) == keys and plan.results_unasked == 2 and plan.results == []
    plan = retain(s3_store, 1, grace_s=0, force=True)
    assert _left(s3_store) == set() and len(plan.results) == 2


def test_a_forged_ledger_only_ever_keeps_more(s3_store: Store, redis_client: Any, run_name: str) -> None:
    ledger = Ledger(redis_client, run_name)
    ledger.create_step(3, H, jobs(1), {}, group=1, lease_ms=LEASE)
    keys = {b: _write(s3_store, b) for b in (3, 7, 8, 9)}
    # What any Actor credential could write: garbage in the steps set, a step key of the wrong type,
    # a step that was never created.
    redis_client.zadd(ledger.k_steps, {"not-a-step": 1, "99999999999999999999": 2, "7": 3})
    redis_client.set(ledger.k_step(8), "not a hash")
    batches = LedgerOpenBatches(ledger)
    assert batches.open_batches({3, 7, 8, 9}) == {3, 7, 8}
    retain(s3_store, 1, run_held_versions(redis_client, run_name), grace_s=0)
    assert _left(s3_store) == {keys[3], keys[7], keys[8]}  # 9 was held by nothing


def test_the_sweep_asks_about_old_keys_only_and_once() -> None:
    asked: list[frozenset[int]] = []

    class Batches:
        def open_batches(self, steps: Any) -> frozenset[int]:
            asked.append(frozenset(steps))
            return frozenset({2})

    keys = [result_key("a", s, 1) for s in (1, 2, 3)]
    ages = {keys[0]: 10.0, keys[1]: 10.0, keys[2]: 1.0}
    sweep = results_to_remove(keys, ages.get, 5.0, Batches())
    assert sweep == ResultsSweep(remove=[keys[0]], young=1, open_batches=1, unasked=0)
    assert asked == [frozenset({1, 2})]


class _Reads:
    """The store the reader is given, counting the ranged reads of each key."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.reads: dict[str, int] = {}
        self.lock = threading.Lock()

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        with self.lock:
            self.reads[key] = self.reads.get(key, 0) + 1
        return self.inner.get_range(key, start, stop)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


class _Script:
    """A clock for collect_batch whose waits run the test's next move (no sleeping on the batch)."""

    def __init__(self, moves: list[Any]) -> None:
        self.now = 0.0
        self.moves = moves

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        self.now += timeout_s
        assert self.moves, "collect_batch kept waiting"
        self.moves.pop(0)()
        return event.is_set()


def test_results_are_read_while_their_batch_is_open_and_a_tampered_one_is_still_refused(
    s3_store: Store, redis_client: Any, run_name: str
) -> None:
    b = 4
    ledger = Ledger(redis_client, run_name, clock=ManualClock())
    register_on(ledger, "a0", b, b, H)
    ledger.create_step(b, H, jobs(3), {}, group=1, lease_ms=LEASE)
    _, leases = ledger.claim("a0", b, 3)
    good, late = b'{"completions": [[1]]}' * 50, b'{"completions": [[2]]}' * 50
    first = write_result(s3_store, "a0", b, leases[0].token, good)
    assert ledger.settle("a0", leases[0], b, H, first).reason == "accepted"
    reads = _Reads(s3_store)
    reader = ResultReader(reads, 1 << 20, SYSTEM_CLOCK, streams=2)  # type: ignore[arg-type]
    first_key = next(iter(s3_store.list("results/")))
    seen: dict[str, Any] = {}

    def while_open() -> None:
        # The first result was collected at the first poll; its object is read before the batch closes.
        wait_until(lambda: reader.ready(b) == 1, "the first result to be read ahead", timeout=30)
        seen["open"], seen["reads"] = ledger.step_exists(b), dict(reads.reads)
        # Then the rest: one honest, one whose object holds other bytes than the sha256 settled.
        second = write_result(s3_store, "a0", b, leases[1].token, late)
        tampered_key = result_key("a0", b, leases[2].token)
        s3_store.put(tampered_key, b"{}" + late[2:])
        ledger.settle("a0", leases[1], b, H, second)
        ledger.settle("a0", leases[2], b, H, reference_payload(tampered_key, late))

    collected: dict[str, Any] = {}
    collect_batch(
        ledger,
        b,
        b,
        3,
        collected,
        [],
        Collected(),
        60_000,
        30.0,
        1.0,
        threading.Event(),
        _Script([while_open]),  # type: ignore[arg-type]
        lambda: pytest.fail("the step was not lost"),
        prompts={p for p, _ in jobs(3)},
        state=H,
        on_collect=lambda r: reader.prefetch(b, r),
    )
    assert seen["open"] and seen["reads"] == {first_key: 1}
    assert not ledger.step_exists(b)
    assert reader.resolve(b, collected) == 1
    assert collected[leases[0].prompt].payload == good and collected[leases[1].prompt].payload == late
    assert collected[leases[2].prompt].payload == b"" and reader.refused == {"hash_mismatch": 1}
    # Read once each, all while collecting (the last two in the batch's last poll): none read again at its close.
    assert reader.read_ahead == 3 and reader.read_at_close == 0 and set(reads.reads.values()) == {1}
    reader.close()
    wait_until(lambda: s3_store.list("results/") == [], "the objects read to be deleted once the batch closed", timeout=30)


def test_a_reference_outside_its_steps_folder_is_refused_and_not_read(s3_store: Store) -> None:
    from aurora_store.coordination.ledger import AcceptedResult

    other = write_result(s3_store, "a0", 9, 1, b"{}")  # a0's own folder, but another step's
    r = AcceptedResult(prompt="p", actor="a0", token=1, version=4, settled_ms=2, leased_ms=1, payload=other)
    reads = _Reads(s3_store)
    reader = ResultReader(reads, 1 << 20, SYSTEM_CLOCK)  # type: ignore[arg-type]
    reader.prefetch(4, r)
    collected = {"p": r}
    assert reader.resolve(4, collected) == 1 and reader.refused == {"wrong_step": 1}
    assert collected["p"].payload == b"" and reads.reads == {} and reader.read_ahead == 0
    reader.close()
