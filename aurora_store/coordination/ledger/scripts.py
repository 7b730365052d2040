"""The ledger's Lua scripts: every state change that must be atomic.

Each script is a module constant with a header saying what ``KEYS`` and
``ARGV`` are and what it returns, in the manner of redis-py's ``lock.py``;
:class:`LedgerScripts` registers them all once per client. redis-py runs a
registered script by SHA and loads it again when Redis answers NOSCRIPT
(after a restart or ``SCRIPT FLUSH``).

Time is the Redis server's ``TIME`` in milliseconds, so Actors' clocks never
matter; a test passes its own clock's reading as the ``now`` argument
instead (``""`` means "ask the server"). The scripts that need the time
share one prelude, :data:`NOW_PRELUDE`.

Every script may run twice: redis-py (or :func:`aurora_store.outage.riding`)
repeats a call whose answer was lost. So each is idempotent or says what a
repeat answers (``CREATE_STEP``: ``exists``; ``SETTLE``: ``duplicate``).

The Trainer's writes (``CREATE_STEP``, ``SEAL_STEP``, ``DROP_STEP``,
``MARK_SETTLED``, ``REOFFER``, ``FENCED_HSET``, ``ENTER_EPOCH``) carry its epoch and are
refused, inside the script, when Redis holds a higher one: they answer
``{'fenced', stored_epoch}`` and change nothing (:data:`EPOCH_PRELUDE`). An
empty epoch argument skips the check (tools and tests without a Trainer).

Keys the Actors' scripts create inside a step (a lease hash, a results
hash) take the step hash's remaining TTL (:data:`TTL_PRELUDE`), so a step
whose Trainer died expires whole.

The scripts live in :mod:`.preludes` (shared Lua functions),
:mod:`.actor_scripts` (registry, claims, settlement) and
:mod:`.trainer_scripts` (steps, epoch, fenced and per-version records); this
module names them all once and registers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aurora_store.coordination.ledger.actor_scripts import (
    CLAIM,
    HEARTBEAT,
    MARK_ACTOR,
    REGISTER,
    RELEASE,
    SETTLE,
    SETTLE_MANY,
    SETTLE_PRELUDE,
    TRIM_ACTOR,
)
from aurora_store.coordination.ledger.preludes import (
    CHUNK_PRELUDE,
    EPOCH_PRELUDE,
    NOW_PRELUDE,
    TTL_PRELUDE,
)
from aurora_store.coordination.ledger.trainer_scripts import (
    CREATE_STEP,
    DROP_STEP,
    ENTER_EPOCH,
    FENCED_HSET,
    MARK_SETTLED,
    RECORD_VERSIONED,
    REOFFER,
    SEAL_STEP,
)

__all__ = [
    "NOW_PRELUDE",
    "EPOCH_PRELUDE",
    "TTL_PRELUDE",
    "CHUNK_PRELUDE",
    "REGISTER",
    "HEARTBEAT",
    "MARK_ACTOR",
    "TRIM_ACTOR",
    "CLAIM",
    "SETTLE_PRELUDE",
    "SETTLE",
    "SETTLE_MANY",
    "RELEASE",
    "CREATE_STEP",
    "SEAL_STEP",
    "DROP_STEP",
    "MARK_SETTLED",
    "REOFFER",
    "ENTER_EPOCH",
    "FENCED_HSET",
    "RECORD_VERSIONED",
    "LedgerScripts",
]


@dataclass(frozen=True, slots=True)
class LedgerScripts:
    """The ledger's scripts registered on one client (redis-py ``Script`` objects)."""

    register: Any
    """:data:`REGISTER`."""
    heartbeat: Any
    """:data:`HEARTBEAT`."""
    mark_actor: Any
    """:data:`MARK_ACTOR`."""
    trim_actor: Any
    """:data:`TRIM_ACTOR`."""
    claim: Any
    """:data:`CLAIM`."""
    settle: Any
    """:data:`SETTLE`."""
    settle_many: Any
    """:data:`SETTLE_MANY`."""
    release: Any
    """:data:`RELEASE`."""
    create_step: Any
    """:data:`CREATE_STEP`."""
    seal_step: Any
    """:data:`SEAL_STEP`."""
    drop_step: Any
    """:data:`DROP_STEP`."""
    mark_settled: Any
    """:data:`MARK_SETTLED`."""
    reoffer: Any
    """:data:`REOFFER`."""
    enter_epoch: Any
    """:data:`ENTER_EPOCH`."""
    fenced_hset: Any
    """:data:`FENCED_HSET`."""

    @classmethod
    def on(cls, redis: Any) -> LedgerScripts:
        """Register every script on ``redis`` (computes the SHAs; no round trip)."""
        return cls(
            register=redis.register_script(REGISTER),
            heartbeat=redis.register_script(HEARTBEAT),
            mark_actor=redis.register_script(MARK_ACTOR),
            trim_actor=redis.register_script(TRIM_ACTOR),
            claim=redis.register_script(CLAIM),
            settle=redis.register_script(SETTLE),
            settle_many=redis.register_script(SETTLE_MANY),
            release=redis.register_script(RELEASE),
            create_step=redis.register_script(CREATE_STEP),
            seal_step=redis.register_script(SEAL_STEP),
            drop_step=redis.register_script(DROP_STEP),
            mark_settled=redis.register_script(MARK_SETTLED),
            reoffer=redis.register_script(REOFFER),
            enter_epoch=redis.register_script(ENTER_EPOCH),
            fenced_hset=redis.register_script(FENCED_HSET),
        )
