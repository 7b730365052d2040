"""What the ledger hands out and answers: value objects, and parsing them from Redis.

Each record is a frozen, slotted dataclass. The ``*_from_*`` helpers turn
what Redis returns (bytes, hash fields) into them, so the ledger's methods
only say which keys they read.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aurora_store.coordination.decode import as_int, as_str

__all__ = [
    "SETTLE_REASONS",
    "Lease",
    "Settlement",
    "AcceptedResult",
    "ActorRecord",
    "StepStatus",
    "StepPoll",
    "ClosedStep",
    "lease_holder",
    "actor_from_hash",
    "accepted_from_redis",
    "step_status_from_hash",
    "new_claim_secret",
    "claim_hash",
    "proves_claim",
]

#: Every answer ``settle`` can give (``closed``: the Trainer closed the step's batch
#: without this result, a deadline passed; ``no_step``: no such step, or its tombstone expired).
SETTLE_REASONS = (
    "accepted",
    "duplicate",
    "already_settled",
    "not_leased",
    "stale_token",
    "expired",
    "wrong_version",
    "wrong_digest",
    "closed",
    "no_step",
)


@dataclass(frozen=True, slots=True)
class Lease:
    """One prompt leased to one Actor."""

    prompt: str
    token: int
    """Fencing token: only the newest lease of a prompt can settle it."""
    version: int
    """Version v_j the rollout must be generated on."""
    state: str
    """State digest h(v_j) the rollout must carry."""
    group: int
    """Completions to generate for the prompt (GRPO group size)."""
    expiry_ms: int
    """Server-clock deadline of the lease."""
    payload: bytes
    """The prompt itself, as the Trainer stored it."""
    step: int = -1
    """Ledger step id the lease belongs to (defaults to ``version``)."""
    secret: str = field(default="", repr=False, compare=False)
    """What settles this lease: chosen by the claimer, only its hash went to Redis
    (:func:`claim_hash`). Kept out of ``repr`` so that no log line carries it."""

    @property
    def step_id(self) -> int:
        return self.version if self.step < 0 else self.step


@dataclass(frozen=True, slots=True)
class Settlement:
    """The ledger's answer to one result."""

    prompt: str
    reason: str
    """One of :data:`SETTLE_REASONS`."""
    now_ms: int

    @property
    def accepted(self) -> bool:
        return self.reason == "accepted"


@dataclass(frozen=True, slots=True)
class AcceptedResult:
    """A result the ledger accepted, as the Trainer collects it."""

    prompt: str
    actor: str
    token: int
    version: int
    settled_ms: int
    leased_ms: int
    payload: bytes
    seq: int = 0
    """Order of acceptance within the step (1, 2, …; 0 when unknown)."""
    state: str = ""
    """The weights digest the Actor settled with (the predicate made it equal the job's)."""
    claim: str = ""
    """The claim hash the lease carried (:func:`claim_hash` of the claimer's secret)."""
    witness: str = ""
    """SHA-1 of the secret the settle presented: :func:`proves_claim` checks it against ``claim``."""


@dataclass(frozen=True, slots=True)
class StepPoll:
    """One read of a step by the Trainer: what is new, and where the step stands."""

    results: list[AcceptedResult]
    """Accepted results not in the ``have`` the caller passed, in order of acceptance."""
    accepted: frozenset[str]
    """Every prompt id the ledger holds as settled (``done``), new or not."""
    total: int
    settled: int
    created_ms: int
    """Server-clock time the step was created (re-created, after a loss)."""
    now_ms: int
    """The ledger's clock at the read."""
    closed: bool
    """Sealed: settles are refused (``closed``) and nothing is leased any more."""
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
    """(prompt, why, its ``done`` value) of entries not in ``have`` that are not what SETTLE
    writes: ``malformed``, ``unproven`` (no proof of the lease's secret, or a ``done`` entry
    that names another settle) or ``no_result``. Left out of ``results``."""


@dataclass(frozen=True, slots=True)
class ClosedStep:
    """What closing a step found: the results not collected before, and the counts."""

    results: list[AcceptedResult]
    total: int
    """Prompts of the step, as the ledger holds it."""
    settled: int
    """Of those, accepted (or marked by the Trainer) before the seal."""

    @property
    def unsettled(self) -> int:
        return max(0, self.total - self.settled)


@dataclass(frozen=True, slots=True)
class ActorRecord:
    """An Actor as the registry knows it."""

    actor: str
    region: str
    engine: str
    status: str
    """``alive``, ``left`` (graceful) or ``gone`` (heartbeat lost)."""
    active: int | None
    staged: int | None
    active_state: str
    tau: float
    heartbeat_ms: int
    settled: int
    leases: int
    quarantined: tuple[int, ...] = ()
    """Versions the Actor refused as invalid and will try again only after a back-off."""


def _versions(raw: Any) -> tuple[int, ...]:
    """A JSON list of version numbers written by an Actor: untrusted, so anything else is no versions."""
    try:
        got = json.loads(as_str(raw or b"[]"))
    except ValueError:
        return ()
    if not isinstance(got, list):
        return ()
    return tuple(sorted({v for v in got[:1000] if isinstance(v, int) and not isinstance(v, bool) and v >= 0}))


@dataclass(frozen=True, slots=True)
class StepStatus:
    version: int
    total: int
    settled: int
    leased: int
    pending: int
    expired: int
    rejected: int
    duplicates: int = 0
    """Duplicate prompt ids a claim dropped instead of leasing (a partial loss repeated a write)."""


_LEASE = re.compile(r"^(.*)\|\d+\|\d+\|\d+(?:\|[0-9a-f]*)?$")


def lease_holder(raw: Any) -> str:
    """The Actor of a ``step:{v}:lease`` value ``actor|token|expiry_ms|leased_ms|claim_hash``
    (the hash is absent in leases of an older release); the raw text when it is neither."""
    text = as_str(raw, "replace")
    m = _LEASE.match(text)
    return m.group(1) if m else text


def new_claim_secret() -> str:
    """A fresh secret for one lease (128 bits)."""
    return secrets.token_hex(16)


def _sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # noqa: S324 - what Lua's redis.sha1hex computes; preimages only


def claim_hash(secret: str) -> str:
    """What a claim stores in the lease: SHA-1 of the SHA-1 (hex) of ``secret``.

    SETTLE recomputes it from the secret and refuses a mismatch; the accepted
    result keeps the inner hash (the witness), which proves the settle knew
    the secret without revealing it, and which :func:`proves_claim` checks.
    SHA-1 is what Redis' Lua offers; only its preimage resistance is relied on.
    """
    return _sha1(_sha1(secret))


def proves_claim(witness: str, claim: str) -> bool:
    """Whether ``witness`` (from an accepted result) is the preimage of the lease's ``claim`` hash."""
    return bool(witness) and bool(claim) and len(witness) == 40 and _sha1(witness) == claim


def _fields(h: Mapping[Any, Any]) -> dict[str, Any]:
    return {as_str(k): v for k, v in h.items()}


def actor_from_hash(actor: str, h: Mapping[Any, Any], leases: int) -> ActorRecord:
    """An ``actor:{id}`` hash (HGETALL) as a record; ``leases`` counted elsewhere."""
    g = _fields(h)
    return ActorRecord(
        actor=actor,
        region=as_str(g.get("region", b"")),
        engine=as_str(g.get("engine", b"")),
        status=as_str(g.get("status", b"")),
        active=as_int(g.get("active")),
        staged=as_int(g.get("staged")),
        active_state=as_str(g.get("active_state", b"")),
        tau=float(g.get("tau", b"0") or 0),
        heartbeat_ms=as_int(g.get("heartbeat_ms"), 0) or 0,
        settled=as_int(g.get("settled"), 0) or 0,
        leases=leases,
        quarantined=_versions(g.get("quarantined")),
    )


_MAX_HEAD = 64 * 1024
"""The longest result record read (the settle script writes a few hundred bytes)."""


def _int(x: Any) -> int:
    """An integer field of a result record: an int, or a string of digits (what Lua's cjson writes)."""
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        raise ValueError(f"not an integer: {x!r}")
    if isinstance(x, str) and not re.fullmatch(r"-?\d{1,20}", x):
        raise ValueError(f"not an integer: {x!r}")
    return int(x)


def accepted_from_redis(head: Any, payload: Any, prompt: str | None = None) -> AcceptedResult | None:
    """One ``step:{v}:results`` entry (JSON ``[prompt, actor, token, version, settled_ms,
    leased_ms, seq, state, witness, claim]``) and its ``results:payload`` entry.

    Redis is not trusted (every Actor's credential can write these keys): anything
    malformed, of the wrong types, or naming another prompt than ``prompt`` (the
    field it was read under) answers None rather than raising.
    """
    if not isinstance(head, (bytes, bytearray, str)) or len(head) > _MAX_HEAD:
        return None
    try:
        got = json.loads(head)
        if not isinstance(got, list) or not 6 <= len(got) <= 10 or not isinstance(payload, (bytes, bytearray)):
            return None
        p, actor, token, version, settled, leased, *rest = got
        if not isinstance(p, str) or not isinstance(actor, str) or (prompt is not None and p != prompt):
            return None
        if not all(isinstance(x, str) for x in rest[1:]):
            return None
        return AcceptedResult(
            p,
            actor,
            _int(token),
            _int(version),
            _int(settled),
            _int(leased),
            bytes(payload),
            _int(rest[0]) if rest else 0,
            rest[1] if len(rest) > 1 else "",
            claim=rest[3] if len(rest) > 3 else "",
            witness=rest[2] if len(rest) > 2 else "",
        )
    except (ValueError, TypeError, RecursionError):
        return None


def step_status_from_hash(v: int, h: Mapping[Any, Any], leased: int, pending: int) -> StepStatus:
    """A ``step:{v}`` hash (HGETALL) with the counts read beside it."""
    g = _fields(h)
    return StepStatus(
        version=v,
        total=int(g.get("total", 0)),
        settled=int(g.get("settled", 0)),
        leased=leased,
        pending=pending,
        expired=int(g.get("expired", 0)),
        rejected=int(g.get("rejected", 0)),
        duplicates=int(g.get("duplicates", 0)),
    )
