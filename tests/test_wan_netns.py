"""The WAN testbed: namespaces, veths, tc, exposed services, teardown.

Tests that need root and ``ip netns`` skip with the reason where not
permitted; the loopback-mode and "unavailable" tests run everywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from aurora_store.errors import WanUnavailable
from aurora_tools.wan import netns as netns_mod
from aurora_tools.wan.host import cleanup_stale, wan_unavailable_reason
from aurora_tools.wan.netns import WanTestbed
from aurora_tools.wan.profile import LinkProfile
from aurora_tools.wan.proxy import Address

pytestmark = [pytest.mark.server, pytest.mark.netns]

_REASON = wan_unavailable_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

BODY = os.urandom(3 * 1024 * 1024)

_FETCH = r"""
import hashlib, sys, time, urllib.request
t = time.perf_counter()
body = urllib.request.urlopen(sys.argv[1], timeout=30).read()
print(len(body), hashlib.sha256(body).hexdigest(), time.perf_counter() - t)
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_server() -> Iterator[Address]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[:2]  # type: ignore[misc]
    srv.shutdown()
    srv.server_close()


def _fetch(tb: WanTestbed, region: str, url: str) -> tuple[int, str, float]:
    proc = tb.run(region, [sys.executable, "-c", _FETCH, url], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"fetch {url} in {region} failed: {proc.stderr[-2000:]}"
    out = proc.stdout.split()
    return int(out[0]), out[1], float(out[2])


def _ours(prefix: str) -> list[str]:
    nss = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line for line in (nss + links).splitlines() if f"{prefix}-" in line or f" {prefix}v" in line]


@needs_netns
def test_namespaces_created_and_removed() -> None:
    tb = WanTestbed({"eu": LinkProfile(), "us": LinkProfile(rate_mbit=100)})
    with tb:
        assert tb.mode == "netns"
        names = {tb.namespace("eu"), tb.namespace("us")}
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert all(n and n in listed for n in names)
        ip = tb.host_address("eu")
        assert ip.startswith("10.77.") and ip.endswith(".1")
        assert tb.region_address("eu") == ip[:-1] + "2"
        assert tb.host_address("eu") != tb.host_address("us")
        addrs = tb.run("eu", ["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        assert tb.region_address("eu") in addrs and "127.0.0.1" in addrs
        assert len(_ours(tb.prefix)) >= 4
    assert _ours(tb.prefix) == []


@needs_netns
@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_teardown_after_exception(exc: type[BaseException]) -> None:
    tb = WanTestbed({"eu": LinkProfile(rate_mbit=50)})
    with pytest.raises(exc), tb:
        tb.popen("eu", ["sleep", "60"])
        raise exc("boom")
    assert _ours(tb.prefix) == []


@needs_netns
def test_process_in_region_reaches_loopback_service(http_server: Address) -> None:
    with WanTestbed({"eu": LinkProfile(delay_ms=5)}) as tb:
        url = tb.expose_url("eu", f"http://{http_server[0]}:{http_server[1]}/blob")
        assert url.startswith(f"http://{tb.host_address('eu')}:")
        assert tb.expose("eu", http_server) == tb.expose("eu", http_server)  # one proxy per upstream
        n, digest, _ = _fetch(tb, "eu", url)
        assert (n, digest) == (len(BODY), hashlib.sha256(BODY).hexdigest())
        st = tb.stats("eu")
        assert st.proxy.bytes_down > len(BODY) and st.proxy.bytes_up > 0 and st.proxy.connections == 1
        assert st.veth_bytes_down > st.proxy.bytes_down  # the kernel adds headers
        assert st.veth_bytes_up > st.proxy.bytes_up
        # The loopback service itself is not reachable from inside the region.
        direct = tb.run("eu", [sys.executable, "-c", _FETCH, f"http://{http_server[0]}:{http_server[1]}/"], capture_output=True, timeout=30)
        assert direct.returncode != 0


@needs_netns
def test_tc_rate_limit_applied(http_server: Address) -> None:
    rate = 40.0  # 5 MB/s: BODY takes ~0.6 s
    with WanTestbed({"eu": LinkProfile(rate_mbit=rate)}) as tb:
        region = tb._region("eu")
        assert region.ns and region.veth_root and region.veth_ns
        for cmd in (["tc", "qdisc", "show", "dev", region.veth_root], ["tc", "-n", region.ns, "qdisc", "show", "dev", region.veth_ns]):
            assert "qdisc htb 1: root" in subprocess.run(cmd, capture_output=True, text=True).stdout
        for cmd in (["tc", "class", "show", "dev", region.veth_root], ["tc", "-n", region.ns, "class", "show", "dev", region.veth_ns]):
            assert "rate 40Mbit ceil 40Mbit" in subprocess.run(cmd, capture_output=True, text=True).stdout
        url = tb.expose_url("eu", f"http://{http_server[0]}:{http_server[1]}/")
        assert tb.proxies("eu")[http_server].stats() is not None
        n, _, secs = _fetch(tb, "eu", url)
        assert n == len(BODY)
        assert secs >= 0.7 * len(BODY) / (rate * 1e6 / 8)  # coarse: the shaper is really there


@needs_netns
def test_parallel_testbeds_get_distinct_subnets() -> None:
    with WanTestbed({"eu": LinkProfile()}) as a, WanTestbed({"eu": LinkProfile()}) as b:
        assert a.prefix != b.prefix
        assert a.host_address("eu") != b.host_address("eu")
    assert _ours(a.prefix) == [] and _ours(b.prefix) == []


@needs_netns
def test_cleanup_stale_removes_leftovers() -> None:
    prefix = f"aurt{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", f"{prefix}-eu"], check=True)
    subprocess.run(["ip", "link", "add", f"{prefix}v200", "type", "veth", "peer", "name", f"{prefix}p200"], check=True)
    try:
        removed = cleanup_stale(prefix)
        assert f"netns {prefix}-eu" in removed and f"link {prefix}v200" in removed
        assert _ours(prefix) == []
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            subprocess.run(["ip", "netns", "del", f"{prefix}-eu"], capture_output=True)
            subprocess.run(["ip", "link", "del", f"{prefix}v200"], capture_output=True)


@needs_netns
def test_cleanup_stale_spares_live_testbeds() -> None:
    with WanTestbed({"eu": LinkProfile()}) as tb:
        assert cleanup_stale(tb.prefix) == []  # its pid is alive
        ns = tb.namespace("eu")
        assert ns and ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_loopback_mode_same_api(http_server: Address) -> None:
    with WanTestbed({"eu": LinkProfile(rate_mbit=80, delay_ms=2)}, mode="loopback") as tb:
        assert tb.mode == "loopback" and tb.namespace("eu") is None
        host, port = tb.expose("eu", http_server)
        assert host == "127.0.0.1" and port != http_server[1]
        t = time.perf_counter()
        n, digest, _ = _fetch(tb, "eu", f"http://{host}:{port}/")
        assert (n, digest) == (len(BODY), hashlib.sha256(BODY).hexdigest())
        assert time.perf_counter() - t >= 0.7 * len(BODY) / 10e6  # the token bucket shapes instead of tc
        st = tb.stats("eu")
        assert st.proxy.bytes_down > len(BODY) and st.veth_bytes_down == 0


def test_unavailable_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(WanUnavailable, match="root"):
        WanTestbed({"eu": LinkProfile()}).start()
    with WanTestbed({"eu": LinkProfile()}, mode="auto") as tb:
        assert tb.mode == "loopback"
