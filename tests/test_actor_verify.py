"""The Actor's weight verification outside the safe point (workers/actor/verify.py, docs/WORKERS.md "Verification").

The first tests drive :class:`~workers.actor.verify.Verifier` with a fake
context (pure logic: the cadence, the settlement gate, a failure); the last
ones run the real Actor on a real Redis and a file store, with a torch
engine that counts its hashes and, in one, writes a delta wrongly.
"""

from __future__ import annotations

import copy
import logging
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from actor_fixtures import TinyRun, running

from aurora_store.apply.sink import tree_weights_digest, weights_digest
from aurora_store.codec.extract import bits_view
from aurora_store.coordination.records import read_digests, record_digest
from aurora_store.storage import Store, open_store
from aurora_store.testing.servers import RedisServer
from aurora_store.testing.wait import wait_until
from workers.actor import Actor, ActorConfig
from workers.actor.config import ActorStats
from workers.actor.holding import Holding
from workers.actor.verify import Verifier
from workers.actor.vouched import UNVERIFIED
from workers.common import Endpoints
from workers.engine.torch_config import EngineConfig
from workers.engine.torch_engine import TorchEngine
from workers.tokenizer import CharTokenizer

GOOD = "tree-sha256:" + "a" * 64
BAD = "tree-sha256:" + "b" * 64


class _Engine:
    """Answers ``verify_digest`` with what the test says, once the test lets it."""

    def __init__(self, answer: str | None = GOOD) -> None:
        self.answer = answer
        self.calls: list[str] = []
        self.go = threading.Event()
        self.go.set()

    def verify_digest(self, expected: str) -> str | None:
        self.calls.append(expected)
        self.go.wait(30)
        return self.answer


def _ctx(every: int | None = None, engine: Any = None, recorded: dict[int, str] | None = None) -> SimpleNamespace:
    digests: list[tuple[str, int, str]] = []
    recs = SimpleNamespace(record_digest=lambda who, v, d: digests.append((who, v, d)))
    store = dict(recorded or {})
    redis = SimpleNamespace(hget=lambda key, field: (store.get(int(field)) or "").encode() or None)
    return SimpleNamespace(
        cfg=SimpleNamespace(verify_every=every, actor_id="a"),
        engine=engine or _Engine(),
        stats=ActorStats(),
        holding=Holding(),
        stop=threading.Event(),
        records=recs,
        redis=redis,
        keys=SimpleNamespace(trainer_digests="digest:trainer"),
        redis_call=lambda fn, what: fn(),
        digests=digests,
    )


def _run(v: Verifier, version: int, digest: str | None, forced: bool = False) -> None:
    """Activate ``version`` and check it as the verify thread would (synchronously)."""
    v.activated(version, f"s{version}", digest, forced)
    job = v._job
    assert job is not None
    job.started = True
    v.check(job)


def _verified(ctx: SimpleNamespace) -> list[int]:
    return [ver for ver, _, _ in ctx.stats.verifications]


def test_by_default_every_version_that_carries_a_digest_is_verified_and_no_other() -> None:
    ctx = _ctx()
    v = Verifier(ctx)  # type: ignore[arg-type]
    for ver in range(1, 7):
        _run(v, ver, GOOD if ver % 3 == 0 else None)
    assert _verified(ctx) == [3, 6]
    assert ctx.digests == [("a", 3, GOOD), ("a", 6, GOOD)]  # what the Actor held, recorded once verified
    assert ctx.holding.verified == (6, GOOD)


def test_the_trainer_s_record_in_redis_stands_in_for_a_manifest_without_a_digest() -> None:
    ctx = _ctx(recorded={2: GOOD, 3: "not a digest"})
    v = Verifier(ctx)  # type: ignore[arg-type]
    for ver in (1, 2, 3):
        _run(v, ver, None)
    assert _verified(ctx) == [2]  # a malformed record is no digest
    assert ctx.engine.calls == [GOOD]


def test_verify_every_n_spaces_verifications_and_zero_verifies_only_what_a_failure_forces() -> None:
    ctx = _ctx(every=3)
    v = Verifier(ctx)  # type: ignore[arg-type]
    for ver in range(1, 11):
        _run(v, ver, GOOD if ver != 4 else None)
    # 1 (the first), then at least 3 versions after the last verified one: 5 (4 carries no digest), then 8
    assert _verified(ctx) == [1, 5, 8]
    ctx0 = _ctx(every=0)
    v0 = Verifier(ctx0)  # type: ignore[arg-type]
    for ver in range(1, 5):
        _run(v0, ver, GOOD)
    _run(v0, 5, GOOD, forced=True)
    assert _verified(ctx0) == [5]


def test_a_version_left_before_its_hash_ended_makes_the_next_one_with_a_digest_due() -> None:
    ctx = _ctx(every=10)
    v = Verifier(ctx)  # type: ignore[arg-type]
    _run(v, 1, GOOD)
    v.activated(2, "s2", GOOD)  # never checked: the engine moved on to 3 first
    _run(v, 3, GOOD)  # due although only 2 versions after 1
    assert _verified(ctx) == [1, 3]


def test_settlement_waits_for_the_verification_and_is_refused_when_it_fails() -> None:
    engine = _Engine(answer=BAD)
    engine.go.clear()
    ctx = _ctx(engine=engine)
    v = Verifier(ctx)  # type: ignore[arg-type]
    t = threading.Thread(target=v.run, daemon=True)
    t.start()
    wait_until(lambda: v._running, "the verify thread")
    v.activated(1, "s1", GOOD)
    answers: list[bool] = []
    gate = threading.Thread(target=lambda: answers.append(v.vouch(1, "s1")), daemon=True)
    gate.start()
    wait_until(lambda: engine.calls == [GOOD], "the hash to start")
    assert gate.is_alive() and not answers  # the results of v1 wait while its weights are hashed
    engine.go.set()
    gate.join(10)
    assert answers == [False]
    failed = v.take_failure()
    assert failed is not None and (failed.version, failed.actual) == (1, BAD) and v.failures_in_row == 1
    assert v.take_failure() is None
    assert ctx.stats.verifications[0][0] == 1 and ctx.stats.verifications[0][2] is False
    assert v.vouch(0, "s0")  # results of a version that was not verified are not held
    ctx.stop.set()
    t.join(10)


# -- the real Actor ---------------------------------------------------------------------------
class _Counting(TorchEngine):
    """A torch engine that records who hashes its weights, and can write one delta wrongly."""

    def __init__(self, broken: int | None = None) -> None:
        super().__init__(CharTokenizer(), EngineConfig(predict_digest=False))
        self.broken = broken
        self.digest_calls = 0
        self.generated = 0
        self.verified_on: list[str] = []
        self.hold = threading.Event()
        self.hold.set()

    def apply(self, staged: Any) -> None:
        super().apply(staged)
        if staged.version == self.broken:
            self.broken = None  # once: the same version reached again from the store is right
            t = next(iter(self._weights.values()))
            with torch.no_grad():
                bits_view(t).view(-1)[0] ^= 1  # a write gone wrong: one bit of one element

    def generate(self, *a: Any, **kw: Any) -> Any:
        out = super().generate(*a, **kw)
        self.generated += 1
        return out

    def digest(self) -> str:
        self.digest_calls += 1
        return super().digest()

    def verify_digest(self, expected: str) -> str | None:
        self.verified_on.append(threading.current_thread().name)
        self.hold.wait(60)
        return super().verify_digest(expected)


def _cfg(**kw: Any) -> ActorConfig:
    base: dict[str, Any] = {"actor_id": "a", "claim": 2, "heartbeat_s": 0.2, "run_poll_s": 0.05, "stage_block_ms": 100}
    base.update(kw)
    return ActorConfig(**base)


@pytest.fixture
def origin(tmp_path: Path) -> Store:
    return open_store(f"file://{tmp_path}/origin")


@pytest.mark.server
def test_the_safe_point_hashes_nothing_and_versions_with_a_digest_are_verified_in_the_verify_thread(
    origin: Store, redis_server: RedisServer, run_name: str
) -> None:
    run = TinyRun(origin, redis_server.url, run_name)
    run.record_states = True
    run.start()
    engine = _Counting()
    engine.load(copy.deepcopy(run.model))
    a = Actor.from_endpoints(Endpoints(origin.url, redis_server.url, run_name), _cfg(), engine=engine)
    with running(a):
        wait_until(lambda: a.holding.bootstrapped, "bootstrap")
        run.step(3)  # every delta carries the weights digest of the version it makes (streamed form)
        run.open_step(1, 3, prompts=4, group=1)
        wait_until(lambda: run.settled(1) == 4, "the step on v3 settled")
        wait_until(lambda: 3 in _versions(a), "v3 verified")
    assert a.stats.activations and max(v for v, _, _ in a.stats.activations) == 3
    assert engine.digest_calls == 0  # no digest at the safe point (nor at bootstrap, nor in a heartbeat)
    assert engine.verified_on and all(name.startswith("verify-") for name in engine.verified_on)
    assert all(ok for _, _, ok in a.stats.verifications)
    _, actors = read_digests(run.redis, run.keys)
    assert actors[("a", 3)] == run.digest(3)  # what the Actor held, recorded once verified
    run.close()


def _versions(a: Actor) -> set[int]:
    return {v for v, _, ok in a.stats.verifications if ok}


@pytest.mark.server
def test_wrong_weights_found_outside_the_safe_point_are_never_settled_and_the_actor_reaches_the_run_again(
    origin: Store, redis_server: RedisServer, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = TinyRun(origin, redis_server.url, run_name)
    run.record_states = True
    run.start()
    engine = _Counting(broken=2)
    engine.load(copy.deepcopy(run.model))
    a = Actor.from_endpoints(Endpoints(origin.url, redis_server.url, run_name), _cfg(), engine=engine)
    with caplog.at_level(logging.INFO, logger="aurora.actor"), running(a) as r:
        wait_until(lambda: a.holding.bootstrapped, "bootstrap")
        run.step(2)
        for v in (1, 2):  # the Trainer's record of each version's digest, in its tree form
            record_digest(run.redis, run.keys, "trainer", v, tree_weights_digest(run.weights[v], run.plan))
        engine.hold.clear()  # hashes wait: results generated meanwhile must wait too
        run.open_step(1, 2, prompts=6, group=1)
        wait_until(lambda: engine.generated > 0 and a.active == 2, "generation on the broken v2")
        assert run.settled(1) == 0  # generated, not settled: v2 is being verified
        engine.hold.set()
        wait_until(lambda: a.stats.rejected.get(UNVERIFIED, 0) > 0, "the results of the broken v2 refused")
        wait_until(lambda: run.settled(1) == 6, "the step settled on v2 reached again from the store")
        assert r["error"] is None
    assert [ok for v, _, ok in a.stats.verifications if v == 2][:2] == [False, True]
    _, actors = read_digests(run.redis, run.keys)
    assert actors[("a", 2)] == tree_weights_digest(run.weights[2], run.plan)  # the good weights, recorded last
    assert weights_digest(run.weights[2], run.plan) == run.digest(2)
    assert any("failed verification" in rec.getMessage() for rec in caplog.records)
    run.close()
