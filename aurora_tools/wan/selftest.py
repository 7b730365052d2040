"""Throughput of the WAN emulation: direct loopback vs our proxy vs tc-shaped veths.

``python -m aurora_tools.wan.selftest [--json] [--quick]`` (also
``python -m aurora_tools.wan.proxy --selftest``) prints a table and one JSON
object. A source process sends N bytes per connection and a sink process
reads them, so the proxy under test has this process (and its GIL) to itself.
The tc rows need root and ``ip netns``; they are skipped with the reason
otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from aurora_tools.wan.netns import WanTestbed, wan_unavailable_reason
from aurora_tools.wan.profile import MIB, LinkProfile
from aurora_tools.wan.proxy import Address, ProxyThread

__all__ = ["main", "measure"]

# Sends the requested byte count to each connection: request = 8-byte big-endian N.
_SOURCE = r"""
import socket, struct, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(64)
print(s.getsockname()[1], flush=True)
block = memoryview(bytes(range(256)) * 16384)
def serve(c):
    with c:
        n = struct.unpack(">Q", c.recv(8, socket.MSG_WAITALL))[0]
        while n > 0:
            n -= c.send(block[:min(n, len(block))])
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

# Asks for N bytes, reads to EOF, prints {"bytes": ..., "seconds": ...}.
_SINK = r"""
import json, socket, struct, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
c = socket.create_connection((host, port)); c.sendall(struct.pack(">Q", n))
buf = bytearray(1 << 20); got = 0
while True:
    k = c.recv_into(buf)
    if not k: break
    got += k
print(json.dumps({"bytes": got, "seconds": time.perf_counter() - t0}))
"""


@dataclass
class Row:
    name: str
    configured_mbit: float | None
    mbytes_per_s: float
    nbytes: int
    seconds: float

    @property
    def vs_configured(self) -> float | None:
        if self.configured_mbit is None:
            return None
        return self.mbytes_per_s * 8 / self.configured_mbit

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "configured_mbit": self.configured_mbit,
            "mbytes_per_s": round(self.mbytes_per_s, 1), "mbit_per_s": round(self.mbytes_per_s * 8, 1),
            "vs_configured": None if self.vs_configured is None else round(self.vs_configured, 3),
            "bytes": self.nbytes, "seconds": round(self.seconds, 3),
        }


def measure(address: Address, nbytes: int, prefix_argv: list[str] | None = None) -> tuple[int, float]:
    """Run the sink (optionally inside a namespace) against ``address``; (bytes, seconds)."""
    argv = [*(prefix_argv or []), sys.executable, "-c", _SINK, address[0], str(address[1]), str(nbytes)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True).stdout
    d = json.loads(out)
    return int(d["bytes"]), float(d["seconds"])


def _row(name: str, rate: float | None, address: Address, nbytes: int, prefix: list[str] | None = None) -> Row:
    got, secs = measure(address, nbytes, prefix)
    if got != nbytes:
        raise RuntimeError(f"{name}: received {got} of {nbytes} bytes")
    return Row(name, rate, got / secs / 1e6, got, secs)


def _size_for(rate_mbit: float | None, seconds: float, cap: int) -> int:
    if rate_mbit is None:
        return cap
    return min(cap, int(rate_mbit * 1e6 / 8 * seconds))


def run(quick: bool = False) -> dict[str, Any]:
    cap = (128 if quick else 512) * MIB
    secs = 1.5 if quick else 3.0
    rows: list[Row] = []
    skipped: dict[str, str] = {}
    source = subprocess.Popen([sys.executable, "-c", _SOURCE], stdout=subprocess.PIPE, text=True)
    try:
        assert source.stdout is not None
        upstream = ("127.0.0.1", int(source.stdout.readline()))
        rows.append(_row("direct loopback", None, upstream, cap))
        proxied: list[tuple[str, LinkProfile]] = [
            ("proxy, no impairment", LinkProfile()),
            ("proxy, 60 ms RTT", LinkProfile(delay_ms=30.0, window_bytes=32 * MIB)),
            ("proxy, token bucket 250 Mbit/s", LinkProfile(rate_mbit=250.0)),
            ("proxy, token bucket 1000 Mbit/s", LinkProfile(rate_mbit=1000.0)),
        ]
        for name, prof in proxied:
            with ProxyThread(upstream, prof) as p:
                rows.append(_row(name, prof.rate_mbit, p.address, _size_for(prof.rate_mbit, secs, cap)))
        reason = wan_unavailable_reason()
        if reason is not None:
            skipped["tc"] = reason
        else:
            for rate, delay in ((250.0, 0.0), (1000.0, 0.0), (1000.0, 30.0), (10000.0, 0.0)):
                prof = LinkProfile(rate_mbit=rate, delay_ms=delay, window_bytes=32 * MIB)
                name = f"netns + tc htb {rate:.0f} Mbit/s" + (f", {2 * delay:.0f} ms RTT" if delay else "")
                with WanTestbed({"r": prof}) as tb:
                    addr = tb.expose("r", upstream)
                    rows.append(_row(name, rate, addr, _size_for(rate, secs, cap), tb.command("r", [])))
    finally:
        source.kill()
        source.wait()
    return {"rows": [r.as_dict() for r in rows], "skipped": skipped}


def _table(result: dict[str, Any]) -> str:
    lines = [f"{'path':<40} {'MB/s':>9} {'Mbit/s':>9} {'configured':>11} {'ratio':>6}"]
    for r in result["rows"]:
        conf = "-" if r["configured_mbit"] is None else f"{r['configured_mbit']:.0f}"
        ratio = "-" if r["vs_configured"] is None else f"{r['vs_configured']:.2f}"
        lines.append(f"{r['name']:<40} {r['mbytes_per_s']:>9.1f} {r['mbit_per_s']:>9.0f} {conf:>11} {ratio:>6}")
    for what, why in result["skipped"].items():
        lines.append(f"({what} rows skipped: {why})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m aurora_tools.wan.selftest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--quick", action="store_true", help="smaller transfers")
    args = ap.parse_args(argv)
    result = run(quick=args.quick)
    if not args.json:
        print(_table(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
