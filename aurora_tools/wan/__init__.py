"""WAN emulation on one machine: a seeded impairing TCP proxy and a netns testbed.

- :mod:`.profile`: :class:`LinkProfile` and the seeded per-connection decisions (pure).
- :mod:`.proxy`: the asyncio proxy (:class:`Proxy`, :class:`ProxyLoop`, :class:`ProxyThread`).
- :mod:`.netns`: :class:`WanTestbed`, network namespaces + veth + tc per region, or loopback only.
- :mod:`.selftest`: throughput of each path, as a table and JSON.

Names are imported lazily, so ``python -m aurora_tools.wan.proxy`` and
``python -m aurora_tools.wan.netns`` run their module once. See ``docs/WAN.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aurora_tools.wan.netns import (
        RegionStats,
        WanTestbed,
        WanUnavailable,
        cleanup_stale,
        wan_unavailable_reason,
    )
    from aurora_tools.wan.profile import LinkProfile, parse_region_spec
    from aurora_tools.wan.proxy import Proxy, ProxyLoop, ProxyStats, ProxyThread

_WHERE = {
    "LinkProfile": "profile",
    "parse_region_spec": "profile",
    "Proxy": "proxy",
    "ProxyLoop": "proxy",
    "ProxyStats": "proxy",
    "ProxyThread": "proxy",
    "WanTestbed": "netns",
    "WanUnavailable": "netns",
    "RegionStats": "netns",
    "cleanup_stale": "netns",
    "wan_unavailable_reason": "netns",
}

__all__ = [
    "LinkProfile",
    "parse_region_spec",
    "Proxy",
    "ProxyLoop",
    "ProxyStats",
    "ProxyThread",
    "WanTestbed",
    "WanUnavailable",
    "RegionStats",
    "cleanup_stale",
    "wan_unavailable_reason",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'aurora_tools.wan' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
