"""Which versions live Actors and Relays still need: the running system's answer to retention.

The lineage layer asks through its ``HeldVersions`` interface
(:mod:`aurora_store.lineage.interfaces`) and knows nothing of Redis; this
module answers it from Redis:

- :class:`LedgerHeldVersions`: the versions live Actors hold (active) or
  are staging, from the ledger's Actor records (optionally one region's:
  what a Relay's mirror must keep);
- :class:`RelayHeldVersions`: the versions live Relays are mirroring, from
  the ``relay-held:{region}`` key each Relay refreshes with its heartbeat
  (:func:`relay_held_value` writes it, :func:`parse_relay_held` reads it);
- :class:`UnionHeld` and :func:`run_held_versions`: all of them, for the
  Trainer's retention and ``aurora gc --redis``;
- :class:`LedgerOpenBatches`: the steps whose batches may still read the
  result objects Actors wrote (``OpenBatches``,
  :mod:`aurora_store.lineage.results`); :func:`run_held_versions` answers it
  too, so the same callers keep those results.

Every read goes to Redis afresh; a failure propagates
(:class:`~aurora_store.errors.RedisUnavailable`), so retention skips a round
rather than deleting what it could not ask about. What Redis holds is
untrusted (any Actor's credential writes it), so its answers are only ever
used to keep more: a forged open step keeps some results a while longer, and
nothing Redis says makes retention delete anything.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from typing import Any

from aurora_store.coordination.decode import as_str
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger import ActorRecord, Ledger
from aurora_store.coordination.redisconn import translate_redis_errors
from aurora_store.errors import ConfigError
from aurora_store.lineage.interfaces import HeldVersions

__all__ = [
    "LedgerHeldVersions",
    "LedgerOpenBatches",
    "RelayHeldVersions",
    "RunHeld",
    "UnionHeld",
    "parse_relay_held",
    "relay_held_value",
    "run_held_versions",
    "versions_held_by",
]

#: Most versions one ``relay-held`` value may name; a longer one is not a Relay's.
MAX_RELAY_HELD = 4096
#: Largest version number accepted from Redis (bytes there are untrusted).
_MAX_VERSION = 1 << 40


def versions_held_by(a: ActorRecord) -> frozenset[int]:
    """The versions one Actor holds or is staging: its active one, its staged one, and those between.

    An Actor on ``active`` with ``staged`` > ``active`` holds every delta in
    between (staged in order, waiting for their Commit). Negative values
    (an Actor that has staged nothing yet reports ``-1``) are no versions.
    """
    out: set[int] = set()
    if a.active is not None:
        out.add(a.active)
    if a.staged is not None:
        lo = a.staged if a.active is None else min(a.active, a.staged)
        if a.staged - lo <= MAX_RELAY_HELD:
            out.update(range(lo, a.staged + 1))
        else:
            # Numbers written by an Actor (untrusted): never a loop over them. The ends are
            # enough, as retention keeps every delta after a held version anyway.
            out.update((lo, a.staged))
    return frozenset(v for v in out if 0 <= v < _MAX_VERSION)


class LedgerHeldVersions:
    """``HeldVersions`` over a ledger: versions of live Actors (registered, ``alive``, heard from recently).

    ``heartbeat_timeout_ms``: an ``alive`` Actor silent for longer than this
    holds nothing (the Trainer reaps it with the same timeout); None counts
    every Actor the registry still calls ``alive``. ``region``: only that
    region's Actors (a Relay cleaning its mirror). Each call reads the
    registry afresh.
    """

    def __init__(self, ledger: Ledger, heartbeat_timeout_ms: int | None = None, region: str | None = None) -> None:
        if heartbeat_timeout_ms is not None and heartbeat_timeout_ms <= 0:
            raise ConfigError(f"heartbeat_timeout_ms must be positive, got {heartbeat_timeout_ms}")
        self.ledger = ledger
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.region = region

    def held_versions(self) -> frozenset[int]:
        """Versions that live Actors hold (active) or are staging (staged, and those before it)."""
        actors = [a for a in self.ledger.actors() if a.status == "alive" and (self.region is None or a.region == self.region)]
        if self.heartbeat_timeout_ms is not None and actors:
            now = self.ledger.server_time_ms()
            actors = [a for a in actors if now - a.heartbeat_ms <= self.heartbeat_timeout_ms]
        out: set[int] = set()
        for a in actors:
            out |= versions_held_by(a)
        return frozenset(out)


def relay_held_value(versions: Iterable[int]) -> str:
    """The ``relay-held:{region}`` value naming ``versions``: ``{"versions": [...]}``, sorted."""
    vs = sorted({int(v) for v in versions if int(v) >= 0})
    if len(vs) > MAX_RELAY_HELD:
        # The newest matter least (retention keeps them anyway); the oldest pin the chain.
        vs = vs[:MAX_RELAY_HELD]
    return json.dumps({"versions": vs}, separators=(",", ":"))


def parse_relay_held(raw: Any) -> frozenset[int] | None:
    """The versions of a ``relay-held`` value, or None if it is not one (untrusted bytes)."""
    if raw is None:
        return None
    try:
        text = as_str(raw)
        if len(text) > 16 * MAX_RELAY_HELD:
            return None
        doc = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return None
    vs = doc.get("versions") if isinstance(doc, dict) else None
    if not isinstance(vs, list) or len(vs) > MAX_RELAY_HELD:
        return None
    if not all(type(v) is int and 0 <= v < _MAX_VERSION for v in vs):
        return None
    return frozenset(vs)


class RelayHeldVersions:
    """``HeldVersions`` of the run's live Relays: each ``relay-held:{region}`` key (it expires with
    its Relay's heartbeat), unioned. A malformed value names no version."""

    def __init__(self, redis: Any, run: str) -> None:
        self.redis = redis
        self.keys = RunKeys(run)

    @translate_redis_errors("RelayHeldVersions.held_versions")
    def held_versions(self) -> frozenset[int]:
        names = sorted({as_str(k, "replace") for k in self.redis.scan_iter(match=self.keys.relay_held_pattern, count=500)})
        out: set[int] = set()
        if names:
            for raw in self.redis.mget(names):
                out |= parse_relay_held(raw) or frozenset()
        return frozenset(out)


class UnionHeld:
    """Every version any of ``sources`` holds (each asked in turn; the first failure propagates)."""

    def __init__(self, *sources: HeldVersions) -> None:
        self.sources = sources

    def held_versions(self) -> frozenset[int]:
        out: set[int] = set()
        for s in self.sources:
            out |= s.held_versions()
        return frozenset(out)


class LedgerOpenBatches:
    """``OpenBatches`` over a ledger: a step counts while the ledger holds it in any form.

    Open (in the run's ``steps`` set), or sealed and being read, or closed a
    moment ago (its hash, or the tombstone it leaves for ``closed_ttl_s``):
    the Trainer reads a closing batch's last results after the ledger dropped
    it. A step lost with Redis is issued again and its Actors write new
    objects; the old ones are read by nobody.
    """

    CHUNK = 1000
    """Steps asked per round trip."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    @translate_redis_errors("LedgerOpenBatches.open_batches")
    def open_batches(self, steps: Collection[int]) -> frozenset[int]:
        asked = sorted({int(s) for s in steps if 0 <= int(s) < _MAX_VERSION})
        held: set[int] = set()
        for i in range(0, len(asked), self.CHUNK):
            chunk = asked[i : i + self.CHUNK]
            pipe = self.ledger.r.pipeline(transaction=False)
            for s in chunk:
                pipe.zscore(self.ledger.k_steps, str(s))
                pipe.exists(self.ledger.k_step(s))
            # An answer that is an error (a planted key of the wrong type) is not None: it keeps the step.
            answers = pipe.execute(raise_on_error=False)
            for j, s in enumerate(chunk):
                in_set, exists = answers[2 * j], answers[2 * j + 1]
                if in_set is not None or exists:
                    held.add(s)
        return frozenset(held)


class RunHeld(UnionHeld):
    """Live Actors' and Relays' versions (:class:`UnionHeld`) and the ledger's open batches (:class:`LedgerOpenBatches`):
    everything retention of a run's origin asks Redis."""

    def __init__(self, ledger: Ledger, *sources: HeldVersions) -> None:
        super().__init__(*sources)
        self.batches = LedgerOpenBatches(ledger)

    def open_batches(self, steps: Collection[int]) -> frozenset[int]:
        return self.batches.open_batches(steps)


def run_held_versions(redis: Any, run: str, heartbeat_timeout_ms: int | None = None) -> RunHeld:
    """What retention of a run's origin store must keep: live Actors' versions and live Relays', and the results of open batches."""
    ledger = Ledger(redis, run)
    return RunHeld(ledger, LedgerHeldVersions(ledger, heartbeat_timeout_ms), RelayHeldVersions(redis, run))
