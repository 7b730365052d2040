"""``aurora status``, ``lineage``, ``verify`` and ``gc`` never import torch, vLLM or the workers.

Each command runs in a fresh interpreter against a real run (a snapshot and
deltas in a ``file://`` store, a ledger and a Trainer head in a real
``redis-server``); the interpreter writes the names of every module it
imported when the command is done, and the test reads them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from redis_fixtures import redis_client, redis_server, run_name  # noqa: F401
from safetensors.torch import save_file

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger
from aurora_tools.cli import main
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights

pytestmark = pytest.mark.server

#: Runs ``aurora ARGV...`` through the console script's function, then writes sorted(sys.modules) to OUT.
DRIVER = """
import json, sys
out, argv = sys.argv[1], sys.argv[2:]
from aurora_tools.cli import main
try:
    rc = main(argv)
finally:
    with open(out, "w") as f:
        json.dump(sorted(sys.modules), f)
sys.exit(rc)
"""

def _heavy(modules: list[str]) -> list[str]:
    """The imported modules a light command must not load."""
    return [
        m
        for m in modules
        if m.split(".")[0] in ("torch", "vllm") or m.split(".")[0] == "workers"
    ]


def _run(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    out = tmp_path / f"modules-{argv[0]}.json"
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(out), *argv],
        capture_output=True, text=True, env=env, timeout=120,
    )
    return proc, json.loads(out.read_text())


@pytest.fixture
def stored_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """A ``file://`` run root holding snapshot 0 and deltas 1 and 2, published with the CLI."""
    w = make_weights(QWEN3_TINY, seed=0)
    master = MasterWeights(w, seed=0)
    files = []
    for i, t in enumerate([w, master.step(lr=1e-6), master.step(lr=1e-6)]):
        path = tmp_path / f"w{i}.safetensors"
        save_file(t, str(path))
        files.append(str(path))
    url = f"file://{tmp_path / 'store'}"
    assert main(["snapshot", "create", files[0], "--version", "0", "--store", url]) == 0
    for v in (1, 2):
        assert main(["delta", "create", files[v - 1], files[v], "--version", str(v), "--store", url]) == 0
    capsys.readouterr()
    return url


def test_light_commands_import_no_torch_vllm_or_workers(
    tmp_path: Path, stored_run: str, redis_server: Any, redis_client: Any, run_name: str  # noqa: F811
) -> None:
    ledger = Ledger(redis_client, run_name)
    ledger.register("a1", region="eu", engine="torch")
    redis_client.hset(RunKeys(run_name).trainer, mapping={"head": 2, "step": 2, "status": "running"})

    commands: list[tuple[str, ...]] = [
        ("status", "--redis", redis_server.url, "--run", run_name, "--json"),
        ("lineage", stored_run),
        ("verify", stored_run),
        ("gc", stored_run, "--keep-snapshots", "1"),
    ]
    for argv in commands:
        proc, modules = _run(tmp_path, *argv)
        assert proc.returncode == 0, (argv, proc.stdout, proc.stderr)
        assert "aurora_tools.cli" in modules  # the driver really ran the command line
        assert _heavy(modules) == [], (argv[0], _heavy(modules)[:10])
        if argv[0] == "status":
            st = json.loads(proc.stdout)
            assert st["run"] == run_name and st["trainer"]["head"] == 2
            assert [a["id"] for a in st["actors"]] == ["a1"]
        elif argv[0] == "lineage":
            assert "3 version(s)" in proc.stdout
        elif argv[0] == "verify":
            assert proc.stdout.startswith("OK: 3 version(s)")


def test_a_heavy_command_does_load_the_workers(tmp_path: Path) -> None:
    """The check above can fail: parsing ``aurora actor`` declares the Actor's options, which imports it."""
    proc, modules = _run(tmp_path, "actor", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "workers.actor" in modules and "torch" in modules
