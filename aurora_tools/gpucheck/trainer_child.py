"""``python -m aurora_tools.gpucheck.trainer_child PEAK_FILE -- TRAINER ARGS``: the real ``aurora trainer``, then its device peak.

Why a wrapper: the peak device memory of a process is known only inside
it (``torch.cuda.max_memory_allocated``). This runs the ``aurora trainer``
command line unchanged, in this process, and when it ends writes
``{"rc": …, "peak_device_bytes": …, "device": …}`` to ``PEAK_FILE``
(``peak_device_bytes`` None where CUDA was never used).
"""

from __future__ import annotations

import json
import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: python -m aurora_tools.gpucheck.trainer_child PEAK_FILE -- TRAINER ARGS", file=sys.stderr)
        return 2
    import importlib

    import torch

    rc = 1
    try:
        # By name: the command line is a layer above the GPU check's parts.
        rc = int(importlib.import_module("aurora_tools.cli.main").main(["trainer", *argv[2:]]))
    finally:
        used = torch.cuda.is_available() and torch.cuda.is_initialized()
        body = {
            "rc": rc,
            # the device the Trainer was given (cuda:N), whichever is current
            "peak_device_bytes": max(int(torch.cuda.max_memory_allocated(i)) for i in range(torch.cuda.device_count())) if used else None,
            "device": torch.cuda.get_device_name() if used else None,
        }
        with open(argv[0], "w", encoding="utf-8") as f:
            json.dump(body, f)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
