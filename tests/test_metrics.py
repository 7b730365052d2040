"""Prometheus metrics (aurora_store.metrics): the registry after recorded events, the exporter,
the outage hook, the Trainer's per-step records, and a whole run scraped against ground truth.

The run: a real Redis, ``file://`` origin and mirror, the Trainer in this process with its
exporter on, and ``aurora relay`` and ``aurora actor`` processes started with
``--metrics-port``. Each endpoint is scraped over HTTP and parsed with prometheus-client's own
parser; the values are compared with what the store, the mirror and the ledger hold.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aurora_store import metrics
from aurora_store.config import free_port
from aurora_store.errors import ConfigError
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.plan import scan_versions
from aurora_store.metrics import SECONDS_BUCKETS, Metrics, step_key, step_record
from aurora_store.outage import Dependency
from aurora_store.storage import Store, open_store
from aurora_store.testing.wait import wait_until
from workers.trainer.step_metrics import save_step_metrics
from workers.trainer.trainer import StepLog

REPO = Path(__file__).resolve().parents[1]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): float(s.value) for fam in text_string_to_metric_families(text) for s in fam.samples}


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return _parse(r.read().decode("utf-8"))


def _v(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over every series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@pytest.fixture
def installed() -> Iterator[Callable[[str], Metrics]]:
    """``install(worker)`` for this test, undone after it (the process goes on to other tests)."""
    yield metrics.install
    metrics.uninstall()


def _step(step: int = 2, **kw: Any) -> StepLog:
    base: dict[str, Any] = dict(
        step=step,
        version=step + 1,
        gen_version=step,
        reward=0.25,
        wait_s=0.5,
        train_s=1.5,
        extract_publish_s=0.02,
        step_s=2.1,
        delta_bytes=1234,
        full_bytes=99999,
        changed=77,
        tokens=640,
        tokens_per_s=304.0,
        eligible=["a"],
        excluded=[],
        by_actor={"a": 3, "b": 5},
    )
    base.update(kw)
    return StepLog(**base)


# -- the module --------------------------------------------------------------------------------
def test_trainer_metrics_count_versions_once_and_bytes_by_kind() -> None:
    m = Metrics("trainer")
    m.published(0, "snapshot", 1000)
    m.published(1, "delta", 40)
    m.published(2, "delta", 60)
    m.published(2, "snapshot", 1000)  # a snapshot at a version already published: not another version
    m.trainer_step(_step())
    m.trainer_step(_step(3))  # nothing published since the last step: not a publish
    m.evaluated(2, 0.375)
    g = m.registry.get_sample_value
    assert g("aurora_versions_published_total") == 3
    assert g("aurora_published_version") == 2
    assert g("aurora_published_bytes_total", {"kind": "delta"}) == 100
    assert g("aurora_published_bytes_total", {"kind": "snapshot"}) == 2000
    assert g("aurora_trainer_steps_total") == 2
    assert g("aurora_trainer_rollouts_total") == 16
    assert g("aurora_trainer_tokens_total") == 1280
    assert g("aurora_trainer_tokens_per_second") == 304.0
    assert g("aurora_reward_mean") == 0.25
    assert g("aurora_eval_accuracy") == 0.375 and g("aurora_eval_version") == 2
    assert g("aurora_publish_seconds_count") == 1 and g("aurora_publish_seconds_sum") == pytest.approx(0.02)
    # 20 ms lands in the 25 ms bucket, not the 10 ms one.
    assert g("aurora_publish_seconds_bucket", {"le": "0.01"}) == 0 and g("aurora_publish_seconds_bucket", {"le": "0.025"}) == 1
    assert g("aurora_trainer_step_seconds_sum", {"phase": "wait"}) == 1.0
    assert g("aurora_trainer_step_seconds_sum", {"phase": "train"}) == 3.0


def test_a_step_that_shipped_nothing_is_not_a_publish() -> None:
    m = Metrics("trainer")
    m.published(0, "snapshot", 10)
    m.trainer_step(_step(1))
    m.trainer_step(_step(2, delta_bytes=0))  # the no-transfer baseline: nothing published in the step
    m.published(3, "delta", 0)  # an empty delta (no group had a signal) is still a publish
    m.trainer_step(_step(3, delta_bytes=0))
    assert m.registry.get_sample_value("aurora_publish_seconds_count") == 2
    assert m.registry.get_sample_value("aurora_trainer_steps_total") == 3


def test_actor_metrics_lag_bytes_by_origin_and_settlements() -> None:
    m = Metrics("actor")
    m.head_seen("a0", "eu", None)  # no head yet: nothing to say
    m.bootstrapped("a0", "eu", 0, 5000)
    m.head_seen("a0", "eu", 2)
    g = m.registry.get_sample_value
    assert g("aurora_actor_lag_versions", {"actor": "a0", "region": "eu"}) == 2
    m.staged("a0", "eu", 1, "delta", 30, "mirror", 0.004)
    m.staged("a0", "eu", 2, "delta", 50, "origin", 0.2)
    m.activated("a0", "eu", 1, 0.0005)
    assert g("aurora_actor_lag_versions", {"actor": "a0", "region": "eu"}) == 1
    m.activated("a0", "eu", 2, 0.0007)
    m.claimed("a0", "eu", 4)
    for result in ("accepted", "accepted", "accepted", "expired"):
        m.settled("a0", "eu", result)
    m.generated("a0", "eu", 4, 100, 0.5)
    a = {"actor": "a0", "region": "eu"}
    assert g("aurora_active_version", a) == 2 and g("aurora_staged_version", a) == 2
    assert g("aurora_actor_lag_versions", a) == 0
    assert g("aurora_versions_staged_total", {**a, "kind": "delta"}) == 2
    assert g("aurora_versions_activated_total", a) == 2
    assert g("aurora_fetched_bytes_total", {**a, "kind": "delta", "origin": "mirror"}) == 30
    assert g("aurora_fetched_bytes_total", {**a, "kind": "delta", "origin": "origin"}) == 50
    assert g("aurora_fetched_bytes_total", {**a, "kind": "snapshot", "origin": "origin"}) == 5000
    assert g("aurora_stage_seconds_count", a) == 2 and g("aurora_apply_seconds_count", a) == 2
    # Activation runs from the start of staging: at least the staging itself.
    assert g("aurora_activation_seconds_count", a) == 2
    assert (g("aurora_activation_seconds_sum", a) or 0.0) >= 0.204
    assert g("aurora_leases_claimed_total", a) == 4
    assert g("aurora_leases_settled_total", {**a, "result": "accepted"}) == 3
    assert g("aurora_leases_settled_total", {**a, "result": "expired"}) == 1
    assert g("aurora_actor_rollouts_total", a) == 4 and g("aurora_actor_tokens_total", a) == 100
    assert g("aurora_actor_tokens_per_second", a) == 200


def test_relay_metrics_and_buckets() -> None:
    m = Metrics("relay")
    m.copied("eu", "model", 10)
    m.copied("eu", "delta", 300)
    m.mirrored("eu", "delta", 3, 0.05)
    m.mirrored("eu", "snapshot", 2, 1.0)
    g = m.registry.get_sample_value
    assert g("aurora_versions_mirrored_total", {"region": "eu", "kind": "delta"}) == 1
    assert g("aurora_mirrored_version", {"region": "eu"}) == 3  # newest, whichever kind came last
    assert g("aurora_mirrored_bytes_total", {"region": "eu", "kind": "delta"}) == 300
    assert g("aurora_mirrored_bytes_total", {"region": "eu", "kind": "model"}) == 10
    assert SECONDS_BUCKETS[0] == 0.001 and SECONDS_BUCKETS[-1] == 60.0
    assert g("aurora_mirror_seconds_bucket", {"region": "eu", "kind": "snapshot", "le": "60.0"}) == 1


def test_each_metrics_has_its_own_registry() -> None:
    """Two sets in one process (the global registry would refuse the second's names)."""
    a, b = Metrics("actor"), Metrics("actor")
    a.claimed("x", "eu", 1)
    assert a.registry.get_sample_value("aurora_leases_claimed_total", {"actor": "x", "region": "eu"}) == 1
    assert b.registry.get_sample_value("aurora_leases_claimed_total", {"actor": "x", "region": "eu"}) is None


def test_exporter_serves_the_registry_and_refuses_a_taken_port() -> None:
    m = Metrics("relay")
    m.mirrored("eu", "delta", 7, 0.01)
    srv = m.serve(0)
    try:
        assert srv.host == "127.0.0.1" and srv.port > 0
        got = _scrape(srv.port)
        assert _v(got, "aurora_versions_mirrored_total", region="eu", kind="delta") == 1
        assert _v(got, "aurora_mirrored_version", region="eu") == 7
        # Only Aurora's metrics: not the default registry's process and platform collectors.
        assert all(name.startswith("aurora_") for name, _ in got)
        with pytest.raises(ConfigError, match=rf"--metrics-port {srv.port}: cannot listen on 127.0.0.1:{srv.port}"):
            Metrics("relay").serve(srv.port)
    finally:
        srv.close()


def test_serve_from_args_is_off_without_a_port(installed: Callable[[str], Metrics]) -> None:
    import argparse

    from aurora_store.options import add_metrics_args

    p = argparse.ArgumentParser()
    add_metrics_args(p)
    assert metrics.serve_from_args(p.parse_args([]), "actor") is None
    with pytest.raises(SystemExit):
        p.parse_args(["--metrics-port", "70000"])
    srv = metrics.serve_from_args(p.parse_args(["--metrics-port", str(free_port())]), "actor")
    assert srv is not None
    try:
        assert metrics.active().worker == "actor"
        metrics.active().claimed("a", "r", 2)
        assert _v(_scrape(srv.port), "aurora_leases_claimed_total", actor="a", region="r") == 2
    finally:
        srv.close()


def test_metrics_port_from_a_config_file_reaches_every_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A top-level ``metrics-port`` applies to every worker (each has the option); a bad one is one line."""
    from aurora_tools.cli import config_file, run_cmds
    from aurora_tools.cli.main import build_parser

    monkeypatch.setenv("AURORA_REDIS_URL", "redis://127.0.0.1:1/0")
    fills = {"trainer": run_cmds.add_trainer_arguments, "actor": run_cmds.add_actor_arguments, "relay": run_cmds.add_relay_arguments}
    f = tmp_path / "run.toml"
    f.write_text('store = "file:///tmp/x"\nrun = "r"\nmetrics-port = 9109\n[relay]\nmetrics-host = "0.0.0.0"\n')
    for worker, extra in (("trainer", []), ("actor", []), ("relay", ["--region", "eu", "--mirror", "file:///tmp/m"])):
        argv = [worker, "--config", str(f), *extra]
        args = config_file.parse_worker_args(build_parser(argv), argv, fills)
        assert args.metrics_port == 9109
        assert args.metrics_host == ("0.0.0.0" if worker == "relay" else None)
    f.write_text('store = "file:///tmp/x"\nrun = "r"\nmetrics-port = 70000\n')
    argv = ["actor", "--config", str(f)]
    with pytest.raises(SystemExit) as exit_:
        config_file.parse_worker_args(build_parser(argv), argv, fills)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) >= 1 and "metrics-port" in err[-1] and "70000 is not a TCP port" in err[-1], err


def test_outage_state_follows_the_dependency(installed: Callable[[str], Metrics]) -> None:
    m = installed("trainer")
    dep = Dependency("Redis", logging.getLogger("test.metrics"))
    labels = {"worker": "trainer", "dependency": "Redis"}
    g = m.registry.get_sample_value
    assert g("aurora_outage", labels) == 0  # the series exists before any outage
    dep.failed(ConnectionError("refused"))
    dep.failed(ConnectionError("refused again"))  # the same outage
    assert g("aurora_outage", labels) == 1 and g("aurora_outages_total", labels) == 1
    dep.ok()
    assert g("aurora_outage", labels) == 0 and g("aurora_outages_total", labels) == 1


# -- the Trainer's per-step records -----------------------------------------------------------
def test_step_record_is_create_only_json(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path / 'run'}")
    dep = Dependency("the store", logging.getLogger("test.metrics"))
    s = _step(3)
    assert save_step_metrics(store, dep, threading.Event(), s, 0.5)
    key = step_key(3)
    assert key == "metrics/step-00000003.json"
    body = json.loads(store.get(key))
    assert body["step"] == 3 and body["version"] == 4 and body["eval_accuracy"] == 0.5
    assert body["delta_bytes"] == 1234 and body["changed"] == 77 and body["tokens"] == 640
    assert {"reward", "tokens_per_s", "wait_s", "train_s", "publish_s"} <= set(body)
    # Written again (a resumed Trainer repeating the step): the first record stays.
    assert save_step_metrics(store, dep, threading.Event(), _step(3, reward=0.9))
    assert json.loads(store.get(key))["reward"] == 0.25
    assert "eval_accuracy" not in json.loads(step_record(_step(4))[1])


def test_a_step_record_that_cannot_be_written_is_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the run root's folder should be")
    store = open_store(f"file://{blocker}/run")
    dep = Dependency("the store", logging.getLogger("test.metrics"))
    with caplog.at_level(logging.WARNING, logger="aurora.trainer"):
        assert not save_step_metrics(store, dep, threading.Event(), _step(1))
    lines = [r for r in caplog.records if r.name == "aurora.trainer"]
    assert len(lines) == 1 and "metrics/step-00000001.json not saved" in lines[0].getMessage()


# -- a whole run, scraped --------------------------------------------------------------------
STEPS = 4


def _dir_bytes(store: Store, prefix: str) -> int:
    return sum(store.size(k) for k in store.list(prefix))


@pytest.mark.slow
@pytest.mark.server
def test_scraped_workers_match_the_store_and_the_ledger(tmp_path: Path, installed: Callable[[str], Metrics]) -> None:
    from aurora_store.coordination.keys import RunKeys
    from aurora_store.coordination.ledger import Ledger
    from aurora_store.coordination.redisconn import connect
    from aurora_store.testing.servers import RedisServer
    from workers.common import Endpoints
    from workers.trainer import TrainerConfig
    from workers.trainer.trainer import Trainer

    run = "metrics"
    origin_url, mirror_url = f"file://{tmp_path / 'origin'}", f"file://{tmp_path / 'mirror'}"
    logs = tmp_path / "logs"
    logs.mkdir()
    env = {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    # Waits fail at once, with the logs' tails, if a child dies; an endpoint not listening yet is "not yet".
    watch: dict[str, Any] = {
        "processes": procs,
        "logs": [logs / "relay.log", logs / "actor.log"],
        "interval": 0.1,
        "ignoring": (urllib.error.URLError, ConnectionError, OSError),
    }
    ports = {"relay": free_port(), "actor": free_port()}
    with RedisServer() as rs:
        m = installed("trainer")
        srv = m.serve(0)
        cfg = TrainerConfig(
            steps=STEPS,
            batch=4,
            group=4,
            eval_every=2,
            eval_size=4,
            checkpoint_every=0,
            snapshot_every=2,
            keep_snapshots=0,
            min_actors=1,
            warm_start_steps=2,  # counts, not learning
        )
        trainer = Trainer(Endpoints(origin_url, rs.url, run, {}), cfg)
        common = ["--store", origin_url, "--redis", rs.url, "--run", run, "--region", "eu", "--mirror", mirror_url]

        def start(name: str, argv: list[str]) -> None:
            out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "aurora_tools.cli", *argv, "--metrics-port", str(ports[name])],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

        failure: list[BaseException] = []

        def train() -> None:
            try:
                trainer.run()
            except BaseException as e:  # noqa: BLE001 - reported below
                failure.append(e)

        try:
            start("relay", ["relay", *common, "--keep-snapshots", "0", "--heartbeat-s", "0.5"])
            start("actor", ["actor", *common, "--id", "a0"])
            t = threading.Thread(target=train, name="trainer", daemon=True)
            t.start()
            wait_until(lambda: not t.is_alive(), "the Trainer's last step", timeout=400, **watch)
            assert not failure, failure
            store, mirror = open_store(origin_url), open_store(mirror_url)
            head = scan_versions(store).latest
            assert head == STEPS

            # The Trainer, scraped over HTTP: versions published = the store's head (+ v0).
            tr = _scrape(srv.port)
            assert _v(tr, "aurora_published_version") == head
            assert _v(tr, "aurora_versions_published_total") == head + 1
            deltas = sum(read_manifest(store, "delta", v).total_bytes for v in range(1, head + 1))
            assert _v(tr, "aurora_published_bytes_total", kind="delta") == deltas
            snaps = sum(read_manifest(store, "snapshot", v).total_bytes for v in scan_versions(store).snapshots)
            assert _v(tr, "aurora_published_bytes_total", kind="snapshot") == snaps
            assert _v(tr, "aurora_trainer_steps_total") == STEPS
            assert _v(tr, "aurora_publish_seconds_count") == STEPS, (
                [lg.delta_bytes for lg in trainer.logs],
                [(k, v) for k, v in tr.items() if "publish_seconds" in k[0]],
            )
            assert _v(tr, "aurora_trainer_rollouts_total") == STEPS * cfg.batch
            assert _v(tr, "aurora_trainer_tokens_total") == sum(lg.tokens for lg in trainer.logs)
            assert _v(tr, "aurora_reward_mean") == pytest.approx(trainer.logs[-1].reward)
            newest_eval = max(trainer.eval_accuracy)
            assert _v(tr, "aurora_eval_version") == newest_eval
            assert _v(tr, "aurora_eval_accuracy") == pytest.approx(trainer.eval_accuracy[newest_eval])
            assert _v(tr, "aurora_outage", worker="trainer", dependency="Redis") == 0
            # One record per step in the run root.
            records = [json.loads(store.get(step_key(b))) for b in range(STEPS)]
            assert [r["version"] for r in records] == list(range(1, STEPS + 1))
            assert [r["delta_bytes"] for r in records] == [lg.delta_bytes for lg in trainer.logs]
            assert records[1]["eval_accuracy"] == pytest.approx(trainer.eval_accuracy[2])

            # The Actor: once it runs the head, what it settled is what the ledger counted.
            ledger = Ledger(connect(rs.url), run)
            a = {"actor": "a0", "region": "eu"}

            def actor_caught_up() -> bool:
                got = _scrape(ports["actor"])
                rec = ledger.actor("a0")
                return (
                    rec is not None
                    and _v(got, "aurora_active_version", **a) == head
                    and _v(got, "aurora_leases_settled_total", **a, result="accepted") == rec.settled
                )

            wait_until(actor_caught_up, "the Actor to activate the head", timeout=180, **watch)
            ac = _scrape(ports["actor"])
            rec = ledger.actor("a0")
            assert rec is not None and rec.settled == STEPS * cfg.batch  # one Actor did all the work
            assert _v(ac, "aurora_leases_settled_total", **a, result="accepted") == rec.settled
            assert (_v(ac, "aurora_leases_claimed_total", **a) or 0) >= rec.settled
            assert _v(ac, "aurora_actor_lag_versions", **a) == 0
            activations = [k for k in connect(rs.url).hkeys(RunKeys(run).activations) if k.decode().startswith("a0|")]
            assert _v(ac, "aurora_versions_activated_total", **a) == len(activations) == head  # bootstrapped at v0
            assert _v(ac, "aurora_activation_seconds_count", **a) == head
            # Every delta it staged, from the mirror or origin: their bytes are the deltas' bytes.
            assert _v(ac, "aurora_versions_staged_total", **a, kind="delta") == head
            assert _sum(ac, "aurora_fetched_bytes_total", **a, kind="delta") == deltas
            assert (
                _v(ac, "aurora_fetched_bytes_total", **a, kind="snapshot", origin="origin")
                == read_manifest(store, "snapshot", 0).total_bytes
            )
            assert _v(ac, "aurora_outage", worker="actor", dependency="Redis") == 0

            # The Relay: what it mirrored is what the mirror holds.
            def relay_caught_up() -> bool:
                return _v(_scrape(ports["relay"]), "aurora_mirrored_version", region="eu") == head

            wait_until(relay_caught_up, "the Relay to mirror the head", timeout=180, **watch)
            rl = _scrape(ports["relay"])
            held = scan_versions(mirror)
            assert _v(rl, "aurora_versions_mirrored_total", region="eu", kind="delta") == len(held.deltas) == head
            assert _v(rl, "aurora_versions_mirrored_total", region="eu", kind="snapshot") == len(held.snapshots)
            assert _v(rl, "aurora_mirrored_bytes_total", region="eu", kind="delta") == _dir_bytes(mirror, "deltas/")
            assert _v(rl, "aurora_mirrored_bytes_total", region="eu", kind="snapshot") == _dir_bytes(mirror, "snapshots/")
        finally:
            trainer.stop.set()
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            srv.close()


# -- the dashboard and the docs name only metrics that exist ----------------------------------
def _sample_names(m: Metrics) -> dict[str, str]:
    """Every sample name the registry can expose -> its family's name."""
    out: dict[str, str] = {}
    for fam in m.registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}[fam.type]
        out.update({fam.name + s: fam.name for s in suffixes})
    return out


def test_the_dashboard_queries_metrics_that_exist_and_covers_the_issue() -> None:
    import re

    dash = json.loads((REPO / "infra" / "grafana-aurora.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"\baurora_[a-z_]+", e)}
    known = _sample_names(Metrics())
    assert used and used <= set(known), sorted(used - set(known))
    for wanted in (
        "aurora_actor_lag_versions",
        "aurora_fetched_bytes_total",
        "aurora_publish_seconds_bucket",
        "aurora_stage_seconds_bucket",
        "aurora_activation_seconds_bucket",
        "aurora_leases_settled_total",
        "aurora_reward_mean",
        "aurora_eval_accuracy",
        "aurora_outage",
    ):
        assert wanted in used, wanted
    assert any("histogram_quantile(0.95" in e for e in exprs) and any("histogram_quantile(0.5" in e for e in exprs)


def test_docs_list_every_metric() -> None:
    text = (REPO / "docs" / "WORKERS.md").read_text()
    section = text[text.index("## Metrics") :]
    section = section[: section.index("\n## ", 1)]
    families = set(_sample_names(Metrics()).values())
    assert len(families) >= 30
    assert not [f for f in sorted(families) if f"`{f}`" not in section]
