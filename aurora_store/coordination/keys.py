"""Every Redis key and stream name Aurora writes, formatted in one place.

All keys of run ``R`` start with ``aurora:{R}:``. The braces are a Redis
Cluster hash tag: every key of a run lives in one slot, so multi-key scripts
also work on a cluster. docs/PROTOCOL.md (ledger and bus) and
docs/WORKERS.md (Trainer, Relays, digests) document each key; the strings
below are the protocol and must not change.

    keys = RunKeys("run-1")
    keys.step(7, "lease")   # 'aurora:{run-1}:step:7:lease'
    keys.relay("eu")        # 'aurora:{run-1}:relay:eu'
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from aurora_store.errors import ConfigError

__all__ = ["RunKeys", "key_prefix", "validate_run_name", "glob_escape", "mirror_token"]

_RUN_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def validate_run_name(run: str) -> str:
    """``run`` itself, if it is 1-128 letters, digits, ``-``, ``_`` or ``.``; else :class:`ConfigError`."""
    if not run or len(run) > 128 or not set(run) <= _RUN_OK:
        raise ConfigError(f"run name {run!r} must be 1-128 characters of letters, digits, '-', '_' or '.'")
    return run


def key_prefix(run: str) -> str:
    """``aurora:{run}:``: every key of a run shares the ``{run}`` hash tag, so
    multi-key scripts also work on Redis Cluster (one slot per run)."""
    return f"aurora:{{{validate_run_name(run)}}}:"


def mirror_token(url: str) -> str:
    """What a Relay's ``relay:{region}`` key holds for mirror ``url``: a digest, never the URL.

    Every role reads that key, and a mirror URL may carry credentials or name
    internal hosts. An Actor compares the token with that of its own
    ``--mirror`` (a trailing ``/`` aside), so the digest is all it needs.
    """
    return "mirror:sha256:" + hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:32]


def glob_escape(s: str) -> str:
    """Escape what Redis' glob treats specially (and braces, harmless and explicit)."""
    return "".join("\\" + c if c in "*?[]\\{}" else c for c in s)


@dataclass(frozen=True, slots=True)
class RunKeys:
    """The keys of one run. Cheap to build; the run name is validated once."""

    run: str
    """Run name (the key namespace)."""
    prefix: str = field(init=False, repr=False, compare=False)
    """``aurora:{run}:``, the start of every key below."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", key_prefix(self.run))

    # -- ledger (docs/PROTOCOL.md) ---------------------------------------------
    @property
    def actors(self) -> str:
        """set: Actor ids registered; an id whose record expired is trimmed by the Trainer's reap."""
        return f"{self.prefix}actors"

    def actor(self, actor: str) -> str:
        """hash: one Actor's registry record (with a TTL, refreshed by register and heartbeat)."""
        return f"{self.prefix}actor:{actor}"

    @property
    def fence(self) -> str:
        """string: the fencing-token counter."""
        return f"{self.prefix}fence"

    @property
    def epoch(self) -> str:
        """string: the epoch of the Trainer that owns the run (fences out older Trainers)."""
        return f"{self.prefix}epoch"

    @property
    def steps(self) -> str:
        """zset: open step ids."""
        return f"{self.prefix}steps"

    def step(self, v: int, part: str = "") -> str:
        """The step hash, or one of its parts (``prompts``, ``pool``, ``lease``, ``exp``, ``done``,
        ``results``, ``results:payload``, ``assignees``)."""
        return f"{self.prefix}step:{v}" + (f":{part}" if part else "")

    def assigned(self, v: int, actor: str) -> str:
        """list: prompts of step ``v`` the scheduler gave ``actor``, not leased yet."""
        return f"{self.prefix}step:{v}:assigned:{actor}"

    # -- bus ---------------------------------------------------------------------
    def events(self, region: str | None = None) -> str:
        """stream: origin announcements, or a Relay's re-announcements for ``region``."""
        return f"{self.prefix}events" if region is None else f"{self.prefix}region:{region}:events"

    # -- workers (docs/WORKERS.md) -----------------------------------------------
    @property
    def trainer(self) -> str:
        """hash: the Trainer's head, head_state, published_ms, step, commit, status, epoch, signed, key_id,
        unreturned, last_batch; written and read only through :mod:`~aurora_store.coordination.records`."""
        return f"{self.prefix}trainer"

    @property
    def trainer_digests(self) -> str:
        """hash: version -> weights digest the Trainer computed."""
        return f"{self.prefix}digest:trainer"

    @property
    def trainer_states(self) -> str:
        """hash: version -> the ``state`` the Trainer published at it (an Actor refuses any other)."""
        return f"{self.prefix}state:trainer"

    @property
    def actor_digests(self) -> str:
        """hash: ``actor|version`` -> weights digest the Actor computed after activating it."""
        return f"{self.prefix}digest:actors"

    @property
    def evals(self) -> str:
        """hash: version -> JSON {accuracy, problems, seconds, measured_ms}: held-out accuracy the Trainer measured on it."""
        return f"{self.prefix}evals"

    @property
    def activations(self) -> str:
        """hash ``actor|version`` -> JSON {stage_s, activate_s, source}: how each activation went."""
        return f"{self.prefix}activations"

    def index(self, key: str) -> str:
        """zset beside a per-version hash of this run (the digests, the activations): field ->
        version, so the hash is trimmed to its newest versions."""
        if not key.startswith(self.prefix):
            raise ConfigError(f"{key!r} is not a key of run {self.run!r}")
        return f"{key}:index"

    def relay(self, region: str) -> str:
        """string with a TTL: the region's mirror URL, while its Relay heartbeats."""
        return f"{self.prefix}relay:{region}"

    @property
    def relay_pattern(self) -> str:
        """SCAN pattern of the run's ``relay:{region}`` keys (the ``{run}`` braces escaped)."""
        return glob_escape(self.prefix) + "relay:*"

    def relay_region(self, key: str) -> str:
        """The region of a ``relay:{region}`` key of this run."""
        return key[len(self.relay("")) :]

    def relay_held(self, region: str) -> str:
        """string with a TTL: JSON ``{"versions": [...]}``, the versions the region's Relay is
        mirroring (origin retention keeps what they need); refreshed with its heartbeat."""
        return f"{self.prefix}relay-held:{region}"

    @property
    def relay_held_pattern(self) -> str:
        """SCAN pattern of the run's ``relay-held:{region}`` keys (not matched by :attr:`relay_pattern`)."""
        return glob_escape(self.prefix) + "relay-held:*"

    # -- benchmarks and synthetic workloads ----------------------------------------
    def wan(self, what: str) -> str:
        """Measurements of the WAN benchmark's synthetic workers (``steps``, ``published``, ``staged``)."""
        return f"{self.prefix}wan:{what}"

    @property
    def pattern(self) -> str:
        """SCAN pattern of every key of the run."""
        return glob_escape(self.prefix) + "*"
