"""What every worker process sets up at start: logging, stop signals, torch threads.

Torch-free at import, so a process that never touches weights (``aurora
relay``) can use it without loading torch; :func:`limit_torch_threads`
imports torch when called, from processes that hold weights anyway.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from typing import Any

from aurora_store.config import Switch

__all__ = ["install_stop_handlers", "limit_torch_threads", "setup_logging"]

log = logging.getLogger("aurora.workers")


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM (a spot preemption notice) and SIGINT set ``stop``: leave gracefully."""

    def handler(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping gracefully", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


TORCH_THREADS = Switch("AURORA_TORCH_THREADS", int | None, None, "torch threads per worker process (default 1; 0: torch's own choice)")


def limit_torch_threads(default: int = 1) -> None:
    """Small CPU machines run several workers: one torch thread each unless told otherwise.

    Measured here: two torch threads per process on a busy 2-core machine ran a
    warm start 6x slower than one. ``AURORA_TORCH_THREADS`` overrides.
    """
    given = TORCH_THREADS.get()
    n = default if given is None else given
    if n > 0:
        import torch

        torch.set_num_threads(n)


def setup_logging(name: str, verbose: bool = False, debug_loggers: Iterable[str] | None = None) -> logging.Logger:
    """Configure the root logger for a worker process (never at import time).

    The root stays at INFO; ``verbose`` turns Aurora's own loggers (``aurora.*``,
    ``aurora_store``, ``workers``) to DEBUG, never a vendor's: botocore's debug
    lines carry request headers, session tokens among them. A vendor logger
    goes to DEBUG only when named in ``debug_loggers`` (``--debug-logger``) or
    ``$AURORA_DEBUG_LOGGERS`` (comma-separated). Every record passes a
    :class:`~aurora_store.redact.RedactingFilter`: URL passwords and the values
    of known secrets (AWS secret key and session token, Redis passwords) are
    masked whatever logger wrote them.
    """
    from aurora_store.options import debug_logger_names
    from aurora_store.redact import VENDOR_LOGGERS, install_redaction

    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    install_redaction()
    asked = debug_logger_names(list(debug_loggers or ()))
    for vendor in VENDOR_LOGGERS:
        if vendor not in asked:
            logging.getLogger(vendor).setLevel(logging.INFO)
    for own in ("aurora", "aurora_store", "workers", "aurora_tools"):
        logging.getLogger(own).setLevel(logging.DEBUG if verbose else logging.NOTSET)
    for n in asked:
        logging.getLogger(n).setLevel(logging.DEBUG)
    return logging.getLogger(f"aurora.{name}")
