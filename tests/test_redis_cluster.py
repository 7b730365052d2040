"""Aurora on a Redis Cluster (three masters, one replica each) of real ``redis-server`` processes.

Only the URL changes (``redis+cluster://host:port,...``). Every key of a run
carries the ``{run}`` hash tag, so the run lives on one master; the tests
check that, run the ledger, the bus and the commit records there, kill the
run's master (SIGKILL) and check that a replica takes over with nothing
lost and nothing accepted twice.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from aurora_store.coordination.bus import Bus
from aurora_store.coordination.commit import RedisCommitLog
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.redisconn import (
    RedisConfig,
    cluster_seeds,
    connect,
    is_cluster_client,
    is_cluster_url,
    server_time_ms,
    translate_redis_error,
    wait_for_replica,
)
from aurora_store.coordination.status import collect_status
from aurora_store.errors import ConfigError, CoordinationError, RedisUnavailable, VersionConflict
from aurora_store.outage import Dependency, is_transient, riding
from aurora_store.redact import redact_url
from aurora_store.testing.cluster import RedisCluster, key_slot
from aurora_store.testing.wait import wait_until

pytestmark = pytest.mark.server

H = "sha256:" + "7" * 64
V = 3


def _scan_node(node: Any, pattern: bytes = b"aurora:*") -> set[bytes]:
    c = node.client()
    try:
        return set(c.scan_iter(match=pattern, count=1000))
    finally:
        c.close()


def _replicates(node: Any, master: Any) -> bool:
    """Whether ``node`` says it replicates ``master`` (its own ``ROLE``: the master's table can
    lag behind a replica that just attached, or roles swapped by a failover under load)."""
    c = node.client()
    try:
        role = c.execute_command("ROLE")
    finally:
        c.close()
    return role[0] in (b"slave", "slave") and int(role[2]) == master.port


def _retry_read(fn: Any) -> Any:
    """``fn()``, riding out what is left of a failover."""
    dep = Dependency("Redis", logging.getLogger("t.cluster"), budget_s=60, initial_s=0.05, max_s=0.5)
    return dep.call(fn, "read after the failover")


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    with RedisCluster(node_timeout_ms=1500) as c:
        yield c


@pytest.fixture
def run() -> str:
    return f"c-{uuid.uuid4().hex[:10]}"


def test_cluster_urls() -> None:
    assert is_cluster_url("redis+cluster://h:1/0") and is_cluster_url("rediss+cluster://h:1")
    assert not is_cluster_url("redis://h:1/0")
    plain, seeds = cluster_seeds("redis+cluster://u:p%40ss@a:7000,b:7001,c/0?ssl_cert_reqs=none")
    assert plain == "redis://u:p%40ss@a:7000/0?ssl_cert_reqs=none"
    assert seeds == [("a", 7000), ("b", 7001), ("c", 6379)]
    plain, seeds = cluster_seeds("rediss+cluster://[::1]:7000")
    assert plain == "rediss://[::1]:7000/0" and seeds == [("::1", 7000)]
    with pytest.raises(ConfigError, match="only database 0"):
        cluster_seeds("redis+cluster://a:7000/2")
    with pytest.raises(ConfigError, match="not host:port"):
        cluster_seeds("redis+cluster://a:x")
    assert "p@ss" not in redact_url("redis+cluster://u:p@ss@a:7000,b:7001/0")


def test_cluster_errors_are_outages_or_answers() -> None:
    import redis.exceptions as rx

    for e in (
        rx.SlotNotCoveredError('Slot "1" is not covered by the cluster.'),
        rx.RedisClusterException("Redis Cluster cannot be connected. Please provide at least one reachable node: x"),
        rx.ClusterDownError("CLUSTERDOWN The cluster is down"),
        rx.TryAgainError("TRYAGAIN"),
    ):
        assert isinstance(translate_redis_error("op", e), RedisUnavailable), e
    for e in (
        rx.ClusterDownError("CLUSTERDOWN"),
        rx.TryAgainError("TRYAGAIN"),
        rx.SlotNotCoveredError("x"),
    ):
        assert is_transient(e), e  # the raw client's errors, inside Dependency.call
    blocked = translate_redis_error("op", rx.RedisClusterException("ERROR: Calling pipelined function evalsha is blocked"))
    assert isinstance(blocked, CoordinationError) and not isinstance(blocked, RedisUnavailable)


def test_a_cluster_with_no_seed_answering_is_an_outage_at_connect() -> None:
    # redis-py raises RedisClusterException (not a RedisError) from the client's constructor:
    # it reached `aurora actor` as a traceback before.
    from aurora_store.testing.servers import free_port

    with pytest.raises(RedisUnavailable, match="connect to the Redis Cluster"):
        connect(f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}", RedisConfig(cluster_connect_wait_s=0.3))


def test_a_cluster_that_comes_up_while_a_worker_connects_is_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    """A worker started before its cluster (or while the network is away) waits, says so once, then connects."""
    c = RedisCluster()
    ports = c._ports(c.masters * (1 + c.replicas))
    c._ports = lambda n: ports  # type: ignore[method-assign]  # the ports the worker already dials
    got: list[Any] = []
    worker = threading.Thread(
        target=lambda: got.append(
            connect(f"redis+cluster://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", RedisConfig(cluster_connect_wait_s=120))
        )
    )
    with caplog.at_level(logging.WARNING, logger="aurora.redis"):
        worker.start()
        wait_until(
            lambda: any("no seed answers yet" in r.getMessage() for r in caplog.records), "the connect to say it waits", interval=0.05
        )
        with c:  # starts it
            worker.join(timeout=120)
            assert got and is_cluster_client(got[0]) and got[0].ping()
    waiting = [r for r in caplog.records if "no seed answers yet" in r.getMessage()]
    assert len(waiting) == 1  # once, however many tries


def test_connect_gives_a_cluster_client(cluster: RedisCluster) -> None:
    r = connect(cluster.url)
    assert is_cluster_client(r) and r.ping()
    assert not is_cluster_client(connect("redis://127.0.0.1:1/0"))
    # any seed that answers is enough
    r2 = connect(f"redis+cluster://127.0.0.1:1,{cluster.nodes[-1].address}")
    assert r2.ping()


def test_ledger_bus_and_commit_records_work_and_the_run_lives_on_one_master(cluster: RedisCluster, run: str) -> None:
    r = connect(cluster.url)
    keys = RunKeys(run)
    led = Ledger(r, run)
    assert led.check_memory_policy() == "noeviction"  # INFO of the run's master
    led.enter_epoch(1)
    for a in ("a", "b"):
        led.register(a, region="eu")
        assert led.heartbeat(a, active=V, staged=V, active_state=H)
    jobs = [(f"p{i}", f"prompt {i}".encode()) for i in range(6)]
    assert led.create_step(V, H, jobs, {"a": 3, "b": 3}, group=2, lease_ms=60_000, epoch=1) == "created"
    status, la = led.claim("a", V, 3)
    assert status == "ok" and len(la) == 3
    status, lb = led.claim("b", V, 3)
    assert status == "ok" and len(lb) == 3
    assert led.settle("a", la[0], V, H, b"r0").accepted
    out = led.settle_many("a", [(x, V, H, b"r") for x in la[1:]] + [(la[0], V, H, b"r0")])
    assert [s.reason for s in out] == ["accepted", "accepted", "duplicate"]
    assert all(s.accepted for s in led.settle_many("b", [(x, V, H, b"r") for x in lb]))
    poll = led.poll(V)
    assert poll.settled == poll.total == 6 and sorted(x.prompt for x in poll.results) == [p for p, _ in jobs]
    assert abs(poll.now_ms - server_time_ms(r, keys.fence)) < 60_000
    assert led.open_step_info() == [(V, V, 0)]
    assert led.lease_counts() == {}
    led.close_step(V, epoch=1)

    bus = Bus(r, run)
    first = bus.announce("version", 1, kind="delta")
    bus.announce("version", 2, kind="delta")
    assert [e.version for e in bus.read("0")] == [1, 2]
    assert [e.version for e in bus.read(first, block_ms=50)] == [2]
    assert bus.read(bus.tail_id(), block_ms=50) == []

    log_ = RedisCommitLog(r, run)
    assert log_.commit("delta", 1, b'{"kind": "delta"}')
    assert not log_.commit("delta", 1, b'{"kind": "delta"}')  # our own earlier attempt
    with pytest.raises(VersionConflict):
        log_.commit("delta", 1, b'{"kind": "other"}')
    assert log_.record("delta", 1) is not None
    assert log_._recorded() == [("delta", 1)]  # SCAN over every master
    assert wait_for_replica(r, keys.fence) == 1

    st = collect_status(r, run)
    assert {a["id"] for a in st["actors"]} == {"a", "b"}

    # One slot, so one master, holds every key of the run; no other node holds any.
    master = cluster.master_of(keys.fence)
    mine = _scan_node(master, keys.pattern.encode())
    assert len(mine) >= 8 and {key_slot(k) for k in mine} == {key_slot(keys.fence)}
    for node in cluster.nodes:
        if node is not master and node.alive and not _replicates(node, master):
            assert not _scan_node(node, keys.pattern.encode()), node.port


def test_a_failover_is_an_outage_that_passes(run: str) -> None:
    """SIGKILL the run's master mid-step: its replica takes over, what was replicated is there,
    the step finishes with each prompt accepted once."""
    with RedisCluster(node_timeout_ms=1000) as c:
        keys = RunKeys(run)
        dep = Dependency("Redis", logging.getLogger("t.cluster"), budget_s=60, initial_s=0.05, max_s=0.5)
        led = riding(Ledger(connect(c.url), run), dep)
        led.register("a")
        assert led.heartbeat("a", active=V, staged=V, active_state=H)
        jobs = [(f"p{i}", b"x") for i in range(8)]
        led.create_step(V, H, jobs, {"a": 8}, group=2, lease_ms=60_000)
        _, leases = led.claim("a", V, 8)
        assert all(s.accepted for s in led.settle_many("a", [(x, V, H, b"r") for x in leases[:4]]))
        r = connect(c.url)
        assert wait_for_replica(r, keys.fence) == 1  # the first half is on the replica
        # a commit record waits for a replica itself: killed right after, it survives
        assert RedisCommitLog(r, run).commit("delta", 1, b'{"kind": "delta"}')
        old = c.master_of(keys.fence)
        c.kill(old)
        # the next call rides out the failover (ConnectionError, then CLUSTERDOWN, then MOVED)
        out = led.settle_many("a", [(x, V, H, b"r") for x in leases[4:]])
        assert all(s.accepted for s in out)
        new = c.wait_failover(old)
        assert new in [n for n in c.nodes if n.alive] and new is not old
        assert c.master_of(keys.fence) is new
        poll = led.poll(V)
        assert poll.settled == poll.total == 8
        assert sorted(x.prompt for x in poll.results) == [p for p, _ in jobs]  # each once
        assert dep.outages >= 1
        assert _retry_read(lambda: RedisCommitLog(r, run).record("delta", 1)) is not None
        # the old master comes back as a replica of the new one
        c.restart(old)
        c.wait_ok()
        c.wait_until(lambda: c.replicas_of(new) == [old], 30, "the old master following the new one")


@pytest.mark.long  # the failover itself: test_a_failover_is_an_outage_that_passes
def test_the_demo_system_survives_losing_its_master(tmp_path: Any) -> None:
    """The real system (Trainer, Relay, Actors in processes) on the cluster; the run's master
    is SIGKILLed mid-run; the run finishes with nothing lost and nothing accepted twice."""
    from aurora_tools.demo.system import DemoConfig, run_system_demo

    run_ = "cluster-demo"
    keys = RunKeys(run_)
    with RedisCluster(node_timeout_ms=1500) as c:
        cfg = DemoConfig(
            steps=6, batch=8, group=4, actors_relay=1, actors_origin=1, kill_at=-1, join_at=-1,
            snapshot_every=3, redis=c.url, run=run_, workdir=str(tmp_path), display=False, mirror_grace_s=0.5,
            tiny_hidden=64, tiny_intermediate=192,
        )  # fmt: skip
        out: dict[str, Any] = {}

        def demo() -> None:
            try:
                out["res"] = run_system_demo(cfg, say=lambda *a, **k: None)
            except BaseException as e:  # noqa: BLE001 - reported below
                out["error"] = e

        t = threading.Thread(target=demo, name="demo")
        t.start()
        try:
            r = connect(c.url)
            # until the run is in its third step (or the demo ended, which the assert reports)
            wait_until(
                lambda: not t.is_alive() or int(r.hget(keys.trainer, "step") or -1) >= 2, "the third step", timeout=300, interval=0.05
            )
            assert t.is_alive(), out
            old = c.master_of(keys.fence)
            c.kill(old)
            new = c.wait_failover(old)
            assert new is not old
        finally:
            t.join()
        assert "error" not in out, out.get("error")
        res = out["res"]
        assert len(res.logs) == cfg.steps
        assert res.prompts_lost == 0
        assert res.accepted_twice == 0 and res.accepted_wrong_version == 0
        assert all(sum(lg.by_actor.values()) == cfg.batch for lg in res.logs)
        assert res.bit_identical, res.mismatches
        # the run's keys are on the new master now
        assert c.master_of(keys.fence) is new and _scan_node(new, keys.pattern.encode())
