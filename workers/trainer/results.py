"""The Trainer's side of results through the store: resolve each reference of a closed batch into its bytes.

An Actor settles a large result as a reference to an object under its own
``results/<actor id>/`` folder (:mod:`aurora_store.lineage.results`).
Once a batch has closed, :class:`ResultReader` replaces each reference in the
collected results by the bytes it names, read in parallel, each as one range
capped at the size the reference records and checked against its sha256, so
the parser of rollouts (``grpo.read_rollouts``) sees the same payloads
whether they came through Redis or through the store. A reference outside
the settling Actor's folder, larger than a result may be, or to an object
that is missing, short or has another hash becomes an empty payload: the
parser drops it as malformed and counts it in ``Rollouts.bad``; the reader
counts it by why in :attr:`ResultReader.refused`. A store that is away is
ridden out by the store given (the Trainer's riding store); past the outage
budget the Trainer stops, as for any other store call.

The objects read are deleted in the background once read: the ledger has
already dropped the batch (a Trainer that resumes issues it again), so
nothing refers to them any more. Retention removes what is left (results of
settles the ledger refused, of a Trainer that died) past its grace.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aurora_store.clock import Clock
from aurora_store.coordination.ledger import AcceptedResult
from aurora_store.lineage.results import ResultRef, ResultRefused, check_reference, parse_reference, read_referenced
from aurora_store.storage import Store

__all__ = ["RESULT_BYTES_PER_TOKEN", "REFUSED_LOG_EVERY_S", "ResultReader", "max_result_bytes"]

log = logging.getLogger("aurora.trainer")

RESULT_BYTES_PER_TOKEN = 64
"""Bytes of result JSON allowed per completion token (its id, and its text escaped as JSON)."""

REFUSED_LOG_EVERY_S = 60.0
"""Refused references are logged at their first, then at most once per this many seconds."""


def max_result_bytes(group: int, max_new_tokens: int) -> int:
    """Most bytes a result of ``group`` completions of at most ``max_new_tokens`` tokens may hold."""
    return (64 << 10) + max(1, group) * max(1, max_new_tokens) * RESULT_BYTES_PER_TOKEN


@dataclass(slots=True)
class ResultReader:
    """Resolves the references of a batch's results (see the module docstring); one per Trainer.

    ``streams``: reads (and deletes) in flight at once.
    """

    store: Store
    max_bytes: int
    clock: Clock
    streams: int = 8
    through_store: int = 0
    """Results read from the store (their reference resolved and checked)."""
    bytes_through_store: int = 0
    """Bytes of those results."""
    refused: dict[str, int] = field(default_factory=dict)
    """References refused, by why: ``malformed_ref``, ``foreign_key``, ``too_large``, ``missing``, ``short``, ``hash_mismatch``."""
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    _said_at: float | None = field(default=None, repr=False)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.streams), thread_name_prefix="aurora-results")
        return self._pool

    def resolve(self, step: int, collected: MutableMapping[str, AcceptedResult]) -> int:
        """Replace every reference in ``collected`` by its bytes (or by ``b""`` when refused); returns how many were refused."""
        todo: list[tuple[str, AcceptedResult, ResultRef]] = []
        refused: list[tuple[str, str, str]] = []
        for pid, r in collected.items():
            try:
                ref = parse_reference(r.payload)
                if ref is None:
                    continue  # inline: the ledger carried the result itself
                check_reference(ref, r.actor, self.max_bytes)
            except ResultRefused as e:
                refused.append((pid, e.reason, str(e)))
                collected[pid] = dataclasses.replace(r, payload=b"")
                continue
            todo.append((pid, r, ref))
        if todo:
            pool = self._executor()
            futures = [pool.submit(read_referenced, self.store, ref) for _, _, ref in todo]
            for (pid, r, ref), fut in zip(todo, futures, strict=True):
                try:
                    data = fut.result()  # a transient fault was ridden out by the store; past the budget it stops the Trainer
                except ResultRefused as e:
                    refused.append((pid, e.reason, str(e)))
                    data = b""
                else:
                    self.through_store += 1
                    self.bytes_through_store += len(data)
                collected[pid] = dataclasses.replace(r, payload=data)
                pool.submit(self._forget, ref.key)
        for pid, why, detail in refused:
            self.refused[why] = self.refused.get(why, 0) + 1
            self._say(step, pid, detail)
        return len(refused)

    def _forget(self, key: str) -> None:
        """Delete one object read (best effort: retention removes what is left)."""
        try:
            self.store.delete(key)
        except Exception as e:  # noqa: BLE001 - a leftover costs only its bytes until retention
            log.debug("could not delete %s: %s", key, e)

    def _say(self, step: int, prompt: str, detail: str) -> None:
        now = self.clock.monotonic()
        if self._said_at is not None and now - self._said_at < REFUSED_LOG_EVERY_S:
            return
        self._said_at = now
        # The prompt id and the key are untrusted text: quoted and cut.
        log.warning(
            "step %d: refused the result of prompt %r through the store (%s); %s so far: dropped as a bad payload",
            step,
            prompt[:64],
            detail[:200],
            dict(sorted(self.refused.items())),
        )

    def close(self) -> None:
        """Finish the deletes in flight and stop the threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
