"""The run's records in Redis: the one module that writes and reads them.

The records (docs/PROTOCOL.md, docs/WORKERS.md):

- the Trainer's hash (``trainer``): ``head``, ``head_state``, ``published_ms``,
  ``status``, ``commit``, ``step``, ``epoch``, ``signed``, ``key_id``,
  ``unreturned``, ``last_batch``. Every write is fenced by the writer's
  epoch (the ledger's ``FENCED_HSET``): a Trainer or Publisher of an older
  epoch changes nothing and gets :class:`~aurora_store.errors.FencedOut`;
- the expected states (``state:trainer``: version -> the ``state`` published
  at it), written before the head names the version;
- the digest log: weight digests of the Trainer (``digest:trainer``) and of
  each Actor (``digest:actors``), also appended to the file named by
  ``AURORA_DIGEST_LOG`` when set, and the Actors' activation timings
  (``activations``). Only some versions have a digest: the writers hash
  version 0, snapshot and checkpoint versions (docs/WORKERS.md "Digests"),
  Actors the versions they verify; every version has its expected state.

Every value read was written by another process and is untrusted: a field
that does not parse reads as missing (None), never as an exception; an
expected state that cannot be a state reads as ``""`` (it matches no
manifest, so the version is refused rather than accepted unchecked).

    records = RunRecords(redis, "run-1")
    records.enter_epoch(3)
    records.record_version(7, state, digest, commit=True)
    records.head_and_commit()   # (7, 7)
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aurora_store.config import Switch
from aurora_store.coordination.decode import as_int, as_str
from aurora_store.coordination.keys import RunKeys
from aurora_store.coordination.ledger.core import LedgerCore
from aurora_store.coordination.redisconn import translate_redis_errors
from aurora_store.coordination.versioned import record_versioned
from aurora_store.errors import ConfigError, CoordinationError

__all__ = [
    "DIGEST_LOG_ENV",
    "EPOCH_LIMIT",
    "RunRecords",
    "TrainerRecord",
    "epoch_problem",
    "read_digests",
    "read_expected_state",
    "record_activation",
    "record_digest",
    "record_expected_state",
]

log = logging.getLogger("aurora.records")

DIGEST_LOG_ENV = "AURORA_DIGEST_LOG"
"""A file each worker appends one JSON line ``{"who", "version", "digest"}`` to per digest it
records, when set: the chaos benchmark compares digests kept outside Redis, which its faults erase."""
DIGEST_LOG = Switch(DIGEST_LOG_ENV, str | None, None, "a file every worker appends each weights digest it records to (one JSON line)")

_digest_log_failed = False

EPOCH_LIMIT = 1 << 53
"""Epochs are integers ``0 <= e < 2**53``: the fence compares them in Lua, whose numbers are
doubles, and from 2^53 on two neighbouring epochs read as one (a fenced-out Trainer would pass)."""


def epoch_problem(x: Any) -> str | None:
    """Why ``x`` (a parsed value: an int from JSON or from the caller) is not an epoch, or None when it is one."""
    if isinstance(x, bool) or not isinstance(x, int):
        return f"epoch {str(x)[:40]!r} is not an integer"
    if not 0 <= x < EPOCH_LIMIT:
        return f"epoch {str(x)[:40]} is outside 0 .. 2^53 - 1"
    return None


def _stored_epoch(raw: Any, key: str) -> int | None:
    """The epoch Redis holds at ``key`` (None: none), read strictly: ASCII digits, below 2^53.

    Anything else is refused with a :class:`~aurora_store.errors.CoordinationError` naming the key:
    read as "no epoch" it would let an older Trainer back in; read as a huge number, fence everyone out.
    """
    if raw is None:
        return None
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    if not (text.isascii() and text.isdigit() and len(text) <= 16):
        raise CoordinationError(
            f"{key}: the stored epoch {text[:40]!r} is not an integer from 0 to 2^53 - 1; an operator must fix or delete the key"
        )
    why = epoch_problem(int(text))
    if why is not None:
        raise CoordinationError(f"{key}: the stored {why}; an operator must fix or delete the key")
    return int(text)


def _append_digest_log(who: str, version: int, digest: str) -> None:
    """One ``write`` of one line with ``O_APPEND``: lines of concurrent workers never interleave."""
    global _digest_log_failed
    path = DIGEST_LOG.get()
    if not path:
        return
    line = (json.dumps({"who": who, "version": int(version), "digest": digest}) + "\n").encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as e:
        if not _digest_log_failed:  # a diagnostic aid: say so once, never stop the worker
            _digest_log_failed = True
            log.warning("%s=%s: cannot append digests: %s", DIGEST_LOG_ENV, path, e)


def _text(x: Any) -> str | None:
    """A field as ASCII text; None when missing or not ASCII."""
    if x is None:
        return None
    try:
        return x.decode("ascii") if isinstance(x, bytes) else str(x)
    except UnicodeDecodeError:
        return None


# -- functions over a client and the run's keys (the methods below use them) -------------
def record_digest(redis: Any, keys: RunKeys, who: str, version: int, digest: str, keep_versions: int | None = None) -> None:
    """``who`` is ``trainer`` or an Actor id.

    The hashes keep the newest ``keep_versions`` versions (default
    ``AURORA_LEDGER_KEEP_VERSIONS``, 1000); with ``AURORA_DIGEST_LOG`` set
    the digest is also appended to that file (first, so a Redis outage does
    not lose it there).
    """
    _append_digest_log(who, version, digest)
    if who == "trainer":
        record_versioned(redis, keys, keys.trainer_digests, str(version), digest, version, keep_versions)
    else:
        record_versioned(redis, keys, keys.actor_digests, f"{who}|{version}", digest, version, keep_versions)


def record_expected_state(redis: Any, keys: RunKeys, version: int, state: str, keep_versions: int | None = None) -> None:
    """The Trainer's record of the ``state`` of ``version`` (``state:trainer``), trimmed like the digests.

    Written before the head names the version, so an Actor that stages a
    version the head reached finds its record.
    """
    record_versioned(redis, keys, keys.trainer_states, str(version), state, version, keep_versions)


def read_expected_state(redis: Any, keys: RunKeys, version: int) -> str | None:
    """The state the Trainer recorded for ``version``; None when there is no record
    (a Trainer of an older release, a Redis that lost its data, a version trimmed away).
    A record that is not ASCII reads as ``""``: it matches no manifest."""
    raw = redis.hget(keys.trainer_states, str(version))
    if raw is None:
        return None
    text = _text(raw)
    return "" if text is None else text


def record_activation(
    redis: Any, keys: RunKeys, who: str, version: int, stage_s: float, activate_s: float, keep_versions: int | None = None
) -> None:
    """How long Actor ``who`` took to stage and to activate ``version`` (read by the demo and ``bench e2e``)."""
    body = json.dumps({"stage_s": stage_s, "activate_s": activate_s})
    record_versioned(redis, keys, keys.activations, f"{who}|{version}", body, version, keep_versions)


def _who_version(field: Any) -> tuple[str, int] | None:
    """``actor|version`` as (actor, version); None for a field that is not one."""
    who, sep, ver = as_str(field, "replace").rpartition("|")
    v = as_int(ver, lenient=True)
    return (who, v) if sep and v is not None else None


def read_digests(redis: Any, keys: RunKeys) -> tuple[dict[int, str], dict[tuple[str, int], str]]:
    """(trainer digests by version, actor digests by (actor, version)): the newest versions kept.

    Fields or values that do not parse are left out.
    """
    t: dict[int, str] = {}
    for k, v in redis.hgetall(keys.trainer_digests).items():
        ver, d = as_int(k, lenient=True), _text(v)
        if ver is not None and d is not None:
            t[ver] = d
    a: dict[tuple[str, int], str] = {}
    for k, v in redis.hgetall(keys.actor_digests).items():
        wv, d = _who_version(k), _text(v)
        if wv is not None and d is not None:
            a[wv] = d
    return t, a


@dataclass(frozen=True, slots=True)
class TrainerRecord:
    """The Trainer's hash as read back; a field missing or unparsable is None."""

    head: int | None = None
    """The newest version published (its expected state is recorded)."""
    head_state: str | None = None
    """The ``state`` of ``head``."""
    commit: int | None = None
    """The newest version whose next batch exists (announced as COMMIT)."""
    step: int | None = None
    """The newest batch created."""
    status: str | None = None
    """``running`` or ``done``."""
    published_ms: int | None = None
    """When ``head`` was recorded (the writer's clock, ms since the epoch)."""
    epoch: int | None = None
    """The writer's epoch as it recorded it (the fence itself is the ``epoch`` key)."""
    signed: bool | None = None
    """Whether the writer signs its manifests (FORMAT.md §4.1)."""
    key_id: str | None = None
    """Its signing key's id ("" unsigned)."""
    unreturned: int | None = None
    """Prompts whose batch closed without their result, over the run."""
    last_batch: str | None = None
    """JSON of how the last batch closed."""

    @classmethod
    def parse(cls, fields: Mapping[Any, Any]) -> TrainerRecord:
        """From ``HGETALL``: every value as untrusted."""
        h = {as_str(k, "replace"): v for k, v in fields.items()}

        def num(name: str) -> int | None:
            return as_int(h.get(name), lenient=True)

        def text(name: str) -> str | None:
            x = h.get(name)
            return None if x is None else as_str(x, "replace")

        signed = num("signed")
        return cls(
            head=num("head"),
            head_state=_text(h.get("head_state")),
            commit=num("commit"),
            step=num("step"),
            status=text("status"),
            published_ms=num("published_ms"),
            epoch=_epoch_field(num("epoch")),
            signed=None if signed is None else signed == 1,
            key_id=text("key_id"),
            unreturned=num("unreturned"),
            last_batch=text("last_batch"),
        )


def _epoch_field(x: int | None) -> int | None:
    """The hash's ``epoch`` field: one that is not an epoch (below 2^53) reads as missing, like any unparsable field."""
    return x if x is not None and epoch_problem(x) is None else None


class RunRecords:
    """The records of one run over one redis-py client; see the module's docstring.

    ``ledger``: the fence's scripts (default: a ledger core on ``redis``; a
    riding one makes the fenced writes ride outages). ``epoch`` is the
    writer's, taken with :meth:`enter_epoch` or given when already taken
    (None: a reader, or a writer not fenced yet, whose writes of the
    Trainer's hash are not checked).
    """

    def __init__(self, redis: Any, run: str, ledger: LedgerCore | None = None, epoch: int | None = None) -> None:
        self.redis = redis
        self.run = run
        self.keys = RunKeys(run)
        self.ledger = ledger if ledger is not None else LedgerCore(redis, run)
        """Holds the epoch fence and its scripts (``ENTER_EPOCH``, ``FENCED_HSET``)."""
        self.epoch: int | None = epoch
        """The epoch this writer holds (:meth:`enter_epoch`, or one it already entered)."""

    def __repr__(self) -> str:
        return f"RunRecords({self.run!r}, epoch={self.epoch})"

    # -- the writer's epoch ------------------------------------------------------------
    def stored_epoch(self) -> int | None:
        """The epoch Redis holds (None: none); one that is not an integer below 2^53 is refused
        (:class:`~aurora_store.errors.CoordinationError`, naming the key)."""
        with translate_redis_errors("RunRecords.stored_epoch"):
            raw = self.redis.get(self.keys.epoch)
        return _stored_epoch(raw, self.keys.epoch)

    def enter_epoch(self, epoch: int) -> None:
        """Take the run for ``epoch``; :class:`~aurora_store.errors.FencedOut` when Redis holds a higher one.

        ``epoch`` must be an integer below 2^53 (:class:`~aurora_store.errors.ConfigError` otherwise).
        """
        why = epoch_problem(epoch)
        if why is not None:
            raise ConfigError(f"run {self.run!r}: a Trainer cannot take this epoch: {why}")
        self.ledger.enter_epoch(epoch)
        self.epoch = epoch

    def check_epoch(self) -> None:
        """:class:`~aurora_store.errors.FencedOut` if a newer writer took the run (also restores a lost fence)."""
        if self.epoch is not None:
            self.ledger.enter_epoch(self.epoch)

    # -- writes of the Trainer's hash (fenced) -----------------------------------------------
    def _hset(self, fields: Mapping[str, Any]) -> None:
        self.ledger.fenced_hset(self.keys.trainer, fields, epoch=self.epoch)

    def record_identity(self, signed: bool, key_id: str = "") -> None:
        """The epoch and whether (and with which key) this writer signs: ``aurora status`` shows them."""
        self._hset({"epoch": self.epoch if self.epoch is not None else "", "signed": int(signed), "key_id": key_id})

    def record_version(self, version: int, state: str, digest: str | None, *, commit: bool = False) -> None:
        """Version ``version`` is published: its digest, its expected state, then the head naming it.

        The expected state is recorded before the head, so an Actor that
        stages a version the head reached finds its record. ``commit``: the
        version is also committed (a writer without batches to create first).
        ``digest`` None (a version nothing binds to was not hashed): none is
        recorded; readers check such a version by its state alone.
        """
        if digest is not None:
            record_digest(self.redis, self.keys, "trainer", version, digest)
        record_expected_state(self.redis, self.keys, version, state)
        fields: dict[str, Any] = {"head": version, "head_state": state, "published_ms": int(time.time() * 1000), "status": "running"}
        if commit:
            fields["commit"] = version
        self._hset(fields)

    def record_head(self, version: int) -> None:
        """The head alone, as a writer of an older release left it (no state, no expected state): for tests and benchmarks."""
        self._hset({"head": version})

    def record_commit(self, version: int) -> None:
        """Commit(``version``), also kept in the hash: an Actor whose Relay went silent still learns of it."""
        self._hset({"commit": version})

    def record_step(self, step: int) -> None:
        """Batch ``step`` was created."""
        self._hset({"step": step})

    def record_status(self, status: str) -> None:
        """``running`` or ``done``."""
        self._hset({"status": status})

    def record_batch_close(self, unreturned: int, last_batch: str) -> None:
        """A batch closed: prompts unreturned over the run, and the JSON of how this one closed."""
        self._hset({"unreturned": unreturned, "last_batch": last_batch})

    def forget_states(self) -> None:
        """A fresh run: expected states an older run of this name left are not its own."""
        with translate_redis_errors("RunRecords.forget_states"):
            key = self.keys.trainer_states
            self.redis.delete(key, self.keys.index(key))

    # -- per-version records of any worker (unfenced: Actors write their own) -------------
    def record_digest(self, who: str, version: int, digest: str) -> None:
        """The weights digest ``who`` (``trainer`` or an Actor id) computed at ``version``."""
        record_digest(self.redis, self.keys, who, version, digest)

    def record_expected_state(self, version: int, state: str) -> None:
        """The ``state`` Actors must reach at ``version``."""
        record_expected_state(self.redis, self.keys, version, state)

    def record_activation(self, who: str, version: int, stage_s: float, activate_s: float) -> None:
        """How long Actor ``who`` took to stage and to activate ``version``."""
        record_activation(self.redis, self.keys, who, version, stage_s, activate_s)

    # -- reads ------------------------------------------------------------------------------
    def trainer(self) -> TrainerRecord:
        """The Trainer's hash (every field None when there is none)."""
        with translate_redis_errors("RunRecords.trainer"):
            return TrainerRecord.parse(self.redis.hgetall(self.keys.trainer))

    def head(self) -> int | None:
        """The run's head: the newest version published (None: none yet, or unparsable)."""
        with translate_redis_errors("RunRecords.head"):
            return as_int(self.redis.hget(self.keys.trainer, "head"), lenient=True)

    def head_and_commit(self) -> tuple[int | None, int | None]:
        """(head, commit) in one round trip."""
        with translate_redis_errors("RunRecords.head_and_commit"):
            head, commit = self.redis.hmget(self.keys.trainer, "head", "commit")
        return as_int(head, lenient=True), as_int(commit, lenient=True)

    def mirror_head_commit(self, region: str) -> tuple[str | None, int | None, int | None]:
        """(the region's Relay mirror URL, head, commit) in one round trip; the URL None while no Relay heartbeats."""
        with translate_redis_errors("RunRecords.mirror_head_commit"):
            pipe = self.redis.pipeline(transaction=False)
            pipe.get(self.keys.relay(region))
            pipe.hmget(self.keys.trainer, "head", "commit")
            url, (head, commit) = pipe.execute()
        return _text(url) or None, as_int(head, lenient=True), as_int(commit, lenient=True)

    def expected_state(self, version: int) -> str | None:
        """See :func:`read_expected_state`."""
        with translate_redis_errors("RunRecords.expected_state"):
            return read_expected_state(self.redis, self.keys, version)

    def digests(self) -> tuple[dict[int, str], dict[tuple[str, int], str]]:
        """See :func:`read_digests`."""
        with translate_redis_errors("RunRecords.digests"):
            return read_digests(self.redis, self.keys)

    def activations(self) -> dict[tuple[str, int], dict[str, Any]]:
        """(actor, version) -> {stage_s, activate_s, ...}; entries that do not parse are left out."""
        out: dict[tuple[str, int], dict[str, Any]] = {}
        with translate_redis_errors("RunRecords.activations"):
            raw = self.redis.hgetall(self.keys.activations)
        for k, v in raw.items():
            wv = _who_version(k)
            try:
                body = json.loads(v)
            except (TypeError, ValueError):
                continue
            if wv is not None and isinstance(body, dict):
                out[wv] = body
        return out
