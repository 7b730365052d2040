"""Proxies for synchronous code: a background thread with its own event loop.

:class:`ProxyLoop` hosts any number of :class:`~aurora_tools.wan.proxy.tcp.Proxy`
objects on one loop (what :class:`~aurora_tools.wan.netns.WanTestbed` uses);
:class:`ProxyThread` is one proxy on a loop of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from aurora_tools.wan.profile import LinkProfile
from aurora_tools.wan.proxy.tcp import Address, Proxy, ProxyStats

__all__ = ["ProxyLoop", "ProxyThread"]

T = TypeVar("T")


class ProxyLoop:
    """A background thread with its own event loop, hosting any number of proxies."""

    def __init__(self, name: str = "aurora-wan-proxy") -> None:
        self.loop = asyncio.new_event_loop()
        self._proxies: list[Proxy] = []
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closed = False

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_proxy(
        self,
        upstream: Address,
        profile: LinkProfile | None = None,
        *,
        listen: Address = ("127.0.0.1", 0),
        rate_limit: bool = True,
        name: str = "",
    ) -> Proxy:
        if self._closed:
            raise RuntimeError("ProxyLoop is closed")
        proxy = Proxy(upstream, profile, listen=listen, rate_limit=rate_limit, name=name)
        self.call(proxy.start())
        self._proxies.append(proxy)
        return proxy

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                self.call(asyncio.wait_for(self._close_all(), 10.0), timeout=15.0)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10.0)
            if not self._thread.is_alive():
                self.loop.close()

    async def _close_all(self) -> None:
        await asyncio.gather(*(p.close() for p in self._proxies), return_exceptions=True)

    def __enter__(self) -> ProxyLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ProxyThread:
    """One :class:`Proxy` on its own background loop: ``.address``, ``.stats()``, ``.close()``."""

    def __init__(
        self, upstream: Address, profile: LinkProfile | None = None, *, listen: Address = ("127.0.0.1", 0), rate_limit: bool = True
    ) -> None:
        self._loop = ProxyLoop()
        try:
            self.proxy = self._loop.start_proxy(upstream, profile, listen=listen, rate_limit=rate_limit)
        except BaseException:
            self._loop.close()
            raise

    @property
    def address(self) -> Address:
        return self.proxy.address

    @property
    def profile(self) -> LinkProfile:
        return self.proxy.profile

    def stats(self) -> ProxyStats:
        return self.proxy.stats()

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> ProxyThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
