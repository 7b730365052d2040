"""Peak resident memory of a process and its descendants over a window, from ``/proc``.

Why the kernel's high-water mark rather than sampling alone: a step's
peak (a gathered layer, the optimizer's temporaries) can last
milliseconds, between any two samples. Writing ``5`` to
``/proc/PID/clear_refs`` resets ``VmHWM`` to the current resident set, so
the mark read at the end of the window is the peak inside it. Where the
reset is refused, ``VmRSS`` is sampled instead (:attr:`TreeMemory.exact` False).
"""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["TreeMemory", "descendants", "maps_kernels", "status_bytes"]


def status_bytes(pid: int, field: str) -> int | None:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/PID/status`` in bytes; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def maps_kernels(pid: int) -> bool:
    """Whether process ``pid`` has loaded the codec's compiled kernels (llvmlite, numba's code
    generator, is mapped); False when it is gone."""
    try:
        with open(f"/proc/{pid}/maps", encoding="ascii", errors="replace") as f:
            return any("llvmlite" in line for line in f)
    except OSError:
        return False


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
            # pid (comm) state ppid …: comm may hold spaces and parentheses; the last ')' ends it
            out[int(name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (children of children too)."""
    parents = _parents()
    out, frontier = [root], [root]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier and p not in out]
        out += kids
        frontier = kids
    return out


class TreeMemory:
    """Peak resident bytes of each process of a tree between :meth:`start` and :meth:`stop`.

    A thread samples every ``interval_s`` (new processes join the tree as
    they appear); :meth:`peaks` gives pid -> peak bytes.
    """

    def __init__(self, root: int, interval_s: float = 0.05) -> None:
        self.root = root
        self.interval_s = interval_s
        self.exact = True
        """Whether the kernel's high-water mark could be reset (else: sampled ``VmRSS``)."""
        self._peaks: dict[int, int] = {}
        self.kernels: dict[int, bool] = {}
        """pid -> whether it had the codec's kernels loaded when the window ended (:func:`maps_kernels`)."""
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        for pid in descendants(self.root):
            try:
                with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
                    f.write("5")
            except OSError:
                self.exact = False
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="bench-trainer-memory", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        for pid in descendants(self.root):
            now = status_bytes(pid, "VmRSS")
            mark = status_bytes(pid, "VmHWM") if self.exact else None
            got = max(x for x in (now, mark, 0) if x is not None)
            if got:
                self._peaks[pid] = max(self._peaks.get(pid, 0), got)

    def _loop(self) -> None:
        while not self._done.wait(self.interval_s):
            with contextlib.suppress(Exception):  # a process that ends between listing and reading
                self._sample()

    def stop(self) -> dict[int, int]:
        """End the window (one last reading) and return :meth:`peaks`."""
        if self._thread is not None and not self._done.is_set():
            self._done.set()
            self._thread.join(5)
            self._sample()
            self.kernels = {pid: maps_kernels(pid) for pid in self._peaks}
        return self.peaks()

    def peaks(self) -> dict[int, int]:
        return dict(self._peaks)
