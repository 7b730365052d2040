"""``aurora status``, ``lineage``, ``verify`` and ``gc`` never import torch, vLLM or the workers;
``aurora relay`` never imports torch or vLLM, even while it waits for Redis.

Each command runs in a fresh interpreter against a real run (a snapshot and
deltas in a ``file://`` store, a ledger and a Trainer head in a real
``redis-server``); the interpreter writes the names of every module it
imported when the command is done, and the test reads them. The Relay runs
under ``python -X importtime``, whose report of each import as it happens
covers the whole run, the wait for an unreachable Redis included.
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
from safetensors.torch import save_file

from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import Ledger
from aurora_store.testing.wait import wait_until
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
    return [m for m in modules if m.split(".")[0] in ("torch", "vllm") or m.split(".")[0] == "workers"]


def _torch_or_vllm(modules: list[str]) -> list[str]:
    """The imported modules no process without weights may load."""
    return [m for m in modules if m.split(".")[0] in ("torch", "vllm")]


def _importtime_modules(stderr: str) -> list[str]:
    """Every module ``python -X importtime`` reported importing, in order (one ``import time:`` line each)."""
    names = [line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")]
    return [n for n in names if n != "imported package"]  # its header line


def _driver(out: Path, *argv: str) -> list[str]:
    """The command line running ``aurora ARGV...`` under ``-X importtime`` with the project importable."""
    return [sys.executable, "-X", "importtime", "-c", DRIVER, str(out), *argv]


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[1]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))


def _run(tmp_path: Path, *argv: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    out = tmp_path / f"modules-{argv[0]}.json"
    proc = subprocess.run(_driver(out, *argv), capture_output=True, text=True, env=_env(), timeout=120)
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
    tmp_path: Path, stored_run: str, redis_server: Any, redis_client: Any, run_name: str
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
    assert "torch" in _torch_or_vllm(_importtime_modules(proc.stderr))  # and the Relay's check can fail too


def test_a_relay_waiting_for_redis_imports_no_torch_or_vllm(tmp_path: Path, dead_redis_url: str) -> None:
    """``aurora relay`` against a Redis that is down rides the outage (it logs that it waits), leaves
    on SIGTERM, and imported neither torch nor vLLM at any point of its life."""
    out, err = tmp_path / "modules-relay.json", tmp_path / "relay.err"
    argv = (
        "relay",
        "--store",
        f"file://{tmp_path / 'origin'}",
        "--mirror",
        f"file://{tmp_path / 'mirror'}",
        "--redis",
        dead_redis_url,
        "--run",
        "imports",
        "--region",
        "eu",
    )
    with err.open("w") as stderr:
        proc = subprocess.Popen(_driver(out, *argv), stdout=subprocess.DEVNULL, stderr=stderr, env=_env())
    try:
        wait_until(
            lambda: "Redis unreachable" in err.read_text(),
            "the Relay waiting for Redis",
            timeout=120,
            processes={"aurora relay": proc},
            logs=[err],
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    imported = _importtime_modules(err.read_text())
    assert "workers.relay.relay" in imported and "redis" in imported  # the report is complete
    assert _torch_or_vllm(imported) == []
    assert _torch_or_vllm(json.loads(out.read_text())) == []
