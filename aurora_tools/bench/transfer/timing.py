"""What a run is measured with: a store that records each request's interval, and wall + CPU seconds."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["Op", "TimedStore", "cpu_of", "Stopwatch"]


@dataclass(frozen=True, slots=True)
class Op:
    kind: str
    key: str
    nbytes: int
    t0: float
    t1: float


class TimedStore:
    """A :class:`~aurora_store.storage.Store` that records when each put and get ran.

    Everything else is delegated; the pipeline under test does not know it is
    being watched.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.ops: list[Op] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _record(self, kind: str, key: str, nbytes: int, t0: float) -> None:
        op = Op(kind, key, nbytes, t0, time.perf_counter())
        with self._lock:
            self.ops.append(op)

    def put(self, key: str, data: bytes, mode: str = "create") -> None:
        t0 = time.perf_counter()
        self.inner.put(key, data, mode=mode)
        self._record("put", key, len(data), t0)

    def get(self, key: str) -> bytes:
        t0 = time.perf_counter()
        data: bytes = self.inner.get(key)
        self._record("get", key, len(data), t0)
        return data

    def get_capped(self, key: str, limit: int, what: str = "") -> bytes:
        t0 = time.perf_counter()
        data: bytes = self.inner.get_capped(key, limit, what)
        self._record("get", key, len(data), t0)
        return data

    def busy(self, kind: str, manifest: bool = False) -> float:
        """Wall seconds with at least one ``kind`` op (on segments, or on the manifest) in flight."""
        spans = sorted((o.t0, o.t1) for o in self.ops if o.kind == kind and o.key.endswith("manifest.json") == manifest)
        total, end = 0.0, -math.inf
        for a, b in spans:
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        return total


def cpu_of(pid: int | None) -> float:
    """CPU seconds (user + system) of a process; this one when ``pid`` is None."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Stopwatch:
    """Wall and CPU seconds of client and server across a block."""

    server_pid: int | None
    wall: float = 0.0
    cpu_client: float = 0.0
    cpu_server: float | None = None

    @contextmanager
    def run(self) -> Iterator[Stopwatch]:
        w, c = time.perf_counter(), cpu_of(None)
        s = cpu_of(self.server_pid) if self.server_pid else None
        try:
            yield self
        finally:
            self.wall = time.perf_counter() - w
            self.cpu_client = cpu_of(None) - c
            if s is not None and self.server_pid:
                self.cpu_server = cpu_of(self.server_pid) - s
