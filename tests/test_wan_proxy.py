"""The WAN proxy: bytes unchanged, delay, pipelining, seeded decisions, faults, counters.

Real sockets on loopback (servers in threads, port 0). Timing assertions are
lower bounds (a delay must really be there), plus one generous bound showing a
delayed link pipelines; nothing asserts a tight wall-clock upper bound.
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
from aurora_tools.wan.profile import MIB, ImpairmentPlan, LinkProfile, parse_region_spec
from aurora_tools.wan.proxy import Address, ProxyStats, ProxyThread

# ---------------------------------------------------------------------------
# loopback servers


@contextlib.contextmanager
def _server(handler: object) -> Iterator[Address]:
    """A threaded TCP server on 127.0.0.1:0 calling ``handler(conn)`` per connection."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=_guarded, args=(handler, c), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[:2]
    finally:
        stop.set()
        # shutdown() wakes the blocked accept() so the thread ends here; a close() alone left it
        # accepting, and its handler once answered another test's connection (test_wan_netns).
        with contextlib.suppress(OSError):
            srv.shutdown(socket.SHUT_RDWR)
        t.join(5)
        srv.close()


def _guarded(handler: object, c: socket.socket) -> None:
    with c, contextlib.suppress(OSError):
        handler(c)  # type: ignore[operator]


def _echo(c: socket.socket) -> None:
    while data := c.recv(1 << 18):
        c.sendall(data)


def _source(c: socket.socket) -> None:
    """Request: 8-byte N; reply: N bytes of a fixed pattern."""
    n = struct.unpack(">Q", c.recv(8, socket.MSG_WAITALL))[0]
    block = _pattern(1 << 20)
    while n > 0:
        k = min(n, len(block))
        c.sendall(block[:k])
        n -= k


def _pattern(n: int) -> bytes:
    return (bytes(range(251)) * (n // 251 + 1))[:n]


@pytest.fixture
def echo() -> Iterator[Address]:
    with _server(_echo) as addr:
        yield addr


@pytest.fixture
def source() -> Iterator[Address]:
    with _server(_source) as addr:
        yield addr


def _download(addr: Address, n: int, timeout: float = 30.0) -> bytes:
    with socket.create_connection(addr, timeout=timeout) as c:
        c.sendall(struct.pack(">Q", n))
        chunks = []
        while data := c.recv(1 << 20):
            chunks.append(data)
        return b"".join(chunks)


# ---------------------------------------------------------------------------
# pure: profiles and the decision stream


def test_profile_validation() -> None:
    with pytest.raises(ConfigError, match="stall_prob"):
        LinkProfile(stall_prob=1.5)
    with pytest.raises(ConfigError, match="rate_mbit"):
        LinkProfile(rate_mbit=0)
    with pytest.raises(ConfigError, match="reset_prob \\+ truncate_prob"):
        LinkProfile(reset_prob=0.6, truncate_prob=0.6)
    assert LinkProfile(delay_ms=30).rtt_ms == 60
    assert not LinkProfile(rate_mbit=100).impaired
    assert LinkProfile(jitter_ms=1).impaired


def test_parse_region_spec() -> None:
    name, p = parse_region_spec("eu:1gbit:60ms:jitter=5ms:stall=0.02/300ms:loss=0.01:reset=0.1:seed=7")
    assert name == "eu"
    assert p == LinkProfile(
        rate_mbit=1000.0, delay_ms=30.0, jitter_ms=5.0, stall_prob=0.02, stall_ms=300.0, loss_prob=0.01, reset_prob=0.1, seed=7
    )
    assert parse_region_spec("us:250mbit:delay=10ms")[1] == LinkProfile(rate_mbit=250.0, delay_ms=10.0)
    with pytest.raises(ConfigError, match="unknown key"):
        parse_region_spec("eu:bogus=1")
    with pytest.raises(ConfigError, match="name"):
        parse_region_spec("EU:1gbit")


def test_same_seed_same_decisions() -> None:
    prof = LinkProfile(jitter_ms=5, stall_prob=0.3, loss_prob=0.2, reset_prob=0.3, truncate_prob=0.3, seed=11)

    def decisions(p: LinkProfile, conn: int) -> tuple[object, ...]:
        plan = ImpairmentPlan(p, conn)
        return (
            plan.fault,
            plan.up.events_between(0, 64 * MIB),
            plan.down.events_between(0, 64 * MIB),
            [plan.up.jitter_s() for _ in range(20)],
        )

    runs = [decisions(prof, c) for c in range(8)]
    assert runs == [decisions(prof, c) for c in range(8)]
    assert runs != [decisions(prof.with_(seed=12), c) for c in range(8)]
    assert len({repr(r) for r in runs}) == 8, "connections draw from their own streams"
    assert any(r[0] is not None for r in runs) and any(r[0] is None for r in runs)


def test_events_independent_of_chunking() -> None:
    prof = LinkProfile(stall_prob=0.5, loss_prob=0.5, seed=3)
    whole = ImpairmentPlan(prof, 0).down.events_between(0, 32 * MIB)
    plan = ImpairmentPlan(prof, 0).down
    pieces, pos = [], 0
    for size in [1, 7, 65536, 300_000, 1 << 20, 3 << 20] * 8:
        pieces += plan.events_between(pos, min(pos + size, 32 * MIB))
        pos = min(pos + size, 32 * MIB)
    pieces += plan.events_between(pos, 32 * MIB)
    assert whole == pieces
    assert [e.offset for e in whole] == sorted(e.offset for e in whole)


def test_event_rates_follow_probabilities() -> None:
    plan = ImpairmentPlan(LinkProfile(stall_prob=0.1, loss_prob=0.05, seed=5), 0).up
    events = plan.events_between(0, 4000 * MIB)
    stalls = sum(e.kind == "stall" for e in events)
    losses = sum(e.kind == "loss" for e in events)
    assert 330 < stalls < 470  # mean 400, sd 19
    assert 150 < losses < 250  # mean 200, sd 14


def test_stats_add() -> None:
    assert ProxyStats(bytes_up=1, stalls=2) + ProxyStats(bytes_up=3, resets=1) == ProxyStats(bytes_up=4, stalls=2, resets=1)


# ---------------------------------------------------------------------------
# real sockets


@pytest.mark.server
def test_bytes_unchanged_both_directions(echo: Address) -> None:
    payload = os.urandom(6 * MIB)
    # Jitter larger than the gap between chunks: order must hold anyway.
    with ProxyThread(echo, LinkProfile(delay_ms=2, jitter_ms=2, seed=1)) as p:
        with socket.create_connection(p.address, timeout=30) as c:

            def send() -> None:
                c.sendall(payload)
                c.shutdown(socket.SHUT_WR)

            sender = threading.Thread(target=send)
            sender.start()
            got = bytearray()
            while data := c.recv(1 << 20):
                got += data
            sender.join()
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()
        wait_until(lambda: p.stats().active == 0, "no active connection", timeout=5.0, interval=0.005)
        st = p.stats()
    assert (st.bytes_up, st.bytes_down, st.connections, st.resets) == (len(payload), len(payload), 1, 0)


@pytest.mark.server
def test_rtt_is_twice_the_delay(echo: Address) -> None:
    delay_ms = 40.0
    with ProxyThread(echo, LinkProfile(delay_ms=delay_ms)) as p, socket.create_connection(p.address, timeout=10) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for i in range(4):
            t = time.perf_counter()
            c.sendall(bytes([i]))
            assert c.recv(1) == bytes([i])
            rtts.append(time.perf_counter() - t)
    assert min(rtts) >= 0.9 * 2 * delay_ms / 1e3


@pytest.mark.server
def test_delayed_link_pipelines(source: Address) -> None:
    # A long delay, so the bound below leaves seconds for the copy itself on a loaded machine.
    delay_s, n = 0.2, 8 * MIB
    with ProxyThread(source, LinkProfile(delay_ms=delay_s * 1e3)) as p:
        t = time.perf_counter()
        data = _download(p.address, n)
        elapsed = time.perf_counter() - t
    assert data == _pattern(1 << 20) * 8
    assert elapsed >= 0.9 * 2 * delay_s  # request out, data back
    one_chunk_per_rtt = (n / (256 * 1024)) * 2 * delay_s  # 12.8 s
    assert elapsed < one_chunk_per_rtt / 4


@pytest.mark.server
def test_window_bounds_one_connection(source: Address) -> None:
    # 256 KiB window, 100 ms RTT: at most 2.5 MiB/s, so 2 MiB needs >= ~0.8 s of RTTs.
    prof = LinkProfile(delay_ms=50, window_bytes=256 * 1024)
    with ProxyThread(source, prof) as p:
        t = time.perf_counter()
        assert len(_download(p.address, 2 * MIB)) == 2 * MIB
        elapsed = time.perf_counter() - t
    assert elapsed >= 0.9 * (2 * MIB / prof.window_bytes - 1) * prof.rtt_ms / 1e3


@pytest.mark.server
def test_userspace_rate_limit(source: Address) -> None:
    prof = LinkProfile(rate_mbit=40.0)  # 5 MB/s
    n = 3 * MIB
    with ProxyThread(source, prof) as p:
        t = time.perf_counter()
        assert len(_download(p.address, n)) == n
        elapsed = time.perf_counter() - t
    burst = max(4 * 64 * 1024, 5e6 * 0.005)
    assert elapsed >= 0.9 * (n - burst) / 5e6
    with ProxyThread(source, prof, rate_limit=False) as p:  # tc's job in a netns testbed
        assert p.proxy._buckets == {}


@pytest.mark.server
def test_stalls_pause_the_direction(source: Address) -> None:
    prof = LinkProfile(stall_prob=1.0, stall_ms=80, seed=2)
    n = 2 * MIB
    expected = ImpairmentPlan(prof, 0).down.events_between(0, n)
    assert [e.kind for e in expected] == ["stall", "stall"]
    with ProxyThread(source, prof) as p:
        t = time.perf_counter()
        assert _download(p.address, n) == _pattern(1 << 20) * 2
        elapsed = time.perf_counter() - t
        assert p.stats().stalls == 2
    assert elapsed >= 0.9 * 2 * 0.08


@pytest.mark.server
def test_loss_pauses_counted(source: Address) -> None:
    prof = LinkProfile(loss_prob=1.0, loss_pause_ms=20, seed=4)
    with ProxyThread(source, prof) as p:
        assert len(_download(p.address, 3 * MIB)) == 3 * MIB
        assert p.stats().loss_pauses == 3


@pytest.mark.server
def test_reset_reaches_the_client(source: Address) -> None:
    prof = LinkProfile(reset_prob=1.0, fault_within_bytes=512 * 1024, seed=9)
    fault = ImpairmentPlan(prof, 0).fault
    assert fault is not None and fault.kind == "reset"
    with ProxyThread(source, prof) as p:
        with pytest.raises(ConnectionError):
            _download(p.address, 4 * MIB)
        wait_until(lambda: p.stats().active == 0, "no active connection", timeout=5.0, interval=0.005)
        st = p.stats()
    assert st.resets == 1 and st.bytes_up + st.bytes_down <= fault.at_bytes


@pytest.mark.server
def test_truncation_is_a_clean_short_stream(source: Address) -> None:
    prof = LinkProfile(truncate_prob=1.0, fault_within_bytes=2 * MIB, seed=9)
    fault = ImpairmentPlan(prof, 0).fault
    assert fault is not None and fault.kind == "truncate"
    with ProxyThread(source, prof) as p:
        data = _download(p.address, 4 * MIB)  # clean EOF: no exception
        st = p.stats()
    # The 8-byte request counts toward the fault's byte budget.
    assert len(data) == fault.at_bytes - 8
    assert data == (_pattern(1 << 20) * 4)[: len(data)]
    assert st.truncations == 1 and st.bytes_down == len(data)


@pytest.mark.server
def test_upstream_refused_counts_and_closes() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[:2]  # bound, not listening: connections are refused
        with ProxyThread(dead) as p, socket.create_connection(p.address, timeout=5) as c:
            with contextlib.suppress(ConnectionError):
                assert c.recv(1) == b""
            wait_until(lambda: p.stats().upstream_errors == 1, "one upstream error", timeout=5.0, interval=0.005)


@pytest.mark.server
def test_cli_prints_bound_address(source: Address) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "aurora_tools.wan.proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"{source[0]}:{source[1]}",
            "--delay-ms",
            "5",
            "--jitter-ms",
            "1",
            "--seed",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        host, port = proc.stdout.readline().strip().rsplit(":", 1)
        assert host == "127.0.0.1"
        assert len(_download((host, int(port)), MIB)) == MIB
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.server
def test_new_connection_costs_a_round_trip(source: Address) -> None:
    delay_s = 0.04
    with ProxyThread(source, LinkProfile(delay_ms=delay_s * 1e3)) as p:
        t = time.perf_counter()
        assert _download(p.address, 1) == b"\x00"
        # handshake (1 RTT) + request and reply (1 RTT)
        assert time.perf_counter() - t >= 0.9 * 4 * delay_s
