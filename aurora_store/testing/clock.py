"""The one clock tests move by hand (see :mod:`aurora_store.clock`).

It serves both kinds of code that take a clock: components that wait (the
:class:`~aurora_store.clock.Clock` Protocol, seconds) and the ledger, whose
``clock`` is a callable returning wall milliseconds (call the clock itself).
"""

from __future__ import annotations

import threading

__all__ = ["ManualClock"]


class ManualClock:
    """Time stands still until :meth:`advance`; waits return when time passes their deadline.

    ``wait`` blocks the calling thread (on a condition, not on wall time)
    until the event is set or another thread advances the clock past the
    deadline, so a component running in a thread can be stepped through its
    back-off and timeouts deterministically.

    Called, it returns wall time in whole milliseconds (the ledger's clock);
    :attr:`now_ms` reads or sets it and :meth:`advance_ms` moves it.
    """

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0, *, instant: bool = False) -> None:
        self._now = float(start)
        self._wall_offset = float(wall) - float(start)
        self._cond = threading.Condition()
        self.instant = instant
        """Waits return at once, time moved on by the whole wait: back-off and retries run
        through in the calling thread, nobody advancing the clock."""
        self.waits = 0
        """How many waits have begun: a test can wait for a component to block."""
        self.waited: list[float] = []
        """Every wait's ``timeout_s``, in order."""

    def monotonic(self) -> float:
        with self._cond:
            return self._now

    def time(self) -> float:
        with self._cond:
            return self._now + self._wall_offset

    def __call__(self) -> int:
        return self.now_ms

    @property
    def now_ms(self) -> int:
        """Wall time in whole milliseconds."""
        return round(self.time() * 1000)

    @now_ms.setter
    def now_ms(self, ms: int) -> None:
        self.advance((ms - self.now_ms) / 1000)

    def advance_ms(self, ms: int) -> int:
        """Move time on by ``ms`` milliseconds (back, if negative); the new :attr:`now_ms`."""
        self.advance(ms / 1000)
        return self.now_ms

    def advance(self, seconds: float) -> None:
        with self._cond:
            self._now += float(seconds)
            self._cond.notify_all()

    def wait(self, event: threading.Event, timeout_s: float) -> bool:
        with self._cond:
            deadline = self._now + max(0.0, timeout_s)
            self.waits += 1
            self.waited.append(timeout_s)
            if self.instant:
                self._now = deadline
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
