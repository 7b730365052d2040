"""The asyncio TCP proxy: connections, per-direction delivery queues, the shared rate limit, counters."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

from aurora_tools.wan.profile import Direction, DirectionPlan, ImpairmentPlan, LinkProfile

__all__ = ["Proxy", "ProxyStats", "Address", "CHUNK", "parse_address"]

Address = tuple[str, int]

CHUNK = 256 * 1024
"""Largest read per system call."""
_RATE_PIECE = 64 * 1024
"""Rate-limited chunks are cut to this size, so one 256 KiB read does not arrive as one burst."""
_WRITE_HIGH = 1024 * 1024
"""Transport write buffer high-water mark before a sender waits for drain."""


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """A snapshot of a proxy's counters (or the sum of several)."""

    bytes_up: int = 0
    """Bytes delivered client -> upstream (out of the region the client sits in)."""
    bytes_down: int = 0
    """Bytes delivered upstream -> client (into the client's region)."""
    connections: int = 0
    """Connections accepted so far."""
    active: int = 0
    """Connections open now."""
    resets: int = 0
    """Injected resets."""
    truncations: int = 0
    """Injected truncations."""
    stalls: int = 0
    loss_pauses: int = 0
    upstream_errors: int = 0
    """Connections the upstream refused, or that either end reset by itself."""

    def __add__(self, other: ProxyStats) -> ProxyStats:
        return ProxyStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class _Counters:
    """Mutable counters; written on the proxy's loop, read from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, int] = {f.name: 0 for f in dataclasses.fields(ProxyStats)}

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.values[key] += n

    def snapshot(self) -> ProxyStats:
        with self.lock:
            return ProxyStats(**self.values)


class _TokenBucket:
    """A shared rate limit (GCRA): reserve ``n`` bytes, sleep until they conform."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float) -> None:
        self.rate = rate_bytes_per_s
        self.tau = burst_bytes / rate_bytes_per_s
        self.tat = 0.0

    async def take(self, n: int) -> None:
        now = asyncio.get_running_loop().time()
        # Reservations are taken in call order, so connections sharing a link are served FIFO.
        self.tat = max(self.tat, now) + n / self.rate
        wait = self.tat - self.tau - now
        if wait > 0:
            await asyncio.sleep(wait)


_EOF, _RESET, _TRUNCATE = object(), object(), object()


class _DelayQueue:
    """Chunks with due times, bounded by bytes: the link's in-flight window."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.items: collections.deque[tuple[float, Any]] = collections.deque()
        self.bytes = 0
        self.nonempty = asyncio.Event()
        self.space = asyncio.Event()
        self.space.set()

    def put(self, due: float, item: Any) -> None:
        self.items.append((due, item))
        if isinstance(item, bytes):
            self.bytes += len(item)
            if self.bytes >= self.window:
                self.space.clear()
        self.nonempty.set()

    async def get(self) -> tuple[float, Any]:
        while not self.items:
            self.nonempty.clear()
            await self.nonempty.wait()
        return self.items.popleft()

    def release(self, n: int) -> None:
        self.bytes -= n
        if self.bytes < self.window:
            self.space.set()


class _Connection:
    """One proxied connection: two directions, four tasks, one fault budget."""

    def __init__(self, proxy: Proxy, plan: ImpairmentPlan, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.plan = plan
        self.writers = (client, upstream)
        self.forwarded = 0  # both directions, for the fault's byte count
        self.fault_fired = False
        self.eofs = 0
        self.tasks: list[asyncio.Task[None]] = []
        self.done = False

    def take(self, n: int) -> tuple[int, Any]:
        """How many of the next ``n`` bytes may pass, and the fault sentinel if it strikes."""
        fault = self.plan.fault
        if fault is None or self.fault_fired:
            self.forwarded += n
            return n, None
        allowed = max(0, min(n, fault.at_bytes - self.forwarded))
        self.forwarded += allowed
        if allowed < n or self.forwarded >= fault.at_bytes:
            self.fault_fired = True
            return allowed, _RESET if fault.kind == "reset" else _TRUNCATE
        return n, None

    def _finish(self) -> None:
        self.done = True
        me = asyncio.current_task()
        for t in self.tasks:
            if t is not me:
                t.cancel()

    def abort(self) -> None:
        """RST to both ends (SO_LINGER 0 then close without flushing)."""
        if self.done:
            return
        for w in self.writers:
            with contextlib.suppress(OSError):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()
        self._finish()

    def close_clean(self) -> None:
        """FIN to both ends after what was already written (truncation, or both sides done)."""
        if self.done:
            return
        for w in self.writers:
            w.close()
        self._finish()

    def eof_delivered(self) -> None:
        self.eofs += 1
        if self.eofs == 2:
            self.close_clean()


class _Direction:
    """Reader -> delivery queue -> sender, for one direction of one connection."""

    def __init__(
        self, conn: _Connection, name: Direction, plan: DirectionPlan, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        proxy = conn.proxy
        self.conn, self.name, self.plan = conn, name, plan
        self.reader, self.writer = reader, writer
        self.profile = proxy.profile
        self.bucket = proxy._buckets.get(name)
        self.counters = proxy._counters
        self.queue = _DelayQueue(proxy.profile.window_bytes)
        self.pos = 0
        self.last_due = 0.0

    def _enqueue(self, data: bytes) -> None:
        loop_time = asyncio.get_running_loop().time
        delay = self.profile.delay_ms / 1e3
        events = self.plan.events_between(self.pos, self.pos + len(data))
        cuts = [e.offset - self.pos for e in events] + [len(data)]
        start, hold = 0, 0.0
        for i, cut in enumerate(cuts):
            if cut > start:
                # A pause is a gap of pause_s after the previous byte's delivery; later chunks
                # queue behind it, so the whole direction waits (and the sender's window fills,
                # as behind a real stall). Pauses add up even when the reader is far ahead.
                due = max(self.last_due, loop_time() + delay + self.plan.jitter_s()) + hold
                self.queue.put(due, data[start:cut])
                self.last_due = due
                start, hold = cut, 0.0
            if i < len(events):
                hold += events[i].pause_s
                self.counters.add("stalls" if events[i].kind == "stall" else "loss_pauses")
        self.pos += len(data)

    async def feed(self) -> None:
        while True:
            try:
                data = await self.reader.read(CHUNK)
            except OSError:
                self.counters.add("upstream_errors")
                self.conn.abort()
                return
            if not data:
                self.queue.put(self.last_due, _EOF)
                return
            allowed, fault = self.conn.take(len(data))
            data = data[:allowed]
            if self.bucket is not None:
                for i in range(0, len(data), _RATE_PIECE):
                    await self.bucket.take(len(data[i : i + _RATE_PIECE]))
                    self._enqueue(data[i : i + _RATE_PIECE])
            elif data:
                self._enqueue(data)
            if fault is not None:
                self.queue.put(self.last_due, fault)
                return
            await self.queue.space.wait()

    async def deliver(self) -> None:
        loop = asyncio.get_running_loop()
        w = self.writer
        key = "bytes_up" if self.name == "up" else "bytes_down"
        delay = self.profile.delay_ms / 1e3
        while True:
            due, item = await self.queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if item is _EOF:
                with contextlib.suppress(OSError):
                    if w.can_write_eof():
                        w.write_eof()
                self.conn.eof_delivered()
                return
            if item is _RESET:
                self.counters.add("resets")
                self.conn.abort()
                return
            if item is _TRUNCATE:
                self.counters.add("truncations")
                self.conn.close_clean()
                return
            try:
                w.write(item)
                self.counters.add(key, len(item))
                await w.drain()
            except OSError:
                self.counters.add("upstream_errors")
                self.conn.abort()
                return
            if delay > 0:
                # The window frees up when the "ACK" is back, one more one-way delay later:
                # so one connection carries at most window_bytes per RTT, as TCP does.
                loop.call_later(delay, self.queue.release, len(item))
            else:
                self.queue.release(len(item))


class Proxy:
    """Forward ``listen`` to ``upstream`` through a :class:`LinkProfile`. Asyncio API.

    ``rate_limit=False`` ignores ``profile.rate_mbit`` (when tc shapes the link instead).
    """

    def __init__(
        self,
        upstream: Address,
        profile: LinkProfile | None = None,
        *,
        listen: Address = ("127.0.0.1", 0),
        rate_limit: bool = True,
        name: str = "",
        counters: Any = None,
        index_start: int = 0,
        index_step: int = 1,
    ) -> None:
        self.upstream = (upstream[0], int(upstream[1]))
        self.profile = profile or LinkProfile()
        self.listen = listen
        self.name = name or f"proxy->{upstream[0]}:{upstream[1]}"
        # A worker process of a multi-process proxy (.workers) counts into shared memory, and
        # numbers its connections start, start + step, ...: indices stay unique across workers.
        self._counters = counters if counters is not None else _Counters()
        self._index_step = max(1, int(index_step))
        self._buckets: dict[str, _TokenBucket] = {}
        rate = self.profile.rate_bytes_per_s if rate_limit else None
        if rate is not None:
            # 5 ms of line rate: the loop's timers are ~1 ms coarse, and a smaller bucket
            # loses credit to every late wake-up (2 ms gave 78% of 1 Gbit/s, 5 ms 93%).
            burst = max(4 * _RATE_PIECE, rate * 0.005)
            self._buckets = {d: _TokenBucket(rate, burst) for d in ("up", "down")}
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_Connection] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._next_index = int(index_start)
        self.address: Address = ("", 0)

    async def start(self, sock: socket.socket | None = None) -> Address:
        """Listen on ``self.listen``, or accept on ``sock`` (a listening socket made elsewhere)."""
        if sock is not None:
            self._server = await asyncio.start_server(self._handle, sock=sock, limit=4 * CHUNK)
        else:
            self._server = await asyncio.start_server(self._handle, self.listen[0], self.listen[1], limit=4 * CHUNK, reuse_address=True)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)
        return self.address

    def stats(self) -> ProxyStats:
        """Thread-safe snapshot of the counters."""
        return self._counters.snapshot()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.abort()
        for t in list(self._handlers):
            t.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Proxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self._handlers.add(me)
        index = self._next_index
        self._next_index += self._index_step
        self._counters.add("connections")
        self._counters.add("active")
        try:
            await self._serve(index, c_reader, c_writer)
        except asyncio.CancelledError:
            # Proxy.close(): end quietly; asyncio's stream callback would log a cancelled task.
            pass
        finally:
            self._counters.add("active", -1)
            self._handlers.discard(me)

    async def _serve(self, index: int, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        _nodelay(c_writer)
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream, limit=4 * CHUNK)
        except OSError:
            self._counters.add("upstream_errors")
            c_writer.transport.abort()
            return
        _nodelay(u_writer)
        plan = ImpairmentPlan(self.profile, index)
        conn = _Connection(self, plan, c_writer, u_writer)
        up = _Direction(conn, "up", plan.up, c_reader, u_writer)
        down = _Direction(conn, "down", plan.down, u_reader, c_writer)
        # The client's connect() returned at once; over the link SYN and SYN-ACK take one RTT
        # first, so its first byte reaches the upstream after 1.5 RTT, not 0.5 (as on a WAN,
        # a new connection costs an RTT).
        up.last_due = asyncio.get_running_loop().time() + 3 * self.profile.delay_ms / 1e3
        conn.tasks = [asyncio.create_task(c) for d in (up, down) for c in (d.feed(), d.deliver())]
        self._conns.add(conn)
        try:
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            if not conn.done:  # cancelled from outside
                conn.abort()


def _nodelay(w: asyncio.StreamWriter) -> None:
    sock = w.get_extra_info("socket")
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    w.transport.set_write_buffer_limits(high=_WRITE_HIGH)


def parse_address(text: str) -> Address:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host or "127.0.0.1", int(port)
