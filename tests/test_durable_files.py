"""Durable local files (issue 12, point 8): a write that fails leaves nothing half-made behind.

The failures are real, not simulated: a child process runs with a file size
limit (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored so the kernel answers
``EFBIG``), so the write itself fails partway, as on a full disk.

- the local store's create-only put: no ``.tmp-*`` file is left, and the
  key does not exist;
- ``aurora delta apply --out FILE``: neither FILE nor any partial file is
  left, and an existing FILE is untouched; on success FILE is whole.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from aurora_store.codec.extract import extract, fuse_weights, plan_of
from aurora_store.lineage.materialize import materialize
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.storage import open_store
from aurora_store.storage.base import TEMP_PREFIX
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

REPO = Path(__file__).resolve().parents[1]
LIMIT = 64 * 1024
"""The child's file size limit: well below a version of the tiny model."""


def _limited() -> None:
    """In the child, before exec: files may not grow past LIMIT, and the kernel says EFBIG (not SIGXFSZ)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _run(args: list[str], limited: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AURORA_STORE_RETRIES": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limited if limited else None,
    )


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.startswith(TEMP_PREFIX) or p.name.endswith(".partial"))


def test_a_failed_local_write_leaves_no_temp_file(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""
        from aurora_store.errors import StoreError
        from aurora_store.storage import open_store
        store = open_store({f"file://{tmp_path}/run"!r})
        store.put("a/small", b"fits")
        try:
            store.put("a/big", bytes({2 * LIMIT}))
        except StoreError as e:
            print("refused:", e)
        else:
            print("written")
    """)
    proc = _run(["-c", code], limited=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused:") and "a/big" in proc.stdout
    folder = tmp_path / "run" / "a"
    assert sorted(os.listdir(folder)) == ["small"]  # no .tmp-*, no half object
    store = open_store(f"file://{tmp_path}/run")
    assert not store.exists("a/big") and store.get("a/small") == b"fits"


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A ``file://`` run root with snapshot 0 and delta 1 of the tiny model."""
    root = tmp_path_factory.mktemp("run")
    store = open_store(f"file://{root}")
    cfg = PublishConfig(streams=2, segment_bytes=4096)
    w = make_weights(QWEN3_TINY, seed=0)
    plan = plan_of(w, tied=False)
    m0 = publish_snapshot(store, "t", 0, fuse_weights(w, plan), None, cfg)
    publish_delta(store, "t", 1, extract(plan, w, MasterWeights(w, seed=0).step(lr=1e-6)), m0.state, cfg)
    return store.url


def _apply(store: str, out: Path, version: int = 1, limited: bool = False) -> subprocess.CompletedProcess[str]:
    return _run(["-m", "aurora_tools.cli", "delta", "apply", "--version", str(version), "--out", str(out), "--store", store], limited)


def test_delta_apply_writes_the_file_whole(stored: str, tmp_path: Path) -> None:
    out = tmp_path / "v1.safetensors"
    proc = _apply(stored, out)
    assert proc.returncode == 0, proc.stderr
    tensors, _ = materialize(open_store(stored), 1)
    got = load_file(str(out))
    assert set(got) == set(tensors) and all(got[n].equal(tensors[n]) for n in tensors)
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_delta_apply_that_fails_leaves_nothing_behind(stored: str, tmp_path: Path) -> None:
    out = tmp_path / "v1.safetensors"
    proc = _apply(stored, out, limited=True)  # the write itself fails partway (EFBIG)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("aurora: error:") and "Traceback" not in proc.stderr
    assert not out.exists() and _leftovers(tmp_path) == [] and os.listdir(tmp_path) == []

    out.write_bytes(b"an older file")  # a failure never touches what was there
    assert _apply(stored, out, limited=True).returncode == 1
    assert out.read_bytes() == b"an older file" and _leftovers(tmp_path) == []

    proc = _apply(stored, tmp_path / "v9.safetensors", version=9)  # not committed: fails before writing
    assert proc.returncode == 1 and not (tmp_path / "v9.safetensors").exists()
    assert _leftovers(tmp_path) == []
