"""One proxy in several processes, so that forwarding is not bound to one core or one GIL.

:class:`ProxyWorkers` listens on one address with ``workers`` sockets bound
with ``SO_REUSEPORT`` (the kernel spreads new connections over them by their
address hash) and hands each socket to a worker process of its own
(``python -c`` running :func:`_worker`). Every worker runs the same
asyncio :class:`~aurora_tools.wan.proxy.tcp.Proxy` as a single-process proxy,
so a connection sees exactly the same delay, window, stalls, pauses, resets
and truncation. Worker ``w`` of ``n`` numbers its connections ``w, w + n,
w + 2n, ...``: indices (and so the seeded decisions of
:class:`~aurora_tools.wan.profile.ImpairmentPlan`) never repeat across
workers; which index a given connection lands on depends on timing, as it
does with one process.

Counters live in a shared-memory block (``memfd``), one row per worker,
written only by that worker; :meth:`ProxyWorkers.stats` sums the rows and can
be read from any thread while traffic flows.

The one thing workers cannot share is the userspace token bucket: a
multi-process proxy never rate-limits (tc does that in a netns testbed; a
loopback testbed with a rate keeps the single-loop proxy). A worker exits when
told to (SIGTERM), and by itself when the process that started it is gone
(its stdin reaches EOF), so no worker outlives its testbed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from aurora_store.config import Switch
from aurora_store.errors import ConfigError
from aurora_tools.wan.profile import LinkProfile
from aurora_tools.wan.proxy.tcp import Address, ProxyStats

__all__ = ["ProxyWorkers", "default_workers"]

_FIELDS = [f.name for f in dataclasses.fields(ProxyStats)]
_ROW = len(_FIELDS)
_MAX_WORKERS = 64


PROXY_WORKERS = Switch(
    "AURORA_WAN_PROXY_WORKERS", int | None, None, "worker processes per WAN-emulation proxy (default: half the usable cores, 1..8)"
)


def default_workers() -> int:
    """Worker processes per proxy when not told: ``AURORA_WAN_PROXY_WORKERS``, else half the usable cores (1..8).

    Half, because the proxy's source and sink (the S3 server, the Actors) need cores too: on
    this 2-core machine one loop forwards faster than two workers (docs/WAN.md, measured),
    and 1 means the single-loop proxy in the testbed's own process.
    """
    n = PROXY_WORKERS.get()
    if n is not None:
        if not 1 <= n <= _MAX_WORKERS:
            raise ConfigError(f"{PROXY_WORKERS.env}={n}: must be in 1..{_MAX_WORKERS}")
        return int(n)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


class _RowCounters:
    """The ``_Counters`` interface over one worker's row of the shared block (one writer: no lock)."""

    def __init__(self, view: memoryview, slot: int) -> None:
        self.view = view
        self.base = slot * _ROW
        self.index = {name: self.base + i for i, name in enumerate(_FIELDS)}

    def add(self, key: str, n: int = 1) -> None:
        i = self.index[key]
        self.view[i] += n

    def snapshot(self) -> ProxyStats:
        return ProxyStats(*(self.view[self.base + i] for i in range(_ROW)))


class ProxyWorkers:
    """A :class:`~aurora_tools.wan.proxy.tcp.Proxy` run by ``workers`` processes on one address.

    Same surface as a ``Proxy`` started on a :class:`~aurora_tools.wan.proxy.loop.ProxyLoop`:
    ``address``, ``upstream``, ``profile``, ``name``, ``stats()``; plus ``start()``/``close()``
    and a context manager. ``profile.rate_mbit`` is never applied here (see the module doc).
    """

    def __init__(
        self,
        upstream: Address,
        profile: LinkProfile | None = None,
        *,
        listen: Address = ("127.0.0.1", 0),
        workers: int | None = None,
        name: str = "",
    ) -> None:
        n = default_workers() if workers is None else int(workers)
        if not 1 <= n <= _MAX_WORKERS:
            raise ConfigError(f"ProxyWorkers: workers={n}; must be in 1..{_MAX_WORKERS}")
        self.upstream = (upstream[0], int(upstream[1]))
        self.profile = profile or LinkProfile()
        self.listen = listen
        self.workers = n
        self.name = name or f"proxy->{upstream[0]}:{upstream[1]}"
        self.address: Address = ("", 0)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._mem: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._final: ProxyStats | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(self, timeout: float = 30.0) -> Address:
        if self._procs:
            return self.address
        size = self.workers * _ROW * 8
        fd = os.memfd_create("aurora-wan-proxy")
        socks: list[socket.socket] = []
        try:
            os.ftruncate(fd, size)
            self._mem = mmap.mmap(fd, size)
            self._view = memoryview(self._mem).cast("q")
            for w in range(self.workers):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                s.bind(self.listen if w == 0 else self.address)
                s.listen(1024)
                if w == 0:
                    self.address = s.getsockname()[:2]
                socks.append(s)
            for w, s in enumerate(socks):
                spec = {
                    "upstream": list(self.upstream),
                    "profile": dataclasses.asdict(self.profile),
                    "slot": w,
                    "workers": self.workers,
                    "listen_fd": s.fileno(),
                    "counters_fd": fd,
                    "name": f"{self.name}#{w}",
                }
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", _ENTRY, json.dumps(spec)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        pass_fds=(s.fileno(), fd),
                    )
                )
            for p in self._procs:
                assert p.stdout is not None
                line = _readline(p, timeout)
                if line.strip() != b"ready":
                    raise RuntimeError(f"{self.name}: proxy worker failed to start (status {p.poll()})")
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)  # the mapping (ours and each worker's) keeps the block alive
            for s in socks:
                s.close()  # each worker holds its own listening socket now
        return self.address

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (for CPU accounting)."""
        return [p.pid for p in self._procs]

    def stats(self) -> ProxyStats:
        """The workers' counters, summed (thread-safe; the last values after ``close``)."""
        with self._lock:
            if self._final is not None:
                return self._final
            if self._view is None:
                return ProxyStats()
            return self._sum()

    def _sum(self) -> ProxyStats:
        assert self._view is not None
        v = self._view
        return ProxyStats(*(sum(v[w * _ROW + i] for w in range(self.workers)) for i in range(_ROW)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            with contextlib.suppress(OSError):
                p.send_signal(signal.SIGTERM)
        for p in self._procs:
            try:
                p.wait(10.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    p.kill()
                p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        with self._lock:
            if self._view is not None:
                self._final = self._sum()
                self._view.release()
                self._view = None
            if self._mem is not None:
                self._mem.close()
                self._mem = None

    def __enter__(self) -> ProxyWorkers:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _readline(p: subprocess.Popen[bytes], timeout: float) -> bytes:
    """One line of ``p``'s stdout, or b"" after ``timeout`` seconds or at EOF."""
    assert p.stdout is not None
    out: list[bytes] = []
    t = threading.Thread(target=lambda: out.append(p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout)
    return out[0] if out else b""


# ---------------------------------------------------------------------------
# the worker process


_ENTRY = "import json, sys; from aurora_tools.wan.proxy.workers import _worker; sys.exit(_worker(json.loads(sys.argv[1])))"
"""A worker's command line (``-c``, not ``-m``: the package imports this module first)."""


def _worker(spec: dict[str, Any]) -> int:
    from aurora_tools.wan.proxy.tcp import Proxy

    workers, slot = int(spec["workers"]), int(spec["slot"])
    mem = mmap.mmap(int(spec["counters_fd"]), workers * _ROW * 8)
    os.close(int(spec["counters_fd"]))
    counters = _RowCounters(memoryview(mem).cast("q"), slot)
    sock = socket.socket(fileno=int(spec["listen_fd"]))
    profile = LinkProfile(**spec["profile"])
    upstream = (spec["upstream"][0], int(spec["upstream"][1]))

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the testbed; it stops us

        def parent_gone() -> None:
            try:
                data = os.read(0, 4096)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(0)
                stop.set()

        loop.add_reader(0, parent_gone)
        proxy = Proxy(upstream, profile, rate_limit=False, name=str(spec["name"]), counters=counters, index_start=slot, index_step=workers)
        await proxy.start(sock=sock)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        try:
            await stop.wait()
        finally:
            await proxy.close()

    asyncio.run(serve())
    return 0
