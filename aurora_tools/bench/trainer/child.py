"""``python -m aurora_tools.bench.trainer.child BASELINE_FILE -- TRAINER ARGS``: the real ``aurora trainer``, after a baseline.

Why a wrapper: ``peak_bytes_per_param`` subtracts the resident memory the
Trainer process has before it builds the model: Python, torch,
transformers, the project's modules, and the codec's compiled kernels,
which the Trainer loads at its start, before the model
(:class:`~workers.trainer.trainer.Trainer`). This process imports what the
Trainer imports, loads the same kernels the same way
(:func:`aurora_store.codec.kernels.warm_up`), writes two lines to
``BASELINE_FILE`` (its resident bytes then, and the bytes the kernels
added to them), then runs the ``aurora trainer`` command line itself,
unchanged, in the same process (its ranks, with ``--nproc``, are its
children; rank 0 loads the kernels as this process did).
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
    before = status_bytes(os.getpid(), "VmRSS") or 0
    from aurora_store.codec.kernels import warm_up

    warm_up()
    rss = status_bytes(os.getpid(), "VmRSS") or 0
    with open(argv[0], "w", encoding="ascii") as f:
        f.write(f"{rss}\n{max(0, rss - before)}\n")
    return aurora(["trainer", *argv[2:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
