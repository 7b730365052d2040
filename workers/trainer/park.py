"""The Trainer parks the newest bf16 version in a spool file while the update runs.

Why: the update (forward, backward, ``optimizer.step()``) is the step's peak, and
nothing in it reads the published version, 2 bytes per parameter of the *whole*
model (in a sharded run rank 0 alone holds it, next to its shard). This is the
host-memory analogue of moving the version off a GPU that is short of memory:
the bytes go to the page cache of a local file, which the kernel may write back
to disk and drop. Measured with ``aurora bench trainer --params 2e8``: one
process peaked at 22.3 bytes per parameter without parking and 20.8 with it;
with ``--nproc 2`` (two gloo ranks) rank 0's peak was rank 1's plus about the
version without parking.

How, without the many holders of the version noticing (the held versions, the
Publisher's base, the behaviour module): the tensors stay where they are. Their
memory's whole pages are copied into a :class:`~workers.trainer.spool.Spool`
(the page cache: the kernel's memory, which it may write back and drop, not the
process's), then handed back to the system (``madvise(MADV_DONTNEED)``: the
addresses stay valid and would read zeros); after the update the pages are read
back into the same addresses. A copy at memory speed each way, a fraction of a
second per step for a 0.2 B model.

What makes that safe: nobody reads the version while it is parked. The update
runs on the Trainer's thread, which parks and unparks; the only other readers
are the Publisher's threads, whose digest ends before a version's manifest is
written, and a background snapshot, which reads the version it uploads: parking
pauses it (:meth:`aurora_store.Publisher.snapshot_reads_paused`: the shard being
built is finished first, the next waits until the version is back; uploads in
flight go on). Before that pause, a step right after a snapshot could not park:
rank 0 of ``aurora bench trainer --params 2e8 --nproc 2`` reached about 13 bytes
per parameter there against 11 in the other steps. The tensors are held by the parking until
they are back, so no page can be freed and reused under it. A failure to write
the spool parks nothing; a failure to read it back is an error (the version's
bits would be lost), never silent.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from workers.trainer.spool import Spool, read_into, write_at

__all__ = ["MIN_PARK_BYTES", "VersionParking", "parkable", "readers_paused"]

log = logging.getLogger("aurora.trainer")

MIN_PARK_BYTES = 64 << 10
"""Storages smaller than this stay resident (a lone small tensor: not worth two system calls)."""

_MADV_DONTNEED = 4


class VersionParking:
    """One rank's parking for the version it holds (see the module's docstring)."""

    def __init__(self, folder: str | None = "") -> None:
        self.spool = Spool(folder, "version")
        self.parked_bytes = 0
        """Bytes the last :meth:`parked` handed back to the system (0: nothing parked)."""

    @contextmanager
    def parked(self, tensors: Iterable[torch.Tensor], pause: Callable[[], AbstractContextManager[None]] = nullcontext) -> Iterator[None]:
        """Inside: the whole pages of ``tensors``' host storages are in the spool, not resident; after: back.

        ``pause``: entered before anything is parked and left once it is back (other readers of the
        tensors wait meanwhile: a background snapshot, :func:`readers_paused`)."""
        regions = _regions(tensors)
        total = sum(n for _, n, _ in regions)
        fd = self.spool.fd(total) if total else None
        if fd is None or not _madvise_available():
            self.parked_bytes = 0
            yield
            return
        with pause():
            yield from self._parked(fd, regions)

    def _parked(self, fd: int, regions: list[tuple[int, int, torch.UntypedStorage]]) -> Iterator[None]:
        done: list[tuple[int, int, int]] = []
        try:
            at = 0
            for addr, n, _keep in regions:
                write_at(fd, _view(addr, n), at)
                done.append((addr, n, at))
                at += n
        except OSError as e:
            log.warning("version spool: %s; the version stays resident during the update", e)
            done = []
        for addr, n, _ in done:
            _madvise(addr, n)
        self.parked_bytes = sum(n for _, n, _ in done)
        try:
            yield
        finally:
            for addr, n, at in done:
                read_into(fd, _view(addr, n), at)  # OSError: the version is lost; the run must stop
            del regions  # the storages may go now that their bits are back

    def close(self) -> None:
        self.spool.close()


def parkable(versions: Any) -> list[torch.Tensor]:
    """The tensors of the newest version a :class:`~workers.trainer.versions.VersionPublisher` holds."""
    return list(versions.held.weights.values())


def readers_paused(versions: Any) -> AbstractContextManager[None]:
    """Inside: the Publisher's background snapshot does not read the version (it waits)."""
    pause = getattr(getattr(versions, "publisher", None), "snapshot_reads_paused", None)
    return pause() if callable(pause) else nullcontext()


def _regions(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int, torch.UntypedStorage]]:
    """(first whole page, bytes of whole pages, the storage kept alive) of each distinct host storage."""
    page = mmap.PAGESIZE
    seen: set[int] = set()
    out = []
    for t in tensors:
        if t.device.type != "cpu":
            continue
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if ptr in seen or n < MIN_PARK_BYTES:
            continue
        seen.add(ptr)
        lo = -(-ptr // page) * page
        hi = (ptr + n) // page * page
        if hi > lo:
            out.append((lo, hi - lo, st))
    return out


def _view(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _madvise_available() -> bool:
    libc = _libc()
    # Linux's MADV_DONTNEED: the pages read as zeros until written again (elsewhere it may keep them).
    return sys.platform.startswith("linux") and libc is not None and hasattr(libc, "madvise")


def _madvise(addr: int, n: int) -> None:
    libc = _libc()
    assert libc is not None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    if fn(addr, n, _MADV_DONTNEED) != 0:  # the pages stay resident: nothing lost, nothing saved
        log.debug("madvise(DONTNEED) refused: errno %d", ctypes.get_errno())
