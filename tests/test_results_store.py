"""Large results through the store: the Actor writes them under its own folder, the ledger carries a reference.

What must hold (issue 25, item 5): a result larger than the Actor's threshold
goes through the store and is trained on; a small one still goes inline; the
Trainer refuses a reference outside the settling Actor's ``results/<id>/``,
drops and counts a tampered object (hash mismatch) and never reads more than
the size the reference records; retention removes leftovers past its grace
(of steps the ledger no longer holds: tests/test_results_gc.py) and weight
readers never count them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from aurora_store.clock import SYSTEM_CLOCK
from aurora_store.coordination.ledger import AcceptedResult, Lease
from aurora_store.lineage.gc import retain
from aurora_store.lineage.report import read_lineage
from aurora_store.lineage.results import (
    ResultRef,
    ResultRefused,
    check_reference,
    parse_reference,
    reference_payload,
    result_key,
    results_prefix,
    write_result,
)
from aurora_store.storage import Store, open_store
from aurora_store.testing.wait import wait_until
from workers.actor.config import ActorConfig, ActorStats
from workers.actor.work import WorkLoop
from workers.trainer.results import ResultReader


def _body(n_tokens: int) -> bytes:
    return json.dumps({"completions": [[7] * n_tokens], "texts": ["x" * n_tokens], "new_tokens": n_tokens, "gen_s": 0.1}).encode()


def _accepted(prompt: str, actor: str, payload: bytes) -> AcceptedResult:
    return AcceptedResult(prompt=prompt, actor=actor, token=1, version=0, settled_ms=2, leased_ms=1, payload=payload)


class _Reads:
    """A store that records how many bytes each ranged read asked for and got."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.asked: list[int] = []
        self.got: list[int] = []

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        self.asked.append(stop - start)
        data = self.inner.get_range(key, start, stop)
        self.got.append(len(data))
        return data

    def get(self, key: str) -> bytes:  # pragma: no cover - the reader must never read a whole object
        raise AssertionError(f"an uncapped read of {key}")

    def delete(self, key: str) -> None:
        self.inner.delete(key)


def _reader(store: Any, max_bytes: int = 1 << 20) -> ResultReader:
    return ResultReader(store, max_bytes, SYSTEM_CLOCK, streams=2)


def test_a_reference_names_its_actors_folder_and_nothing_else() -> None:
    key = result_key("a/../b", 3, 9)
    assert key.startswith("results/a%2F..%2Fb/s00000003/9-") and key.endswith(".json")
    ref = parse_reference(reference_payload(key, b"hello"))
    assert ref is not None and ref.size == 5 and ref.sha256 == hashlib.sha256(b"hello").hexdigest()
    check_reference(ref, "a/../b", 100)
    for actor in ("a", "a/..", "b"):
        with pytest.raises(ResultRefused) as e:
            check_reference(ref, actor, 100)
        assert e.value.reason == "foreign_key"
    with pytest.raises(ResultRefused) as e:
        check_reference(ref, "a/../b", 4)
    assert e.value.reason == "too_large"
    # An inline result is no reference; a payload that names one badly is refused.
    # Ids that would climb out of results/ stay inside it, and so must every reference.
    assert results_prefix("..") == "results/%2E%2E/" and results_prefix("a.b") == "results/a.b/"
    for bad in ("results/a/../b/x", "results/a//x", "results/a/./x", "results/a/"):
        with pytest.raises(ResultRefused):
            check_reference(ResultRef(bad, 1, "0" * 64), "a", 100)
    assert parse_reference(_body(3)) is None
    with pytest.raises(ResultRefused):
        parse_reference(b'{"result_ref": {"key": "results/a/x", "bytes": -1, "sha256": "00"}}')


def test_the_trainer_reads_references_capped_refuses_foreign_and_tampered_ones(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    big, small = _body(5000), _body(3)
    good = write_result(store, "a", 0, 1, big)
    # b points at a's object: refused, never read.
    foreign = reference_payload(parse_reference(good).key, big)  # type: ignore[union-attr]
    tampered = write_result(store, "c", 0, 2, big)
    tampered_key = parse_reference(tampered).key  # type: ignore[union-attr]
    store.put(tampered_key, big[:-1] + b" " + b"x" * (1 << 20), mode="overwrite")  # other bytes, and far larger
    missing = reference_payload(result_key("d", 0, 3), big)
    collected = {
        "p0": _accepted("p0", "a", good),
        "p1": _accepted("p1", "b", foreign),
        "p2": _accepted("p2", "c", tampered),
        "p3": _accepted("p3", "d", missing),
        "p4": _accepted("p4", "e", small),
    }
    reads = _Reads(store)
    rd = _reader(reads)
    assert rd.resolve(0, collected) == 3
    assert collected["p0"].payload == big and collected["p4"].payload == small
    assert collected["p1"].payload == collected["p2"].payload == collected["p3"].payload == b""
    assert rd.refused == {"foreign_key": 1, "hash_mismatch": 1, "missing": 1}
    assert (rd.through_store, rd.bytes_through_store) == (1, len(big))
    # Never more than the recorded size asked for, nor received, whatever the object holds.
    assert reads.asked == [len(big)] * 3 and max(reads.got) == len(big)
    rd.close()
    # What was read (and checked) is deleted; a's object, which b pointed at, too: the Trainer read it for a.
    assert store.list("results/") == []


def test_a_reference_larger_than_a_result_may_be_is_refused_unread(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    payload = write_result(store, "a", 0, 1, _body(5000))
    reads = _Reads(store)
    rd = _reader(reads, max_bytes=1000)
    collected = {"p": _accepted("p", "a", payload)}
    assert rd.resolve(0, collected) == 1 and rd.refused == {"too_large": 1} and reads.asked == []
    assert collected["p"].payload == b""


class _Ctx:
    """What :meth:`WorkLoop.settled_payload` needs of an Actor's context."""

    def __init__(self, store: Store, threshold: int) -> None:
        self.cfg = ActorConfig(actor_id="a0", result_inline_max_bytes=threshold)
        self.origin = store
        self.stats = ActorStats()

    def store_call(self, fn: Any, what: str) -> Any:
        return fn()


def test_the_actor_settles_small_results_inline_and_large_ones_by_reference(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    loop = WorkLoop(_Ctx(store, threshold=1000), lambda: None)  # type: ignore[arg-type]
    lease = Lease(prompt="p", token=5, version=0, state="s", group=1, expiry_ms=0, payload=b"{}", step=7)
    small, big = _body(10), _body(2000)
    assert loop.settled_payload(lease, small) == small
    ref_payload = loop.settled_payload(lease, big)
    ref = parse_reference(ref_payload)
    assert ref is not None and ref.key.startswith(results_prefix("a0") + "s00000007/5-")
    assert store.get(ref.key) == big and loop.ctx.stats.results_through_store == 1
    # A settle the ledger refused: the Actor removes its own object.
    loop.forget_result(ref_payload)
    assert not store.exists(ref.key)


class _ReadOnly:
    def put(self, key: str, data: bytes, mode: str = "create") -> None:
        raise PermissionError(13, "Access Denied")


def test_an_actor_that_may_not_write_its_folder_says_so_in_one_line() -> None:
    from aurora_store.errors import StoreError

    loop = WorkLoop(_Ctx(_ReadOnly(), threshold=10), lambda: None)  # type: ignore[arg-type]
    lease = Lease(prompt="p", token=5, version=0, state="s", group=1, expiry_ms=0, payload=b"{}", step=7)
    with pytest.raises(StoreError) as e:
        loop.settled_payload(lease, _body(100))
    assert "results/a0/" in str(e.value) and "--result-inline-max-bytes" in str(e.value) and "\n" not in str(e.value)


def test_retention_removes_old_results_and_weight_readers_ignore_them(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/run")
    write_result(store, "a", 0, 1, b"x" * 100)
    assert read_lineage(store).orphans == []  # no reader of weights counts it
    young = retain(store, keep_snapshots=1, grace_s=3600)
    assert young.results == [] and young.young_results == 1 and len(store.list("results/")) == 1
    # Old, but no ledger was asked whether its batch is open (tests/test_results_gc.py asks one): kept.
    unasked = retain(store, keep_snapshots=1, grace_s=0)
    assert unasked.results == [] and unasked.results_unasked == 1 and len(store.list("results/")) == 1
    old = retain(store, keep_snapshots=1, grace_s=0, batches=_NoneOpen())
    assert len(old.results) == 1 and store.list("results/") == []


class _NoneOpen:
    """A ledger that holds no step."""

    def open_batches(self, steps: Any) -> frozenset[int]:
        return frozenset()


@pytest.mark.slow
@pytest.mark.server
def test_large_results_go_through_the_store_and_are_trained_on(tmp_path: Path, redis_server: Any, run_name: str) -> None:
    from actor_fixtures import running

    from workers.actor import Actor
    from workers.common import Endpoints
    from workers.trainer import TrainerConfig
    from workers.trainer.trainer import Trainer

    url = f"file://{tmp_path}/run"
    steps, batch = 2, 4
    cfg = TrainerConfig(
        steps=steps, batch=batch, group=2, eval_every=0, checkpoint_every=0, snapshot_every=0, warm_start_steps=0, min_actors=1, poll_s=0.02
    )
    trainer = Trainer(Endpoints(url, redis_server.url, run_name, {}), cfg)
    # Threshold 0: every result, however small, goes through the store.
    actor = Actor.from_endpoints(Endpoints(url, redis_server.url, run_name), ActorConfig(actor_id="a0", result_inline_max_bytes=0))
    with running(actor):
        logs = trainer.run()
    assert sum(sum(lg.by_actor.values()) for lg in logs) == steps * batch  # trained on every one
    assert all(lg.rejected_payloads == 0 for lg in logs)
    rd = trainer.batches.results
    assert rd is not None and rd.through_store == steps * batch and rd.refused == {}
    # Every reference was read as it was collected (BatchBook wires the read ahead), none only at its batch's close.
    assert rd.read_ahead == steps * batch and rd.read_at_close == 0
    assert actor.ctx.stats.results_through_store >= steps * batch
    rd.close()  # the deletes in flight
    store = open_store(url)
    wait_until(lambda: store.list("results/") == [], "the results read to be deleted", timeout=30)


@pytest.mark.server
def test_bench_ledger_moves_payloads_above_the_threshold_through_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from aurora_tools.bench.ledger import add_arguments, main

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    common = ["--actors", "3", "--step-prompts", "24", "--steps", "2", "--claim", "4", "--workers", "1", "--expire", "0", "--churn", "0"]
    common += ["--lease-ms", "5000", "--json"]
    url = f"file://{tmp_path}/results"
    assert main(ap.parse_args([*common, "--payload-bytes", "100000", "--results-store", url])) == 0
    big = json.loads(capsys.readouterr().out)
    assert big["ok"] is True and big["through_store"] is True
    (r,) = big["sweep"]
    assert r["results_read"] == r["settled"] == 48 and r["results_refused"] == 0
    assert big["redis_payload_bytes_per_prompt"] < 300 and big["store_payload_bytes_per_prompt"] == 100000
    assert open_store(url).list("results/") == []  # the Trainer deleted what it read
    # At the threshold a payload still goes through Redis as it is.
    assert main(ap.parse_args([*common, "--payload-bytes", "65536"])) == 0
    small = json.loads(capsys.readouterr().out)
    assert small["ok"] is True and small["through_store"] is False
    assert small["redis_payload_bytes_per_prompt"] == 65536 and small["store_payload_bytes_per_prompt"] == 0
