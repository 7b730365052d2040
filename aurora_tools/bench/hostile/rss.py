"""Memory of the bench's processes: each child's peak resident size, under an address-space limit.

``peak_rss_mb`` in the summary is the largest resident size of any process
the bench ran: the bench itself (``RUSAGE_SELF``) and every child it waited
for (``RUSAGE_CHILDREN``: the kernel keeps the largest). A reader of an
oversized object runs under :data:`AS_LIMIT` of address space, so a reader
that loads a planted object whole fails its case instead of the machine.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aurora_tools.bench.hostile.cases import CliRun

__all__ = ["AS_LIMIT", "Measured", "run_measured", "peak_rss_mb", "limit_address_space"]

AS_LIMIT = 8 << 30
"""Address space a reader of planted objects may map (8 GiB)."""


def peak_rss_mb() -> float:
    """The largest resident size of this process or any child it has waited for, in MiB (ru_maxrss is KiB on Linux)."""
    kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return round(kib / 1024, 1)


def limit_address_space(limit: int = AS_LIMIT) -> Callable[[], None]:
    """A ``preexec_fn`` capping the child's address space at ``limit`` bytes."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


@dataclass(frozen=True)
class Measured(CliRun):
    """A finished child: exit status, its output (:class:`CliRun`), and its own peak resident size."""

    peak_mb: float


def run_measured(argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 300.0, limit: int | None = AS_LIMIT) -> Measured:
    """Run ``argv`` to its end (killed past ``timeout``: rc 124) and read its own peak RSS from ``wait4``.

    Output goes through temporary files, so a chatty child never blocks on a pipe.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=err,
            env=env,
            preexec_fn=limit_address_space(limit) if limit is not None else None,  # noqa: PLW1509 - no threads of ours touch it
        )
        deadline = time.monotonic() + timeout
        killed = False
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                break
            if time.monotonic() > deadline and not killed:
                p.kill()
                killed = True
            time.sleep(0.05)
        p.returncode = 124 if killed else os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Measured(
            p.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"), round(usage.ru_maxrss / 1024, 1)
        )


def cli_measured(argv: Sequence[str], timeout: float = 300.0, limit: int | None = AS_LIMIT) -> Measured:
    """``python -m aurora_tools.cli ARGV`` through :func:`run_measured`, with no AURORA_* settings inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AURORA_")}
    return run_measured([sys.executable, "-m", "aurora_tools.cli", *argv], env=env, timeout=timeout, limit=limit)
