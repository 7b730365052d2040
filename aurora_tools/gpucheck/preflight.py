"""Whether the GPU check can run on this machine at all: torch, a CUDA build of it, a visible device (stdlib and torch only).

``make gpu-check`` runs this file first, with the machine's own ``python3``
and nothing of the project importable::

    python3 aurora_tools/gpucheck/preflight.py [--device cuda]

Exit status 0, nothing printed: the check can run. Otherwise it prints
``{"gpu": false, "reason": "…"}`` on standard output and exits 3, within
seconds (an import of torch), so a machine without a GPU spends neither
network nor minutes on wheels it cannot use.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["device_reason", "main"]


def device_reason(device: str) -> str | None:
    """Why ``device`` cannot run the check here (None: it can). Never raises."""
    try:
        import torch
    except ImportError as e:
        return f"torch is not importable by {sys.executable} ({e})"
    if device.startswith("cuda"):
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU build (no CUDA)"
        if not torch.cuda.is_available():
            return f"no CUDA device is visible to torch {torch.__version__} (CUDA {torch.version.cuda})"
    elif device != "cpu":
        return f"--device must be cpu, cuda or cuda:N, got {device!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--device", default="cuda")
    args, _ = p.parse_known_args(argv)  # the check's other arguments are not this file's
    reason = device_reason(args.device)
    if reason is None:
        return 0
    print(json.dumps({"gpu": False, "reason": reason}), flush=True)
    return 3


if __name__ == "__main__":
    sys.exit(main())
