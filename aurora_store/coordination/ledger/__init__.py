"""The job ledger: Actors, per-prompt leases and settlement, on Redis.

Every state change that must be atomic is one Lua script
(:mod:`~aurora_store.coordination.ledger.scripts`: module constants with a
header saying what KEYS and ARGV are and what each returns). Time comes from
the Redis server clock (``TIME``) so Actors' clocks never matter; tests pass
a clock (milliseconds) instead, and the scripts use it.

The settlement predicate (paper §5.4) is :attr:`Ledger.SETTLE`: a result is
accepted iff it arrives no later than its lease expiry, for the version and
state digest the job was created with, under the current fencing token; a
prompt is accepted at most once. Expired leases go back to the pool inside
the next claim, with nobody's help.

The pieces: :mod:`.records` (what the ledger hands out), :mod:`.scripts`,
:mod:`.core` (client, keys, clock), :mod:`.registry` (Actors) and
:mod:`.steps` (steps, leases, claims, settlement). :class:`Ledger` is the
registry and the steps over one core. Its public methods translate redis-py
errors into :class:`~aurora_store.errors.RedisUnavailable` and
:class:`~aurora_store.errors.CoordinationError`.
"""

from __future__ import annotations

from aurora_store.coordination.ledger.records import (
    SETTLE_REASONS,
    AcceptedResult,
    ActorRecord,
    Lease,
    Settlement,
    StepStatus,
)
from aurora_store.coordination.ledger.registry import ActorRegistry
from aurora_store.coordination.ledger.steps import StepBook
from aurora_store.errors import LedgerLost, StepExists

__all__ = [
    "Lease",
    "Settlement",
    "ActorRecord",
    "StepStatus",
    "AcceptedResult",
    "Ledger",
    "StepExists",
    "LedgerLost",
    "SETTLE_REASONS",
]


class Ledger(ActorRegistry, StepBook):
    """The ledger of one run. Thread-safe as far as the redis-py client is.

    ``Ledger(redis, run, clock=None)``: ``redis`` a redis-py client,
    ``clock`` milliseconds for tests (default: the Redis server's TIME).
    """
