"""Snapshots written off the publishing step: one upload at a time, on a thread of its own.

A snapshot at version V is a second copy of weights the chain already
reaches: the delta at V is committed first (it carries the digest that binds
the snapshot, FORMAT.md §4.1), so nothing waits for the snapshot but late
joiners. :class:`SnapshotWriter` runs each one on a thread, shards first and
manifest last (a crash mid-upload leaves only orphans under the attempt id,
never a visible snapshot); a failure is logged, reported, and the next
snapshot is written as usual. Only one is in flight: the next waits for the
one before (each holds its version's weights, and a shard file per upload
stream, built from them as a stream frees: :mod:`aurora_store.lineage.shards`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from aurora_store.format.manifest import version_dir

__all__ = ["SnapshotResult", "SnapshotWriter"]

log = logging.getLogger("aurora.publisher")


@dataclass(frozen=True, slots=True)
class SnapshotResult:
    """How one snapshot written in the background ended (told to ``on_snapshot``)."""

    version: int
    bytes: int
    """Bytes written (0 when it failed)."""
    seconds: float
    error: BaseException | None = None
    """None: committed; else why it was not (nothing is visible at that version)."""

    @property
    def ok(self) -> bool:
        return self.error is None


class SnapshotWriter:
    """Runs snapshot uploads one at a time on a background thread; see the module's docstring.

    ``on_done`` is called on the writer's thread once a snapshot is committed
    or has failed (an error it raises is logged).
    """

    def __init__(self, on_done: Callable[[SnapshotResult], None] | None = None) -> None:
        self.on_done = on_done
        self._thread: threading.Thread | None = None
        self._version: int | None = None
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int | None:
        """The version being uploaded (None: none)."""
        with self._lock:
            return self._version

    def spares(self, key: str) -> bool:
        """Whether ``key`` (relative to the run root) may belong to the snapshot in flight: retention
        must not take it for an orphan (its manifest is written last)."""
        v = self.in_flight
        return v is not None and key.startswith(version_dir("snapshot", v) + "/")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the snapshot in flight; False when it is still running after ``timeout`` seconds."""
        t = self._thread
        if t is None:
            return True
        t.join(timeout)
        return not t.is_alive()

    def submit(self, version: int, write: Callable[[], int]) -> float:
        """Start ``write`` (returns the bytes it wrote) for snapshot ``version`` once the one before has
        ended; returns the seconds spent waiting for that one."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        with self._lock:
            self._version = version
        self._thread = threading.Thread(target=self._run, args=(version, write), name=f"aurora-snapshot-v{version}", daemon=True)
        self._thread.start()
        return waited

    def _run(self, version: int, write: Callable[[], int]) -> None:
        t0 = time.perf_counter()
        try:
            res = SnapshotResult(version, write(), time.perf_counter() - t0)
            log.info("snapshot %d: %d bytes committed in the background in %.2fs", version, res.bytes, res.seconds)
        except Exception as e:  # noqa: BLE001 - reported below; the step that asked for it has moved on
            res = SnapshotResult(version, 0, time.perf_counter() - t0, e)
            log.error(
                "snapshot %d was not written (%s: %s); nothing is visible at that version, readers use the chain, "
                "and the next snapshot is written as usual",
                version,
                type(e).__name__,
                str(e).splitlines()[0][:300] if str(e) else "",
            )
        finally:
            with self._lock:
                self._version = None
        if self.on_done is not None:
            try:
                self.on_done(res)
            except Exception as e:  # noqa: BLE001 - a report of a snapshot must not take the writer down
                log.warning("snapshot %d: its report failed (%s: %s)", version, type(e).__name__, e)
