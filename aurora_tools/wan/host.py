"""The machine's network, through ``ip`` and ``tc``: namespaces, veth counters, htb shaping, leftovers.

What :class:`~aurora_tools.wan.netns.WanTestbed` runs on the host, and
:func:`cleanup_stale`, which removes what dead testbeds left behind. Every
command failure is a :class:`~aurora_store.errors.WanUnavailable` naming the
command and its stderr.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

from aurora_store.errors import WanUnavailable
from aurora_tools.testbed.processes import process_alive

__all__ = [
    "SUBNET",
    "sh",
    "wan_unavailable_reason",
    "shape_egress",
    "netns_list",
    "subnets_in_use",
    "sysfs_counter",
    "tc_dropped",
    "cleanup_stale",
]

SUBNET = "10.77"
"""Regions get ``10.77.<k>.0/24``: private, and only ever on our own veths."""

_PID_PREFIX = re.compile(r"^aur(\d+)[a-z]?$")


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command; its failure (with ``check``) is :class:`WanUnavailable`."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise WanUnavailable(f"`{' '.join(argv)}` failed (status {proc.returncode}): {proc.stderr.strip()}")
    return proc


def wan_unavailable_reason() -> str | None:
    """Why a netns testbed cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the netns WAN testbed needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN for `ip netns`); use mode='loopback'"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the netns WAN testbed needs `{tool}` (iproute2) on PATH"
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"`ip netns list` failed: {proc.stderr.strip()}"
    return None


def shape_egress(ns: str | None, dev: str, rate_mbit: float) -> None:
    """htb on ``dev``'s egress: one class at ``rate_mbit``, burst sized for the rate."""
    tc = ["tc", "-n", ns] if ns else ["tc"]
    rate = f"{rate_mbit * 1000:.0f}kbit"
    # htb refills from a timer; at Gbit rates a tiny burst caps throughput well below the rate.
    # 2 ms of line rate (>= two 64 KiB GSO packets) keeps it within a few percent.
    burst = max(128 * 1024, int(rate_mbit * 1e6 / 8 * 0.002))
    sh(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    sh(
        *tc,
        "class",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "classid",
        "1:1",
        "htb",
        "rate",
        rate,
        "ceil",
        rate,
        "burst",
        str(burst),
        "cburst",
        str(burst),
        "quantum",
        "60000",
    )


def netns_list() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def subnets_in_use() -> set[int]:
    out = sh("ip", "-4", "-o", "addr", "show", check=False).stdout
    pat = re.compile(rf"inet {re.escape(SUBNET)}\.(\d+)\.")
    return {int(m.group(1)) for m in pat.finditer(out)}


def sysfs_counter(dev: str, name: str) -> int:
    try:
        return int(Path(f"/sys/class/net/{dev}/statistics/{name}").read_text())
    except (OSError, ValueError):
        return 0


def tc_dropped(ns: str | None, dev: str) -> int:
    tc = ["tc", "-n", ns] if ns else ["tc"]
    out = sh(*tc, "-s", "qdisc", "show", "dev", dev, check=False).stdout
    m = re.search(r"qdisc htb 1: .*?dropped (\d+)", out, re.S)
    return int(m.group(1)) if m else 0


def cleanup_stale(prefix: str = "aur", *, force: bool = False) -> list[str]:
    """Delete namespaces ``<P>-<region>`` and veths ``<P>v<k>`` whose prefix P starts with ``prefix``.

    A P of the default form ``aur<pid>[a-z]`` is removed only once that pid is
    gone (so ``cleanup_stale()`` never touches a running testbed); any other P
    only when it equals ``prefix`` (it may belong to a live testbed with an
    explicit prefix: name it to remove it). ``force`` removes every P starting
    with ``prefix``. Returns what was deleted.
    """

    def stale(p: str) -> bool:
        if not p.startswith(prefix):
            return False
        if force:
            return True
        m = _PID_PREFIX.match(p)
        return p == prefix if m is None else not process_alive(int(m.group(1)))

    removed: list[str] = []
    for ns in netns_list():
        p, sep, _ = ns.partition("-")
        if sep and stale(p):
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            if sh("ip", "netns", "del", ns, check=False).returncode == 0:
                removed.append(f"netns {ns}")
    links = sh("ip", "-o", "link", "show", check=False).stdout
    for m in re.finditer(r"^\d+: ([a-z][a-z0-9]*)v(\d+)[@:]", links, re.M):
        if stale(m.group(1)) and sh("ip", "link", "del", f"{m.group(1)}v{m.group(2)}", check=False).returncode == 0:
            removed.append(f"link {m.group(1)}v{m.group(2)}")
    return removed
