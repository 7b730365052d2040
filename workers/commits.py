"""Which commit records a reading worker checks (FORMAT.md §1, Redis-commit mode).

Why: in a run that commits through Redis a manifest in the store is a
version only if its bytes match the run's Redis record; an Actor or a Relay
that used every manifest it finds would apply or mirror one written by a
stray publisher (or a writer that lost the commit). Both ask once, when the
run's first version is seen: the writer puts the run in Redis-commit mode
(``commit-mode`` key, then the store marker) before it writes any manifest,
so by then the answer is settled, whereas a worker that asked at its own
start could ask before the Trainer did and never check at all.

A run whose store carries the marker ``.aurora/commit.json`` but whose
Redis has no ``commit-mode`` key (a Redis that lost its data, an operator's
flush) is checked anyway: an unchecked manifest is the danger, a version
held back until the Trainer records it again (it does at start) is not.
Every record read rides out a Redis outage on the worker's dependency.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from aurora_store.coordination.commit import RedisCommitLog, commit_records_for
from aurora_store.outage import Dependency
from aurora_store.storage import Store
from aurora_store.storage.probe import read_commit_marker

__all__ = ["RidingRecords", "resolve_commit_records"]


class RidingRecords:
    """A :class:`~aurora_store.lineage.interfaces.CommitRecords` whose reads ride out a Redis outage.

    Why: a reader checks a record per manifest it reads, from threads that
    wait out a store outage but would end on a Redis error; the record read
    belongs to the Redis dependency (one budget, one log line per outage).
    """

    def __init__(self, inner: RedisCommitLog, dep: Dependency, stop: threading.Event | None = None) -> None:
        self.inner = inner
        self.dep = dep
        self.stop = stop

    def __repr__(self) -> str:
        return f"RidingRecords({self.inner!r})"

    def commit_record(self, kind: str, version: int) -> str | None:
        return self.dep.call(lambda: self.inner.commit_record(kind, version), "read a commit record", self.stop)


def resolve_commit_records(
    client: Any,
    run: str,
    store: Store,
    redis_call: Callable[[Callable[[], Any], str], Any],
    store_call: Callable[[Callable[[], Any], str], Any],
    log: logging.Logger,
    who: str,
) -> RedisCommitLog | None:
    """The run's commit records when it commits through Redis, else None (the store commits).

    ``redis_call`` / ``store_call`` run one call through the worker's
    Redis / store dependency. ``who`` names the worker in the log line.
    """
    found: RedisCommitLog | None = redis_call(lambda: commit_records_for(client, run), "read the run's commit mode")
    if found is not None:
        log.info("%s: run %r commits through Redis: every manifest is checked against its commit record", who, run)
        return found
    marker = store_call(lambda: read_commit_marker(store), "read the store's commit marker")
    if marker is None:
        return None
    log.warning(
        "%s: %s says run %r commits through Redis, but Redis has no commit mode for run %r; checking commit "
        "records anyway (a version without one is not used until the Trainer records it)",
        who,
        store.url,
        marker[:64],
        run,
    )
    return RedisCommitLog(client, run)
