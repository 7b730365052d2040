"""A Trainer SIGKILLed mid-run and started again with ``--resume``: the chain neither forks
nor gaps, the resumed Trainer takes a new epoch, an Actor that kept running follows it
bit for bit, and a run root that holds versions is refused without ``--resume``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.records import read_digests
from aurora_store.coordination.redisconn import connect
from aurora_store.format.manifest import version_dir
from aurora_store.lineage.fetch import read_manifest
from aurora_store.lineage.plan import scan_versions
from aurora_store.storage import open_store
from aurora_store.testing.wait import wait_until
from workers.trainer.checkpoint import list_checkpoints
from workers.trainer.crash import CRASH_ENV

pytestmark = [pytest.mark.slow, pytest.mark.server]


def _env() -> dict[str, str]:
    return {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _trainer(store: str, redis_url: str, log: Path, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    run = Path(store.removeprefix("file://")).parent.name  # one run name per test (the Redis server is shared)
    cmd = [
        sys.executable,
        "-m",
        "aurora_tools.cli",
        "trainer",
        "--store",
        store,
        "--redis",
        redis_url,
        "--run",
        run,
        "--steps",
        "9",
        "--batch",
        "8",
        "--group",
        "4",
        "--snapshot-every",
        "0",
        "--checkpoint-every",
        "2",
        *extra,
    ]
    return subprocess.Popen(cmd, env={**_env(), **(env or {})}, stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115


CRASH = 6
"""Crash points are at version 6 (``segment``: the first version from 6 on with a segment)."""


# mid-batch and mid-publish run in `make test`; the other two crash points in `make test-all`.
@pytest.mark.parametrize(
    "crash",
    [
        pytest.param(None, id="mid-batch", marks=pytest.mark.long),  # the slowest; mid-publish keeps a resume in CI
        pytest.param("segment", id="mid-publish"),
        pytest.param("manifest", id="after-manifest", marks=pytest.mark.long),
        pytest.param("closed", id="after-close", marks=pytest.mark.long),
    ],
)
def test_sigkilled_trainer_resumes_without_fork_or_gap(tmp_path: Path, redis_url: str, crash: str | None) -> None:
    store_url = f"file://{tmp_path}/run"
    store = open_store(store_url)
    r = connect(redis_url)
    RUN = tmp_path.name  # noqa: N806 - the run name _trainer derives from the store URL
    tlog, alog = tmp_path / "trainer.log", tmp_path / "actor.log"
    # A step whose groups all scored alike changes no weight and publishes no segment:
    # "segment" crashes at the first version from CRASH on that has one.
    spec = f"{crash}@{CRASH}+" if crash == "segment" else f"{crash}@{CRASH}"
    # With a crash point, only the checkpoint before step 0 is taken: whatever version the
    # crash lands on, versions were published after the newest checkpoint.
    extra = ("--checkpoint-every", "1000") if crash else ()
    trainer = _trainer(store_url, redis_url, tlog, *extra, env={CRASH_ENV: spec} if crash else None)
    actor = None
    try:
        wait_until(
            lambda: r.hget(RunKeys(RUN).trainer, "head") is not None,
            "v0",
            timeout=300,
            interval=0.1,
            processes={"the Trainer": trainer},
            logs=[tlog],
        )
        actor = subprocess.Popen(
            [sys.executable, "-m", "aurora_tools.cli", "actor", "--store", store_url, "--redis", redis_url, "--run", RUN, "--id", "a0"],
            env=_env(),
            stdout=open(alog, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )

        def head() -> int:
            h = r.hget(RunKeys(RUN).trainer, "head")
            return -1 if h is None else int(h)

        if crash is None:
            # Killed while waiting for a batch, with a version published after its newest
            # checkpoint (every 2 versions, so each odd head opens a window of a whole step).
            def past_checkpoint() -> bool:
                h = head()
                return h >= 3 and h % 2 == 1 and max(list_checkpoints(store), default=-1) < h

            wait_until(
                past_checkpoint,
                "an odd version after a checkpoint",
                timeout=300,
                interval=0.01,
                processes={"the Trainer": trainer},
                logs=[tlog],
            )
            trainer.send_signal(signal.SIGKILL)
            assert trainer.wait(timeout=30) == -signal.SIGKILL
        else:
            assert trainer.wait(timeout=300) == -signal.SIGKILL, tlog.read_text(errors="replace")[-3000:]
            hit = re.search(rf"crash point {crash}@(\d+) reached", tlog.read_text(errors="replace"))
            assert hit, tlog.read_text(errors="replace")[-3000:]
            at = int(hit.group(1))
            committed = scan_versions(store).latest
            # What each point leaves behind: no version `at` yet, or one the run does not know of.
            assert committed == (at if crash == "manifest" else at - 1)
            assert head() == at - 1
            if crash == "segment":
                assert store.list(version_dir("delta", at)), "a segment of it, no manifest"
        killed_head = scan_versions(store).latest
        assert killed_head is not None and killed_head > max(list_checkpoints(store))

        if crash is None:
            # Without --resume an existing run is refused, with one line and no traceback.
            refused = tmp_path / "refused.log"
            p = _trainer(store_url, redis_url, refused)
            assert p.wait(timeout=120) != 0
            text = refused.read_text(errors="replace")
            assert "--resume" in text and "Traceback" not in text, text[-2000:]

        trainer = _trainer(store_url, redis_url, tlog, "--resume")
        assert trainer.wait(timeout=420) == 0, tlog.read_text(errors="replace")[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
        if actor is not None:
            actor.send_signal(signal.SIGTERM)
            try:
                actor.wait(timeout=60)
            except subprocess.TimeoutExpired:
                actor.kill()
    text = tlog.read_text(errors="replace")
    assert "resumed epoch 2 from the checkpoint before step" in text, text[-3000:]
    index = scan_versions(store)
    assert index.latest == 9
    # One chain: every delta from v1 to v7, each on the state of the one before.
    assert sorted(index.deltas) == list(range(1, 10))
    prev = read_manifest(store, "snapshot", 0).state
    epochs = []
    for v in range(1, 10):
        m = read_manifest(store, "delta", v)
        assert m.base_version == v - 1 and m.base_state == prev, f"v{v} forks the chain"
        prev = m.state
        epochs.append(m.producer.get("epoch"))
    assert epochs[0] == 1 and epochs[-1] == 2 and epochs == sorted(epochs), epochs
    # The Actor, which never restarted, followed the resumed Trainer bit for bit.
    tdig, adig = read_digests(r, RunKeys(RUN))
    after = [v for (who, v) in adig if who == "a0" and v > killed_head]
    assert after, (adig, alog.read_text(errors="replace")[-2000:])
    for (who, v), d in adig.items():
        if who == "a0":
            assert d == tdig[v], f"v{v}: the Actor's weights differ from the Trainer's"
    assert "Traceback" not in alog.read_text(errors="replace")


@pytest.mark.long  # fencing is covered part by part: tests/test_records.py, test_trainer_parts.py, test_ledger_robust.py
def test_an_old_epoch_trainer_woken_after_a_resume_is_fenced_out(tmp_path: Path, redis_url: str) -> None:
    store_url = f"file://{tmp_path}/run"
    store = open_store(store_url)
    r = connect(redis_url)
    RUN = tmp_path.name  # noqa: N806 - the run name _trainer derives from the store URL
    old_log, new_log, alog = tmp_path / "old.log", tmp_path / "new.log", tmp_path / "actor.log"
    old = _trainer(store_url, redis_url, old_log)
    new = actor = None
    try:
        wait_until(
            lambda: r.hget(RunKeys(RUN).trainer, "head") is not None,
            "v0",
            timeout=300,
            interval=0.1,
            processes={"the Trainer": old},
            logs=[old_log],
        )
        actor = subprocess.Popen(
            [sys.executable, "-m", "aurora_tools.cli", "actor", "--store", store_url, "--redis", redis_url, "--run", RUN, "--id", "a0"],
            env=_env(),
            stdout=open(alog, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        wait_until(
            lambda: (scan_versions(store).latest or 0) >= 2, "v2", timeout=300, interval=0.1, processes={"the Trainer": old}, logs=[old_log]
        )
        old.send_signal(signal.SIGSTOP)  # a partition, a paused VM: it thinks it is still the Trainer
        stopped_at = scan_versions(store).latest or 0
        new = _trainer(store_url, redis_url, new_log, "--resume")
        wait_until(
            lambda: (scan_versions(store).latest or 0) >= stopped_at + 2,
            "the resumed Trainer to publish",
            timeout=300,
            interval=0.1,
            processes={"the Trainer": new},
            logs=[new_log],
        )
        old.send_signal(signal.SIGCONT)
        rc_old = old.wait(timeout=120)
        assert new.wait(timeout=420) == 0, new_log.read_text(errors="replace")[-3000:]
    finally:
        for p in (old, new):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
        if actor is not None:
            actor.send_signal(signal.SIGTERM)
            try:
                actor.wait(timeout=60)
            except subprocess.TimeoutExpired:
                actor.kill()
    text = old_log.read_text(errors="replace")
    assert rc_old != 0 and "newer Trainer" in text and "Traceback" not in text, text[-3000:]
    # The woken Trainer changed nothing: one chain, epoch 1 then epoch 2, nothing of epoch 1 after it.
    prev = read_manifest(store, "snapshot", 0).state
    epochs = []
    for v in range(1, 10):
        m = read_manifest(store, "delta", v)
        assert m.base_state == prev, f"v{v} forks the chain"
        prev = m.state
        epochs.append(m.producer.get("epoch"))
    assert epochs == sorted(epochs) and epochs[-1] == 2, epochs
    assert int(r.hget(RunKeys(RUN).trainer, "epoch")) == 2 and r.hget(RunKeys(RUN).trainer, "status") == b"done"
