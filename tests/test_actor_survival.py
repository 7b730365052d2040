"""The Actor rides out faults: started before the Trainer, Redis paused or restarted
without its data, the S3 server paused while it stages, an outage past the budget,
a bucket that does not exist; and a bug is not an outage.

The real Actor (torch engine, a tiny Qwen3) runs in a thread (its own
heartbeat and stager threads inside); the Trainer's side is written by hand
(:class:`actor_fixtures.TinyRun`). Servers are real: ``redis-server`` (a
server of the test's own where it is paused or restarted) and moto's S3
server in a child process for the S3 pause. Timeouts are shortened through
the environment so an outage is noticed in a fraction of a second; every
wait is on a condition.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
from actor_fixtures import TinyRun, running

from aurora_store.clock import SYSTEM_CLOCK
from aurora_store.config import Backoff
from aurora_store.errors import OutageTooLong, StoreError
from aurora_store.storage import Store, open_store
from aurora_store.testing.servers import RedisServer, S3Server
from aurora_store.testing.wait import wait_until
from workers.actor import Actor, ActorConfig
from workers.common import Endpoints
from workers.engine.torch_engine import TorchEngine

pytestmark = pytest.mark.server

FAST = Backoff(initial_s=0.05, max_s=0.3, factor=2.0, jitter=0.5)


def _cfg(actor_id: str = "a", **kw: Any) -> ActorConfig:
    base: dict[str, Any] = {
        "actor_id": actor_id,
        "claim": 2,
        "heartbeat_s": 0.2,
        "run_poll_s": 0.05,
        "outage_backoff": FAST,
        "stage_block_ms": 100,
    }
    base.update(kw)
    return ActorConfig(**base)


@pytest.fixture
def short_redis_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused Redis is noticed in a fraction of a second, not after redis-py's 10 s."""
    monkeypatch.setenv("AURORA_REDIS_COMMAND_TIMEOUT_S", "0.3")
    monkeypatch.setenv("AURORA_REDIS_CONNECT_TIMEOUT_S", "0.3")
    monkeypatch.setenv("AURORA_REDIS_BLOCK_MARGIN_S", "0.3")


@pytest.fixture
def origin(tmp_path: Path) -> Store:
    return open_store(f"file://{tmp_path}/origin")


def _messages(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_an_actor_started_before_the_trainer_waits_for_the_run(
    origin: Store, redis_server: RedisServer, redis_client: Any, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = TinyRun(origin, redis_server.url, run_name)  # nothing written yet: no model, no v0, no head
    a = Actor.from_endpoints(Endpoints(origin.url, redis_server.url, run_name), _cfg("early"), clock=SYSTEM_CLOCK)
    with caplog.at_level(logging.INFO, logger="aurora.actor"), running(a) as r:
        wait_until(lambda: bool(_messages(caplog, "waiting for the run")), "the Actor to say it waits", timeout=60)
        run.describe()  # the Trainer warms up: a model description, no version yet
        wait_until(lambda: a.ctx.has_engine, "the engine to be built", timeout=60)
        assert r["error"] is None and r["thread"].is_alive()
        run.publish_v0(announce_head=False)  # v0 in the store, nothing in Redis yet
        wait_until(lambda: a.active == 0, "the bootstrap", timeout=60)
        run.set_head(0)
        run.open_step(0, 0, prompts=6)
        wait_until(lambda: run.settled(0) == 6, "the first step settled", timeout=60)
        assert r["error"] is None
    assert len(_messages(caplog, "waiting for the run")) == 1
    assert _messages(caplog, "the run appeared")
    assert a.engine.digest() == run.digest(0)
    run.close()


def test_redis_paused_longer_than_a_retry_is_ridden_out(
    origin: Store, own_redis_server: RedisServer, run_name: str, short_redis_timeouts: None, caplog: pytest.LogCaptureFixture
) -> None:
    run = TinyRun(origin, own_redis_server.url, run_name)
    run.start()
    run.open_step(0, 0, prompts=300, group=1)
    a = Actor.from_endpoints(Endpoints(origin.url, own_redis_server.url, run_name), _cfg(), clock=SYSTEM_CLOCK)
    pid = own_redis_server.proc.pid
    with caplog.at_level(logging.INFO, logger="aurora.actor"), running(a) as r:
        wait_until(lambda: run.settled(0) >= 4, "work before the pause", timeout=60)
        os.kill(pid, signal.SIGSTOP)
        try:
            # Several attempts and back-offs (each attempt times out after 0.3 s).
            wait_until(lambda: a.ctx.redis_dep.away and a.ctx.redis_dep.away_for_s() > 1.5, "the Actor to notice the outage", timeout=60)
            assert r["error"] is None
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: not a.ctx.redis_dep.away, "the end of the outage", timeout=60)
        n = run.settled(0)
        wait_until(lambda: run.settled(0) >= n + 4, "work after the pause", timeout=60)
        assert r["error"] is None
    # Results settled through the outage were settled once: the Actor's count is the ledger's.
    assert a.stats.settled == run.settled(0)
    # One line when the outage starts, one when it ends (a command that timed out just as
    # Redis resumed may make a second, tiny one: each still has its two lines).
    started, ended = _messages(caplog, "Redis unreachable"), _messages(caplog, "Redis reachable again")
    assert 1 <= len(started) <= 2 and len(started) == len(ended), started + ended
    run.close()


def test_redis_restarted_without_its_data_finds_the_actor_registering_again(
    origin: Store, own_redis_server: RedisServer, run_name: str, short_redis_timeouts: None, caplog: pytest.LogCaptureFixture
) -> None:
    run = TinyRun(origin, own_redis_server.url, run_name)
    run.start()
    run.open_step(0, 0, prompts=300, group=1)
    a = Actor.from_endpoints(Endpoints(origin.url, own_redis_server.url, run_name), _cfg(), clock=SYSTEM_CLOCK)
    with caplog.at_level(logging.INFO, logger="aurora.actor"), running(a) as r:
        wait_until(lambda: run.settled(0) >= 4, "work before the restart", timeout=60)
        own_redis_server.restart()  # the same port, nothing kept: no actor record, no steps, no head
        run.reconnect()
        # The Trainer notices the loss and re-creates what it needs.
        run.set_head(0)
        run.open_step(1, 0, prompts=6)
        wait_until(lambda: run.settled(1) == 6, "the re-created step settled by the re-registered Actor", timeout=60)
        rec = run.ledger.actor("a")
        assert rec is not None and rec.status == "alive" and rec.active == 0
        assert r["error"] is None
    assert _messages(caplog, "registering again")
    run.close()


@pytest.fixture(scope="module")
def paused_s3() -> Iterator[S3Server]:
    """An S3 server in a child process, which a test may SIGSTOP and SIGCONT (never restart: it keeps
    objects in memory)."""
    with S3Server(process=True) as server:
        yield server


@pytest.mark.slow
def test_the_s3_server_paused_while_staging_is_ridden_out_and_work_goes_on(
    paused_s3: S3Server,
    redis_server: RedisServer,
    redis_client: Any,
    run_name: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for k, v in {"AURORA_STORE_READ_TIMEOUT_S": "0.5", "AURORA_STORE_CONNECT_TIMEOUT_S": "0.5", "AURORA_STORE_RETRIES": "0"}.items():
        monkeypatch.setenv(k, v)
    opts = dict(paused_s3.storage_options(), config_kwargs={"retries": {"max_attempts": 1}})
    url = f"s3://{paused_s3.new_bucket()}/run"
    run = TinyRun(open_store(url, opts), redis_server.url, run_name)
    run.start()
    run.open_step(0, 0, prompts=3000, group=1)  # more than the Actor gets through: closed by hand below
    a = Actor.from_endpoints(Endpoints(url, redis_server.url, run_name, opts), _cfg(), clock=SYSTEM_CLOCK)
    assert paused_s3.pid is not None
    with caplog.at_level(logging.INFO, logger="aurora.actor"), running(a) as r:
        wait_until(lambda: run.settled(0) >= 2, "work before the pause", timeout=60)
        run.step(1, announce_head=False)  # v1 is in the store; the Actor learns of it during the pause
        os.kill(paused_s3.pid, signal.SIGSTOP)
        try:
            run.set_head(1)  # the stager goes for v1, into the outage
            wait_until(lambda: a.ctx.store_dep.away, "the stager to notice the store is away", timeout=60)
            n = run.settled(0)
            wait_until(lambda: run.settled(0) >= n + 4, "generation on v0 while the store is away", timeout=60)
            assert a.staged_version == 0 and r["error"] is None
        finally:
            os.kill(paused_s3.pid, signal.SIGCONT)
        wait_until(lambda: a.staged_version == 1, "v1 staged once the store is back", timeout=60)
        run.ledger.close_step(0)  # the Trainer moves on
        run.open_step(1, 1, prompts=4)
        wait_until(lambda: run.settled(1) == 4, "work on v1", timeout=60)
        assert r["error"] is None
    assert a.engine.digest() == run.digest(1)
    assert len(_messages(caplog, "the store unreachable")) == 1
    assert len(_messages(caplog, "the store reachable again")) == 1
    run.close()


def test_an_outage_past_the_budget_ends_the_actor_with_outage_too_long(
    origin: Store, redis_server: RedisServer, redis_client: Any, run_name: str, dead_redis_url: str
) -> None:
    run = TinyRun(origin, redis_server.url, run_name)
    run.start()
    a = Actor.from_endpoints(Endpoints(origin.url, dead_redis_url, run_name), _cfg(outage_budget_s=0.5), clock=SYSTEM_CLOCK)
    with pytest.raises(OutageTooLong, match=r"Redis unreachable for \d+s \(outage budget 0s\)") as ei:
        a.run()
    assert "\n" not in str(ei.value)
    run.close()


def test_a_bucket_that_does_not_exist_ends_the_actor_with_one_line(s3_server: S3Server, redis_server: RedisServer, run_name: str) -> None:
    a = Actor.from_endpoints(
        Endpoints("s3://no-such-bucket-aurora/run", redis_server.url, run_name, s3_server.storage_options()), _cfg(), clock=SYSTEM_CLOCK
    )
    with pytest.raises(StoreError, match="bucket 'no-such-bucket-aurora' does not exist") as ei:
        a.run()
    assert "\n" not in str(ei.value)


@pytest.mark.slow
def test_aurora_actor_past_its_outage_budget_exits_non_zero_with_one_line(
    origin: Store, redis_server: RedisServer, redis_client: Any, run_name: str, dead_redis_url: str
) -> None:
    run = TinyRun(origin, redis_server.url, run_name)
    run.start()
    env = dict(os.environ, AURORA_OUTAGE_BUDGET_S="30", AURORA_TORCH_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aurora_tools.cli",
            "actor",
            "--store",
            origin.url,
            "--redis",
            dead_redis_url,
            "--run",
            run_name,
            "--outage-budget-s",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("aurora: error: Redis unreachable for") and "outage budget 1s" in last, proc.stderr[-2000:]
    run.close()


def test_an_actor_restarted_with_the_same_id_releases_what_its_dead_process_held(
    origin: Store, redis_server: RedisServer, run_name: str
) -> None:
    run = TinyRun(origin, redis_server.url, run_name)
    run.start()
    run.open_step(0, 0, prompts=6, lease_ms=3_600_000, group=1)
    # The dead process: registered, holding leases that would not expire for an hour.
    run.ledger.register("a")
    run.ledger.heartbeat("a", active=0, staged=0)
    status, leases = run.ledger.claim("a", 0, 4)
    assert status == "ok" and len(leases) == 4
    a = Actor.from_endpoints(Endpoints(origin.url, run.redis_url, run_name), _cfg(), clock=SYSTEM_CLOCK)
    with running(a) as r:
        wait_until(lambda: run.settled(0) == 6, "every prompt settled by the new process, its predecessor's leases included", timeout=60)
        assert r["error"] is None
    run.close()


class _BuggyPrepare:
    """A torch engine whose ``prepare`` has a bug (a TypeError, as a wrong call would raise)."""

    def __init__(self, inner: TorchEngine) -> None:
        self.inner = inner
        self.calls = 0

    def prepare(self, staged: Any) -> Any:
        self.calls += 1
        raise TypeError("prepare() got an unexpected keyword argument 'basis'")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_bug_in_the_stager_ends_the_actor_with_its_error_instead_of_being_retried(
    origin: Store, redis_server: RedisServer, redis_client: Any, run_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = TinyRun(origin, redis_server.url, run_name)
    run.start()
    inner = TorchEngine(run.tokenizer)
    inner.load(deepcopy(run.model))
    eng = _BuggyPrepare(inner)
    a = Actor.from_endpoints(Endpoints(origin.url, redis_server.url, run_name), _cfg(), SYSTEM_CLOCK, engine=eng)
    with caplog.at_level(logging.WARNING, logger="aurora.actor"), pytest.raises(TypeError, match="unexpected keyword"), running(a) as r:
        wait_until(lambda: a.active == 0, "the bootstrap", timeout=60)
        run.step(1)  # the stager fetches v1 and hands it to the buggy prepare
        wait_until(lambda: r["error"] is not None, "the Actor to end with the stager's error", timeout=60)
    assert eng.calls == 1, "a bug is not retried like an outage"
    assert not _messages(caplog, "unexpected keyword"), "nor logged as a passing warning"
    run.close()
