"""The multi-process proxy (``ProxyWorkers``): same bytes, same impairments, counters summed across workers.

Real sockets on loopback; the netns test skips with the reason where ``ip netns`` is not permitted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from aurora_store.errors import ConfigError
from aurora_store.testing.wait import wait_until
from aurora_tools.wan.host import wan_unavailable_reason
from aurora_tools.wan.netns import WanTestbed
from aurora_tools.wan.profile import MIB, LinkProfile
from aurora_tools.wan.proxy import Address, ProxyWorkers, default_workers
from aurora_tools.wan.proxy.workers import _RowCounters

pytestmark = pytest.mark.server

_REASON = wan_unavailable_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _pattern(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]


@contextlib.contextmanager
def _source_server() -> Iterator[Address]:
    """Request: 8-byte N; reply: N bytes of a fixed pattern (one thread per connection)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)

    def serve(c: socket.socket) -> None:
        with c, contextlib.suppress(OSError):
            n = struct.unpack(">Q", c.recv(8, socket.MSG_WAITALL))[0]
            c.sendall(_pattern(n))

    def accept() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[:2]
    finally:
        # shutdown() wakes the blocked accept(); closing first would leave it holding the socket
        # (and a later socket reusing the descriptor number could be accepted on by this thread).
        with contextlib.suppress(OSError):
            srv.shutdown(socket.SHUT_RDWR)
        t.join(5)
        srv.close()


def _download(addr: Address, n: int) -> bytes:
    with socket.create_connection(addr, timeout=30) as c:
        c.sendall(struct.pack(">Q", n))
        chunks = []
        while data := c.recv(1 << 20):
            chunks.append(data)
        return b"".join(chunks)


def test_default_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AURORA_WAN_PROXY_WORKERS", "3")
    assert default_workers() == 3
    monkeypatch.setenv("AURORA_WAN_PROXY_WORKERS", "zero")
    with pytest.raises(ConfigError, match="AURORA_WAN_PROXY_WORKERS"):
        default_workers()
    monkeypatch.delenv("AURORA_WAN_PROXY_WORKERS")
    assert 1 <= default_workers() <= 8
    with pytest.raises(ConfigError, match="workers"):
        ProxyWorkers(("127.0.0.1", 1), workers=0)


def test_row_counters_are_per_worker() -> None:
    view = memoryview(bytearray(8 * 9 * 2)).cast("q")
    a, b = _RowCounters(view, 0), _RowCounters(view, 1)
    a.add("bytes_down", 5)
    b.add("bytes_down", 7)
    b.add("connections")
    assert (a.snapshot().bytes_down, b.snapshot().bytes_down, a.snapshot().connections, b.snapshot().connections) == (5, 7, 0, 1)


def test_many_connections_spread_and_counted() -> None:
    n, conns = 3 * MIB, 12
    with _source_server() as up, ProxyWorkers(up, LinkProfile(delay_ms=1), workers=2) as p:
        assert len(p.pids) == 2 and p.address[1] != up[1]
        results: list[bytes] = [b""] * conns

        def get(i: int) -> None:
            results[i] = _download(p.address, n)

        ts = [threading.Thread(target=get, args=(i,)) for i in range(conns)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        want = hashlib.sha256(_pattern(n)).hexdigest()
        assert all(hashlib.sha256(r).hexdigest() == want for r in results)
        wait_until(lambda: p.stats().active == 0, "no active connection", timeout=10.0, interval=0.005)
        st = p.stats()
        assert (st.connections, st.bytes_down, st.bytes_up) == (conns, conns * n, conns * 8)
        pids = p.pids
    # Closed: the workers are gone, and the last counters stay readable.
    for pid in pids:
        wait_until(
            lambda pid=pid: not os.path.exists(f"/proc/{pid}") or "Z" in _state(pid),
            "the worker process reaped",
            timeout=10.0,
            interval=0.005,
        )
    assert p.stats().bytes_down == conns * n


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return "Z"


def test_impairments_hold_in_workers() -> None:
    # A truncation after uniform[0, 1 MiB) bytes, on whichever worker takes the connection.
    prof = LinkProfile(truncate_prob=1.0, fault_within_bytes=MIB, seed=3)
    with _source_server() as up, ProxyWorkers(up, prof, workers=2) as p:
        data = _download(p.address, 4 * MIB)
        assert len(data) < MIB and data == _pattern(len(data))
        wait_until(lambda: p.stats().truncations == 1, "one truncation", timeout=10.0, interval=0.005)


def test_delay_holds_in_workers() -> None:
    delay_s = 0.04
    with _source_server() as up, ProxyWorkers(up, LinkProfile(delay_ms=delay_s * 1e3), workers=2) as p:
        t = time.perf_counter()
        assert len(_download(p.address, 1024)) == 1024
        # Connect (one RTT held back), request out, data back: at least two RTTs.
        assert time.perf_counter() - t >= 0.9 * 4 * delay_s


def test_workers_exit_with_their_parent() -> None:
    code = (
        "import sys; from aurora_tools.wan.proxy import ProxyWorkers\n"
        "p = ProxyWorkers(('127.0.0.1', 9), workers=2); p.start()\n"
        "print(*p.pids, flush=True)\n"
        "import os; os._exit(0)\n"  # no close(): the workers must notice on their own
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    pids = [int(x) for x in out.split()]
    assert len(pids) == 2
    for pid in pids:
        wait_until(
            lambda pid=pid: _state(pid) == "Z" or not os.path.exists(f"/proc/{pid}"),
            "the worker process gone",
            timeout=10.0,
            interval=0.005,
        )


@needs_netns
@pytest.mark.netns
def test_netns_testbed_with_workers() -> None:
    n = 2 * MIB
    with _source_server() as up, WanTestbed({"eu": LinkProfile(rate_mbit=400)}, proxy_workers=2) as tb:
        host, port = tb.expose("eu", up)
        assert isinstance(tb.proxies("eu")[up], ProxyWorkers)
        code = (
            "import hashlib, socket, struct, sys\n"
            "c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)\n"
            "c.sendall(struct.pack('>Q', int(sys.argv[3]))); b = bytearray()\n"
            "while d := c.recv(1 << 20): b += d\n"
            "print(len(b), hashlib.sha256(b).hexdigest())\n"
        )
        for _ in range(3):
            out = tb.run(
                "eu", [sys.executable, "-c", code, host, str(port), str(n)], capture_output=True, text=True, timeout=60, check=True
            ).stdout.split()
            assert (int(out[0]), out[1]) == (n, hashlib.sha256(_pattern(n)).hexdigest())
        wait_until(lambda: tb.stats("eu").proxy.active == 0, "no active connection at the eu proxy", timeout=10.0, interval=0.005)
        st = tb.stats("eu")
        assert st.proxy.connections == 3 and st.proxy.bytes_down == 3 * n
        assert st.veth_bytes_down > st.proxy.bytes_down
        pids = tb.proxies("eu")[up].pids  # type: ignore[union-attr]
    for pid in pids:
        wait_until(
            lambda pid=pid: _state(pid) == "Z" or not os.path.exists(f"/proc/{pid}"),
            "the worker process gone",
            timeout=10.0,
            interval=0.005,
        )
