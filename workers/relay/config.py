"""What a Relay is told (:class:`RelayConfig`) and what it reports (:class:`RelayStats`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aurora_store.config import DEFAULT_STREAMS, STREAMS_ENV, Backoff, from_env, option
from aurora_store.coordination.keys import validate_run_name
from aurora_store.errors import ConfigError
from aurora_store.format.signing import TrustKeys
from aurora_store.lineage.gc import DEFAULT_GRACE_S
from aurora_store.lineage.prefetch import FETCH_MODES
from aurora_store.outage import DEFAULT_OUTAGE_BUDGET_S, OUTAGE_BUDGET_ENV
from aurora_store.redact import redacted_repr

__all__ = ["ENV_PREFIX", "RelayConfig", "RelayStats", "VersionId", "relay_config_from_env"]

ENV_PREFIX = "AURORA_RELAY_"
"""Prefix of the Relay's environment variables (``AURORA_RELAY_HEARTBEAT_S`` …);
``streams`` is ``AURORA_STREAMS``, shared with publishing."""

_REGION = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

VersionId = tuple[str, int]
"""(kind, version): ``("delta", 5)`` and ``("snapshot", 5)`` are different objects."""


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Where a Relay copies from and to, and how often it proves it is alive."""

    __repr__ = redacted_repr  # the Redis URL may hold a password; the options stay out (repr=False)

    origin: str
    """Run root at origin (``s3://bucket/prefix/run``, ``file:///path``)."""
    mirror: str
    """Run root of the region's mirror; also the value of the heartbeat key."""
    redis: str
    """Redis URL of the run."""
    run: str
    """Run name (Redis namespace)."""
    region: str
    """Region this Relay serves (letters, digits, ``.``, ``_``, ``-``)."""
    origin_options: Mapping[str, Any] = field(default_factory=dict, repr=False, metadata={"env": False})
    """fsspec storage options of the origin (may hold credentials: never logged)."""
    mirror_options: Mapping[str, Any] = field(default_factory=dict, repr=False, metadata={"env": False})
    """fsspec storage options of the mirror (may hold credentials: never logged)."""
    heartbeat_s: float = option(2.0, metavar="S", help="period of the heartbeat (seconds)")
    """Period of the heartbeat ``SET``."""
    ttl_s: float = option(6.0, metavar="S", help="heartbeat key TTL: how long Actors keep using a silent Relay's mirror")
    """TTL of the heartbeat key: how long Actors keep using a silent Relay's mirror."""
    block_ms: int = option(1000, metavar="MS", help="longest blocking stream read (ms)")
    """Longest blocking stream read; also bounds how long a stop takes to be noticed."""
    streams: int = option(DEFAULT_STREAMS, env=STREAMS_ENV, metavar="S", help="concurrent copies (connections to each store)")
    """Concurrent object copies (connections to each store); env ``AURORA_STREAMS``."""
    resync_s: float = option(60.0, metavar="S", help="list origin this often even without a gap; 0: never")
    """Period of a full listing of origin even without a gap (0: only on gaps and failures)."""
    retry_s: float = option(5.0, flag=None, help="delay before listing again after a version could not be mirrored")
    """Delay before listing again after a version could not be mirrored (or while the run has not
    appeared at origin); also the first wait of a quarantined version."""
    backoff: Backoff = field(default_factory=Backoff, metadata={"env": False})
    """First and longest delay between attempts to reach Redis or a store while it is away."""
    outage_budget_s: float = option(
        DEFAULT_OUTAGE_BUDGET_S,
        env=OUTAGE_BUDGET_ENV,
        metavar="S",
        help="give up (exit 1, one line) once Redis, origin or the mirror has been unreachable this long",
    )
    """How long Redis, origin or the mirror may stay unreachable before the Relay gives up
    (``--outage-budget-s``, env ``AURORA_OUTAGE_BUDGET_S``, shared with every worker)."""
    quarantine_max_s: float = option(600.0, flag=None, help="longest wait between attempts at a version that failed verification")
    """Longest wait between attempts at a version that failed verification (the first is ``retry_s``, then doubling)."""
    keep_snapshots: int = option(
        2,
        metavar="K",
        help="mirror retention: keep the newest K snapshots and everything after the oldest, plus what the region's live Actors hold; 0: keep everything",
    )
    """Mirror retention: keep the newest N snapshots and every version after the oldest of them,
    plus what the region's live Actors hold; older versions are not copied. 0: keep and copy every version."""
    gc_every_s: float = option(300.0, metavar="S", help="clean the mirror this often; 0: never")
    """Period of the mirror's retention (0: never clean it)."""
    grace_s: float = option(DEFAULT_GRACE_S, metavar="S", help="spare mirror orphans and temporary files younger than this")
    """Orphans and temporary files in the mirror younger than this are spared (a copy in flight)."""
    trust: TrustKeys | None = field(default=None, metadata={"env": False})
    """Mirror only versions signed by these keys (FORMAT.md §4.1; ``--trust-key``, env
    ``AURORA_TRUST_KEYS``): public keys only, a Relay never needs the private one. An
    unsigned, untrusted or badly signed manifest is quarantined and never written to the
    mirror (segments announced before it may already be copied: bytes, never decoded). None: no check."""
    actor_timeout_s: float = option(60.0, flag=None, help="a region Actor silent this long holds nothing the mirror must keep")
    """A region Actor silent for longer than this holds nothing the mirror must keep."""
    fetch: str = option(
        "announced",
        choices=FETCH_MODES,
        help="announced: copy each segment when origin announces it, before its manifest; "
        "manifest-first: copy only what a manifest lists, once it is read",
    )
    """``announced``: copy each segment the moment origin announces it (cut-through, before its
    manifest; verified against the announcement, and a version is mirrored only once its
    manifest lists every object with that sha256); ``manifest-first``: copy only what a
    manifest lists, once it is read (the path to measure prefetching against). ``--fetch``."""

    def __post_init__(self) -> None:
        validate_run_name(self.run)
        if not _REGION.fullmatch(self.region):
            raise ConfigError(f"region {self.region!r} must be 1-64 letters, digits, '.', '_' or '-'")
        if not self.origin or not self.mirror:
            raise ConfigError("a Relay needs an origin and a mirror URL")
        if self.origin.rstrip("/") == self.mirror.rstrip("/"):
            raise ConfigError(f"mirror {self.mirror!r} is the origin itself")
        if self.heartbeat_s <= 0 or self.ttl_s <= self.heartbeat_s:
            raise ConfigError(f"need 0 < heartbeat_s < ttl_s (got heartbeat_s={self.heartbeat_s}, ttl_s={self.ttl_s})")
        if self.block_ms < 1:
            raise ConfigError(f"block_ms must be >= 1 (0 would block forever), got {self.block_ms}")
        if not 1 <= self.streams <= 256:
            raise ConfigError(f"streams must be 1..256, got {self.streams}")
        if self.fetch not in FETCH_MODES:
            raise ConfigError(f"fetch must be one of {', '.join(FETCH_MODES)}, got {self.fetch!r}")
        if self.resync_s < 0 or self.retry_s <= 0:
            raise ConfigError(f"resync_s must be >= 0 and retry_s > 0 ({self.resync_s}, {self.retry_s})")
        if self.outage_budget_s <= 0 or self.quarantine_max_s < self.retry_s:
            raise ConfigError(
                f"need outage_budget_s > 0 and quarantine_max_s >= retry_s "
                f"(got {self.outage_budget_s}, {self.quarantine_max_s}, {self.retry_s})"
            )
        if self.keep_snapshots < 0 or self.gc_every_s < 0 or self.grace_s < 0 or self.actor_timeout_s <= 0:
            raise ConfigError(
                f"need keep_snapshots, gc_every_s, grace_s >= 0 and actor_timeout_s > 0 "
                f"(got {self.keep_snapshots}, {self.gc_every_s}, {self.grace_s}, {self.actor_timeout_s})"
            )


def relay_config_from_env(**overrides: Any) -> RelayConfig:
    """A :class:`RelayConfig` from ``AURORA_RELAY_*`` (and ``AURORA_STREAMS``); ``overrides`` win."""
    return from_env(RelayConfig, ENV_PREFIX, **overrides)


@dataclass(frozen=True, slots=True)
class RelayStats:
    """What a Relay has done so far (a consistent snapshot)."""

    versions_mirrored: int
    """Versions this process committed to the mirror (its manifest written)."""
    bytes_copied: int
    """Bytes written to the mirror."""
    bytes_fetched: int
    """Bytes read from origin: what crossed into the region."""
    segments_copied: int
    """Objects (segments, shards) written to the mirror."""
    segments_rejected: int
    """Objects read from origin whose size or sha256 did not match; never written."""
    last_event_id: str
    """Newest origin stream id handled."""
    mirrored: tuple[VersionId, ...]
    """Versions known to be complete in the mirror, in order."""
    bytes_by_version: Mapping[VersionId, int]
    """Bytes fetched from origin per version (objects and manifest)."""
    quarantined: Mapping[VersionId, int] = field(default_factory=dict)
    """Versions that failed verification and wait for their next attempt: failed attempts so far."""
    listings: int = 0
    """Listings of origin done (each compares origin with the mirror), counted as each ends."""
    removed: int = 0
    """Objects the mirror's retention deleted."""
