"""``make gpu-check`` here: ``{"gpu": false, …}`` and exit 0; the GPU path's code on the CPU; its pieces.

The GPU machine runs ``python3 -m aurora_tools.gpucheck`` with Llama-3-8B
shapes on CUDA, the real ``aurora trainer --device cuda`` and a vLLM Actor;
here ``--device cpu --small`` runs the same code (the 8B-shaped
extraction/encode/apply/digest with its exactness checks, the real Trainer
and a torch-engine Actor through Redis and an S3 server) as a subprocess,
and its one JSON object is checked. The wheel installer is run on real
wheel files built here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ROOT / "aurora_tools" / "gpucheck" / "install.py"
KEYS = {
    # the keys (a contract), then what explains them
    "gpu",
    "trainer_steps_ok",
    "bit_identical",
    "extract_ms_8b",
    "encode_ms_8b",
    "apply_ms_8b",
    "digest_ms_8b",
    "peak_device_bytes_per_param",
    "vllm",
    "extract_device_ms_8b",
    "device_gbps",
    "nnz_8b",
    "params_8b",
    "digests_compared",
    "ok",
}


def _env() -> dict[str, str]:
    return {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.server
def test_cpu_small_run_is_the_real_trainer_and_actor_and_passes(tmp_path: Path) -> None:
    """The GPU path's code on the CPU: the real aurora trainer and aurora actor (torch engine) through Redis and S3."""
    r = subprocess.run(
        [sys.executable, "-m", "aurora_tools.gpucheck", "--device", "cpu", "--small", "--reps", "1", "--workdir", str(tmp_path)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout  # the report alone on stdout
    rep = json.loads(lines[0])
    assert rep.keys() >= KEYS
    assert rep["gpu"] is False and rep["device"] == "cpu" and rep["shape_8b"] == "small"
    assert rep["trainer_steps_ok"] is True and rep["bit_identical"] is True and rep["digests_compared"] > 0
    assert rep["apply_exact_8b"] is True and rep["extract_exact_8b"] is True
    # ~1% of the elements changed (drawn with repetition: a little under)
    assert 0.009 < rep["density_8b"] <= 0.01
    assert all(rep[k] > 0 for k in ("device_gbps", "extract_ms_8b", "encode_ms_8b", "apply_ms_8b", "digest_ms_8b"))
    assert rep["actor_engine"] == "torch" and rep["vllm"].startswith("not asked")
    # what ran: the real command lines, their logs kept in --workdir
    assert "step 3 -> v4" in (tmp_path / "trainer.log").read_text()
    assert "verified v4 by digest" in (tmp_path / "actor-torch.log").read_text() or rep["digests_compared"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_the_last_line_is_gpu_false_and_the_exit_status_0() -> None:
    r = subprocess.run([sys.executable, "-m", "aurora_tools.gpucheck"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["gpu"] is False and ("CPU build" in last["reason"] or "no CUDA device" in last["reason"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_make_gpu_check_here_prints_gpu_false_and_exits_0(tmp_path: Path) -> None:
    for python in (sys.executable, _bare_python(tmp_path)):
        r = subprocess.run(
            ["make", "--no-print-directory", "gpu-check", f"GPU_PYTHON={python}", f"GPU_WHEELS={tmp_path / 'no-wheels'}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        last = json.loads(r.stdout.strip().splitlines()[-1])
        assert last == {"gpu": False, "reason": last["reason"]} and last["reason"]
    assert "torch is not importable" in last["reason"]  # the bare Python's


def _bare_python(tmp_path: Path) -> str:
    """A Python that cannot import torch: this one, isolated (-I) from the environment and its site-packages."""
    script = tmp_path / "bare-python"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    script.chmod(0o755)
    return str(script)


def test_preflight_names_what_is_missing() -> None:
    from aurora_tools.gpucheck import preflight

    assert preflight.device_reason("cpu") is None
    assert "must be cpu, cuda" in str(preflight.device_reason("tpu"))
    if not torch.cuda.is_available():
        assert preflight.device_reason("cuda") is not None


def test_missing_modules_and_the_reason_that_names_them() -> None:
    from aurora_tools.gpucheck.main import missing_modules

    assert missing_modules(("aurora_no_such_module_xyz", "json")) == ["aurora_no_such_module_xyz"]


def test_the_commands_are_the_real_cli_with_the_device_and_engine() -> None:
    from aurora_tools.gpucheck.e2e import Plan, actor_argv, trainer_argv

    p = Plan(device="cuda", engine="vllm")
    t = trainer_argv(p, "s3://b/run", "redis://h:1", "/m", "store")
    assert t[t.index("--device") + 1] == "cuda" and t[t.index("--model") + 1] == "/m"
    assert t[t.index("--checkpoint-every") + 1] == t[t.index("--snapshot-every") + 1] == str(p.every)
    assert int(t[t.index("--steps") + 1]) % p.every == 0  # the last version carries a digest
    a = actor_argv(p, "s3://b/run", "redis://h:1", "vllm")
    assert a[0] == "actor" and a[a.index("--engine") + 1] == "vllm" and "--device" not in a
    a = actor_argv(p, "s3://b/run", "redis://h:1", "torch")
    assert a[a.index("--device") + 1] == "cuda"


def test_bit_identical_needs_one_comparison_and_no_difference() -> None:
    from aurora_tools.gpucheck.e2e import compare_digests

    t = {0: "tree-sha256:a", 2: "tree-sha256:b"}
    assert compare_digests(t, {("x", 0): "tree-sha256:a", ("x", 2): "tree-sha256:b"}) == (True, 2, [])
    assert compare_digests(t, {("x", 2): "tree-sha256:c", ("y", 4): "tree-sha256:d"}) == (False, 2, [2, 4])
    assert compare_digests(t, {}) == (False, 0, [])


def _wheel(folder: Path, dist: str, version: str, module: str, body: str) -> Path:
    """A minimal valid pure-Python wheel (METADATA, WHEEL, RECORD)."""
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{module}.py": body.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return path


def test_install_skips_present_distributions_and_installs_the_rest(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "aurora_gpucheck_probe", "1.0", "aurora_gpucheck_probe", "VALUE = 42\n")
    # numpy is installed here at a newer version than 0.1: left alone, not shadowed
    _wheel(wheels, "numpy", "0.1", "numpy_shadow_probe", "")
    target = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, str(INSTALL), "--wheels", str(wheels), "--target", str(target)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "installed aurora_gpucheck_probe-1.0-py3-none-any.whl" in r.stdout
    assert "present numpy" in r.stdout
    assert (target / "aurora_gpucheck_probe.py").read_text() == "VALUE = 42\n"
    assert not (target / "numpy_shadow_probe.py").exists()


def test_install_without_wheels_says_what_to_run(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(INSTALL), "--wheels", str(tmp_path / "none"), "--target", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "make gpu-wheels" in r.stderr and "Traceback" not in r.stderr


def test_the_trainer_wrapper_runs_the_real_cli_and_always_writes_its_peak(tmp_path: Path) -> None:
    peak = tmp_path / "peak.json"
    argv = ["--store", f"file://{tmp_path / 'run'}", "--redis", "redis://127.0.0.1:1", "--run", "r", "--steps", "0"]
    r = subprocess.run(
        [sys.executable, "-m", "aurora_tools.gpucheck.trainer_child", str(peak), "--", *argv],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    # the command line's own one-line refusal (steps >= 1), exit 1, and the peak file all the same
    assert r.returncode == 1 and "aurora: error:" in r.stderr and "steps >= 1" in r.stderr and "Traceback" not in r.stderr
    body = json.loads(peak.read_text())
    assert body["rc"] == 1 and (body["peak_device_bytes"] is None) == (not torch.cuda.is_available())
