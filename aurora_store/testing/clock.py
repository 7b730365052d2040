"""A clock tests move by hand (see :mod:`aurora_store.clock`)."""

from __future__ import annotations

import threading

__all__ = ["ManualClock"]


class ManualClock:
    """Time stands still until :meth:`advance`; waits return when time passes their deadline.

    ``wait`` blocks the calling thread (on a condition, not on wall time)
    until the event is set or another thread advances the clock past the
    deadline, so a component running in a thread can be stepped through its
    back-off and timeouts deterministically.
    """

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._now = float(start)
        self._wall_offset = float(wall) - float(start)
        self._cond = threading.Condition()
        self.waits = 0
        """How many waits have begun: a test can wait for a component to block."""

    def monotonic(self) -> float:
        with self._cond:
            return self._now

    def time(self) -> float:
        with self._cond:
            return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        with self._cond:
            self._now += float(seconds)
            self._cond.notify_all()

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        with self._cond:
            deadline = self._now + max(0.0, timeout_s)
            self.waits += 1
            self._cond.notify_all()
            while not event.is_set() and self._now < deadline:
                # Real time bounds each sleep only so that an event set without
                # notifying the clock is still seen; progress comes from advance().
                self._cond.wait(0.01)
            return event.is_set()

    def wait_for_waiters(self, n: int, timeout_s: float = 10.0) -> bool:
        """Block until ``n`` waits have begun in total (or the real timeout passed)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.waits >= n, timeout_s)
