"""A whole run rides out its dependencies: the real Trainer and an Actor (separate processes)
on an S3 server and a Redis that are paused (SIGSTOP) and restarted without data mid-run.
Both finish, each outage is logged once when it starts and once when it ends, no traceback,
and the Actor's weights stay the Trainer's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aurora_store.lineage.plan import scan_versions
from aurora_store.storage import open_store
from aurora_store.testing.servers import RedisServer, S3Server
from aurora_store.testing.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.server]

RUN = "outages"
STEPS = 10


def test_trainer_and_actor_ride_out_redis_and_s3_outages(tmp_path: Path) -> None:
    with S3Server(process=True) as s3, RedisServer() as rs:
        bucket = s3.new_bucket()
        store_url = f"s3://{bucket}/run"
        env = {
            **os.environ,
            **s3.env_vars,
            "AURORA_TORCH_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            # Two warm-start steps: riding out outages is the point, not what the model learns.
            "AURORA_TRAINER_WARM_START_STEPS": "2",
            # Short timeouts, so an outage is noticed within a second or two.
            "AURORA_REDIS_COMMAND_TIMEOUT_S": "1",
            "AURORA_REDIS_CONNECT_TIMEOUT_S": "1",
            "AURORA_REDIS_BLOCK_MARGIN_S": "1",
            "AURORA_STORE_RETRIES": "1",
            "AURORA_STORE_READ_TIMEOUT_S": "1",
            "AURORA_STORE_CONNECT_TIMEOUT_S": "1",
            "AURORA_STORE_OP_TIMEOUT_S": "3",
            # Digests kept outside Redis, which the restart erases.
            "AURORA_DIGEST_LOG": str(tmp_path / "digests.jsonl"),
        }
        common = ["--store", store_url, "--redis", rs.url, "--run", RUN]
        tlog, alog = tmp_path / "trainer.log", tmp_path / "actor.log"
        trainer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "aurora_tools.cli",
                "trainer",
                *common,
                "--steps",
                str(STEPS),
                "--batch",
                "8",
                "--group",
                "4",
                "--snapshot-every",
                "0",
                "--checkpoint-every",
                "0",
                "--digest-every",
                "1",  # every version hashed: the Actor's weights are compared at each activation
            ],
            env=env,
            stdout=open(tlog, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        actor = subprocess.Popen(
            [sys.executable, "-m", "aurora_tools.cli", "actor", *common, "--id", "a0"],
            env=env,
            stdout=open(alog, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        procs, logs = [trainer, actor], [tlog, alog]
        both: dict[str, Any] = {"timeout": 240, "interval": 0.05, "processes": {"the Trainer": trainer, "the Actor": actor}, "logs": logs}
        store = open_store(store_url, s3.storage_options())

        def head() -> int:
            return scan_versions(store).latest or -1

        def said(log: Path, text: str) -> bool:
            return text in log.read_text(errors="replace")

        try:
            # 1. Redis paused until both processes have noticed, then resumed.
            wait_until(lambda: head() >= 2, "v2", **both)
            os.kill(rs.proc.pid, signal.SIGSTOP)
            try:
                wait_until(
                    lambda: said(tlog, "Redis unreachable") and said(alog, "Redis unreachable"), "both to notice Redis is away", **both
                )
            finally:
                os.kill(rs.proc.pid, signal.SIGCONT)
            # 2. The S3 server paused until the Trainer, publishing, notices it.
            wait_until(lambda: head() >= 4, "v4", **both)
            os.kill(s3.pid, signal.SIGSTOP)  # type: ignore[arg-type]
            try:
                wait_until(lambda: said(tlog, "the store unreachable"), "the Trainer to notice the store is away", **both)
            finally:
                os.kill(s3.pid, signal.SIGCONT)  # type: ignore[arg-type]
            # 3. Redis restarted without its data (steps, leases, the Actor's record, the fence)
            # while the Actor is stopped, so the Trainer is sure to be waiting on a lost step.
            wait_until(lambda: head() >= 6, "v6", **both)
            os.kill(actor.pid, signal.SIGSTOP)
            try:
                rs.restart()
                wait_until(
                    lambda: said(tlog, "ledger lost"),
                    "the Trainer to re-issue the lost step",
                    timeout=240,
                    interval=0.05,
                    processes={"the Trainer": trainer},
                    logs=[tlog],
                )
            finally:
                os.kill(actor.pid, signal.SIGCONT)
            assert trainer.wait(timeout=300) == 0, tlog.read_text(errors="replace")[-3000:]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
        ttext, atext = tlog.read_text(errors="replace"), alog.read_text(errors="replace")
        assert head() == STEPS
        for text in (ttext, atext):
            assert "Traceback" not in text, text[-3000:]
        assert ttext.count("Redis unreachable") == ttext.count("Redis reachable again") >= 1, ttext[-3000:]
        assert ttext.count("the store unreachable") == ttext.count("the store reachable again") >= 1, ttext[-3000:]
        assert "ledger lost" in ttext, ttext[-3000:]  # the restart lost the open steps, which were issued again
        # At every version the Actor activated, its weights were the Trainer's (digests from the log).
        lines = [json.loads(x) for x in (tmp_path / "digests.jsonl").read_text().splitlines()]
        trainer_at = {d["version"]: d["digest"] for d in lines if d["who"] == "trainer"}
        actor_at = [(d["version"], d["digest"]) for d in lines if d["who"] == "a0"]
        assert sorted(trainer_at) == list(range(STEPS + 1))
        assert len({v for v, _ in actor_at}) >= STEPS // 2, actor_at
        for v, d in actor_at:
            assert trainer_at[v] == d, f"v{v}: the Actor's weights differ from the Trainer's"
