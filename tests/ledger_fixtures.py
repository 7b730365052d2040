"""What the ledger tests share: prompt bodies, an Actor that joins on a version, a ledger on a manual clock.

Each test file keeps its own version and state constants (``V``, ``H``) and
wraps :func:`register_on` in a ``join`` that defaults to them.
"""

from __future__ import annotations

from typing import Any

import pytest

from aurora_store.coordination.ledger import Ledger
from aurora_store.testing.clock import ManualClock


def jobs(n: int, prefix: str = "p") -> list[tuple[str, bytes]]:
    """``n`` prompts ``p000``, ``p001``, ... with small bodies."""
    return [(f"{prefix}{i:03d}", f"prompt {i}".encode()) for i in range(n)]


def register_on(ledger: Ledger, actor: str, v: int | None, staged: int | None, state: str) -> None:
    """Register ``actor`` and heartbeat it as running ``v`` (with ``state``), having staged ``staged``."""
    ledger.register(actor)
    assert ledger.heartbeat(actor, active=v, staged=staged, active_state=state)


@pytest.fixture
def clock() -> ManualClock:
    """A manual clock; the ledger reads it in milliseconds (``clock()``, ``clock.advance_ms``)."""
    return ManualClock()


@pytest.fixture
def ledger(redis_client: Any, run_name: str, clock: ManualClock) -> Ledger:
    return Ledger(redis_client, run_name, clock=clock)
