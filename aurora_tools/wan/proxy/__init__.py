"""A seeded asyncio TCP proxy that makes a loopback hop look like a WAN link.

Each accepted connection is forwarded to one upstream ``(host, port)``. Per
direction the bytes go through a *delivery queue*: a reader task reads up to
256 KiB at a time, stamps each chunk with its due time (``now + delay +-
jitter``, never earlier than the chunk before it, so byte order holds) and
queues it; a sender task writes each chunk when it is due. The queue holds up
to ``LinkProfile.window_bytes`` in flight (queued, plus delivered bytes whose
"ACK" is still one delay away), so a link with 60 ms RTT carries a full window
per RTT, the way TCP does, instead of one chunk per delay.

Impairments, all drawn from :class:`~aurora_tools.wan.profile.ImpairmentPlan`
(seeded per connection, see ``profile.py``): a token-bucket rate limit shared
by all connections of the proxy per direction (optional: a netns testbed
shapes with tc instead), stalls and loss-like pauses placed at byte offsets,
and per connection a reset (RST to both ends) or a truncation (clean FIN to
both ends) after a random byte count.

Counters are kept under a lock and :meth:`Proxy.stats` may be called from any
thread. For sync code, :mod:`.loop` runs proxies on a background event loop
(:class:`ProxyLoop`, any number of proxies on one loop; :class:`ProxyThread`,
one proxy on its own). :mod:`.tcp` is the proxy itself, :mod:`.workers` the
same proxy in several processes (:class:`ProxyWorkers`, ``SO_REUSEPORT``), and
:mod:`.__main__` its command line.

CLI: ``python -m aurora_tools.wan.proxy --listen 127.0.0.1:0 --upstream
127.0.0.1:9000 --delay-ms 30 --jitter-ms 5 --seed 1`` prints the bound address
and forwards until interrupted; ``--selftest`` measures throughput.
"""

from __future__ import annotations

from aurora_tools.wan.proxy.loop import ProxyLoop, ProxyThread
from aurora_tools.wan.proxy.tcp import Address, Proxy, ProxyStats, parse_address
from aurora_tools.wan.proxy.workers import ProxyWorkers, default_workers

__all__ = ["Address", "Proxy", "ProxyStats", "ProxyLoop", "ProxyThread", "ProxyWorkers", "default_workers", "parse_address"]
