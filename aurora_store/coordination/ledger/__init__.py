"""The job ledger: Actors, per-prompt leases and settlement, on Redis.

Every state change that must be atomic is one Lua script
(:mod:`~aurora_store.coordination.ledger.scripts`: module constants with a
header saying what KEYS and ARGV are and what each returns). Time comes from
the Redis server clock (``TIME``) so Actors' clocks never matter; tests pass
a clock (milliseconds) instead, and the scripts use it.

The settlement predicate (paper §5.4) is :attr:`Ledger.SETTLE`: a result is
accepted iff it arrives no later than its lease expiry, for the version and
state digest the job was created with, under the current fencing token, from
the claimer that holds the lease's secret; a prompt is accepted at most once. Expired leases go back to the pool inside
the next claim, with nobody's help.

Partial loss (docs/PROTOCOL.md, "Partial Redis failure"): results are
collected by prompt id, step creation is one idempotent script, a settled
prompt is never leased again, and only ``noeviction`` Redis is accepted
(:meth:`Ledger.check_memory_policy`). The Trainer's writes carry its epoch
and are refused under a newer one (:meth:`Ledger.enter_epoch`). Keys are
bounded (:class:`LedgerConfig`): Actor records and open steps expire unless
refreshed, closed steps leave a short tombstone.

The pieces: :mod:`.records` (what the ledger hands out), :mod:`.scripts`,
:mod:`.core` (client, keys, clock, lifetimes, epoch), :mod:`.registry` (Actors),
:mod:`.steps` (steps and what the Trainer reads of them) and :mod:`.leases`
(claims and settlement, each lease bound to its claimer's secret). :class:`Ledger` is
the registry, the steps and the leases over one core. Its public methods translate redis-py
errors into :class:`~aurora_store.errors.RedisUnavailable` and
:class:`~aurora_store.errors.CoordinationError`.
"""

from __future__ import annotations

from aurora_store.coordination.ledger.core import LedgerConfig, memory_policy_problem
from aurora_store.coordination.ledger.leases import LeaseBook
from aurora_store.coordination.ledger.records import (
    SETTLE_REASONS,
    AcceptedResult,
    ActorRecord,
    ClosedStep,
    Lease,
    Settlement,
    StepPoll,
    StepStatus,
)
from aurora_store.coordination.ledger.registry import ActorRegistry
from aurora_store.coordination.ledger.steps import StepBook
from aurora_store.errors import FencedOut, LedgerLost, StepExists

__all__ = [
    "Lease",
    "Settlement",
    "ActorRecord",
    "StepStatus",
    "StepPoll",
    "ClosedStep",
    "AcceptedResult",
    "Ledger",
    "LedgerConfig",
    "StepExists",
    "LedgerLost",
    "FencedOut",
    "SETTLE_REASONS",
    "memory_policy_problem",
]


class Ledger(ActorRegistry, StepBook, LeaseBook):
    """The ledger of one run. Thread-safe as far as the redis-py client is.

    ``Ledger(redis, run, clock=None, config=None)``: ``redis`` a redis-py
    client, ``clock`` milliseconds for tests (default: the Redis server's
    TIME), ``config`` key lifetimes (default: from ``AURORA_LEDGER_*``).
    """
