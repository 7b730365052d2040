"""Link profiles and the seeded impairment decisions drawn from them.

Pure logic, no sockets: a :class:`LinkProfile` says what a link does (rate,
one-way delay, jitter, stalls, resets, truncation, loss-like pauses); an
:class:`ImpairmentPlan` holds every random decision for one connection, drawn
from generators seeded with ``(profile.seed, connection index, direction,
kind)``, so a run is reproducible and the decision stream can be tested
without a clock.

Stalls and loss pauses are placed in *byte space*: for each MiB forwarded in a
direction, one Bernoulli draw decides whether a stall (and, independently, a
loss pause) happens inside it and at which byte offset. How the proxy's reads
happen to be chunked therefore never changes which bytes are held back.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace
from typing import Literal

from aurora_store.errors import ConfigError

__all__ = [
    "MIB",
    "LinkProfile",
    "Fault",
    "PauseEvent",
    "DirectionPlan",
    "ImpairmentPlan",
    "parse_region_spec",
]

MIB = 1 << 20

Direction = Literal["up", "down"]
"""``up``: client -> upstream (out of a region); ``down``: upstream -> client (into it)."""


@dataclass(frozen=True, slots=True)
class LinkProfile:
    """What one link does to the bytes crossing it, in each direction."""

    rate_mbit: float | None = None
    """Rate limit in Mbit/s per direction (tc in a netns testbed, a token bucket in the proxy
    otherwise); None for unlimited."""
    delay_ms: float = 0.0
    """One-way delay added to each direction; RTT through the link is ``2 * delay_ms``."""
    jitter_ms: float = 0.0
    """Each chunk is delayed by ``delay_ms +- uniform(jitter_ms)``; byte order is kept."""
    stall_prob: float = 0.0
    """Probability, per MiB forwarded in a direction, of pausing that direction for ``stall_ms``."""
    stall_ms: float = 500.0
    """Length of one stall."""
    reset_prob: float = 0.0
    """Probability per connection of an abort (RST to both ends) after a random byte count."""
    truncate_prob: float = 0.0
    """Probability per connection of a clean close (FIN to both ends) after a random byte count."""
    loss_prob: float = 0.0
    """Probability, per MiB forwarded in a direction, of a retransmission-timeout-like pause."""
    loss_pause_ms: float = 200.0
    """Length of one loss-like pause (Linux's minimum RTO is 200 ms)."""
    seed: int = 0
    """Seed of every random decision; connection ``i`` draws from ``(seed, i, ...)``."""
    window_bytes: int = 8 * MIB
    """Emulated TCP window: bytes in flight per direction per connection, released one
    one-way delay after delivery (the ACK's trip back). One connection carries at most
    ``window_bytes / RTT`` (8 MiB at 60 ms RTT: ~140 MB/s); more streams, more windows."""
    fault_within_bytes: int = 16 * MIB
    """A reset or truncation happens after ``uniform[0, fault_within_bytes)`` bytes (both
    directions counted together); a connection that carries fewer bytes never sees it."""

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ConfigError(f"LinkProfile.rate_mbit={self.rate_mbit!r}: must be > 0 or None")
        for name in ("delay_ms", "jitter_ms", "stall_ms", "loss_pause_ms"):
            if getattr(self, name) < 0:
                raise ConfigError(f"LinkProfile.{name}={getattr(self, name)!r}: must be >= 0")
        for name in ("stall_prob", "reset_prob", "truncate_prob", "loss_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"LinkProfile.{name}={getattr(self, name)!r}: must be in [0, 1]")
        if self.reset_prob + self.truncate_prob > 1.0:
            raise ConfigError(f"LinkProfile.reset_prob + truncate_prob = {self.reset_prob + self.truncate_prob}: must be <= 1")
        if self.window_bytes < 64 * 1024:
            raise ConfigError(f"LinkProfile.window_bytes={self.window_bytes}: must be >= 65536")
        if self.fault_within_bytes < 1:
            raise ConfigError(f"LinkProfile.fault_within_bytes={self.fault_within_bytes}: must be >= 1")

    @property
    def rtt_ms(self) -> float:
        return 2.0 * self.delay_ms

    @property
    def rate_bytes_per_s(self) -> float | None:
        return None if self.rate_mbit is None else self.rate_mbit * 1e6 / 8.0

    @property
    def impaired(self) -> bool:
        """True when the proxy has anything to do besides forwarding (rate aside)."""
        return bool(self.delay_ms or self.jitter_ms or self.stall_prob or self.reset_prob or self.truncate_prob or self.loss_prob)

    def with_(self, **changes: object) -> LinkProfile:
        return replace(self, **changes)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# region specs: "eu:1000mbit:60ms:jitter=5ms:stall=0.01/300ms"

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)bit$")
_MS = re.compile(r"^(\d+(?:\.\d+)?)ms$")
_REGION = re.compile(r"^[a-z][a-z0-9_]{0,15}$")


def _ms(key: str, text: str) -> float:
    m = _MS.match(text)
    if m is None:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"region spec {key}={text!r}: expected milliseconds like 30ms") from None
    return float(m.group(1))


def _prob_and_ms(key: str, text: str) -> tuple[float, float | None]:
    p, _, ms = text.partition("/")
    try:
        prob = float(p)
    except ValueError:
        raise ConfigError(f"region spec {key}={text!r}: expected PROB or PROB/MSms") from None
    return prob, (_ms(key, ms) if ms else None)


def parse_region_spec(spec: str) -> tuple[str, LinkProfile]:
    """``NAME:TOKEN:TOKEN...`` -> ``(name, LinkProfile)``.

    Tokens: ``1000mbit`` / ``1gbit`` (rate), a bare ``60ms`` (the round-trip time,
    split into ``delay_ms=30`` each way), and ``key=value`` for ``rtt``, ``delay``
    (one way), ``jitter``, ``stall=P[/MSms]``, ``loss=P[/MSms]``, ``reset=P``,
    ``truncate=P``, ``window=BYTES``, ``seed=N``. Probabilities of stalls and
    losses are per MiB. Example: ``eu:1000mbit:60ms:jitter=5ms:stall=0.02/300ms``.
    """
    name, *tokens = spec.split(":")
    if not _REGION.match(name):
        raise ConfigError(f"region spec {spec!r}: name must match {_REGION.pattern}")
    kw: dict[str, float | int | None] = {}
    for tok in tokens:
        tok = tok.strip().lower()
        if not tok:
            continue
        rate = _RATE.match(tok)
        if rate is not None:
            kw["rate_mbit"] = float(rate.group(1)) * {"k": 1e-3, "m": 1.0, "g": 1e3}[rate.group(2)]
            continue
        if _MS.match(tok):
            kw["delay_ms"] = _ms("rtt", tok) / 2.0
            continue
        key, eq, value = tok.partition("=")
        if not eq:
            raise ConfigError(f"region spec {spec!r}: token {tok!r} is not RATE, RTTms or key=value")
        if key == "rtt":
            kw["delay_ms"] = _ms(key, value) / 2.0
        elif key == "delay":
            kw["delay_ms"] = _ms(key, value)
        elif key == "jitter":
            kw["jitter_ms"] = _ms(key, value)
        elif key in ("stall", "loss"):
            prob, ms = _prob_and_ms(key, value)
            kw[f"{key}_prob"] = prob
            if ms is not None:
                kw["stall_ms" if key == "stall" else "loss_pause_ms"] = ms
        elif key in ("reset", "truncate"):
            kw[f"{key}_prob"] = _prob_and_ms(key, value)[0]
        elif key in ("window", "seed"):
            try:
                kw["window_bytes" if key == "window" else "seed"] = int(value)
            except ValueError:
                raise ConfigError(f"region spec {spec!r}: {key}={value!r} is not an integer") from None
        else:
            raise ConfigError(f"region spec {spec!r}: unknown key {key!r}")
    return name, LinkProfile(**kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# decisions


@dataclass(frozen=True, slots=True)
class Fault:
    """The connection-level fault drawn for one connection."""

    kind: Literal["reset", "truncate"]
    at_bytes: int
    """Bytes forwarded (both directions together) before the fault strikes."""


@dataclass(frozen=True, slots=True)
class PauseEvent:
    """Hold back a direction's bytes from ``offset`` on for ``pause_s``."""

    offset: int
    kind: Literal["stall", "loss"]
    pause_s: float


@dataclass(slots=True)
class DirectionPlan:
    """The random decisions for one direction of one connection.

    ``events_between(a, b)`` is a pure function of the seed: which pause events
    fall in the byte range ``[a, b)``. ``jitter_s()`` yields the next jitter
    sample (one per chunk; chunking is timing-dependent, the sequence is not).
    """

    profile: LinkProfile
    conn_index: int
    direction: Direction
    _units: list[tuple[PauseEvent, ...]] = field(default_factory=list)
    _events_rng: random.Random = field(init=False)
    _jitter_rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        base = f"{self.profile.seed}/{self.conn_index}/{self.direction}"
        # str seeds hash through sha512: stable across processes and PYTHONHASHSEED.
        self._events_rng = random.Random(f"{base}/events")
        self._jitter_rng = random.Random(f"{base}/jitter")

    def _unit(self, u: int) -> tuple[PauseEvent, ...]:
        p = self.profile
        while len(self._units) <= u:
            base = len(self._units) * MIB
            rng = self._events_rng
            # Always four draws per MiB, so one kind's probability never shifts the other's stream.
            s_hit, s_off, l_hit, l_off = rng.random(), rng.random(), rng.random(), rng.random()
            unit: list[PauseEvent] = []
            if s_hit < p.stall_prob:
                unit.append(PauseEvent(base + int(s_off * MIB), "stall", p.stall_ms / 1e3))
            if l_hit < p.loss_prob:
                unit.append(PauseEvent(base + int(l_off * MIB), "loss", p.loss_pause_ms / 1e3))
            unit.sort(key=lambda e: e.offset)
            self._units.append(tuple(unit))
        return self._units[u]

    def events_between(self, start: int, end: int) -> list[PauseEvent]:
        if end <= start or not (self.profile.stall_prob or self.profile.loss_prob):
            return []
        out: list[PauseEvent] = []
        for u in range(start // MIB, (end - 1) // MIB + 1):
            out.extend(e for e in self._unit(u) if start <= e.offset < end)
        return out

    def jitter_s(self) -> float:
        j = self.profile.jitter_ms
        return self._jitter_rng.uniform(-j, j) / 1e3 if j else 0.0


@dataclass(slots=True)
class ImpairmentPlan:
    """Every random decision for connection number ``conn_index`` of a link."""

    profile: LinkProfile
    conn_index: int
    fault: Fault | None = field(init=False)
    up: DirectionPlan = field(init=False)
    down: DirectionPlan = field(init=False)

    def __post_init__(self) -> None:
        p = self.profile
        rng = random.Random(f"{p.seed}/{self.conn_index}/fault")
        r, at = rng.random(), rng.randrange(p.fault_within_bytes)
        self.fault = Fault("reset", at) if r < p.reset_prob else Fault("truncate", at) if r < p.reset_prob + p.truncate_prob else None
        self.up = DirectionPlan(p, self.conn_index, "up")
        self.down = DirectionPlan(p, self.conn_index, "down")
