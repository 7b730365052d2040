"""``aurora testbed`` (local Redis + S3 server) and ``aurora status`` (a run at a glance).

Real servers on loopback only: redis-server, moto's S3 server (in-process or
in the detached testbed process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger
from aurora_store.coordination.redisconn import RedisConfig, connect
from aurora_store.coordination.status import collect_status, render
from aurora_store.errors import RedisUnavailable
from aurora_store.storage import open_store
from aurora_store.testing.clock import ManualClock
from aurora_tools import testbed
from aurora_tools.cli import main
from aurora_tools.testbed import processes

pytestmark = pytest.mark.server

H = "sha256:" + "ab" * 32


def _ping(url: str) -> bool:
    return processes.redis_answers(url, timeout_s=0.5)


def _s3_client(endpoint: str, env: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


# ---------------------------------------------------------------------------
# testbed


def test_testbed_in_process_start_stop(tmp_path: Path) -> None:
    with testbed.Testbed(tmp_path / "tb", bucket="tb-inproc", s3="moto") as tb:
        urls, env = tb.urls, tb.env
        assert urls["redis"].startswith("redis://127.0.0.1:")
        assert urls["s3"].startswith("http://127.0.0.1:")
        assert urls["store"].startswith("s3://tb-inproc/")
        assert env["AWS_ENDPOINT_URL"] == urls["s3"]
        assert set(env) == {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}
        assert _ping(urls["redis"])
        names = [b["Name"] for b in _s3_client(urls["s3"], env).list_buckets()["Buckets"]]
        assert "tb-inproc" in names
        store = open_store(urls["store"], tb.storage_options())
        store.put("hello", b"world")
        assert store.get("hello") == b"world"
        assert tb.problem() is None
    assert not _ping(urls["redis"])
    assert not processes.http_answers(urls["s3"] + "/", timeout_s=0.5)
    tb.stop()  # idempotent


@pytest.mark.slow
def test_testbed_up_background_then_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "tb"
    assert main(["testbed", "up", "--background", "--dir", str(d), "--bucket", "tb-bg"]) == 0
    out = capsys.readouterr().out
    for word in (
        "AWS_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_DEFAULT_REGION",
        "--store s3://tb-bg/",
        "aurora trainer",
        "aurora actor",
        "aurora relay",
        "testbed down",
    ):
        assert word in out, word
    state_file = d / testbed.STATE_FILE
    state = json.loads(state_file.read_text())
    pid, redis_pid = state["pid"], state["redis"]["pid"]
    try:
        assert state["redis"]["port"] > 0 and state["s3"]["port"] > 0
        assert testbed.process_alive(pid) and testbed.process_alive(redis_pid)
        assert _ping(state["urls"]["redis"])
        client = _s3_client(state["urls"]["s3"], state["env"])
        assert "tb-bg" in [b["Name"] for b in client.list_buckets()["Buckets"]]
        assert f"127.0.0.1:{state['redis']['port']}" in state["urls"]["redis"]

        # A second "up" in the same folder is refused while this one runs.
        assert main(["testbed", "up", "--background", "--dir", str(d)]) == 1
        assert "already running" in capsys.readouterr().err
        assert json.loads(state_file.read_text())["pid"] == pid

        assert main(["testbed", "down", "--dir", str(d)]) == 0
        assert "stopped" in capsys.readouterr().err
    finally:
        if testbed.process_alive(pid):  # the test failed half-way: do not leak servers
            processes.terminate(pid, 5)
            processes.terminate(redis_pid, 5)
    assert not state_file.exists()
    assert not testbed.process_alive(pid) and not testbed.process_alive(redis_pid)
    assert not _ping(state["urls"]["redis"])
    assert not processes.http_answers(state["urls"]["s3"] + "/", timeout_s=0.5)

    assert main(["testbed", "down", "--dir", str(d)]) == 1
    err = capsys.readouterr().err
    assert "no testbed is running" in err and str(d) in err


def test_testbed_down_with_a_stale_state_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tb_dir = tmp_path / "tb"
    tb_dir.mkdir()
    (tb_dir / testbed.STATE_FILE).write_text(json.dumps({"pid": dead.pid, "redis": {"pid": dead.pid}, "s3": {"pid": dead.pid}}))
    assert main(["testbed", "down", "--dir", str(tb_dir)]) == 1
    assert "stale" in capsys.readouterr().err
    assert not (tb_dir / testbed.STATE_FILE).exists()

    (tb_dir / testbed.STATE_FILE).write_text("{not json")
    with pytest.raises(testbed.TestbedStale, match="not a testbed state file"):
        testbed.stop_background(tb_dir)


# ---------------------------------------------------------------------------
# status


def _populate(redis: Any, run: str, clock: ManualClock) -> int:
    """A ledger in a known state; returns the reference time (ms)."""
    ledger = Ledger(redis, run, clock=clock)
    t0 = clock.now_ms
    ledger.register("a1", region="eu", engine="torch", tau=120.5)
    ledger.register("a2", region="us", engine="torch")
    ledger.register("a3", region="us")
    ledger.leave("a3")
    assert ledger.heartbeat("a1", active=0, staged=1, active_state=H)
    assert ledger.heartbeat("a2", active=0, staged=0, active_state=H)

    # Step 0: 6 prompts, 2 assigned to each Actor, 2 in the pool.
    ledger.create_step(0, H, [(f"p{i}", b"{}") for i in range(6)], {"a1": 2, "a2": 2}, group=2, lease_ms=60_000)
    status, l1 = ledger.claim("a1", 0, 3)  # 2 assigned + 1 from the pool
    assert status == "ok" and len(l1) == 3
    status, l2 = ledger.claim("a2", 0, 1)
    assert status == "ok" and len(l2) == 1
    assert ledger.settle("a1", l1[0], 0, H, b"{}").accepted
    assert ledger.settle("a1", l1[1], 7, H, b"{}").reason == "wrong_version"  # back to the pool, rejected

    # Step 1 (also on version 0): short leases, two of which expire.
    ledger.create_step(1, H, [(f"q{i}", b"{}") for i in range(4)], {}, group=2, lease_ms=1_000, version=0)
    assert len(ledger.claim("a1", 1, 2)[1]) == 2
    clock.advance_ms(2_000)
    assert len(ledger.claim("a2", 1, 1)[1]) == 1  # returns the two expired leases to the pool first
    assert ledger.heartbeat("a2")

    redis.hset(
        f"aurora:{{{run}}}:trainer",
        mapping={"head": 1, "head_state": H, "published_ms": clock.now_ms - 3_000, "step": 1, "status": "running"},
    )
    redis.set(f"aurora:{{{run}}}:relay:eu", "s3://aurora/mirrors/eu/r", px=30_000)
    # Another run whose name starts alike: its relay must not show up.
    redis.set(f"aurora:{{{run}x}}:relay:zz", "s3://other", px=30_000)
    return t0


def test_collect_status_numbers(redis_client: Any, run_name: str) -> None:
    clock = ManualClock()
    t0 = _populate(redis_client, run_name, clock)
    now = clock.advance_ms(500)
    st = collect_status(redis_client, run_name, now_ms=now)
    assert st["run"] == run_name and st["now_ms"] == now

    assert st["trainer"] == {
        "head": 1,
        "head_state": H,
        "published_ms": t0 + 2_000 - 3_000,
        "published_age_s": 3.5,
        "step": 1,
        "status": "running",
    }

    assert len(st["relays"]) == 1
    relay = st["relays"][0]
    assert relay["region"] == "eu" and relay["mirror"] == "s3://aurora/mirrors/eu/r"
    assert 0 < relay["ttl_s"] <= 30

    actors = {a["id"]: a for a in st["actors"]}
    assert sorted(actors) == ["a1", "a2", "a3"]
    a1, a2, a3 = actors["a1"], actors["a2"], actors["a3"]
    assert (a1["region"], a1["engine"], a1["status"], a1["active"], a1["staged"], a1["tau"]) == ("eu", "torch", "alive", 0, 1, 120.5)
    # a1: l1[2] on step 0 (l1[1] went back to the pool); its two step-1 leases expired.
    assert (a1["leases"], a1["settled"], a1["heartbeat_age_s"]) == (1, 1, 2.5)
    assert (a2["region"], a2["active"], a2["staged"], a2["leases"], a2["settled"], a2["heartbeat_age_s"]) == ("us", 0, 0, 2, 0, 0.5)
    assert a3["status"] == "left" and a3["leases"] == 0

    steps = {s["step"]: s for s in st["steps"]}
    assert sorted(steps) == [0, 1]
    assert steps[0] == {"step": 0, "version": 0, "total": 6, "leased": 2, "settled": 1, "pending": 3, "expired": 0, "rejected": 1}
    assert steps[1] == {"step": 1, "version": 0, "total": 4, "leased": 1, "settled": 0, "pending": 3, "expired": 2, "rejected": 0}
    for s in steps.values():
        assert s["settled"] + s["leased"] + s["pending"] == s["total"]
    json.dumps(st)  # JSON-able as is

    text = render(st)
    for word in ("a1", "a2", "a3", "eu", "us", "s3://aurora/mirrors/eu/r", "head v1", "running", "120.5", "left"):
        assert word in text, word
    assert "Actors (3, 2 alive)" in text and "Open steps (2)" in text and "Relays (1)" in text
    assert "s3://other" not in text


def test_relay_pattern_escapes_the_hash_tag() -> None:
    assert RunKeys("r-1.x").relay_pattern == "aurora:\\{r-1.x\\}:relay:*"


def test_status_of_an_empty_run(redis_client: Any, run_name: str) -> None:
    st = collect_status(redis_client, run_name)
    assert st["trainer"] is None and st["relays"] == [] and st["actors"] == [] and st["steps"] == []
    assert "nothing of run" in render(st)


def test_status_of_a_redis_that_is_away(dead_redis_url: str, run_name: str) -> None:
    with pytest.raises(RedisUnavailable) as e:
        collect_status(connect(dead_redis_url, RedisConfig(connect_timeout_s=1.0)), run_name)
    assert e.value.op == "status" and isinstance(e.value, ConnectionError)


def test_status_cli(redis_client: Any, redis_server: Any, run_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    _populate(redis_client, run_name, ManualClock())
    assert main(["status", "--redis", redis_server.url, "--run", run_name, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert [a["id"] for a in st["actors"]] == ["a1", "a2", "a3"]
    assert [s["step"] for s in st["steps"]] == [0, 1] and st["trainer"]["head"] == 1
    assert st["relays"][0]["region"] == "eu"

    assert main(["status", "--redis", redis_server.url, "--run", run_name]) == 0
    out = capsys.readouterr().out
    assert "a1" in out and "head v1" in out and "\x1b[" not in out

    assert main(["status", "--redis", redis_server.url, "--run", run_name, "--watch", "0"]) == 1
    assert "--watch" in capsys.readouterr().err


def test_status_cli_watch_prints_blocks_without_ansi(redis_server: Any, run_name: str) -> None:
    """--watch on a pipe: successive plain blocks, no screen clearing; stopped by SIGINT."""
    import signal
    import time

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    code = (
        # A process started from an xdist worker may inherit SIGINT ignored; a user's shell gives Python's handler.
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "import sys; from aurora_tools.cli.run_cmds import cmd_status; import argparse; "
        f"sys.exit(cmd_status(argparse.Namespace(redis={redis_server.url!r}, run={run_name!r}, watch=0.1, json=False)))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 15
        out = b""
        os.set_blocking(proc.stdout.fileno(), False)  # type: ignore[union-attr]
        while out.count(b"Open steps") < 3 and time.monotonic() < deadline:
            out += proc.stdout.read() or b""  # type: ignore[union-attr]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)  # a loaded machine (make test beside mypy) can take a while to deliver it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out += rest
    assert proc.returncode == 0, err
    assert out.count(b"Open steps") >= 3 and b"\x1b[" not in out
