"""A WAN testbed on one machine: one network namespace per region.

The trainer region is the root namespace: the S3-protocol server and Redis
listen there on loopback. For each other region ``k`` (1, 2, ...) the testbed
creates

- a namespace ``<prefix>-<region>`` with ``lo`` up;
- a veth pair ``<prefix>v<k>`` (root side, ``10.77.<k>.1/24``) <->
  ``<prefix>p<k>`` (region side, ``10.77.<k>.2/24``);
- when the region's :class:`LinkProfile` has ``rate_mbit``, an htb rate limit
  on the egress of *both* ends (root end: into the region; region end: out of it);
- on :meth:`WanTestbed.expose`, one of our proxies listening on
  ``10.77.<k>.1:<port>`` and forwarding to a loopback service, adding the
  profile's delay, jitter, stalls, resets, truncation and loss-like pauses
  (this kernel has no netem, so delay comes from the proxy).

A process started with :meth:`WanTestbed.popen` inside the region reaches the
service at the exposed address, through the tc rate limit and the proxy.
Nothing is routed between regions, nor out of the machine. ``k`` is the lowest
``10.77.<k>.0/24`` not already on a root-namespace interface, chosen under a
file lock, so parallel testbeds never collide.

``mode="loopback"`` offers the same API without namespaces (no root needed):
proxies on 127.0.0.1 with the rate limit in userspace, and processes run
directly. ``mode="auto"`` picks netns when permitted.

Teardown (``close()``/``__exit__``, also after exceptions, KeyboardInterrupt,
and at interpreter exit) stops the processes started in each namespace, the
proxies, and deletes the namespaces (which deletes the veth pairs and their
qdiscs). :func:`~aurora_tools.wan.host.cleanup_stale` removes leftovers of
dead processes; :mod:`aurora_tools.wan.host` holds the ``ip``/``tc`` commands.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import os
import re
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from aurora_store.errors import ConfigError, WanUnavailable
from aurora_store.testing.servers import stop_process
from aurora_tools.wan.host import (
    SUBNET,
    cleanup_stale,
    netns_list,
    sh,
    shape_egress,
    subnets_in_use,
    sysfs_counter,
    tc_dropped,
    wan_unavailable_reason,
)
from aurora_tools.wan.profile import LinkProfile
from aurora_tools.wan.proxy import (
    Address,
    Proxy,
    ProxyLoop,
    ProxyStats,
    ProxyWorkers,
    default_workers,
)

__all__ = [
    "WanUnavailable",
    "WanTestbed",
    "RegionStats",
    "cleanup_stale",
    "wan_unavailable_reason",
    "SUBNET",
]

Mode = Literal["netns", "loopback", "auto"]

_LOCK_PATH = Path(tempfile.gettempdir()) / "aurora-wan.lock"
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,10}$")
_REGION = re.compile(r"^[a-z][a-z0-9_]{0,15}$")


@dataclass(frozen=True, slots=True)
class RegionStats:
    """Bytes crossing one region's boundary (the proxies' view and the kernel's)."""

    region: str
    proxy: ProxyStats
    """All proxies exposed to this region, summed: ``bytes_down`` into it, ``bytes_up`` out of it."""
    veth_bytes_down: int = 0
    """Bytes the root-side veth sent into the region (IP headers included; 0 in loopback mode)."""
    veth_bytes_up: int = 0
    """Bytes the root-side veth received from the region."""
    tc_dropped_down: int = 0
    """Packets the rate limit dropped into the region (TCP retransmits them)."""
    tc_dropped_up: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["proxy"] = self.proxy.as_dict()
        return d


@dataclass(slots=True)
class _Region:
    name: str
    profile: LinkProfile
    k: int
    ns: str | None = None
    veth_root: str | None = None
    veth_ns: str | None = None
    proxies: dict[Address, Proxy | ProxyWorkers] = field(default_factory=dict)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def host_ip(self) -> str:
        return f"{SUBNET}.{self.k}.1" if self.ns else "127.0.0.1"

    @property
    def region_ip(self) -> str:
        return f"{SUBNET}.{self.k}.2" if self.ns else "127.0.0.1"


_live: set[str] = set()
_live_lock = threading.Lock()


def _default_prefix() -> str:
    with _live_lock:
        for suffix in ["", *"bcdefghijklmnopqrstuvwxyz"]:
            p = f"aur{os.getpid()}{suffix}"
            if p not in _live:
                return p
    raise ConfigError("more than 25 WanTestbeds alive in one process")


class WanTestbed:
    """Regions joined to the trainer region (the root namespace) by shaped, impaired links.

    ``regions`` maps a region name (``[a-z][a-z0-9_]{0,15}``) to its link profile.
    ``proxy_workers``: processes per exposed service (None: :func:`~.proxy.default_workers`,
    ``AURORA_WAN_PROXY_WORKERS`` or half the cores); 1 keeps every proxy on one event loop in this
    process. A loopback testbed whose region has a rate keeps the single loop (its token
    bucket cannot be shared across processes).
    """

    def __init__(
        self, regions: Mapping[str, LinkProfile], *, prefix: str | None = None, mode: Mode = "netns", proxy_workers: int | None = None
    ) -> None:
        for name in regions:
            if not _REGION.match(name):
                raise ConfigError(f"WanTestbed region {name!r}: must match {_REGION.pattern}")
        if len(regions) > 250:
            raise ConfigError(f"WanTestbed: {len(regions)} regions; at most 250")
        if prefix is not None and not _PREFIX.match(prefix):
            raise ConfigError(f"WanTestbed prefix {prefix!r}: must match {_PREFIX.pattern} (veth names are <= 15 chars)")
        if mode not in ("netns", "loopback", "auto"):
            raise ConfigError(f"WanTestbed mode {mode!r}: one of netns, loopback, auto")
        self._explicit_prefix = prefix is not None
        self.prefix = prefix or _default_prefix()
        self._profiles = dict(regions)
        self._requested_mode: Mode = mode
        self.proxy_workers = default_workers() if proxy_workers is None else int(proxy_workers)
        if self.proxy_workers < 1:
            raise ConfigError(f"WanTestbed proxy_workers={proxy_workers!r}: must be >= 1")
        self.mode: Literal["netns", "loopback"] = "loopback"
        self._regions: dict[str, _Region] = {}
        self._loop: ProxyLoop | None = None
        self._started = False
        self._closed = False

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> WanTestbed:
        if self._started:
            return self
        reason = wan_unavailable_reason() if self._requested_mode != "loopback" else "loopback requested"
        if reason is not None and self._requested_mode == "netns":
            raise WanUnavailable(reason)
        self._started = True
        self.mode = "netns" if reason is None else "loopback"
        with _live_lock:
            if self.prefix in _live:
                raise ConfigError(f"WanTestbed prefix {self.prefix!r} is already in use in this process")
            _live.add(self.prefix)
        atexit.register(self.close)
        try:
            self._loop = ProxyLoop(name=f"wan-{self.prefix}")
            if self.mode == "netns":
                self._create_namespaces()
            else:
                for k, (name, prof) in enumerate(self._profiles.items(), start=1):
                    self._regions[name] = _Region(name, prof, k)
        except BaseException:
            self.close()
            raise
        return self

    def _create_namespaces(self) -> None:
        existing = set(netns_list())
        _LOCK_PATH.touch(exist_ok=True)
        with open(_LOCK_PATH) as lock:
            # Held from choosing k until its address is on our veth: a parallel testbed
            # that scans afterwards sees the subnet taken.
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = subnets_in_use()
            free = (k for k in range(1, 255) if k not in used)
            for name, prof in self._profiles.items():
                k = next(free, None)
                if k is None:
                    raise WanUnavailable(f"no free {SUBNET}.<k>.0/24 subnet left for region {name!r}")
                region = _Region(name, prof, k, ns=f"{self.prefix}-{name}", veth_root=f"{self.prefix}v{k}", veth_ns=f"{self.prefix}p{k}")
                assert region.ns and region.veth_root and region.veth_ns
                if region.ns in existing:
                    if self._explicit_prefix:
                        raise WanUnavailable(
                            f"network namespace {region.ns!r} already exists; "
                            f"another testbed uses prefix {self.prefix!r}, or run cleanup_stale"
                        )
                    sh("ip", "netns", "del", region.ns, check=False)  # ours: same pid, dead process
                self._regions[name] = region
                sh("ip", "netns", "add", region.ns)
                # Created with its peer already inside the namespace: no window in which a
                # half-built pair sits in the root namespace.
                sh("ip", "link", "add", region.veth_root, "type", "veth", "peer", "name", region.veth_ns, "netns", region.ns)
                sh("ip", "addr", "add", f"{region.host_ip}/24", "dev", region.veth_root)
                sh("ip", "link", "set", region.veth_root, "up")
                sh("ip", "-n", region.ns, "addr", "add", f"{region.region_ip}/24", "dev", region.veth_ns)
                sh("ip", "-n", region.ns, "link", "set", region.veth_ns, "up")
                sh("ip", "-n", region.ns, "link", "set", "lo", "up")
                if prof.rate_mbit is not None:
                    shape_egress(None, region.veth_root, prof.rate_mbit)
                    shape_egress(region.ns, region.veth_ns, prof.rate_mbit)

    def close(self) -> None:
        """Tear everything down; safe to call twice, and after a failed start."""
        if self._closed or not self._started:
            return
        self._closed = True
        atexit.unregister(self.close)
        with _sigint_deferred():
            for region in self._regions.values():
                for proc in region.procs:
                    _stop(proc)
            for region in self._regions.values():
                for p in region.proxies.values():
                    if isinstance(p, ProxyWorkers):
                        p.close()
            if self._loop is not None:
                self._loop.close()
            for region in self._regions.values():
                if region.ns is None:
                    continue
                for pid in sh("ip", "netns", "pids", region.ns, check=False).stdout.split():
                    with contextlib.suppress(OSError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                sh("ip", "netns", "del", region.ns, check=False)
                if region.veth_root and Path(f"/sys/class/net/{region.veth_root}").exists():
                    sh("ip", "link", "del", region.veth_root, check=False)
            with _live_lock:
                _live.discard(self.prefix)

    def __enter__(self) -> WanTestbed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries -------------------------------------------------------------

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(self._profiles)

    def _region(self, region: str) -> _Region:
        if not self._started or self._closed:
            raise RuntimeError("WanTestbed is not running (use it as a context manager)")
        try:
            return self._regions[region]
        except KeyError:
            raise KeyError(f"unknown region {region!r}; regions: {', '.join(self._regions)}") from None

    def profile(self, region: str) -> LinkProfile:
        return self._region(region).profile

    def namespace(self, region: str) -> str | None:
        """The region's network namespace name (None in loopback mode)."""
        return self._region(region).ns

    def host_address(self, region: str) -> str:
        """The root-side address the region reaches exposed services on."""
        return self._region(region).host_ip

    def region_address(self, region: str) -> str:
        """The region side's own address (what the root namespace sees as the peer)."""
        return self._region(region).region_ip

    # -- exposing services ---------------------------------------------------

    def expose(self, region: str, upstream: Address, *, profile: LinkProfile | None = None) -> Address:
        """The address a process in ``region`` uses to reach ``upstream`` (a root-namespace service).

        Starts a proxy on the region's host address with the region's profile (or
        ``profile``); the same upstream exposed twice returns the same address.
        Proxy ``j`` of a region draws from seed ``profile.seed + 7919 * j``.
        """
        r = self._region(region)
        upstream = (upstream[0], int(upstream[1]))
        if upstream in r.proxies:
            return r.proxies[upstream].address
        prof = profile or r.profile
        prof = prof.with_(seed=prof.seed + 7919 * len(r.proxies))
        assert self._loop is not None
        name = f"{region}->{upstream}"
        userspace_rate = r.ns is None and prof.rate_mbit is not None
        proxy: Proxy | ProxyWorkers
        if self.proxy_workers > 1 and not userspace_rate:
            proxy = ProxyWorkers(upstream, prof, listen=(r.host_ip, 0), workers=self.proxy_workers, name=name)
            proxy.start()
        else:
            proxy = self._loop.start_proxy(upstream, prof, listen=(r.host_ip, 0), rate_limit=(r.ns is None), name=name)
        r.proxies[upstream] = proxy
        return proxy.address

    def expose_url(self, region: str, url: str, *, profile: LinkProfile | None = None) -> str:
        """``url`` (http://, redis://, ...) with host:port replaced by the exposed address."""
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ConfigError(f"expose_url {url!r}: needs an explicit host and port")
        host, port = self.expose(region, (parts.hostname, parts.port), profile=profile)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{host}:{port}" if userinfo else f"{host}:{port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def proxies(self, region: str) -> dict[Address, Proxy | ProxyWorkers]:
        return dict(self._region(region).proxies)

    # -- processes -----------------------------------------------------------

    def command(self, region: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so it runs inside the region."""
        ns = self._region(region).ns
        return ["ip", "netns", "exec", ns, *argv] if ns else list(argv)

    def popen(self, region: str, argv: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the region; stopped (SIGTERM, then SIGKILL) at teardown."""
        r = self._region(region)
        proc = subprocess.Popen(self.command(region, argv), env=dict(env) if env is not None else None, **kw)
        r.procs.append(proc)
        return proc

    def run(self, region: str, argv: Sequence[str], *, timeout: float | None = None, **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside the region to completion (``subprocess.run`` semantics)."""
        return subprocess.run(self.command(region, argv), timeout=timeout, **kw)

    # -- counters ------------------------------------------------------------

    def stats(self, region: str) -> RegionStats:
        r = self._region(region)
        proxy = sum((p.stats() for p in r.proxies.values()), ProxyStats())
        if r.ns is None or r.veth_root is None or r.veth_ns is None:
            return RegionStats(region, proxy)
        return RegionStats(
            region,
            proxy,
            veth_bytes_down=sysfs_counter(r.veth_root, "tx_bytes"),
            veth_bytes_up=sysfs_counter(r.veth_root, "rx_bytes"),
            tc_dropped_down=tc_dropped(None, r.veth_root),
            tc_dropped_up=tc_dropped(r.ns, r.veth_ns),
        )

    def all_stats(self) -> dict[str, RegionStats]:
        return {name: self.stats(name) for name in self._regions}


def _stop(proc: subprocess.Popen[Any], grace_s: float = 3.0) -> None:
    stop_process(proc, grace_s)


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C during teardown (main thread only), so a second one cannot leave debris."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hit: list[object] = []
    previous = signal.signal(signal.SIGINT, lambda *a: hit.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if hit:
            raise KeyboardInterrupt


# ---------------------------------------------------------------------------
# CLI: python -m aurora_tools.wan.netns up|down


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from aurora_tools.wan.profile import parse_region_spec
    from aurora_tools.wan.proxy import parse_address

    ap = argparse.ArgumentParser(
        prog="python -m aurora_tools.wan.netns",
        description="Bring a WAN testbed up (foreground, Ctrl-C tears it down) or remove leftovers of dead ones.",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create regions and expose loopback services into them")
    up.add_argument(
        "--regions",
        nargs="+",
        required=True,
        metavar="SPEC",
        help="NAME:RATE:RTT[:key=value...], e.g. eu:1000mbit:60ms:jitter=5ms:stall=0.01/300ms",
    )
    up.add_argument(
        "--expose",
        nargs="*",
        default=[],
        type=parse_address,
        metavar="HOST:PORT",
        help="loopback services to expose into every region (S3, Redis, ...)",
    )
    up.add_argument("--prefix", default=None, help="name prefix (default aur<pid>)")
    up.add_argument("--mode", choices=["netns", "loopback", "auto"], default="netns")
    down = sub.add_parser("down", help="delete namespaces and veths of testbeds whose process is gone")
    down.add_argument("--prefix", default="aur")
    down.add_argument("--force", action="store_true", help="also those of live processes")
    args = ap.parse_args(argv)

    if args.cmd == "down":
        for what in cleanup_stale(args.prefix, force=args.force):
            print(f"removed {what}")
        return 0

    regions = dict(parse_region_spec(s) for s in args.regions)

    def on_term(*_: object) -> None:
        raise KeyboardInterrupt  # `kill <pid>` tears down like Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    with WanTestbed(regions, prefix=args.prefix, mode=args.mode) as tb:
        for name in tb.regions:
            ns = tb.namespace(name)
            print(f"region {name}: {tb.profile(name)}")
            print(f"  namespace {ns or '-'}  host side {tb.host_address(name)}  region side {tb.region_address(name)}")
            for upstream in args.expose:
                host, port = tb.expose(name, upstream)
                print(f"  {upstream[0]}:{upstream[1]} -> {host}:{port}")
            if ns:
                print(f"  run inside: ip netns exec {ns} <command>")
        print("up; Ctrl-C (or SIGTERM) tears it down", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
        print(json.dumps({name: st.as_dict() for name, st in tb.all_stats().items()}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
