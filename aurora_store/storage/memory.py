"""``memory://`` (unit tests and demos only): fsspec's in-process filesystem.

The memory filesystem is one dictionary for the whole process, shared by
every store on it, so the create-only write holds a process-wide lock
around "exists, then write": two stores on the same root (two Actors in one
test) still see at most one winner.
"""

from __future__ import annotations

import threading

from aurora_store.storage.base import Store

__all__ = ["MemoryStore"]

# Process-wide because the filesystem it guards is (see the module docstring).
_MEMORY_LOCK = threading.Lock()


class MemoryStore(Store):
    """A run root in fsspec's process-wide memory filesystem."""

    def _create(self, key: str, path: str, data: bytes) -> None:
        with _MEMORY_LOCK:
            if self.fs.exists(path):
                self._same_or_conflict(key, data)
                return
            self.fs.pipe_file(path, data)
