"""A rank of ``aurora trainer --nproc 2`` that fails ends every rank at once, with one clear line.

Rank 0 fails before version 0 while rank 1 waits for it inside a collective
(the model's bf16 gather): its ``--model`` directory has a generation config
that is not JSON, which only rank 0 reads (with the tokenizer). Rank 0 must
say so in one line and exit without a barrier; rank 1's collective then
fails and it exits too, and the command ends with status 1. Before the fix
rank 0 sat in a barrier rank 1 never reached, the line printed after it:
the run hung. The Trainer runs in a session of its own, so the test can see
that no process of it (ranks, reward workers) is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aurora_store.testing.wait import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.server]


def _session(sid: int) -> list[int]:
    """Processes of session ``sid`` still alive (zombies aside)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # after the comm: state, ppid, pgrp, session
            out.append(int(name))
    return out


def test_rank_0_failing_before_version_0_ends_both_ranks_with_one_line(tmp_path: Path, redis_url: str) -> None:
    from aurora_tools.tinymodel import make_model_dir

    model = Path(make_model_dir(tmp_path / "model", "qwen3"))
    (model / "generation_config.json").write_text("{not json")
    cmd = [sys.executable, "-m", "aurora_tools.cli", "trainer", "--store", f"file://{tmp_path}/run", "--redis", redis_url]
    cmd += ["--run", "abandon", "--model", str(model), "--nproc", "2", "--steps", "2", "--batch", "2", "--group", "2"]
    env = {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "trainer.log"
    with open(log, "wb") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=600)  # a hang fails here
        finally:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    text = log.read_text(errors="replace")
    assert rc == 1, text[-3000:]
    said = [ln for ln in text.splitlines() if "not a generation config" in ln]
    assert len(said) == 1 and said[0].startswith("aurora: error: trainer rank 0: "), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    wait_until(lambda: not _session(p.pid), "every process of the Trainer's session to end", timeout=60, interval=0.2)
