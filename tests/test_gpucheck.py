"""``make gpu-check`` on a CPU: the same script CI can run, with small shapes.

The GPU machine runs ``python3 -m aurora_tools.gpucheck`` with Llama-3-8B
shapes on CUDA; here ``--device cpu --small`` runs every part of it (the
8B-shaped extraction/encode/apply with its exactness checks, two GRPO steps
through a ``file://`` store into a torch engine, the vLLM probe) as a
subprocess, and its one JSON object is checked. The wheel installer is run
on real wheel files built here.
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
    "extract_ms_8b",
    "extract_device_ms_8b",
    "device_gbps",
    "encode_ms_8b",
    "apply_ms_8b",
    "grpo_steps_ok",
    "vllm",
    "nnz_8b",
    "params_8b",
    "ok",
}


def _env() -> dict[str, str]:
    return {**os.environ, "AURORA_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_cpu_small_run_reports_every_figure_and_passes() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "aurora_tools.gpucheck", "--device", "cpu", "--small", "--reps", "1"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout  # the report alone on stdout
    rep = json.loads(lines[0])
    assert rep.keys() >= KEYS
    assert rep["grpo_steps_ok"] is True, rep.get("grpo_checks")
    assert rep["apply_exact_8b"] is True and rep["extract_exact_8b"] is True
    assert rep["shape_8b"] == "small" and rep["device"] == "cpu"
    # ~1% of the elements changed (drawn with repetition: a little under)
    assert 0.009 < rep["density_8b"] <= 0.01
    assert rep["nnz_8b"] > 0 and rep["delta_bytes_8b"] > 0
    assert all(rep[k] > 0 for k in ("device_gbps", "extract_ms_8b", "encode_ms_8b", "apply_ms_8b"))
    steps = rep["grpo_steps"]
    assert [s["version"] for s in steps] == [1, 2]
    assert all(s["nnz"] > 0 for s in steps) and steps[0]["digest"] != steps[1]["digest"]
    assert rep["vllm"].startswith("skipped")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_device_is_one_line_and_exit_2() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "aurora_tools.gpucheck", "--skip-8b", "--skip-grpo"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stdout == ""
    assert "sees no CUDA device" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


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
