"""WAN emulation on one machine: a seeded impairing TCP proxy and a netns testbed.

- :mod:`.profile`: :class:`~.profile.LinkProfile` and the seeded per-connection decisions (pure).
- :mod:`.proxy`: the asyncio proxy (:class:`~.proxy.Proxy`) and, for sync code,
  :class:`~.proxy.ProxyLoop` and :class:`~.proxy.ProxyThread`; ``python -m aurora_tools.wan.proxy``.
- :mod:`.netns`: :class:`~.netns.WanTestbed`, network namespaces + veth + tc per region, or
  loopback only; ``python -m aurora_tools.wan.netns up|down``.
- :mod:`.host`: the ``ip``/``tc`` commands it runs, and ``cleanup_stale``.
- :mod:`.selftest`: throughput of each path, as a table and JSON.

Import names from their module (``from aurora_tools.wan.netns import
WanTestbed``): this package imports none of them, so ``python -m
aurora_tools.wan.netns`` runs its module once. See ``docs/WAN.md``.
"""
