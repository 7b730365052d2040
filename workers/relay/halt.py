"""The Relay's own stop: set on a graceful stop, or by the first thread that meets an error that ends it.

A Relay works on several threads (the stream reader, the serial version
thread, a copy pool, the heartbeat). An error that must end the process (an
outage longer than the budget, a permanent failure of the first listing) can
surface on any of them; it is recorded here once, every wait of every thread
is cut short (they all wait on :attr:`Halt.event`), and the stream reader
raises it from :meth:`~workers.relay.relay.Relay.run`.
"""

from __future__ import annotations

import threading

__all__ = ["Halt"]


class Halt:
    """A stop event plus the error (if any) that set it. Thread-safe."""

    def __init__(self) -> None:
        self.event = threading.Event()
        """Set once the Relay is stopping, for whatever reason; every wait of its threads watches it."""
        self._lock = threading.Lock()
        self._error: BaseException | None = None

    def is_set(self) -> bool:
        return self.event.is_set()

    def stop(self) -> None:
        """A graceful stop."""
        self.event.set()

    def fail(self, e: BaseException) -> None:
        """End the Relay with ``e`` (the first error wins; later ones are consequences)."""
        with self._lock:
            if self._error is None:
                self._error = e
        self.event.set()

    @property
    def error(self) -> BaseException | None:
        with self._lock:
            return self._error

    def raise_if_failed(self) -> None:
        e = self.error
        if e is not None:
            raise e
