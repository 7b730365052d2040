"""A local file the Trainer copies bytes into so that it can let go of them for a while.

Two users: a checkpoint's tensors are copied into one while the next step
runs, then uploaded from it (:mod:`~workers.trainer.ckpt_async`), and the
newest bf16 version is parked in one while the update runs, then read back
(:mod:`~workers.trainer.held`). Either way a copy at memory speed stands for
a wait (an upload) or for resident memory (the version), and the disk is what
it costs.

A :class:`Spool` is one file in the temporary folder (``TMPDIR``), unlinked as
soon as it is made (it goes with the process, killed or not), and written over
in place every time, never truncated: its pages stay in the page cache (the
kernel's memory, which it can write back and drop; not the process's), so a
copy after the first does not fault in new pages. It grows to the largest
thing copied into it only while the folder keeps :data:`RESERVE_BYTES` free;
when it cannot, :meth:`Spool.fd` says so once in the log and answers None,
and the caller does without (uploads from the live tensors, keeps the version).
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import IO

__all__ = ["RESERVE_BYTES", "Spool", "read_into", "write_at"]

log = logging.getLogger("aurora.trainer")

RESERVE_BYTES = 1 << 30
"""Free space a spool leaves in its folder."""


class Spool:
    """One spool file (see the module's docstring); ``folder``: where (``""``: the temporary folder;
    None: no spool at all); ``what``: what it holds, for the log."""

    def __init__(self, folder: str | None, what: str) -> None:
        self.folder = folder
        self.what = what
        self._file: IO[bytes] | None = None
        self._said = False

    def fd(self, nbytes: int) -> int | None:
        """The file's descriptor, once the folder has room for ``nbytes`` in it; None: no spool."""
        if self.folder is None or nbytes <= 0:
            return None
        try:
            if self._file is None:
                # Kept open: the next copy writes into the pages this one leaves cached.
                self._file = tempfile.TemporaryFile(prefix=f"aurora-{self.what}-spool-", dir=self.folder or None)  # noqa: SIM115
            fd = self._file.fileno()
            grow = nbytes - os.fstat(fd).st_size
            fs = os.fstatvfs(fd)
            if grow > 0 and fs.f_bavail * fs.f_frsize - grow < RESERVE_BYTES:
                raise OSError(f"{grow} more bytes would leave less than {RESERVE_BYTES >> 20} MiB free")
        except OSError as e:
            if not self._said:
                self._said = True
                log.warning("%s spool in %s: %s; going without it", self.what, self.folder or tempfile.gettempdir(), e)
            return None
        return fd

    @property
    def nbytes(self) -> int:
        """Disk the spool takes (0: none yet)."""
        if self._file is None:
            return 0
        try:
            return os.fstat(self._file.fileno()).st_size
        except OSError:
            return 0

    def close(self) -> None:
        """Drop the file (its disk and pages are freed)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def write_at(fd: int, data: memoryview | bytes, at: int) -> None:
    """All of ``data`` into ``fd`` at offset ``at``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def read_into(fd: int, out: memoryview, at: int) -> None:
    """Fill ``out`` from ``fd`` at offset ``at``; OSError if the file ends first (it was cut short under us)."""
    view = out.cast("B")
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], at + got)
        if n <= 0:
            raise OSError(f"spool: {got} of {len(view)} bytes at offset {at}")
        got += n
