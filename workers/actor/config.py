"""The Actor's configuration and counters."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aurora_store.config import DEFAULT_STREAMS, STREAMS_ENV, Backoff, from_env, option
from aurora_store.errors import ConfigError
from aurora_store.format.signing import TrustKeys
from aurora_store.lineage.prefetch import DEFAULT_MAX_HELD_BYTES, FETCH_MODES
from aurora_store.lineage.results import DEFAULT_INLINE_MAX_BYTES
from aurora_store.outage import DEFAULT_OUTAGE_BUDGET_S, OUTAGE_BUDGET_ENV

__all__ = ["ENV_PREFIX", "ActorConfig", "ActorStats"]

ENV_PREFIX = "AURORA_ACTOR_"
"""Prefix of the Actor's environment variables (``AURORA_ACTOR_REGION`` …); ``streams`` is
``AURORA_STREAMS``, shared with the Trainer and the Relay, ``outage_budget_s`` is ``AURORA_OUTAGE_BUDGET_S``,
shared with every worker, and ``actor_id`` is ``AURORA_ACTOR_ID``."""

_MIB = 1 << 20


def _random_id() -> str:
    return f"actor-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class ActorConfig:
    """How an Actor works, where it reads versions from, and how it waits."""

    actor_id: str = option(
        help="Actor id, its name in the ledger",
        flag="--id",
        env="AURORA_ACTOR_ID",
        default_factory=_random_id,
        default_text="actor- and 8 random hex digits",
    )
    """Name in the ledger (default: ``actor-`` and 8 random hex digits)."""
    region: str = option(
        "default", default_text='"default"', help="region name; the Actor uses its Relay's mirror (--mirror) while that Relay is alive"
    )
    """Region: the Actor stages from its Relay's mirror while that Relay heartbeats."""
    mirror: str | None = option(
        None, metavar="URL", help="run root of the region's mirror, the only one this Actor reads", default_text="none: origin only"
    )
    """Run root of the region's mirror (``--mirror``, env ``AURORA_ACTOR_MIRROR``): the only
    mirror this Actor reads, and only while the region's Relay heartbeats with this URL. The
    Relay's key in Redis says whether the mirror is alive, never where it is: whoever can
    write Redis must not be able to point the region's Actors at a store of their choice.
    None: origin only."""
    mirror_options: Mapping[str, Any] = field(default_factory=dict, repr=False, metadata={"env": False})
    """fsspec storage options of the mirror (``--mirror-option``, env
    ``AURORA_ACTOR_MIRROR_OPTIONS`` as a JSON object): a mirror in another account has its
    own credentials. May hold secrets: never logged."""
    trust: TrustKeys | None = field(default=None, metadata={"env": False})
    """Accept only versions signed by these keys (FORMAT.md §4.1; ``--trust-key``, env
    ``AURORA_TRUST_KEYS``): an unsigned, untrusted or badly signed manifest, from origin or
    the mirror, is refused before any of its segments is read, and quarantined. None: no check."""
    engine: str = option(
        "torch", choices=("torch", "vllm"), help="inference engine; vllm: pip install 'aurora-store[vllm]' (docs/WORKERS.md)"
    )
    """Inference engine (``torch``, ``vllm``; see :func:`workers.engine.make_engine`)."""
    device: str | None = option(
        None, env=False, metavar="DEV", help="torch engine only: cpu, cuda or cuda:N", default_text="$AURORA_ENGINE_DEVICE, else cpu"
    )
    """Device of the torch engine (``--device``: ``cpu``, ``cuda``, ``cuda:N``); None: the
    engine's own setting (env ``AURORA_ENGINE_DEVICE``, else cpu)."""
    serve_dtype: str = option(
        "bf16",
        choices=("bf16", "fp8-block128"),
        help="what generation reads: the bf16 weights, or an FP8 copy with 128x128 block scales kept current at each safe point (torch engine; docs/FP8.md)",
    )
    """What the engine generates from: ``bf16`` (the held weights) or ``fp8-block128`` (an FP8
    copy requantized incrementally inside each safe point; deltas, states and digests stay bf16).
    The vllm engine refuses ``fp8-block128`` in one line (docs/FP8.md)."""
    claim: int = option(8, metavar="N", help="prompts per generation batch (one claim)")
    """Prompts leased per claim (one generation batch)."""
    max_new_tokens: int = option(14, flag=None, help="longest completion sampled")
    """Longest completion sampled."""
    temperature: float = option(1.0, flag=None, help="sampling temperature (0: greedy)")
    """Sampling temperature (0: greedy)."""
    seed: int = option(0, metavar="N", help="mixed with each lease's token into the sampling seed")
    """Mixed with each lease's token into the sampling seed."""
    result_inline_max_bytes: int = option(
        DEFAULT_INLINE_MAX_BYTES,
        metavar="N",
        help="a result payload larger than N bytes is written to the store under results/<id>/ and the ledger carries its key, "
        "size and sha256 (0: every result)",
    )
    """Largest result payload settled through the ledger as it is (``--result-inline-max-bytes``,
    env ``AURORA_ACTOR_RESULT_INLINE_MAX_BYTES``; default 64 KiB): a larger one is written as an
    object under ``results/<actor id>/`` in the run root, which this Actor's store credential
    must be allowed to write (docs/SECURITY.md), and the ledger settles a reference to it
    (:mod:`aurora_store.lineage.results`). A negative value is read as 0."""
    heartbeat_s: float = option(1.0, flag=None, help="period of the ledger heartbeat (seconds)")
    """Period of the ledger heartbeat (active and staged versions)."""
    idle: Backoff = field(default_factory=lambda: Backoff(initial_s=0.05, max_s=0.25, factor=1.5, jitter=0.0), metadata={"env": False})
    """Pauses between looks for work while there is none: idle Actors polling Redis steal CPU
    from whoever shares the machine."""
    slowdown: float = option(1.0, metavar="X", help="run X times slower (heterogeneity experiments)")
    """>1 makes this Actor that many times slower (heterogeneity experiments)."""
    streams: int = option(
        DEFAULT_STREAMS, env=STREAMS_ENV, metavar="S", help="parallel connections per fetched version (shared with every worker)"
    )
    """Parallel segment fetches per staged version (env ``AURORA_STREAMS``)."""
    fetch: str = option(
        "announced",
        choices=FETCH_MODES,
        help="announced: fetch each segment from its announcement, before the manifest (held until the manifest lists it); "
        "manifest-first: read the manifest, then its segments",
    )
    """How a delta's segments are fetched (``--fetch``): ``announced``, each from its
    announcement on the stream while the manifest is still to come (held, bounded by
    ``max_prefetch_bytes``, and decoded only once the manifest, trusted, lists it with that
    sha256: :mod:`aurora_store.lineage.prefetch`); ``manifest-first``, the manifest and then
    the segments it lists (the path before prefetching, kept to measure against)."""
    max_prefetch_bytes: int = option(
        DEFAULT_MAX_HELD_BYTES,
        flag=None,
        env="AURORA_ACTOR_MAX_PREFETCH_MIB",
        scale=_MIB,
        help="most MiB of announced segments held before their manifest is read",
    )
    """Most bytes of announced segments held before their manifest is read (env
    ``AURORA_ACTOR_MAX_PREFETCH_MIB``, in MiB); announcements past it are fetched after the manifest."""
    mirror_grace_s: float = option(
        2.0, metavar="S", help="with the region's Relay alive, wait this long for its mirror to have a version before reading origin"
    )
    """While the region's Relay is alive, a version its mirror lacks is read from origin only
    once it has been missing this long: otherwise every Actor races the Relay's cut-through
    copy and the region pays for the version once per Actor. Each segment of the version the
    Relay announces restarts the wait: a Relay that is copying it is worth waiting for."""
    mirror_timeout_s: float = option(
        10.0,
        metavar="S",
        help="a version the mirror has not delivered within S seconds (or failed to) is read from origin; the mirror is tried again later",
    )
    """The per-mirror breaker's bound (``--mirror-timeout-s``, env ``AURORA_ACTOR_MIRROR_TIMEOUT_S``):
    a mirror that errs, or does not deliver a delta (or the listing and manifests of a catch-up)
    within this long, costs at most this once: that version is read from origin, and so is every
    version after it until a cool-down has passed (this long, doubling at each failure, up to
    5 minutes); then the mirror is tried again. The mirror's store is opened with one retry and
    connect and read timeouts of at most this long. Mirror faults never spend the store's outage
    budget, which is origin's. Raise it for deltas that take longer than this to read in the region."""
    relay_wait_s: float = option(
        0.0, metavar="S", help="at start, wait up to S seconds for the region's Relay before staging from origin (0: do not wait)"
    )
    """At start, wait up to this long for the region's Relay to heartbeat before staging from
    origin (for regions deployed with a Relay: Actors started with it would otherwise all
    read the first versions across the region boundary)."""
    verify_every: int | None = option(
        None,
        metavar="N",
        default_text="every version whose record carries a digest",
        help="verify the weights by digest, outside the safe point, at versions whose record carries one: "
        "N >= 1 at most once every N versions, 0 never (only after a failure)",
    )
    """Cadence of weight verification (``--verify-every``, env ``AURORA_ACTOR_VERIFY_EVERY``).

    The state chain is checked at every version, whatever this says. A version
    whose record carries a ``weights_digest`` (its delta manifest's, else the
    Trainer's record of it) can be verified: the engine hashes its weights
    in the form the record names, in the Actor's verify thread, never in the
    safe point, and nothing generated on that version is settled until it
    passes (docs/WORKERS.md, "Verification"). None: every such version.
    N >= 1: such a version when at least N versions were activated since the
    last verified one (so 1 is the default; a version without a digest is
    never verified, and the next one with a digest is). 0: never, except the
    version reached again after a failed verification or a refused activation.
    """
    join_poll_s: float = option(0.1, flag=None, help="how often to look for the run's head (--join-at-version) and the region's Relay")
    """How often the Actor looks for the run's head (``--join-at-version``) and, during
    ``relay_wait_s``, for the region's Relay."""
    stage_block_ms: int = option(500, flag=None, help="longest blocking read of the announcement stream (ms)")
    """Longest blocking read of the announcement stream by the stager."""
    run_poll_s: float = option(1.0, flag=None, help="how often an Actor started before the Trainer looks for the run")
    """How often an Actor started before the Trainer looks for the run to appear (its model
    description, its first version): Actors and the Trainer start in any order."""
    outage_budget_s: float = option(
        DEFAULT_OUTAGE_BUDGET_S,
        env=OUTAGE_BUDGET_ENV,
        metavar="S",
        help="give up (exit 1, one line) once Redis or the store has been unreachable this long",
    )
    """How long Redis or the store may stay unreachable before the Actor gives up (exits
    non-zero); ``--outage-budget-s``, env ``AURORA_OUTAGE_BUDGET_S``, shared with every worker."""
    outage_backoff: Backoff = field(
        default_factory=lambda: Backoff(initial_s=0.2, max_s=10.0, factor=2.0, jitter=0.5), metadata={"env": False}
    )
    """Pauses between attempts to reach Redis or the store while one is away (exponential with
    jitter: many Actors do not come back in step and knock together)."""
    max_staged_bytes: int = option(
        1 << 30,
        flag="--max-staged-mib",
        env="AURORA_ACTOR_MAX_STAGED_MIB",
        scale=_MIB,
        metavar="MIB",
        help="most staged data (MiB) held beside the active weights",
    )
    """Most staged data (decoded deltas, or a whole version for a catch-up) the Actor holds
    beside its active weights; the stager fetches no further until activation frees room
    (one version always fits). Env ``AURORA_ACTOR_MAX_STAGED_MIB``, in MiB."""
    quarantine: Backoff = field(
        default_factory=lambda: Backoff(initial_s=5.0, max_s=300.0, factor=2.0, jitter=0.2), metadata={"env": False}
    )
    """Back-off of a version that failed validation (and of a chain with no way through):
    fetching it on every stager loop is an egress storm that fixes nothing; a repair at
    origin is picked up at the next attempt."""

    def __post_init__(self) -> None:
        if not self.actor_id:
            raise ConfigError("actor_id must not be empty")
        if self.claim < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"claim and max_new_tokens must be >= 1 (got {self.claim}, {self.max_new_tokens})")
        if not 1 <= self.streams <= 256:
            raise ConfigError(f"streams must be 1..256, got {self.streams}")
        if self.heartbeat_s <= 0 or self.join_poll_s <= 0 or self.stage_block_ms < 1:
            raise ConfigError(
                f"heartbeat_s and join_poll_s must be > 0 and stage_block_ms >= 1 "
                f"(got {self.heartbeat_s}, {self.join_poll_s}, {self.stage_block_ms})"
            )
        if self.outage_backoff.initial_s <= 0:
            raise ConfigError(f"outage_backoff.initial_s must be > 0, got {self.outage_backoff.initial_s}")
        if self.outage_budget_s <= 0 or self.run_poll_s <= 0:
            raise ConfigError(f"outage_budget_s and run_poll_s must be > 0 (got {self.outage_budget_s}, {self.run_poll_s})")
        if self.mirror is not None and "://" not in self.mirror:
            raise ConfigError(f"mirror must be a URL (file:///path, s3://bucket/prefix), got {self.mirror!r}")
        if self.mirror is None and self.mirror_options:
            raise ConfigError("mirror options were given without a mirror (--mirror URL)")
        if self.fetch not in FETCH_MODES:
            raise ConfigError(f"fetch must be one of {', '.join(FETCH_MODES)}, got {self.fetch!r}")
        if self.max_prefetch_bytes < 0:
            raise ConfigError(f"max_prefetch_bytes must be >= 0, got {self.max_prefetch_bytes}")
        if self.verify_every is not None and self.verify_every < 0:
            raise ConfigError(f"verify_every must be >= 0, got {self.verify_every}")
        if self.max_staged_bytes < 1:
            raise ConfigError(f"max_staged_bytes must be >= 1, got {self.max_staged_bytes}")
        if not self.mirror_timeout_s > 0:
            raise ConfigError(f"mirror_timeout_s must be > 0, got {self.mirror_timeout_s}")
        if self.temperature < 0 or self.slowdown <= 0 or self.mirror_grace_s < 0 or self.relay_wait_s < 0:
            raise ConfigError(
                "temperature, mirror_grace_s and relay_wait_s must be >= 0 and slowdown > 0 "
                f"(got {self.temperature}, {self.mirror_grace_s}, {self.relay_wait_s}, {self.slowdown})"
            )

    @classmethod
    def from_env(cls, prefix: str = ENV_PREFIX, **overrides: Any) -> ActorConfig:
        """Defaults, then ``AURORA_ACTOR_*`` (and ``AURORA_STREAMS``, ``AURORA_ACTOR_ID``), then ``overrides``."""
        return from_env(cls, prefix, **overrides)


@dataclass(slots=True)
class ActorStats:
    """What an Actor has done (its own view; the ledger holds the run's)."""

    activations: list[tuple[int, float, float]] = field(default_factory=list)
    """(version, stage seconds, activation seconds)"""
    settled: int = 0
    """Results the ledger accepted (``duplicate`` answers to a retried settle included: the
    first attempt was accepted, its answer lost)."""
    rejected: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    results_through_store: int = 0
    """Results written to the store (larger than ``result_inline_max_bytes``) and settled by reference."""
    verifications: list[tuple[int, float, bool]] = field(default_factory=list)
    """(version, seconds, passed) of each weight verification (outside the safe point)."""
    rebootstraps: int = 0
    """Whole versions swapped in after bootstrap (a catch-up through a snapshot, a broken chain)."""
    spilled: int = 0
    """Deltas an engine whose workers read a store (vLLM) staged from segments held from their
    announcements (``--fetch announced``), not from the store."""
