"""The Trainer's side of results through the store: each reference of a batch read as it settles, the bytes in place when it closes.

An Actor settles a large result as a reference to an object under its own
``results/<actor id>/s<step>/`` folder (:mod:`aurora_store.lineage.results`).
As the Trainer collects a batch, :meth:`ResultReader.prefetch` starts reading
each reference it accepts, in the background (each as one range capped at
the size the reference records, checked against its sha256), so the reads
overlap the wait for the rest of the batch instead of following it. Once the
batch has closed, :meth:`ResultReader.resolve` replaces each reference in the
collected results by the bytes it names: those read ahead as they are, any
other (settled in the batch's last poll, or whose read ahead failed for a
store fault) read then, so the parser of rollouts (``grpo.read_rollouts``)
sees the same payloads whether they came through Redis or through the store.
A reference outside the settling Actor's folder for that step, larger than a
result may be, or to an object that is missing, short or has another hash
becomes an empty payload: the parser drops it as malformed and counts it in
``Rollouts.bad``; the reader counts it by why in :attr:`ResultReader.refused`
(a read ahead never decides: the same checks run in :meth:`resolve`, on the
payload the batch closed with). A store that is away is ridden out by the
store given (the Trainer's riding store); past the outage budget the Trainer
stops, as for any other store call.

The objects are deleted in the background once their batch has closed, never
before: until then the ledger holds the reference, and a Trainer that resumes
reopens the batch and reads them again. Retention removes what is left
(results of settles the ledger refused, of a Trainer that died) past its
grace, and keeps those of steps the ledger still holds.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
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
    """References refused, by why: ``malformed_ref``, ``foreign_key``, ``wrong_step``, ``too_large``, ``missing``, ``short``,
    ``hash_mismatch``."""
    read_ahead: int = 0
    """References whose read was started while their batch was still open (:meth:`prefetch`)."""
    read_at_close: int = 0
    """References read only once their batch had closed (settled in its last poll, or read again after a store fault)."""
    _ahead: dict[tuple[int, str], tuple[bytes, str, Future[bytes]]] = field(default_factory=dict, repr=False)
    """(step, prompt) -> (the payload and Actor it was read for, the read): touched by the collecting thread only."""
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    _said_at: float | None = field(default=None, repr=False)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.streams), thread_name_prefix="aurora-results")
        return self._pool

    def prefetch(self, step: int, r: AcceptedResult) -> None:
        """Start reading the reference of ``r``, a result of open batch ``step`` just collected (inline results: nothing to do).

        A reference the checks refuse is not read: :meth:`resolve` refuses it
        (and counts it) when the batch closes, exactly as without a read ahead.
        """
        try:
            ref = parse_reference(r.payload)
            if ref is None:
                return
            check_reference(ref, r.actor, self.max_bytes, step)
        except ResultRefused:
            return
        key = (step, r.prompt)
        before = self._ahead.get(key)
        if before is not None:
            if before[:2] == (r.payload, r.actor):
                return
            self._drop(before)  # collected afresh after a re-issue: the earlier result is nobody's now
        self._ahead[key] = (r.payload, r.actor, self._executor().submit(read_referenced, self.store, ref))
        self.read_ahead += 1

    def ready(self, step: int) -> int:
        """Reads ahead of ``step`` finished so far (what a test or a benchmark waits on)."""
        return sum(1 for (s, _), (_, _, fut) in list(self._ahead.items()) if s == step and fut.done())

    def resolve(self, step: int, collected: MutableMapping[str, AcceptedResult]) -> int:
        """Replace every reference in ``collected`` (batch ``step``, closed) by its bytes (or by ``b""`` when refused);
        returns how many were refused."""
        ahead = {p: v for (s, p), v in self._ahead.items() if s == step}
        for p in ahead:
            del self._ahead[(step, p)]
        todo: list[tuple[str, AcceptedResult, ResultRef, Future[bytes] | None]] = []
        refused: list[tuple[str, str, str]] = []
        for pid, r in collected.items():
            try:
                ref = parse_reference(r.payload)
                if ref is None:
                    continue  # inline: the ledger carried the result itself
                check_reference(ref, r.actor, self.max_bytes, step)
            except ResultRefused as e:
                refused.append((pid, e.reason, str(e)))
                collected[pid] = dataclasses.replace(r, payload=b"")
                continue
            got = ahead.pop(pid, None)
            todo.append((pid, r, ref, got[2] if got is not None and got[:2] == (r.payload, r.actor) else None))
        if todo or ahead:
            pool = self._executor()
            reads = [fut if fut is not None else self._read_now(pool, ref) for _, _, ref, fut in todo]
            for (pid, r, ref, fut), read in zip(todo, reads, strict=True):
                try:
                    data = self._bytes(pool, ref, read, ahead=fut is not None)
                except ResultRefused as e:
                    refused.append((pid, e.reason, str(e)))
                    data = b""
                else:
                    self.through_store += 1
                    self.bytes_through_store += len(data)
                collected[pid] = dataclasses.replace(r, payload=data)
                pool.submit(self._forget, ref.key)
            # Read ahead for results the batch closed without (a re-issue on a newer version dropped them):
            # nothing refers to them any more.
            for left in ahead.values():
                self._drop(left)
        for pid, why, detail in refused:
            self.refused[why] = self.refused.get(why, 0) + 1
            self._say(step, pid, detail)
        return len(refused)

    def _drop(self, ahead: tuple[bytes, str, Future[bytes]]) -> None:
        """Forget a read ahead whose result no batch will use, and delete its object (best effort)."""
        ahead[2].cancel()
        try:
            ref = parse_reference(ahead[0])
        except ResultRefused:
            return
        if ref is not None:
            self._executor().submit(self._forget, ref.key)

    def _read_now(self, pool: ThreadPoolExecutor, ref: ResultRef) -> Future[bytes]:
        self.read_at_close += 1
        return pool.submit(read_referenced, self.store, ref)

    def _bytes(self, pool: ThreadPoolExecutor, ref: ResultRef, read: Future[bytes], ahead: bool) -> bytes:
        """The checked bytes of one read; a read ahead that failed for a store fault is read once more now.

        Why: it may have run into an outage the store has ridden out since;
        without it the result would have been read only now. A refusal is an
        answer about the bytes, and stands.
        """
        try:
            return read.result()  # a transient fault was ridden out by the store; past the budget it stops the Trainer
        except ResultRefused:
            raise
        except Exception:
            if not ahead:
                raise
            return self._read_now(pool, ref).result()

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
        """Drop the reads ahead, finish the deletes in flight and stop the threads."""
        for _, _, fut in self._ahead.values():
            fut.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
