"""``python -m aurora_tools.bench.trainer.child BASELINE_FILE -- TRAINER ARGS``: the real ``aurora trainer``, after a baseline.

Why a wrapper: ``peak_bytes_per_param`` subtracts the resident memory the
Trainer process has before it builds the model (Python, torch,
transformers, the project's modules). This process imports what the
Trainer imports, writes its resident bytes to ``BASELINE_FILE``, then
runs the ``aurora trainer`` command line itself, unchanged, in the same
process (its ranks, with ``--nproc``, are its children).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print("usage: python -m aurora_tools.bench.trainer.child BASELINE_FILE -- TRAINER ARGS", file=sys.stderr)
        return 2
    import importlib
    import os

    import torch  # noqa: F401 - imported for the baseline
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    import workers.trainer.policy  # noqa: F401
    import workers.trainer.trainer  # noqa: F401
    from aurora_tools.bench.trainer.memory import status_bytes

    # By name: the command line imports the benchmarks (the import graph stays one way).
    aurora = importlib.import_module("aurora_tools.cli.main").main
    rss = status_bytes(os.getpid(), "VmRSS") or 0
    with open(argv[0], "w", encoding="ascii") as f:
        f.write(str(rss))
    return aurora(["trainer", *argv[2:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
