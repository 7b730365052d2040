"""The clock that code which waits is given, so tests never sleep on wall time.

Components that poll, back off or time out take a ``clock`` argument (default
:data:`SYSTEM_CLOCK`). Tests pass a :class:`~aurora_store.testing.clock.ManualClock`
and advance it; a wait then returns as soon as the clock or the awaited event
says so.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "SystemClock", "SYSTEM_CLOCK"]


@runtime_checkable
class Clock(Protocol):
    """Monotonic time, wall time and waiting, in seconds.

    A Protocol rather than a base class: anything with these three methods
    will do, and the system clock costs nothing to pass around.
    """

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards."""
        ...

    def time(self) -> float:
        """Seconds since the epoch (for timestamps that leave the process)."""
        ...

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        """Wait until ``event`` is set or ``timeout_s`` passed; True if it was set."""
        ...


class SystemClock:
    """The real clock: :func:`time.monotonic`, :func:`time.time`, ``Event.wait``."""

    __slots__ = ()

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        return event.wait(max(0.0, timeout_s))


SYSTEM_CLOCK: Clock = SystemClock()
