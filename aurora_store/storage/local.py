"""Local files (``file://…`` or a plain path): create by temporary file + hard link, overwrite by rename.

The bytes go to a temporary file in the key's folder, flushed to disk, which
is then hard-linked to its name. ``link`` fails if the name exists, so a
reader never sees a partial object and two writers cannot both win; the
folder is fsynced after the link (and each folder this write created, in its
parent) so that a committed object survives a crash of the machine, not only
of the process: a manifest can never outlive the links of its segments. The
temporary file is created inside the cleanup scope and removed whatever
happens (a failed write included); one left by a killed writer is hidden
from listings by its name (:data:`~aurora_store.storage.base.TEMP_PREFIX`)
and removed by retention once older than its grace
(:func:`aurora_store.lineage.gc.retain`).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable

from aurora_store.storage.base import TEMP_PREFIX, Store

__all__ = ["LocalStore"]


def _fsync_dir(folder: str) -> None:
    """Make the entries of ``folder`` (a new link, a removed name) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(folder: str, attempts: int = 3) -> None:
    """``os.makedirs(folder, exist_ok=True)``, with each new folder's entry fsynced in its parent.

    Retention removes folders it emptied; one removed between our check and
    our ``mkdir`` (a parent vanishing under us) is simply made again.
    """
    for attempt in range(attempts):
        missing: list[str] = []
        f = os.path.abspath(folder)
        while not os.path.isdir(f):
            missing.append(f)
            parent = os.path.dirname(f)
            if parent == f:
                break
            f = parent
        try:
            for d in reversed(missing):
                with contextlib.suppress(FileExistsError):  # another writer made it first: fsync its entry all the same
                    os.mkdir(d)
                _fsync_dir(os.path.dirname(d))
            return
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise


class LocalStore(Store):
    """A run root on the local filesystem."""

    def put(self, key: str, data: bytes, mode: str = "create") -> None:
        if mode not in ("create", "overwrite"):
            raise ValueError(f"mode must be 'create' or 'overwrite', got {mode!r}")
        path = self._path(key)
        if mode == "overwrite":
            # Through a temporary file and a rename, as a create goes through a link: a reader
            # (or a crash) never meets a torn object, only the old bytes or the new.
            self._retry(f"put {self.where(key)}", lambda: self._write_then(path, data, os.replace))
            return
        self._create(key, path, data)

    def _create(self, key: str, path: str, data: bytes) -> None:
        if not self._retry(f"put {self.where(key)}", lambda: self._write_then(path, data, os.link)):
            self._same_or_conflict(key, data)

    @staticmethod
    def _write_then(path: str, data: bytes, place: Callable[[str, str], None]) -> bool:
        """Write ``data`` to a temporary file beside ``path``, flushed to disk, then ``place(tmp, path)``
        (``os.link``: only if nothing is there; ``os.replace``: whatever is). False: the name was taken."""
        folder = os.path.dirname(path)
        _makedirs_durable(folder)
        tmp = os.path.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                place(tmp, path)
            except FileExistsError:
                return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # after a link; a replace already moved it
        _fsync_dir(folder)
        return True
